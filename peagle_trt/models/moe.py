"""Sparse mixture-of-experts MLP (Qwen3-MoE, GPT-OSS, Gemma-4) for the reference target.

Parameter names (our canonical layout; the adapters in checkpoint/adapters/ map each family's on-disk
layout onto it): `gate.weight` [E, H] (+ `gate.bias` [E], GPT-OSS's router bias) and one small
MLP per expert, `experts.{e}.gate_proj / up_proj / down_proj` (+ biases for GPT-OSS). Experts
are plain `nn.Linear`s, so FP8 checkpoints load through the same `fp8_swap` as dense layers.

Routing runs in float32 (router logits cast up before softmax / top-k), as transformers does:
  softmax_topk (Qwen3-MoE): p = softmax(logits); w, idx = topk(p, k); w /= sum(w) if norm_topk_prob
  topk_softmax (GPT-OSS):   top, idx = topk(logits, k); w = softmax(top)
Gemma-4 adds a router input rmsnorm(x) * router_scale / sqrt(H), weights w * per_expert_scale[idx]
and takes the router input apart from the expert input (the layer passes both).
The torch forward runs each expert that was hit on the rows routed to it (one batched call per
expert, no per-token loop). `SparseMoE.write_onnx` writes the same layer as ONNX nodes: routing in
float32, then EVERY expert computed densely for every row and weighted by its routing weight (0
for experts not in the row's top-k).

Trade-off (why dense): the graph is static and small (two batched MatMuls over stacked expert
weights [E, H, I] / [E, I, H], no loops, no data-dependent shapes) and equals the sparse torch
forward up to summation order; the price is E/k times the expert FLOPs of a sparse kernel. At
decode / verify sizes the step is bound by reading the weights, and N rows x k picks touch most
experts anyway once N*k >= E, so dense costs little there; prefill pays the extra FLOPs. The
gather alternative (Gather the k experts' weights per row) reads only what is used but copies
N*k weight matrices, which is worse for prefill. A serving-grade TensorRT engine would use a
grouped-GEMM MoE plugin instead; the ONNX contract (inputs, outputs) stays the same.
Tests: tests/models/test_families.py (equal to transformers' models), tests/e2e/test_families_e2e.py
(onnxruntime equals torch).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from peagle_trt.architecture import MoEConfig
from peagle_trt.errors import BuildError
from peagle_trt.models.layers import ACTIVATIONS, RMSNorm, write_onnx_act


class ExpertMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, cfg: MoEConfig):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=cfg.expert_bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=cfg.expert_bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=cfg.expert_bias)
        self.activation, self.alpha, self.limit = cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(expert_act(self.gate_proj(x), self.up_proj(x), self.activation, self.alpha,
                                         self.limit))


def expert_act(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation in ACTIVATIONS:  # SwiGLU / GeGLU, the dense MLP's gates
        return ACTIVATIONS[activation](gate) * up
    # GPT-OSS clamped SwiGLU: the +1 on the linear half, alpha-scaled sigmoid, both halves clamped
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def route(logits: torch.Tensor, cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k])."""
    logits = logits.float()
    if cfg.routing == "softmax_topk":
        weights, ids = torch.topk(logits.softmax(dim=-1), cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    top, ids = torch.topk(logits, cfg.top_k, dim=-1)
    return top.softmax(dim=-1), ids


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=cfg.router_bias)
        self.experts = nn.ModuleList(ExpertMLP(hidden, cfg.intermediate_size, cfg) for _ in range(cfg.num_experts))
        if cfg.router_input_norm:  # Gemma-4
            self.router_norm = RMSNorm(hidden, cfg.router_norm_eps, scale=False)
            self.router_scale = nn.Parameter(torch.ones(hidden))
        if cfg.per_expert_scale:
            self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def router_input(self, flat: torch.Tensor) -> torch.Tensor:
        if not self.cfg.router_input_norm:
            return flat
        return self.router_norm(flat) * self.router_scale * flat.shape[-1] ** -0.5

    def forward(self, x: torch.Tensor, router_x: torch.Tensor | None = None) -> torch.Tensor:
        # x [..., H] expert input; router_x [..., H] what the router sees (default x)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [T, H]
        r = flat if router_x is None else router_x.reshape(-1, shape[-1])
        weights, ids = route(self.gate(self.router_input(r)), self.cfg)  # [T, k] each
        if self.cfg.per_expert_scale:
            weights = weights * self.per_expert_scale[ids]
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in torch.unique(ids).tolist():  # experts hit by at least one row
            rows, which = (ids == e).nonzero(as_tuple=True)  # [n], [n]
            y = self.experts[e](flat[rows]) * weights[rows, which, None]
            out.index_put_((rows,), y, accumulate=True)  # (index_add_ is ~10x slower on CPU)
        return out.reshape(shape)

    # -- ONNX ------------------------------------------------------------------------------------
    def write_onnx(self, w, x: str, prefix: str, router_x: str | None = None) -> str:
        """x [B, S, H] -> [B, S, H]; router_x: what the router sees (default x; Gemma-4 passes
        the block input, with its router norm and scales)."""
        from onnx import TensorProto

        cfg, hidden = self.cfg, self.gate.in_features
        flat = w.op("Reshape", x, w.ints(-1, hidden))  # [N, H]
        r = flat if router_x is None else w.op("Reshape", router_x, w.ints(-1, hidden))
        if cfg.router_input_norm:
            r = w.op("Mul", w.op("Mul", self.router_norm.write_onnx(w, r, f"{prefix}.router_norm"),
                                 w.param(f"{prefix}.router_scale", self.router_scale)),
                     w.const(np.asarray(hidden ** -0.5, dtype=w.np)))
        logits = w.linear(r, self.gate, f"{prefix}.gate")
        logits = w.op("Cast", logits, to=TensorProto.FLOAT)  # routing in float32
        vals, ids = _write_route(w, logits, cfg)  # [N, k]
        if cfg.per_expert_scale:
            scales = w.weight(f"{prefix}.per_expert_scale",
                              self.per_expert_scale.detach().float().cpu().numpy())
            vals = w.op("Mul", vals, w.op("Gather", scales, ids, axis=0))
        zeros = w.op("Mul", logits, w.const(np.float32(0)))
        dense = w.op("ScatterElements", zeros, ids, vals, axis=-1)  # [N, E]
        weights = w.op("Unsqueeze", w.op("Transpose", dense, perm=[1, 0]), w.ints(2))  # [E, N, 1]
        if w.dtype != "float32":
            weights = w.op("Cast", weights, to=w.float_type)
        rows = w.op("Unsqueeze", flat, w.ints(0))  # [1, N, H]

        def project(inp: str, proj: str) -> str:
            weight, bias = self._write_stacked(w, proj, prefix)
            y = w.op("MatMul", inp, weight)  # [E, N, out]
            return w.op("Add", y, bias) if bias is not None else y

        gate, up = project(rows, "gate_proj"), project(rows, "up_proj")  # [E, N, I]
        if cfg.activation in ACTIVATIONS:  # SwiGLU / GeGLU, as expert_act
            act = w.op("Mul", write_onnx_act(w, gate, cfg.activation), up)
        else:  # GPT-OSS clamped SwiGLU
            limit, alpha = w.const(w.np(cfg.swiglu_limit)), w.const(w.np(cfg.swiglu_alpha))
            g = w.op("Min", gate, limit)
            u = w.op("Max", w.op("Min", up, limit), w.op("Neg", limit))
            glu = w.op("Mul", g, w.op("Sigmoid", w.op("Mul", g, alpha)))
            act = w.op("Mul", w.op("Add", u, w.const(w.np(1.0))), glu)
        out = w.op("Mul", project(act, "down_proj"), weights)  # [E, N, H]
        out = w.op("ReduceSum", out, w.ints(0), keepdims=0)  # [N, H]
        return w.op("Reshape", out, w.op("Shape", x))

    def _write_stacked(self, w, proj: str, prefix: str) -> tuple[str, str | None]:
        """Stacked weights [E, in, out] (+ biases [E, 1, out]) of one projection of every expert."""
        mods = [getattr(e, proj) for e in self.experts]
        if any(m.weight.dtype == torch.float8_e4m3fn for m in mods):
            raise BuildError(f"{prefix}: FP8 experts cannot be exported yet (the dense MoE graph has no FP8 "
                             "Q/DQ); export the unquantized checkpoint")
        weight = w.param(f"{prefix}.experts.{proj}.weight", torch.stack([m.weight.t() for m in mods]))
        bias = None
        if mods[0].bias is not None:
            bias = w.param(f"{prefix}.experts.{proj}.bias", torch.stack([m.bias for m in mods])[:, None])
        return weight, bias


def _write_route(w, logits: str, cfg: MoEConfig) -> tuple[str, str]:
    """float32 logits [N, E] -> (top-k weights [N, k], expert ids [N, k]), as `route`."""
    k = w.ints(cfg.top_k)
    if cfg.routing == "softmax_topk":
        vals, ids = w.op("TopK", w.op("Softmax", logits, axis=-1), k, axis=-1, outputs=2)
        if cfg.norm_topk_prob:
            vals = w.op("Div", vals, w.op("ReduceSum", vals, w.ints(-1), keepdims=1))
        return vals, ids
    vals, ids = w.op("TopK", logits, k, axis=-1, outputs=2)
    return w.op("Softmax", vals, axis=-1), ids
