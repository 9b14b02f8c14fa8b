"""Stage quantize (ModelOpt FP8 PTQ) and our FP8 loader.

* the FP8 checkpoint loads into a TargetModel with FP8Linear layers that reproduce ModelOpt's
  fake-quantized forward (exactly, given the same rounding form of the scale);
* FP8-vs-fp32 logit error is measured and printed (loose sanity bound only);
* speculative decoding over the FP8 target equals that FP8 target's own greedy output;
* bad calibration data and failures are clean (ConfigError, nothing left behind).

The targets are quantized once per module (module-scoped fixtures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization", reason="nvidia-modelopt is not installed")

from peagle_trt.checkpoint import load_pair  # noqa: E402
from peagle_trt.checkpoint.target import load_target, load_target_config  # noqa: E402
from peagle_trt.config import SpecConfig  # noqa: E402
from peagle_trt.errors import BuildError, CheckpointError, ConfigError  # noqa: E402
from peagle_trt.manifest import verify_manifest  # noqa: E402
from peagle_trt.models.fp8 import FP8Linear, fake_quant_fp8, fp8_layers  # noqa: E402
from peagle_trt.models.target import TargetModel  # noqa: E402
from peagle_trt.quantize import QuantizeOptions, calibrate, quantize_target  # noqa: E402
from peagle_trt.quantize.calib import BUILTIN, read_calib_file  # noqa: E402
from peagle_trt.runtime.scheduler import generate  # noqa: E402
from peagle_trt.tokenizer import TextCodec  # noqa: E402
from tests.helpers import greedy, make_decoder  # noqa: E402

SPEC = QuantizeOptions(num_calib=8)
LINEARS_PER_LAYER = 7  # q k v o gate up down


def quantize(src: Path, out: Path, spec: QuantizeOptions) -> SimpleNamespace:
    calls = []
    t0 = time.perf_counter()
    manifest = quantize_target(src, out, spec, progress=lambda i, n: calls.append((i, n)))
    wall = time.perf_counter() - t0
    print(f"\nquantize {src.name}: {wall:.2f} s wall (calibration {manifest['calibration']})")
    return SimpleNamespace(dir=out, manifest=manifest, wall=wall, progress=calls)


@pytest.fixture(scope="module")
def fp8(tiny, tmp_path_factory) -> SimpleNamespace:
    return quantize(tiny["llama"], tmp_path_factory.mktemp("fp8") / "llama-fp8", SPEC)


@pytest.fixture(scope="module")
def fp8_qwen3(tiny, tmp_path_factory) -> SimpleNamespace:
    return quantize(tiny["qwen3"], tmp_path_factory.mktemp("fp8") / "qwen3-fp8", QuantizeOptions(num_calib=4))


def build(path: Path) -> TargetModel:
    ckpt = load_target(path)
    return TargetModel.from_tensors(ckpt.config, ckpt.tensors, (), name=str(path))


def sequences(target_dir: Path) -> list[list[int]]:
    """Inputs for logit comparisons: chat prompts through the tokenizer and random token ids."""
    codec = TextCodec(target_dir)
    seqs = [codec.encode_prompt(p) for p in ("Explain speculative decoding.", "Write a haiku about FP8.")]
    gen = torch.Generator().manual_seed(7)
    return seqs + [torch.randint(0, 500, (48,), generator=gen).tolist() for _ in range(4)]


@torch.no_grad()
def ours(model: TargetModel, ids: list[int]) -> torch.Tensor:
    n = len(ids)
    logits, _ = model(torch.tensor([ids]), torch.arange(n)[None], torch.tensor([0]),
                      model.new_cache(1, n + 1))
    return logits[0]


@torch.no_grad()
def hf(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


# -- the export -------------------------------------------------------------------------------------
def test_export_layout(fp8, tiny):
    from safetensors import safe_open

    files = {p.name for p in fp8.dir.iterdir()}
    assert {"config.json", "hf_quant_config.json", "manifest.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    assert not any(n.startswith(".") for n in (p.name for p in fp8.dir.parent.iterdir()))  # no temp dirs
    verify_manifest(fp8.dir)
    hq = json.loads((fp8.dir / "hf_quant_config.json").read_text())["quantization"]
    assert hq["quant_algo"] == "FP8" and hq.get("kv_cache_quant_algo") is None
    assert fp8.manifest["quantization"]["fp8_layers"] == 8 * LINEARS_PER_LAYER
    assert fp8.manifest["calibration"]["samples"] == SPEC.num_calib
    assert fp8.progress[-1] == (SPEC.num_calib, SPEC.num_calib)
    with safe_open(str(fp8.dir / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    assert dtypes["lm_head.weight"] == dtypes["model.embed_tokens.weight"] == torch.float32
    assert dtypes["model.layers.3.mlp.down_proj.weight"] == torch.float8_e4m3fn
    assert dtypes["model.layers.3.mlp.down_proj.input_scale"] == torch.float32
    assert not any(k.endswith(("k_scale", "v_scale")) for k in dtypes)
    assert load_target_config(fp8.dir).quantization == "fp8"
    assert load_target_config(tiny["llama"]).quantization is None


def test_loaded_model_has_fp8_layers(fp8):
    model = build(fp8.dir)
    layers = fp8_layers(model)
    assert len(layers) == 8 * LINEARS_PER_LAYER
    q = model.layers[0].self_attn.q_proj
    assert isinstance(q, FP8Linear) and q.weight.dtype == torch.float8_e4m3fn
    assert q.weight_scale.dtype == q.input_scale.dtype == torch.float32 and q.input_scale.ndim == 0
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    # casting the model keeps FP8 weights and fp32 scales; the forward follows the model dtype
    half = build(fp8.dir).to(dtype=torch.bfloat16)
    hq = half.layers[0].self_attn.q_proj
    assert hq.weight.dtype == torch.float8_e4m3fn and hq.weight_scale.dtype == torch.float32
    assert torch.equal(hq.weight.view(torch.uint8), q.weight.view(torch.uint8))
    ids = [5, 17, 42, 99, 3]
    a, b = ours(half, ids), ours(model, ids)  # bf16 activations: close, not equal
    assert torch.isfinite(a).all() and (a - b).abs().mean() < 0.1 * b.abs().mean()


def test_fake_quant_math():
    x = torch.tensor([0.0, 1e-4, 0.3, -1.0, 2.5, 1e6, -1e6])
    s = torch.tensor(2.0 / 448)
    y = fake_quant_fp8(x, s)
    assert y[-2] == 2.0 and y[-1] == -2.0  # saturates at +-448 * scale, never inf/NaN
    assert torch.equal(y, (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s)
    layer = FP8Linear(3, 2)
    layer.weight.data = torch.tensor([[1.0, -2.0, 0.5], [4.0, 0.0, -0.25]]).to(torch.float8_e4m3fn)
    layer.weight_scale.data, layer.input_scale.data = torch.tensor(0.5), torch.tensor(1.0)
    out = layer(torch.tensor([[1.0, 2.0, 3.0]]))
    assert torch.allclose(out, torch.tensor([[(1 - 4 + 1.5) * 0.5, (4 - 0.75) * 0.5]]))


# -- fidelity ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def modelopt_model(fp8, tiny):
    """ModelOpt's fake-quantized HF model, calibrated exactly as the exported checkpoint was."""
    model, _ = calibrate(tiny["llama"], SPEC, progress=None)
    return model


