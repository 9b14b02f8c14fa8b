"""Block-scaled FP8 checkpoints (the layout of Qwen3-Coder-30B-A3B-Instruct-FP8: `quant_method: fp8`,
128 x 128 `weight_scale_inv` per linear, dynamic activations) load as they are: attention and dense
MLPs as block FP8Linears (peagle_trt/models/fp8.py), the experts stacked with block scales
(peagle_trt/checkpoint/experts.py, peagle_trt/models/moe.py). The block layer computes the op's block
math; speculative output equals target-only output on torch and onnxruntime, and onnxruntime
near-equals torch (tests/export/crossbackend.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from peagle_trt.checkpoint import load_pair
from peagle_trt.checkpoint.target import load_target
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.executors.onnxruntime import OrtExecutor
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.export import ExportOptions, export_models
from peagle_trt.models.fp8 import FP8_MAX, fp8_layers
from peagle_trt.models.moe import fp8_experts
from peagle_trt.ops import reference
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from tests.export.crossbackend import check_greedy_near_equal

K, SEQ = 3, 96
# logits, torch against onnxruntime: one block layer agrees to ~1e-6 (float32 rounding), but a dynamic
# scale is its group's amax, so a last-bit difference upstream moves every code of the group across
# E4M3 rounding boundaries at once; over three layers of random weights that reaches ~3% of the logits
CROSS_TOL = 0.3
SHAPE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0])


def to_block_fp8(src, dst) -> None:
    """Rewrite the checkpoint at `src` into `dst` as block-FP8 checkpoints are: every decoder-layer
    linear but the router in E4M3 with a [ceil(N/128), ceil(K/128)] `weight_scale_inv`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in src.glob("*.safetensors"):
        for name, w in load_file(f).items():
            linear = name.startswith("model.layers.") and name.endswith("proj.weight") and w.dim() == 2
            if not linear:
                tensors[name] = w
                continue
            n, k = w.shape
            padded = torch.nn.functional.pad(w.float(), (0, -k % 128, 0, -n % 128))
            amax = padded.reshape(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128).abs().amax(dim=(1, 3))
            scale = amax.clamp(min=1e-12) / FP8_MAX  # [nb, kb]
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
            tensors[name] = (w.float() / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def block_pair(tmp_path_factory):
    from peagle_trt.make_tiny import make_drafter, make_target

    root = tmp_path_factory.mktemp("fp8_block")
    target = make_target(root / "bf", "qwen3_moe", seed=3, layers=3, **SHAPE)
    to_block_fp8(target, root / "target")
    return {"target": root / "target", "drafter": make_drafter(root / "drafter", target, "aws", seed=4)}


def test_block_fp8_loads_as_block_linears_and_block_experts(block_pair):
    ckpt = load_target(block_pair["target"])
    assert ckpt.config.quantization == "fp8"
    t, _ = load_pair(block_pair["target"], None, SpecConfig("none", 0)).build()
    linears, experts = fp8_layers(t), fp8_experts(t)
    assert len(linears) == 3 * 4 + 3 and all(m.block for m in linears.values())  # attention + layer 0's MLP
    assert set(experts) == {"layers.1.mlp.experts", "layers.2.mlp.experts"}
    assert experts["layers.1.mlp.experts"].gate_up_proj_scale.shape == (4, 2, 2)  # [E, 2I/128, H/128]
    q = linears["layers.0.self_attn.q_proj"]
    x = torch.randn(5, 256)
    codes, a = reference.quantize_activation(x, "block")
    want = reference.fp8_matmul(codes, a, q.weight, q.weight_scale_inv, "block")
    assert torch.equal(q(x), want)  # the op's block math
    deq = q.dequantized_weight()
    assert (x @ deq.T - want).abs().max() < 0.1 * want.abs().max()  # close to the dequantized weight's


def test_block_fp8_speculates_exactly_on_torch_and_onnxruntime(block_pair, tmp_path):
    spec = SpecConfig("peagle", K)
    t, d = load_pair(block_pair["target"], block_pair["drafter"], spec).build()
    out = tmp_path / "export"
    export_models(t, d, out, ExportOptions(spec, 1, SEQ, max_rows=16))
    prompt, params = list(range(30, 49)), SamplingParams(max_tokens=16, ignore_eos=True)
    made = {"torch": lambda: TorchExecutor(t, d, 1, SEQ + K + 1, deterministic=True),
            "ort": lambda: OrtExecutor(out, deterministic=True)}
    outputs = {}
    for backend, make in made.items():
        runs = {mode: generate(SpecDecoder(make(), SpecConfig(mode, K)), prompt, params, prefill_chunk=16).output
                for mode in ("none", "peagle")}
        assert runs["peagle"] == runs["none"] and len(runs["none"]) == 16, backend
        outputs[backend] = runs["none"]
    check_greedy_near_equal(lambda: TorchExecutor(t, None, 1, SEQ + K + 1), lambda: OrtExecutor(out), prompt,
                            outputs["torch"], outputs["ort"], CROSS_TOL, 8)
