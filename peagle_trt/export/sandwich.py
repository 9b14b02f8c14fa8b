"""ONNX for the sandwich-norm decoder layer and the per-layer inputs (models/sandwich.py, Gemma-4),
written with the same `ModelWriter` blocks as the Llama layer. Tests: tests/e2e/test_families_e2e.py
(onnxruntime equals torch, spec = target-only)."""

from __future__ import annotations

import math

import numpy as np

from peagle_trt.export.moe import moe


def per_layer_inputs(w, ple, ids: str, embeds: str) -> str:
    """ids [B, S], scaled embedding [B, S, H] -> per-layer inputs [B, S, L, P]."""
    shape = w.ints(0, 0, ple.num_layers, ple.size)
    vocab = ple.embed_tokens_per_layer.num_embeddings
    safe = w.op("Where", w.op("Less", ids, w.ints(vocab)), ids, w.ints(0))  # past the table: row 0
    table = w.param("per_layer_inputs.embed_tokens_per_layer.weight", ple.embed_tokens_per_layer.weight)
    token = w.op("Mul", w.op("Gather", table, safe, axis=0),
                 w.const(np.asarray(math.sqrt(ple.size), dtype=w.np)))
    proj = w.linear(embeds, ple.per_layer_model_projection, "per_layer_inputs.per_layer_model_projection")
    proj = w.op("Mul", proj, w.const(np.asarray(ple.hidden ** -0.5, dtype=w.np)))
    proj = w.norm(w.op("Reshape", proj, shape), ple.per_layer_projection_norm,
                  "per_layer_inputs.per_layer_projection_norm")
    return w.op("Mul", w.op("Add", proj, w.op("Reshape", token, shape)),
                w.const(np.asarray(2.0 ** -0.5, dtype=w.np)))


def sandwich_layer(w, x: str, layer, i: int, cos: str, sin: str, positions: str, slots: str, past, present,
                   pli: str | None, source: int | None) -> str:
    p = f"layers.{i}"
    h = w.attention(w.norm(x, layer.input_layernorm, f"{p}.input_layernorm"), layer.self_attn, i,
                    f"{p}.self_attn", cos, sin, positions, slots, past, present, source)
    x = w.op("Add", x, w.norm(h, layer.post_attention_layernorm, f"{p}.post_attention_layernorm"))
    h = w.mlp(w.norm(x, layer.pre_feedforward_layernorm, f"{p}.pre_feedforward_layernorm"), layer.mlp,
              f"{p}.mlp")
    if layer.moe is not None:  # beside the dense MLP: both normed, summed
        experts = moe(w, w.norm(x, layer.pre_feedforward_layernorm_2, f"{p}.pre_feedforward_layernorm_2"),
                      layer.moe, f"{p}.moe", router_x=x)
        h = w.op("Add", w.norm(h, layer.post_feedforward_layernorm_1, f"{p}.post_feedforward_layernorm_1"),
                 w.norm(experts, layer.post_feedforward_layernorm_2, f"{p}.post_feedforward_layernorm_2"))
    x = w.op("Add", x, w.norm(h, layer.post_feedforward_layernorm, f"{p}.post_feedforward_layernorm"))
    if pli is not None:
        mine = w.op("Gather", pli, w.const(np.int64(i)), axis=2)  # [B, S, P]
        gate = w.act(w.linear(x, layer.per_layer_input_gate, f"{p}.per_layer_input_gate"), layer.act)
        h = w.linear(w.op("Mul", gate, mine), layer.per_layer_projection, f"{p}.per_layer_projection")
        x = w.op("Add", x, w.norm(h, layer.post_per_layer_input_norm, f"{p}.post_per_layer_input_norm"))
    if layer.layer_scalar is not None:
        x = w.op("Mul", x, w.param(f"{p}.layer_scalar", layer.layer_scalar))
    return x
