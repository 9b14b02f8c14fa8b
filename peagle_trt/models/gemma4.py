"""The Gemma-4 decoder layer (sandwich norms) and its per-layer input embeddings, each with its
torch `forward` and its ONNX writer `write_onnx` (node by node, with the blocks of
peagle_trt/models/layers.py; `w` is the `ModelWriter` of peagle_trt/export/graphs.py).

Layer (TargetConfig.sandwich_norm), with `post_*` norms on each block's output:
    x = x + post_attention_layernorm(attn(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
        with an MoE beside the dense MLP (Gemma-4 26B-A4B), the MLP term above becomes
        post_feedforward_layernorm_1(mlp(...))
            + post_feedforward_layernorm_2(moe(pre_feedforward_layernorm_2(x), router input x))
    x = x + post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(x)) * pli))
                                                            (only with per-layer inputs)
    x = x * layer_scalar                                    (only with TargetConfig.layer_scalar)
Per-layer inputs (PLE, `per_layer_input_size` P > 0), for all L layers at once from the token ids
and the (scaled) token embedding e:
    pli = (norm(reshape(per_layer_model_projection(e) / sqrt(H), [L, P]))
           + embed_tokens_per_layer(ids) * sqrt(P)) / sqrt(2)              # [B, S, L, P]
Parameter names follow transformers' Gemma4TextModel so checkpoints load by name.
Tests: tests/models/test_gemma4.py (equal to transformers' Gemma4ForCausalLM),
tests/e2e/test_families_e2e.py (onnxruntime equals torch, spec = target-only).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from peagle_trt.models.layers import ACTIVATIONS, RMSNorm, write_onnx_act


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, hidden: int, eps: float, attn: nn.Module, mlp: nn.Module, act: str,
                 per_layer_input_size: int = 0, layer_scalar: bool = False, moe: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.moe = moe
        if moe is not None:
            self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.act = act
        if per_layer_input_size:
            self.per_layer_input_gate = nn.Linear(hidden, per_layer_input_size, bias=False)
            self.per_layer_projection = nn.Linear(per_layer_input_size, hidden, bias=False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1)) if layer_scalar else None

    def forward(self, x, cos, sin, cache, layer, tables, positions, per_layer_input=None, tree_mask=None):
        # x [B, S, H]; per_layer_input [B, S, P] or None
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, tables, positions, tree_mask))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.moe is not None:
            experts = self.moe(self.pre_feedforward_layernorm_2(x), router_x=x)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(experts)
        x = x + self.post_feedforward_layernorm(h)
        if per_layer_input is not None:
            gate = ACTIVATIONS[self.act](self.per_layer_input_gate(x)) * per_layer_input  # [B, S, P]
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return x if self.layer_scalar is None else x * self.layer_scalar

    def write_onnx(self, w, x: str, i: int, cos: str, sin: str, positions: str, table: str, past, present,
                   pli: str | None = None, source: int | None = None) -> str:
        """Layer `i` as nodes (x [B, S, H] -> [B, S, H]); pli [B, S, L, P] or None; `source`: the
        layer whose KV cache a KV-shared layer reads."""
        p = f"layers.{i}"
        h = self.self_attn.write_onnx(w, self.input_layernorm.write_onnx(w, x, f"{p}.input_layernorm"), i,
                                      f"{p}.self_attn", cos, sin, positions, table, past, present, source)
        x = w.op("Add", x, self.post_attention_layernorm.write_onnx(w, h, f"{p}.post_attention_layernorm"))
        h = self.pre_feedforward_layernorm.write_onnx(w, x, f"{p}.pre_feedforward_layernorm")
        h = self.mlp.write_onnx(w, h, f"{p}.mlp")
        if self.moe is not None:  # beside the dense MLP: both normed, summed
            normed = self.pre_feedforward_layernorm_2.write_onnx(w, x, f"{p}.pre_feedforward_layernorm_2")
            experts = self.moe.write_onnx(w, normed, f"{p}.moe", router_x=x)
            dense = self.post_feedforward_layernorm_1.write_onnx(w, h, f"{p}.post_feedforward_layernorm_1")
            experts = self.post_feedforward_layernorm_2.write_onnx(w, experts,
                                                                  f"{p}.post_feedforward_layernorm_2")
            h = w.op("Add", dense, experts)
        h = self.post_feedforward_layernorm.write_onnx(w, h, f"{p}.post_feedforward_layernorm")
        x = w.op("Add", x, h)
        if pli is not None:
            mine = w.op("Gather", pli, w.const(np.int64(i)), axis=2)  # [B, S, P]
            gate = w.linear(x, self.per_layer_input_gate, f"{p}.per_layer_input_gate")
            gate = write_onnx_act(w, gate, self.act)
            h = w.linear(w.op("Mul", gate, mine), self.per_layer_projection, f"{p}.per_layer_projection")
            h = self.post_per_layer_input_norm.write_onnx(w, h, f"{p}.post_per_layer_input_norm")
            x = w.op("Add", x, h)
        if self.layer_scalar is not None:
            x = w.op("Mul", x, w.param(f"{p}.layer_scalar", self.layer_scalar))
        return x


class Gemma4PerLayerInputs(nn.Module):
    """Per-layer input embeddings: (ids [B, S], scaled embedding e [B, S, H]) -> [B, S, L, P]."""

    def __init__(self, hidden: int, num_layers: int, size: int, vocab: int, eps: float):
        super().__init__()
        self.num_layers, self.size, self.hidden = num_layers, size, hidden
        self.embed_tokens_per_layer = nn.Embedding(vocab, num_layers * size)
        self.per_layer_model_projection = nn.Linear(hidden, num_layers * size, bias=False)
        self.per_layer_projection_norm = RMSNorm(size, eps)

    def forward(self, ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        shape = (*ids.shape, self.num_layers, self.size)
        # tokens past the table (a larger main vocabulary) read row 0, as vLLM does
        ids = torch.where(ids < self.embed_tokens_per_layer.num_embeddings, ids, torch.zeros_like(ids))
        scale = torch.tensor(math.sqrt(self.size), dtype=embeds.dtype)
        token = (self.embed_tokens_per_layer(ids) * scale).reshape(shape)
        proj = self.per_layer_model_projection(embeds) * self.hidden ** -0.5
        proj = self.per_layer_projection_norm(proj.reshape(shape))
        return (proj + token) * 2.0 ** -0.5

    def write_onnx(self, w, ids: str, embeds: str) -> str:
        """ids [B, S], scaled embedding [B, S, H] -> per-layer inputs [B, S, L, P]."""
        shape = w.ints(0, 0, self.num_layers, self.size)
        vocab = self.embed_tokens_per_layer.num_embeddings
        safe = w.op("Where", w.op("Less", ids, w.ints(vocab)), ids, w.ints(0))  # past the table: row 0
        table = w.param("per_layer_inputs.embed_tokens_per_layer.weight", self.embed_tokens_per_layer.weight)
        token = w.op("Mul", w.op("Gather", table, safe, axis=0),
                     w.const(np.asarray(math.sqrt(self.size), dtype=w.np)))
        proj = w.linear(embeds, self.per_layer_model_projection,
                        "per_layer_inputs.per_layer_model_projection")
        proj = w.op("Mul", proj, w.const(np.asarray(self.hidden ** -0.5, dtype=w.np)))
        proj = self.per_layer_projection_norm.write_onnx(w, w.op("Reshape", proj, shape),
                                                         "per_layer_inputs.per_layer_projection_norm")
        return w.op("Mul", w.op("Add", proj, w.op("Reshape", token, shape)),
                    w.const(np.asarray(2.0 ** -0.5, dtype=w.np)))
