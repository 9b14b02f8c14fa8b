"""ONNX for the sparse MoE MLP (models/moe.py; Qwen3-MoE, GPT-OSS, Gemma-4): routing in float32, then EVERY expert computed
densely for every row and weighted by its routing weight (0 for experts not in the row's top-k).

Trade-off (why dense): the graph is static and small (two batched MatMuls over stacked expert
weights [E, H, I] / [E, I, H], no loops, no data-dependent shapes) and equals the sparse torch
forward up to summation order; the price is E/k times the expert FLOPs of a sparse kernel. At
decode / verify sizes the step is bound by reading the weights, and N rows x k picks touch most
experts anyway once N*k >= E, so dense costs little there; prefill pays the extra FLOPs. The
gather alternative (Gather the k experts' weights per row) reads only what is used but copies
N*k weight matrices, which is worse for prefill. A serving-grade TensorRT engine would use a
grouped-GEMM MoE plugin instead; the ONNX contract (inputs, outputs) stays the same.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto

from peagle_trt.errors import BuildError


def _stack(w, mlp, proj: str, prefix: str) -> tuple[str, str | None]:
    """Stacked weights [E, in, out] (+ biases [E, 1, out]) of one projection of every expert."""
    mods = [getattr(e, proj) for e in mlp.experts]
    if any(m.weight.dtype == torch.float8_e4m3fn for m in mods):
        raise BuildError(f"{prefix}: FP8 experts cannot be exported yet (the dense MoE graph has no FP8 "
                         "Q/DQ); export the unquantized checkpoint")
    weight = w.param(f"{prefix}.experts.{proj}.weight", torch.stack([m.weight.t() for m in mods]))
    bias = None
    if mods[0].bias is not None:
        bias = w.param(f"{prefix}.experts.{proj}.bias", torch.stack([m.bias for m in mods])[:, None])
    return weight, bias


def _routing(w, logits: str, cfg) -> tuple[str, str]:
    """float32 logits [N, E] -> (top-k weights [N, k], expert ids [N, k])."""
    k = w.ints(cfg.top_k)
    if cfg.routing == "softmax_topk":
        vals, ids = w.op("TopK", w.op("Softmax", logits, axis=-1), k, axis=-1, outputs=2)
        if cfg.norm_topk_prob:
            vals = w.op("Div", vals, w.op("ReduceSum", vals, w.ints(-1), keepdims=1))
        return vals, ids
    vals, ids = w.op("TopK", logits, k, axis=-1, outputs=2)
    return w.op("Softmax", vals, axis=-1), ids


def moe(w, x: str, mlp, prefix: str, router_x: str | None = None) -> str:
    """x [B, S, H] -> [B, S, H]; router_x: what the router sees (default x; Gemma-4 passes the
    block input, with its router norm and scales, see models/moe.py)."""
    cfg, hidden = mlp.cfg, mlp.gate.in_features
    flat = w.op("Reshape", x, w.ints(-1, hidden))  # [N, H]
    r = flat if router_x is None else w.op("Reshape", router_x, w.ints(-1, hidden))
    if cfg.router_input_norm:
        r = w.op("Mul", w.op("Mul", w.norm(r, mlp.router_norm, f"{prefix}.router_norm"),
                             w.param(f"{prefix}.router_scale", mlp.router_scale)),
                 w.const(np.asarray(hidden ** -0.5, dtype=w.np)))
    logits = w.linear(r, mlp.gate, f"{prefix}.gate")
    logits = w.op("Cast", logits, to=TensorProto.FLOAT)  # routing in float32
    vals, ids = _routing(w, logits, cfg)  # [N, k]
    if cfg.per_expert_scale:
        scales = w.weight(f"{prefix}.per_expert_scale", mlp.per_expert_scale.detach().float().cpu().numpy())
        vals = w.op("Mul", vals, w.op("Gather", scales, ids, axis=0))
    dense = w.op("ScatterElements", w.op("Mul", logits, w.const(np.float32(0))), ids, vals, axis=-1)  # [N, E]
    weights = w.op("Unsqueeze", w.op("Transpose", dense, perm=[1, 0]), w.ints(2))  # [E, N, 1]
    if w.dtype != "float32":
        weights = w.op("Cast", weights, to=w.float_type)
    rows = w.op("Unsqueeze", flat, w.ints(0))  # [1, N, H]

    def project(inp: str, proj: str) -> str:
        weight, bias = _stack(w, mlp, proj, prefix)
        y = w.op("MatMul", inp, weight)  # [E, N, out]
        return w.op("Add", y, bias) if bias is not None else y

    gate, up = project(rows, "gate_proj"), project(rows, "up_proj")  # [E, N, I]
    if cfg.activation == "silu":
        act = w.op("Mul", w.silu(gate), up)
    elif cfg.activation == "gelu_tanh":
        act = w.op("Mul", w.gelu_tanh(gate, w.np), up)
    else:  # GPT-OSS clamped SwiGLU
        limit, alpha = w.const(w.np(cfg.swiglu_limit)), w.const(w.np(cfg.swiglu_alpha))
        g = w.op("Min", gate, limit)
        u = w.op("Max", w.op("Min", up, limit), w.op("Neg", limit))
        glu = w.op("Mul", g, w.op("Sigmoid", w.op("Mul", g, alpha)))
        act = w.op("Mul", w.op("Add", u, w.const(w.np(1.0))), glu)
    out = w.op("ReduceSum", w.op("Mul", project(act, "down_proj"), weights), w.ints(0), keepdims=0)  # [N, H]
    return w.op("Reshape", out, w.op("Shape", x))
