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
expert, no per-token loop); the ONNX export computes every expert densely and weights them
(export/moe.py). Tests: tests/unit/test_families.py (equal to transformers' models).
"""

from __future__ import annotations

import torch
from torch import nn

from peagle_trt.architecture import MoEConfig
from peagle_trt.models.layers import ACTIVATIONS, RMSNorm


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
