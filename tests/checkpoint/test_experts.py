"""Per-expert MoE linears stacked on load (peagle_trt/checkpoint/experts.py): layouts, FP8 scale
kinds, and the errors that name what is wrong."""

from __future__ import annotations

import pytest
import torch

from peagle_trt.checkpoint.experts import stack_experts
from peagle_trt.errors import CheckpointError

E, INTER, H = 3, 128, 256
P = "layers.1.mlp.experts"


def per_expert(bias=False, fp8=None) -> dict:
    torch.manual_seed(0)
    out = {"layers.1.mlp.gate.weight": torch.randn(E, H)}
    for e in range(E):
        for name, shape in (("gate_proj", (INTER, H)), ("up_proj", (INTER, H)), ("down_proj", (H, INTER))):
            key = f"{P}.{e}.{name}"
            w = torch.randn(shape)
            out[f"{key}.weight"] = w.to(torch.float8_e4m3fn) if fp8 else w
            if bias:
                out[f"{key}.bias"] = torch.randn(shape[0])
            if fp8 == "modelopt":
                out[f"{key}.weight_scale"] = torch.tensor(0.5 + e + (name == "up_proj"))
                out[f"{key}.input_scale"] = torch.tensor(0.25 + e)
            elif fp8 == "block":
                out[f"{key}.weight_scale_inv"] = torch.rand(shape[0] // 128, shape[1] // 128)
    return out


def test_stacks_gate_then_up_and_biases():
    t = per_expert(bias=True)
    out = stack_experts(t, "t")
    assert set(out) == {"layers.1.mlp.gate.weight", f"{P}.gate_up_proj", f"{P}.down_proj", f"{P}.gate_up_proj_bias",
                        f"{P}.down_proj_bias"}
    assert out[f"{P}.gate_up_proj"].shape == (E, 2 * INTER, H) and out[f"{P}.down_proj"].shape == (E, H, INTER)
    assert torch.equal(out[f"{P}.gate_up_proj"][2, :INTER], t[f"{P}.2.gate_proj.weight"])
    assert torch.equal(out[f"{P}.gate_up_proj"][2, INTER:], t[f"{P}.2.up_proj.weight"])
    assert torch.equal(out[f"{P}.gate_up_proj_bias"][1, INTER:], t[f"{P}.1.up_proj.bias"])


def test_modelopt_fp8_scales_per_channel_when_gate_and_up_differ():
    out = stack_experts(per_expert(fp8="modelopt"), "t")
    assert out[f"{P}.gate_up_proj"].dtype == torch.float8_e4m3fn
    s = out[f"{P}.gate_up_proj_scale"]
    assert s.shape == (E, 2 * INTER) and s[1, 0] == 1.5 and s[1, INTER] == 2.5  # gate 0.5 + e, up 1.5 + e
    assert out[f"{P}.down_proj_scale"].tolist() == [0.5, 1.5, 2.5]
    assert out[f"{P}.gate_up_proj_input_scale"].tolist() == [0.25, 1.25, 2.25]


def test_block_fp8_scales_stack():
    t = per_expert(fp8="block")
    out = stack_experts(t, "t")
    assert out[f"{P}.gate_up_proj_scale"].shape == (E, 2 * INTER // 128, H // 128)
    assert torch.equal(out[f"{P}.gate_up_proj_scale"][0, 1], t[f"{P}.0.up_proj.weight_scale_inv"][0])


def test_missing_expert_and_inconsistent_input_scales_are_named():
    t = per_expert()
    del t[f"{P}.1.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"experts\.1\.up_proj\.weight is missing"):
        stack_experts(t, "t")
    t = per_expert(fp8="modelopt")
    t[f"{P}.2.up_proj.input_scale"] = torch.tensor(9.0)
    with pytest.raises(CheckpointError, match="expert 2's gate_proj and up_proj input scales differ"):
        stack_experts(t, "t")