@pytest.fixture(scope="module")
def modelopt_models(modelopt_model, fp8, fp8_qwen3, tiny):
    """family -> (ModelOpt fake-quant HF model, our FP8 TargetModel, the target dir)."""
    qwen3, _ = calibrate(tiny["qwen3"], QuantizeOptions(num_calib=4), progress=None)
    return {"llama": (modelopt_model, build(fp8.dir), tiny["llama"]),
            "qwen3": (qwen3, build(fp8_qwen3.dir), tiny["qwen3"])}


def test_calibration_is_what_was_exported(fp8, modelopt_model):
    tensors = load_target(fp8.dir).tensors
    for name, m in modelopt_model.model.named_modules():
        if hasattr(m, "input_quantizer") and m.input_quantizer.is_enabled:
            assert float(m.input_quantizer.amax) / 448 == pytest.approx(float(tensors[f"{name}.input_scale"]),
                                                                       rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_loader_reproduces_modelopt_fake_quant(family, modelopt_models, monkeypatch):
    """ModelOpt quantizes x * (448 / amax); the checkpoint stores scale = amax / 448 and our
    FP8Linear (like ONNX QuantizeLinear) computes x / scale. With ModelOpt's quantizer switched to
    the same division form, its forward and ours are the same numbers. With its own form, a value
    sitting on an E4M3 rounding boundary occasionally rounds the other way, and that one flip
    propagates to later positions: the logits then differ by a few percent on a few rows."""
    from modelopt.torch.quantization import tensor_quant

    modelopt_model, model, target_dir = modelopt_models[family]
    seqs = sequences(target_dir)
    native = [(hf(modelopt_model, s), ours(model, s)) for s in seqs]

    def division_form(x, amax=None):
        scale = amax.float() / 448.0
        q = (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        return (q.float() * scale).to(x.dtype)

    if not hasattr(tensor_quant, "_fp8_eager"):
        pytest.skip("this modelopt has no eager FP8 fake-quant to switch")
    monkeypatch.setattr(tensor_quant, "_fp8_eager", division_form)
    for s in seqs:
        ref, got = hf(modelopt_model, s), ours(model, s)
        scale = ref.abs().max()
        assert (ref - got).abs().max() < 1e-5 * scale  # measured: 0 (bit-identical) on this CPU
        assert torch.equal(ref.argmax(-1), got.argmax(-1))
    monkeypatch.undo()
    rows = torch.cat([(r - o).abs().amax(-1) for r, o in native])
    same = torch.cat([r.argmax(-1) == o.argmax(-1) for r, o in native]).float().mean()
    print(f"\nFP8 loader vs ModelOpt fake-quant ({family}, its own rounding form), {len(rows)} positions: "
          f"max abs {rows.max():.2e}, rows within 1e-4: {(rows < 1e-4).float().mean():.2%}, "
          f"top-1 agreement {same:.2%}")
    assert same >= 0.9 and rows.max() < 0.1 * max(r.abs().max() for r, _ in native)


def error_stats(a_model, b_model, seqs) -> dict:
    a = torch.cat([ours(a_model, s) for s in seqs])
    b = torch.cat([ours(b_model, s) for s in seqs])
    d = (a - b).abs()
    return {"positions": a.shape[0], "max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "logit_absmax": float(a.abs().max()), "logit_std": float(a.std()),
            "top1_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean())}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fp8_vs_fp32_error(family, fp8, fp8_qwen3, tiny):
    """Measured and reported, loosely bounded: the tiny models have random weights and nearly flat
    logits, so top-1 flips under FP8 are far more frequent than for a trained model."""
    quantized = {"llama": fp8, "qwen3": fp8_qwen3}[family]
    stats = error_stats(build(tiny[family]), build(quantized.dir), sequences(tiny[family]))
    print(f"\nFP8 vs fp32 logits ({family}): {json.dumps({k: round(v, 4) for k, v in stats.items()})}")
    assert stats["max_abs"] < 0.5 * stats["logit_absmax"]
    assert stats["mean_abs"] < 0.5 * stats["logit_std"]
    assert stats["top1_agreement"] >= 0.5


# -- speculative decoding over the FP8 target ----------------------------------------------------
@pytest.mark.parametrize("k", [1, 3, 7])
def test_speculative_equals_fp8_greedy(fp8, tiny, k):
    models = {"fp8": fp8.dir, "aws": tiny["aws"]}
    pair = load_pair(fp8.dir, tiny["aws"], SpecConfig("peagle", k))
    target, drafter = pair.build()
    assert fp8_layers(target) and drafter is not None  # hidden 64 / vocab 512 pair as before
    gen = torch.Generator().manual_seed(k)
    for prompt in ([3, 14, 15, 92, 65], torch.randint(0, 500, (20,), generator=gen).tolist()):
        plain = generate(make_decoder(models, "fp8", None, "none", 1, max_len=256), prompt, greedy(30)).output
        spec = generate(make_decoder(models, "fp8", "aws", "peagle", k, max_len=256), prompt, greedy(30))
        assert spec.output == plain and len(plain) == 30


def test_speculative_equals_fp8_greedy_qwen3(fp8_qwen3, tiny):
    models = {"fp8": fp8_qwen3.dir, "speculators": tiny["speculators"]}
    prompt = [7, 8, 9, 100, 200, 300]
    plain = generate(make_decoder(models, "fp8", None, "none", 1, max_len=256), prompt, greedy(30)).output
    for mode in ("peagle", "eagle3"):
        spec = generate(make_decoder(models, "fp8", "speculators", mode, 3, max_len=256), prompt, greedy(30))
        assert spec.output == plain


# -- KV cache scales, the CLI -----------------------------------------------------------------------
def test_cli_kv_cache_fp8(tiny, tmp_path, capsys):
    from peagle_trt.quantize.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "kv"
    args = parser.parse_args(["quantize", "--target", str(tiny["llama"]), "--output", str(out),
                              "--kv-cache-fp8", "--num-calib", "2"])
    result = args.func(args)
    json.dumps(result)  # JSON-able
    assert result["kv_cache"] == "fp8_e4m3" and result["fp8_layers"] == 8 * LINEARS_PER_LAYER
    assert "calibrating 2/2" in capsys.readouterr().err
    hq = json.loads((out / "hf_quant_config.json").read_text())["quantization"]
    assert hq["kv_cache_quant_algo"] == "FP8"
    model = build(out)
    attn = model.layers[5].self_attn
    assert attn.k_proj.kv_scale_name == "k_scale" and attn.v_proj.kv_scale_name == "v_scale"
    assert float(attn.k_proj.kv_scale) > 0 and attn.q_proj.kv_scale is None
    assert torch.isfinite(ours(model, [1, 2, 3, 4])).all()


# -- errors ---------------------------------------------------------------------------------------
BAD_LINES = [
    ('{"text": "ok"}\n{"text": "unterminated\n', "line 2: not valid JSON"),
    ('["a list"]\n', "expected a JSON object"),
    ('{"content": "x"}\n', 'exactly one of the keys "prompt"'),
    ('{"prompt": "x", "text": "y"}\n', "exactly one of the keys"),
    ('{"text": ""}\n', "non-empty string"),
    ('{"prompt": 3}\n', "non-empty string"),
    ("\n\n", "holds no samples"),
]


@pytest.mark.parametrize("content,message", BAD_LINES)
def test_bad_calibration_file(tiny, tmp_path, content, message):
    data = tmp_path / "calib.jsonl"
    data.write_text(content)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=message):
        quantize_target(tiny["llama"], out, QuantizeOptions(calib_data=data), progress=None)
    assert not out.exists() and list(tmp_path.iterdir()) == [data]


def test_calibration_file_missing_or_not_utf8(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_calib_file(tmp_path / "nope.jsonl")
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_calib_file(bad)
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "hi"}\n\n{"text": "raw"}\n{"text": "third"}\n')
    assert [(s.kind, s.text) for s in read_calib_file(good, limit=2)] == [("prompt", "hi"), ("text", "raw")]
    assert len(BUILTIN) >= 16


def test_calibration_file_is_used(tiny, tmp_path):
    data = tmp_path / "calib.jsonl"
    data.write_text('{"prompt": "Explain FP8."}\n{"text": "raw text for calibration"}\n')
    _, info = calibrate(tiny["llama"], QuantizeOptions(calib_data=data, num_calib=10, max_calib_len=4), None)
    assert info["source"] == str(data) and info["samples"] == 2 and info["tokens"] == 8


def test_failed_quantization_leaves_nothing(tiny, tmp_path, monkeypatch):
    import peagle_trt.quantize.fp8 as q

    def broken_export(model, export_dir):
        (export_dir / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(q, "export_checkpoint", broken_export)
    out = tmp_path / "sub" / "out"
    with pytest.raises(RuntimeError, match="simulated"):
        quantize_target(tiny["llama"], out, QuantizeOptions(num_calib=1), progress=None)
    assert not out.exists() and list((tmp_path / "sub").iterdir()) == []

    def empty_export(model, export_dir):  # writes a checkpoint our loader rejects
        (export_dir / "config.json").write_text((tiny["llama"] / "config.json").read_text())

    monkeypatch.setattr(q, "export_checkpoint", empty_export)
    with pytest.raises(CheckpointError, match="no weights found"):
        quantize_target(tiny["llama"], out, QuantizeOptions(num_calib=1), progress=None)
    assert not out.exists() and list((tmp_path / "sub").iterdir()) == []


def test_refusals(fp8, tiny, tmp_path):
    with pytest.raises(BuildError, match="already exists"):
        quantize_target(tiny["llama"], fp8.dir, SPEC, progress=None)
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_target(fp8.dir, tmp_path / "again", SPEC, progress=None)
    with pytest.raises(ConfigError, match="drafter quantization is not supported"):
        QuantizeOptions(quantize_drafter=True)
    with pytest.raises(ConfigError, match="num_calib"):
        QuantizeOptions(num_calib=0)
    assert not (tmp_path / "again").exists()
    with pytest.raises(ConfigError, match="target directory itself"):
        quantize_target(tiny["llama"], tiny["llama"], SPEC, force=True, progress=None)


def test_force_replaces_a_previous_output(fp8, tiny, tmp_path):
    """--force replaces a previous quantize output (a foreign folder is refused: tests/faults)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(fp8.dir, out)
    before = (out / "manifest.json").read_text()
    manifest = quantize_target(tiny["llama"], out, QuantizeOptions(num_calib=1), force=True, progress=None)
    assert (out / "manifest.json").read_text() != before and "model.safetensors" in manifest["files"]
    assert manifest["calibration"]["samples"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_loader_rejects_unsupported_fp8(fp8, tmp_path):
    ckpt = load_target(fp8.dir)
    name = "layers.2.mlp.up_proj"

    def load(tensors):
        return TargetModel.from_tensors(ckpt.config, tensors, (), name="t")

    tensors = dict(ckpt.tensors)
    del tensors[f"{name}.input_scale"]
    with pytest.raises(CheckpointError, match="has no 'layers.2.mlp.up_proj.input_scale'"):
        load(tensors)
    tensors = {**ckpt.tensors, f"{name}.weight_scale": torch.ones(128)}
    with pytest.raises(CheckpointError, match="only per-tensor"):
        load(tensors)
    tensors = {**ckpt.tensors, f"{name}.weight_scale_inv": torch.ones(3, 3)}
    with pytest.raises(CheckpointError, match=r"128 x 128 block scales of a .* weight are"):
        load(tensors)
    tensors = {**ckpt.tensors, "norm.weight": ckpt.tensors["norm.weight"].to(torch.float8_e4m3fn)}
    with pytest.raises(CheckpointError, match="not the weight of a linear layer"):
        load(tensors)
    tensors = {**ckpt.tensors, f"{name}.weight_scale": torch.tensor(0.0)}
    with pytest.raises(CheckpointError, match="not a positive"):
        load(tensors)
    cfg = json.loads((fp8.dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not supported"):
        load_target_config(tmp_path)
