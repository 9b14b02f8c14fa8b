"""The MoE op's CPU reference (peagle_trt/ops/reference.py `moe`, what the torch target runs on a CPU)
against a plain row-by-row, pick-by-pick computation written here from the contract (docs/EXPORT.md
"PEagleMoE"), for every family's routing and activation and every FP8 scale kind; the PEagleMoE
node's function bodies (peagle_trt/ops/onnx_defs.py: onnxruntime's com.microsoft::MoE, or the exact
dense form) against the reference in onnxruntime; `quantize_experts`; an FP8-expert MoE target
exported and run by onnxruntime against torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from peagle_trt.architecture import MoEConfig
from peagle_trt.models.moe import SparseMoE, moe_form, quantize_experts
from peagle_trt.ops import reference
from peagle_trt.ops.onnx_defs import MOE_INPUTS, moe_function

FAMILIES = {  # MoEConfig of each family's routing and activation
    "qwen3_moe": MoEConfig(8, 2, 16, routing="softmax_topk", norm_topk_prob=True),
    "qwen3_moe_raw": MoEConfig(8, 2, 16, routing="softmax_topk", norm_topk_prob=False),
    "gpt_oss": MoEConfig(8, 2, 16, routing="topk_softmax", router_bias=True, expert_bias=True,
                         activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0),
    "gemma4": MoEConfig(8, 2, 16, routing="softmax_topk", norm_topk_prob=True, activation="gelu_tanh",
                        per_expert_scale=True),
}
HIDDEN = 32


def make_moe(family: str, seed: int = 0, fp8: str | None = None, static: bool = False, hidden: int = HIDDEN,
             cfg: MoEConfig | None = None) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(hidden, cfg or FAMILIES[family])
    with torch.no_grad():
        for name, p in moe.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "scale" in name else 0.2) + (1.0 if "scale" in name else 0.0))
    if fp8:
        quantize_experts(moe, fp8, act_scale=4.0 if static else None)
    return moe.eval()


def naive(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """y [T, H] row by row, pick by pick, in float32 (the contract, spelled out)."""
    c, ex = moe.cfg, moe.experts
    logits = moe.gate(moe.router_input(x)).float()
    out = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        p = logits[t].softmax(-1) if c.routing == "softmax_topk" else logits[t]
        order = sorted(range(c.num_experts), key=lambda e: (-float(p[e]), e))[:c.top_k]
        w = p[order]
        w = w.softmax(-1) if c.routing == "topk_softmax" else (w / w.sum() if c.norm_topk_prob else w)
        for j, e in enumerate(order):
            weight = w[j] * (moe.per_expert_scale[e] if c.per_expert_scale else 1.0)
            gu = linear(x[t], ex, "gate_up_proj", e)
            if ex.gate_up_proj_bias is not None:
                gu = gu + ex.gate_up_proj_bias[e]
            g, u = gu[:c.intermediate_size], gu[c.intermediate_size:]
            if c.activation == "silu":
                h = F.silu(g) * u
            elif c.activation == "gelu_tanh":
                h = F.gelu(g, approximate="tanh") * u
            else:
                g = g.clamp(max=c.swiglu_limit)
                h = (u.clamp(-c.swiglu_limit, c.swiglu_limit) + 1) * g * torch.sigmoid(c.swiglu_alpha * g)
            o = linear(h, ex, "down_proj", e)
            if ex.down_proj_bias is not None:
                o = o + ex.down_proj_bias[e]
            out[t] += weight * o
    return out


def linear(v: torch.Tensor, ex, proj: str, e: int) -> torch.Tensor:
    """v [K] @ expert e's weight [N, K]^T; FP8: codes and scales element by element."""
    w = getattr(ex, proj)[e]
    if not ex.fp8:
        return w.float() @ v.float()
    scale, act = ex.scales(proj)
    s, n, k = scale[e], w.shape[0], w.shape[1]
    if s.dim() == 2:  # blocks
        ws = w.float() * s[torch.arange(n)[:, None] // 128, torch.arange(k)[None] // 128]
    else:
        ws = w.float() * (s[:, None] if s.dim() == 1 else s)
    if act is not None:
        a = act[e].expand(k)
    elif s.dim() == 2:
        a = torch.stack([v[g * 128:(g + 1) * 128].abs().max().clamp(min=1e-12) / 448 for g in range(-(-k // 128))])
        a = a.repeat_interleave(128)[:k]
    else:
        a = (v.abs().max().clamp(min=1e-12) / 448).expand(k)
    vq = (v.float() / a).clamp(-448, 448).to(torch.float8_e4m3fn).float() * a
    return ws @ vq


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("rows", [1, 8, 40])
def test_reference_equals_the_contract(family, rows):
    moe = make_moe(family)
    x = torch.randn(rows, HIDDEN)
    with torch.no_grad():
        got = moe(x)
    torch.testing.assert_close(got, naive(moe, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind, static", [("tensor", True), ("channel", False), ("channel", True), ("block", False)])
def test_reference_fp8_experts(kind, static):
    # hidden 160, intermediate 128: partial 128-blocks along H, whole ones along I
    cfg = MoEConfig(4, 2, 128, routing="softmax_topk", norm_topk_prob=True)
    moe = make_moe("qwen3_moe", fp8=kind, static=static, hidden=160, cfg=cfg)
    x = torch.randn(6, 160)
    with torch.no_grad():
        got = moe(x)
    torch.testing.assert_close(got, naive(moe, x), rtol=1e-4, atol=1e-4)


def test_routing_ties_take_the_lower_expert():
    weights, ids = reference.moe_route(torch.zeros(2, 6), 3, "softmax_topk", renormalize=True)
    assert ids.tolist() == [[0, 1, 2]] * 2 and torch.allclose(weights, torch.full((2, 3), 1 / 3))


def test_rows_routed_to_one_expert_and_to_every_expert():
    moe = make_moe("qwen3_moe")
    x = torch.randn(5, HIDDEN)
    with torch.no_grad():
        moe.gate.weight.zero_()
        moe.gate.weight[3] = 0  # every row: equal logits -> experts 0 and 1 (ties to the lower id)
        same = moe(x)
        torch.testing.assert_close(same, naive(moe, x), rtol=1e-5, atol=1e-5)
        moe.gate.weight.copy_(torch.randn_like(moe.gate.weight) * 5)
        xs = torch.randn(64, HIDDEN)
        _, ids = reference.moe_route(moe.gate(xs), 2, "softmax_topk", True)
        assert len(set(ids.reshape(-1).tolist())) == 8  # every expert hit
        torch.testing.assert_close(moe(xs), naive(moe, xs), rtol=1e-5, atol=1e-5)


def test_quantize_experts_kinds():
    moe = make_moe("qwen3_moe", cfg=MoEConfig(4, 2, 128), hidden=160)
    w = moe.experts.gate_up_proj.detach().clone()
    for kind, shape in (("tensor", (4,)), ("channel", (4, 256)), ("block", (4, 2, 2))):
        q = make_moe("qwen3_moe", cfg=MoEConfig(4, 2, 128), hidden=160, fp8=kind)
        assert q.experts.gate_up_proj.dtype == torch.float8_e4m3fn
        assert tuple(q.experts.gate_up_proj_scale.shape) == shape
        back = reference.moe_dequantize(q.experts.gate_up_proj, q.experts.gate_up_proj_scale)
        assert (back - w).abs().max() <= 0.07 * w.abs().max()  # E4M3: 3 mantissa bits
        assert q.to(torch.float16).experts.gate_up_proj.dtype == torch.float8_e4m3fn  # .to keeps FP8


# -- the PEagleMoE node's bodies in onnxruntime ------------------------------------------------------

def run_node(moe: SparseMoE, x: torch.Tensor, dtype: str = "float32") -> tuple[np.ndarray, bool]:
    """The PEagleMoE node over `moe`'s weights (its function body) in onnxruntime: (y, contrib body)."""
    from peagle_trt.executors.onnxruntime import session_options
    from peagle_trt.export.graphs import ModelWriter
    from peagle_trt.ops.names import MOE

    w = ModelWriter(dtype)
    xi = w.input("x", w.float_type, ["rows", HIDDEN if x.shape[1] == HIDDEN else x.shape[1]])
    y = moe.write_onnx(w, w.op("Unsqueeze", xi, w.ints(0)), "moe")
    w.op("Squeeze", y, w.ints(0), outputs=["y"])
    w.output("y", w.float_type, ["rows", x.shape[1]])
    model = w.model("moe")
    assert [n.op_type for n in model.graph.node if n.domain == "peagle"] == [MOE]
    import onnxruntime as ort

    options = session_options()
    options.use_per_session_threads = False  # the process's shared pool (peagle_trt/executors/onnxruntime.py)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = x.numpy().astype(np.float32 if dtype == "float32" else np.float16)
    return session.run(None, {"x": feed})[0].astype(np.float32), moe_form(moe).contrib


@pytest.mark.parametrize("family, contrib", [("qwen3_moe", True), ("qwen3_moe_raw", True), ("gpt_oss", True),
                                             ("gemma4", False)])
def test_onnx_body_equals_reference(family, contrib):
    moe = make_moe(family, seed=1)
    x = torch.randn(9, HIDDEN)
    got, used = run_node(moe, x)
    assert used == contrib
    with torch.no_grad():
        np.testing.assert_allclose(got, moe(x).numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind, static", [("tensor", True), ("channel", False), ("block", False)])
def test_onnx_fp8_experts_equal_reference(kind, static):
    cfg = MoEConfig(4, 2, 128, routing="topk_softmax", expert_bias=True, router_bias=True,
                    activation="clamped_swiglu")
    moe = make_moe("gpt_oss", fp8=kind, static=static, hidden=160, cfg=cfg)
    x = torch.randn(7, 160)
    got, used = run_node(moe, x)
    assert not used  # FP8 experts: the exact dense form
    with torch.no_grad():
        np.testing.assert_allclose(got, moe(x).numpy(), rtol=1e-3, atol=1e-4)


def test_onnx_float16_export():
    moe = make_moe("qwen3_moe", seed=2)
    x = torch.randn(4, HIDDEN)
    got, _ = run_node(moe, x, "float16")
    with torch.no_grad():
        ref = moe.half()(x.half()).float().numpy()
    np.testing.assert_allclose(got, ref, rtol=2e-2, atol=2e-3)


def test_function_inputs_are_the_op_signature():
    import inspect

    fn = moe_function(moe_form(make_moe("gpt_oss")))
    params = list(inspect.signature(reference.moe).parameters)[:len(MOE_INPUTS)]
    assert list(fn.input) == MOE_INPUTS == params
