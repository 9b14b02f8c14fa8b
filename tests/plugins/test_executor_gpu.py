"""The torch executor on a GPU: greedy speculative output equals target-only output token for token
(the hard gate, on the same backend), for every target family of tests/helpers.PAIRS (add a family
there and it is covered here), every spec mode, bf16 and float32 weights, FP8 (E4M3) weights loaded
from a ModelOpt-layout checkpoint, and the custom ops on the torch references and on the Triton kernels
(`TorchExecutor(kernels="cuda")`). Also: the kernels really serve the `kernels="cuda"` executor, and
`torch._scaled_mm` on the checkpoint's FP8 weights and scales reproduces `FP8Linear` (the numerics a
_scaled_mm path would have; FP8Linear itself dequantizes the weight and runs a bf16 matmul).

Marked gpu (skipped without CUDA); run by scripts/gpu_validate.sh after scripts/build_plugins.sh.
First run 2026-11-27 on an H200 (docs/SERVING.md, "GPU validation").
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SpecConfig
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.models.fp8 import FP8_DTYPE, FP8_MAX, fp8_layers
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.helpers import PAIRS, ScriptedDrafter, greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILIES = sorted(PAIRS)  # target family -> its P-EAGLE drafter (tests/helpers.py)
MODES = [("eagle3", 3), ("eagle3", 7), ("peagle", 1), ("peagle", 3), ("peagle", 7)]
KERNELS = ["reference", "cuda"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prompts(family: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(len(family))
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in (1, 9, 40)]


@pytest.fixture(scope="module")
def kernels_ready():
    """The Triton kernels must be available on this GPU (triton installed)."""
    from peagle_trt.ops import kernels

    try:
        kernels.load()
    except kernels.KernelsUnavailable as e:
        pytest.fail(f"GPU present but the Triton kernels are unavailable: {e}")
    return kernels


def decoder(models: dict, target: str, drafter: str | None, mode: str, k: int, dtype, kernels: str,
            proposer=None) -> SpecDecoder:
    spec = SpecConfig(mode, k)
    pair = load_pair(models[target], models[drafter] if drafter else None, spec)
    t, d = pair.build("cuda", dtype)
    return SpecDecoder(TorchExecutor(t, d, 1, 256, kernels=kernels), spec, proposer=proposer)


def first_difference(plain: SpecDecoder, prompt: list[int], expected: list[int], got: list[int]) -> dict:
    """Where two outputs part, and the target's top-2 there (one full forward over the prompt and the
    common prefix)."""
    i = next(j for j in range(min(len(got), len(expected)) + 1) if j == len(got) or got[j] != expected[j])
    seq = prompt + expected[:i]
    ex = plain.ex
    logits, _ = ex.target(torch.tensor([seq], device=ex.device), torch.arange(len(seq), device=ex.device)[None],
                          torch.tensor([0], device=ex.device))
    row = logits[0, -1].float()  # [V]
    top = float(row.max())
    below = lambda t: None if t is None else top - float(row[t])  # noqa: E731
    return {"at": i, "spec": got[i] if i < len(got) else None, "plain": expected[i] if i < len(expected) else None,
            "spec_below_top": below(got[i] if i < len(got) else None),
            "plain_below_top": below(expected[i] if i < len(expected) else None), "scale": max(abs(top), 1.0)}


def check_spec_equals_plain(models, family, drafter, dtype, kernels, rel_noise: float, n=40):
    """Greedy speculative output == target-only output, token for token. The one allowed exception is
    batch variance: a verify forward of K+1 rows and a decode forward of one row may round differently
    (GEMM kernels depend on the row count; bf16 / FP8 keep that difference, and bf16 logits of a random
    tiny model tie EXACTLY at many steps), so the outputs must agree up to their first difference, and
    there both tokens must be within `rel_noise` (relative to the top logit) of the target's top logit
    in a full forward: a tie at the dtype's resolution, not a decisive token. The count of identical
    runs is printed."""
    plain = decoder(models, family, None, "none", 1, dtype, kernels)
    runs, identical, ties = 0, 0, []
    for mode, k in MODES:
        spec = decoder(models, family, drafter, mode, k, dtype, kernels)
        for prompt in prompts(family):
            expected = generate(plain, prompt, greedy(n)).output
            got = generate(spec, prompt, greedy(n)).output
            runs += 1
            assert len(got) == n
            if got == expected:
                identical += 1
                continue
            d = first_difference(plain, prompt, expected, got)
            what = f"{family} {mode} K={k} prompt {len(prompt)} {dtype} ops={kernels}: {d}"
            tol = rel_noise * d["scale"]
            assert d["spec_below_top"] is not None and d["plain_below_top"] is not None, what
            assert d["spec_below_top"] <= tol and d["plain_below_top"] <= tol, what
            ties.append(what)
    print(f"{identical}/{runs} runs identical; tie splits: {ties}")


# relative logit noise between row counts: fp32 ~1e-6 (1e-5 allowed), bf16 ~2 ulps at the top logit
# (2^-7 each), FP8 weights with bf16 activations: an activation that crosses an E4M3 rounding boundary
# (3 mantissa bits) moves the logits by a few percent (seen on CPU in fp32: 0.055 at logit 2.2)
NOISE = {"fp32": 1e-5, "bf16": 2.0 ** -6, "fp8": 0.08}


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_equals_target_only(tiny, family, dtype, kernels, request):
    if kernels == "cuda":
        request.getfixturevalue("kernels_ready")
    check_spec_equals_plain(tiny, family, PAIRS[family], DTYPES[dtype], kernels, NOISE[dtype])


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_drafts_are_accepted_and_exact(tiny, family, kernels, request):
    """Drafts that are the target's own tokens are all accepted (every verify row is used) and the
    output is still exactly the target's (float32: no ties at the dtype's resolution)."""
    if kernels == "cuda":
        request.getfixturevalue("kernels_ready")
    plain = decoder(tiny, family, None, "none", 1, torch.float32, kernels)
    refs = {tuple(p): generate(plain, p, greedy(48)).output for p in prompts(family)}
    oracle = ScriptedDrafter(refs, 512, lambda i, rng: True)
    spec = decoder(tiny, family, PAIRS[family], "peagle", 7, torch.float32, kernels, proposer=oracle)
    for prompt, expected in refs.items():
        seq = generate(spec, list(prompt), greedy(48))
        assert seq.output == expected
        assert seq.stats.accepted >= 32  # 6 steps of 7 accepted drafts + the bonus token


# -- FP8 weights from a ModelOpt-layout checkpoint -----------------------------------------------
def activation_amax(target_dir: Path) -> dict[str, float]:
    """Max calibration (ModelOpt's default for FP8): the largest |input| of every decoder linear over a
    few prompts, by module name."""
    model, _ = load_pair(target_dir, None, SpecConfig("none", 1)).build()
    amax: dict[str, float] = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, name=name: amax.__setitem__(
                 name, max(amax.get(name, 0.0), float(args[0].abs().max()))))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name.startswith("layers.")]
    ex = TorchExecutor(model, None, 1, 128)
    for prompt in prompts("calibration"):
        ex.target(torch.tensor([prompt]), torch.arange(len(prompt))[None], torch.tensor([0]))
    for h in hooks:
        h.remove()
    return amax


def write_modelopt_fp8(src: Path, dst: Path) -> Path:
    """The layout `peagle-trt quantize` exports (ModelOpt FP8_DEFAULT_CFG, export_hf_checkpoint):
    every decoder linear X as X.weight float8_e4m3fn = W / weight_scale, X.weight_scale = amax(W)/448,
    X.input_scale = calibrated activation amax / 448, and config.json's quantization_config.
    Written directly (max calibration here) so the GPU machine needs no nvidia-modelopt."""
    amax = activation_amax(src)
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        w = tensors[name].float()
        scale = w.abs().max().clamp(min=1e-12) / FP8_MAX
        stem = name[: -len(".weight")]
        tensors[name] = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        tensors[f"{stem}.weight_scale"] = scale.reshape(())
        tensors[f"{stem}.input_scale"] = torch.tensor(amax[stem.removeprefix("model.")] / FP8_MAX)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8"}
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


@pytest.fixture(scope="module")
def fp8_models(tiny, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fp8")
    models = dict(tiny)
    for family in FAMILIES:
        models[f"{family}-fp8"] = write_modelopt_fp8(tiny[family], root / family)
    return models


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_speculative_equals_fp8_target_only(fp8_models, family, kernels, request):
    if kernels == "cuda":
        request.getfixturevalue("kernels_ready")
    target, _ = load_pair(fp8_models[f"{family}-fp8"], None, SpecConfig("none", 1)).build("cuda", torch.bfloat16)
    layers = fp8_layers(target)
    assert layers and all(m.weight.dtype == FP8_DTYPE and m.weight.is_cuda for m in layers.values())
    check_spec_equals_plain(fp8_models, f"{family}-fp8", PAIRS[family], torch.bfloat16, kernels, NOISE["fp8"])


@pytest.mark.parametrize("family", FAMILIES)
def test_scaled_mm_reproduces_fp8linear(fp8_models, family):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 matmuls need sm_89+")
    target, _ = load_pair(fp8_models[f"{family}-fp8"], None, SpecConfig("none", 1)).build("cuda", torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, layer in fp8_layers(target).items():
        x = torch.randn(16, layer.in_features, device="cuda", dtype=torch.bfloat16, generator=gen)  # [M, in]
        ref = layer(x).float()  # [M, out]: fake-quant x, dequantized weight, bf16 matmul
        xq = (x.float() / layer.input_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        got = torch._scaled_mm(xq, layer.weight.t(), scale_a=layer.input_scale.float().reshape(()),
                               scale_b=layer.weight_scale.float().reshape(()), out_dtype=torch.bfloat16).float()
        err = (got - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, (name, float(err))


# -- the kernels="cuda" executor really runs the kernels ---------------------------------------------
def test_cuda_kernels_option_runs_every_kernel(tiny, kernels_ready, monkeypatch):
    calls = {"kv_attention": 0, "draft_inputs": 0, "draft_sample": 0}
    for name in calls:
        fn = getattr(kernels_ready, name)

        def counted(*a, _fn=fn, _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(kernels_ready, name, counted)
    family = FAMILIES[0]
    spec = decoder(tiny, family, PAIRS[family], "peagle", 3, torch.bfloat16, "cuda")
    generate(spec, prompts(family)[1], greedy(8))
    assert all(n > 0 for n in calls.values()), calls
    before = dict(calls)
    ref = decoder(tiny, family, PAIRS[family], "peagle", 3, torch.bfloat16, "reference")
    generate(ref, prompts(family)[1], greedy(8))
    assert calls == before  # a reference executor in the same process is untouched
