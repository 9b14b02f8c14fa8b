"""Assemble the target and drafter ONNX graphs from the reference torch models.

The graphs are built node by node (no tracing). This module owns the graph level: inputs and
outputs (I/O names and shapes: docs/EXPORT.md), the KV cache I/O, weights, linears (FP8 Q/DQ
when the layer is FP8), RoPE tables, embedding / taps / lm_head wiring, the `peagle` plugin
nodes of the drafter (parallel draft rows, d2t argmax) and the loop over layers. Each layer
writes itself: `write_onnx` beside its torch forward in peagle_trt/models/layers.py (RMSNorm,
attention with the PEagleKVAttention node, MLP, Llama layer), peagle_trt/models/moe.py (sparse
MoE), peagle_trt/models/gemma4.py (Gemma-4 layer, per-layer inputs) and
peagle_trt/models/drafter.py (the fusion layer).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from peagle_trt.config import KVLayout
from peagle_trt.models.target import kv_groups
from peagle_trt.ops.names import DOMAIN, DOMAIN_VERSION, DRAFT_INPUTS, DRAFT_SAMPLE
from peagle_trt.ops.onnx_builder import Builder
from peagle_trt.ops.onnx_defs import (
    OPSET,
    draft_inputs_function,
    draft_sample_function,
    fp8_act_quant,
    fp8_weight,
    plugin_attrs,
)

NP = {"float32": np.float32, "float16": np.float16}
ONNX_T = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


class ModelWriter(Builder):
    """The graph being written. What the layer writers (`write_onnx` in peagle_trt/models/) use
    besides the `Builder` blocks: `param` (a weight in the export dtype), `linear`, `rope`,
    `np` / `dtype` / `float_type`, `functions`, `written` (KV sharing), `max_len` (positions per
    request: a window at least this long cuts nothing) and `kv_fp8` (the KV caches hold E4M3 codes:
    uint8 bit patterns here, float8e4m3fn in the TensorRT copy; ops/onnx_defs.py)."""

    def __init__(self, dtype: str):
        super().__init__()
        self.dtype, self.np = dtype, NP[dtype]
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.functions: dict[str, onnx.FunctionProto] = {}  # op_type -> model-local function (ops.onnx_defs)
        self.written: dict[int, tuple] = {}  # layer -> (k, v, present, (k_scale, v_scale)) for KV-shared readers
        self.max_len = 1 << 62  # set by the export functions
        self.kv_fp8 = False  # set by the export functions from the KV layout's cache_dtype
        self.tree_mask: str | None = None  # the target graph's tree_mask input, which its attention reads

    def param(self, name: str, tensor: torch.Tensor) -> str:
        return self.weight(name, tensor.detach().float().cpu().numpy().astype(self.np, copy=False))

    def input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, name: str, elem: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    @property
    def float_type(self) -> int:
        return ONNX_T[self.dtype]

    def linear(self, x: str, module, name: str) -> str:
        """x @ W^T (+ b); FP8 layers become QuantizeLinear/DequantizeLinear around an FP8 weight; block-scaled
        FP8 layers dequantize their weight per 128 x 128 block and quantize x per row and 128-column group."""
        weight = module.weight
        if weight.dtype == torch.float8_e4m3fn and getattr(module, "block", False):
            y = self._block_fp8_linear(x, module, name)
        elif weight.dtype == torch.float8_e4m3fn:
            zero = self.weight(f"{name}.fp8_zero", helper.make_tensor(f"{name}.fp8_zero", TensorProto.FLOAT8E4M3FN,
                                                                         [], [0.0]))
            in_scale = self.weight(f"{name}.input_scale", np.asarray(float(module.input_scale), np.float32))
            w_scale = self.weight(f"{name}.weight_scale", np.asarray(float(module.weight_scale), np.float32))
            raw = weight.detach().t().contiguous().view(torch.uint8).cpu().numpy().tobytes()
            w_fp8 = self.weight(f"{name}.weight", helper.make_tensor(f"{name}.weight", TensorProto.FLOAT8E4M3FN,
                                                                      list(weight.shape[::-1]), raw, raw=True))
            x32 = self.op("Cast", x, to=TensorProto.FLOAT) if self.dtype != "float32" else x
            xq = self.op("DequantizeLinear", self.op("QuantizeLinear", x32, in_scale, zero), in_scale, zero)
            y = self.op("MatMul", xq, self.op("DequantizeLinear", w_fp8, w_scale))
            y = self.op("Cast", y, to=self.float_type) if self.dtype != "float32" else y
        else:
            y = self.op("MatMul", x, self.param(f"{name}.weight", weight.t()))
        if getattr(module, "bias", None) is not None:
            y = self.op("Add", y, self.param(f"{name}.bias", module.bias))
        return y

    def _block_fp8_linear(self, x: str, module, name: str) -> str:
        """x @ W^T for a block-scaled FP8Linear (peagle_trt/models/fp8.py): float32 math, x's type out."""
        weight = module.weight
        raw = weight.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
        w_fp8 = self.weight(f"{name}.weight", helper.make_tensor(f"{name}.weight", TensorProto.FLOAT8E4M3FN,
                                                                  list(weight.shape), raw, raw=True))
        inv = self.weight(f"{name}.weight_scale_inv", module.weight_scale_inv.detach().float().cpu().numpy())
        codes = self.op("Unsqueeze", self.op("Cast", w_fp8, to=TensorProto.FLOAT), self.ints(0))  # [1, out, in]
        dequant = fp8_weight(self, codes, "block", self.op("Unsqueeze", inv, self.ints(0)))
        w32 = self.op("Transpose", self.op("Squeeze", dequant, self.ints(0)), perm=[1, 0])  # [in, out]
        x32 = self.op("Cast", x, to=TensorProto.FLOAT) if self.dtype != "float32" else x
        y = self.op("MatMul", fp8_act_quant(self, x32, None, True), w32)
        return self.op("Cast", y, to=self.float_type) if self.dtype != "float32" else y

    def rope_tables(self, inv_freq: torch.Tensor, scale: float, max_len: int, positions: str) -> tuple[str, str]:
        """cos/sin [B, S, 1, d] gathered from tables of max_len + 1 positions (padding -> 0)."""
        pos = torch.arange(max_len + 1).float()[:, None] * inv_freq.float().cpu()[None]
        emb = torch.cat((pos, pos), dim=-1)
        cos = self.param(self.name("rope_cos"), emb.cos() * scale)
        sin = self.param(self.name("rope_sin"), emb.sin() * scale)
        clamped = self.op("Max", positions, self.ints(0))
        return (self.op("Unsqueeze", self.op("Gather", cos, clamped, axis=0), self.ints(2)),
                self.op("Unsqueeze", self.op("Gather", sin, clamped, axis=0), self.ints(2)))

    def rope(self, x: str, heads: int, head_dim: int, cos: str, sin: str) -> str:
        x4 = self.op("Reshape", x, self.ints(0, 0, heads, head_dim))  # [B,S,heads,d]
        x1, x2 = self.op("Split", x4, self.ints(head_dim // 2, head_dim // 2), axis=-1, outputs=2)
        rotated = self.op("Concat", self.op("Neg", x2), x1, axis=-1)
        out = self.op("Add", self.op("Mul", x4, cos), self.op("Mul", rotated, sin))
        return self.op("Reshape", out, self.ints(0, 0, heads * head_dim))

    def kv_io(self, layer_shapes: tuple, group_blocks: tuple[int, ...], layer_groups: tuple[int, ...],
              block_size: int, kv_sources: tuple[int, ...] | None = None):
        """past_/present_ KV pairs per layer, paged: [blocks of its group + 1, block_size, kv_heads,
        head_dim] (layer_shapes: (kv_heads, head_dim) per layer); a KV-shared layer
        (kv_sources[i] != i) has none: (None, None)."""
        past, present = [], []
        cache_type = TensorProto.UINT8 if self.kv_fp8 else self.float_type  # E4M3 bit patterns, or activations
        for i, (kv, d) in enumerate(layer_shapes):
            if kv_sources and kv_sources[i] != i:
                past.append(None)
                present.append(None)
                continue
            shape = [group_blocks[layer_groups[i]] + 1, block_size, kv, d]
            pair = (self.input(f"past_key_{i}", cache_type, shape), self.input(f"past_value_{i}", cache_type, shape))
            past.append(pair)
            present.append((f"present_key_{i}", f"present_value_{i}"))
            self.output(f"present_key_{i}", cache_type, shape)
            self.output(f"present_value_{i}", cache_type, shape)
        return past, present

    def model(self, graph_name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, graph_name, self.inputs, self.outputs, self.initializers)
        opsets = {"": OPSET, DOMAIN: DOMAIN_VERSION}
        for fn in self.functions.values():  # the domains the function bodies call (ORT's contrib ops)
            opsets.update({o.domain: o.version for o in fn.opset_import if o.domain not in opsets})
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()],
                                  functions=list(self.functions.values()), producer_name="peagle-trt")
        model.ir_version = 10
        return model


def export_target(model, kv: KVLayout, dtype: str = "float32") -> onnx.ModelProto:
    """target.onnx: prefill / decode / verify rows -> logits at `logit_rows`, taps, KV in place,
    through block tables [G, B, M] (one [B, M] table per KV group: full attention, each window);
    `tree_mask` [B, S, ceil(S / 32)] int32 (full-attention targets only): the rows' ancestor bits (a
    causal mask for plain rows)."""
    c, w = model.config, ModelWriter(dtype)
    w.max_len, w.kv_fp8 = kv.max_len, kv.cache_dtype == "fp8"
    ids = w.input("input_ids", TensorProto.INT64, ["batch", "rows"])
    positions = w.input("positions", TensorProto.INT64, ["batch", "rows"])
    windows, groups = kv_groups(c)
    block_tables = w.input("block_tables", TensorProto.INT64, [len(windows), "batch", kv.max_blocks])
    logit_rows = w.input("logit_rows", TensorProto.INT64, ["batch", "logit_rows"])
    # packed ancestor bits of draft-tree rows (peagle_trt/speculative/tree.py; causal outside tree verifies); a
    # target with sliding-window layers verifies chains only (the decoder refuses trees), so no input
    if len(windows) == 1:
        w.tree_mask = w.input("tree_mask", TensorProto.INT32, ["batch", "rows", "mask_words"])
    attn = [c.attention(i) for i in range(c.num_layers)]
    past, present = w.kv_io(tuple((a.num_kv_heads, a.head_dim) for a in attn), kv.group_blocks(windows), groups,
                            kv.block_size, tuple(a.kv_source for a in attn))
    group_tables = [w.op("Gather", block_tables, w.const(np.int64(g)), axis=0) for g in range(len(windows))]
    x = w.op("Gather", w.param("embed_tokens.weight", model.embed_tokens.weight), ids, axis=0)
    if c.embed_scale != 1.0:
        x = w.op("Mul", x, w.const(np.asarray(c.embed_scale, dtype=w.np)))
    pli = model.per_layer_inputs.write_onnx(w, ids, x) if c.per_layer_input_size else None
    ropes = [w.rope_tables(inv, scale, kv.max_len, positions)
             for inv, scale in zip(model.inv_freqs(), model.rope_scales)]
    tapped = {}
    for i, layer in enumerate(model.layers):
        tapped[i] = x
        cos, sin = ropes[model.layer_rope[i]]
        x = layer.write_onnx(w, x, i, cos, sin, positions, group_tables[groups[i]], past[i], present[i], pli,
                             attn[i].kv_source)
    tapped[c.num_layers] = x
    if model.taps:
        w.op("Concat", *[tapped[t] for t in model.taps], axis=-1, outputs=["aux_hidden"])
    else:  # no drafter: an empty [B, S, 0] tensor keeps the interface uniform
        w.op("Slice", x, w.ints(0), w.ints(0), w.ints(-1), outputs=["aux_hidden"])
    w.output("aux_hidden", w.float_type, ["batch", "rows", len(model.taps) * c.hidden_size])
    rows = w.op("Expand", w.op("Unsqueeze", logit_rows, w.ints(2)),
                w.op("Concat", w.op("Shape", logit_rows), w.ints(c.hidden_size), axis=0))
    xs = w.op("GatherElements", x, rows, axis=1)
    logits = w.op("Cast", w.linear(model.norm.write_onnx(w, xs, "norm"), model.lm_head, "lm_head"),
                  to=TensorProto.FLOAT)
    if c.logit_softcap:  # c * tanh(logits / c), in float32
        cap = w.const(np.float32(c.logit_softcap))
        logits = w.op("Mul", w.op("Tanh", w.op("Div", logits, cap)), cap)
    w.op("Identity", logits, outputs=["logits"])
    w.output("logits", TensorProto.FLOAT, ["batch", "logit_rows", c.vocab_size])
    return w.model("peagle_target")


def _drafter_layers(w: ModelWriter, model, e: str, g: str, positions: str, table: str, past, present,
                    max_len: int) -> str:
    cos, sin = w.rope_tables(model.inv_freq, model.rope_scale, max_len, positions)
    x = model.layers[0].write_onnx(w, e, g, cos, sin, positions, table, past[0], present[0])  # fusion layer
    for i, layer in enumerate(model.layers[1:], start=1):
        x = layer.write_onnx(w, x, i, cos, sin, positions, table, past[i], present[i])
    return x


def _drafter_kv(w: ModelWriter, model, kv: KVLayout) -> tuple[str, list, list]:
    """The drafter's block tables input [B, M] (KV group 0, the target's full-attention tables) and
    its paged KV I/O."""
    c = model.config
    w.max_len, w.kv_fp8 = kv.max_len, kv.cache_dtype == "fp8"
    table = w.input("block_tables", TensorProto.INT64, ["batch", kv.max_blocks])
    past, present = w.kv_io(((c.num_kv_heads, c.head_dim),) * c.num_layers, (kv.num_blocks,), (0,) * c.num_layers,
                            kv.block_size)
    return table, past, present


def _project(w: ModelWriter, model, aux: str) -> str:
    c = model.config
    if c.norm_before_fc:
        aux = model.input_norm.write_onnx(w, aux, "input_norm")
    if c.fc_norm:
        chunks = w.op("Split", aux, w.ints(*[c.target_hidden_size] * c.num_aux), axis=-1, outputs=c.num_aux)
        chunks = [chunks] if c.num_aux == 1 else chunks
        aux = w.op("Concat", *[norm.write_onnx(w, ch, f"fc_norm.{i}") for i, (ch, norm) in
                               enumerate(zip(chunks, model.fc_norm))], axis=-1)
    return w.linear(aux, model.fc, "fc")


def export_drafter(model, kv: KVLayout, num_spec_tokens: int, dtype: str = "float32") -> onnx.ModelProto:
    """drafter.onnx: ONE parallel P-EAGLE pass -> k <= K = `num_spec_tokens` draft ids (k = the
    length of `draft_slots`), and each position's top W candidates with their log-probabilities (W =
    the length of `draft_width`; what a draft tree is built from, peagle_trt/speculative/tree.py)."""
    c, w = model.config, ModelWriter(dtype)
    ids = w.input("pending_ids", TensorProto.INT64, ["batch", "pending"])
    aux = w.input("pending_aux", w.float_type, ["batch", "pending", c.num_aux * c.target_hidden_size])
    n = w.input("num_pending", TensorProto.INT64, ["batch"])
    cur = w.input("cur", TensorProto.INT64, ["batch"])
    slots = w.input("draft_slots", TensorProto.INT64, ["drafts"])  # only its length k (1..K) counts
    width = w.input("draft_width", TensorProto.INT64, ["width"])  # only its length W counts
    table, past, present = _drafter_kv(w, model, kv)
    w.functions[DRAFT_INPUTS] = draft_inputs_function(num_spec_tokens, c.mask_token_id)
    w.functions[DRAFT_SAMPLE] = draft_sample_function()
    embeds, hidden, positions, rows = w.op(
        DRAFT_INPUTS, ids, _project(w, model, aux), n, cur,
        w.param("embed_tokens.weight", model.embed_tokens.weight), w.param("h_mask", model.h_mask),
        domain=DOMAIN, outputs=4, name=DRAFT_INPUTS,
        **plugin_attrs(num_spec_tokens=num_spec_tokens, mask_token_id=c.mask_token_id))
    # k < K drafts: the layers run the first P + k - 1 of the R = P + K - 1 rows, which hold every
    # request's sample rows n-1 .. n+k-2 (n <= P); mask rows past them only cost time.
    drafts = w.op("Shape", slots)  # [1] = k
    keep = w.op("Add", w.op("Shape", ids, start=1, end=2), w.op("Sub", drafts, w.ints(1)))  # [1] = P + k - 1
    embeds, hidden, positions = (w.op("Slice", t, w.ints(0), keep, w.ints(1)) for t in (embeds, hidden, positions))
    rows = w.op("Slice", rows, w.ints(0), drafts, w.ints(1))  # [B, k]
    x = _drafter_layers(w, model, embeds, hidden, positions, table, past, present, kv.max_len)
    gather = w.op("Expand", w.op("Unsqueeze", rows, w.ints(2)),
                  w.op("Concat", w.op("Shape", rows), w.ints(c.hidden_size), axis=0))
    xs = w.op("GatherElements", x, gather, axis=1)  # [B, k, H]
    logits = w.op("Cast", w.linear(model.norm.write_onnx(w, xs, "norm"), model.lm_head, "lm_head"),
                  to=TensorProto.FLOAT)
    d2t = w.weight("d2t", model.d2t.cpu().numpy().astype(np.int64))
    w.op(DRAFT_SAMPLE, logits, d2t, domain=DOMAIN, outputs=["draft_ids"], name=DRAFT_SAMPLE,
         **plugin_attrs())
    w.output("draft_ids", TensorProto.INT64, ["batch", "drafts"])
    top_n = w.op("Min", w.op("Shape", width), w.ints(int(model.lm_head.weight.shape[0])))  # W, at most V_d
    top_logp, top = w.op("TopK", w.op("LogSoftmax", logits, axis=-1), top_n, axis=-1, outputs=2)
    w.op("Identity", top_logp, outputs=["top_logp"])
    w.op("Add", top, w.op("Gather", d2t, top, axis=0), outputs=["top_ids"])  # draft -> target ids
    w.output("top_ids", TensorProto.INT64, ["batch", "drafts", "width"])
    w.output("top_logp", TensorProto.FLOAT, ["batch", "drafts", "width"])
    return w.model("peagle_drafter")


def export_drafter_step(model, kv: KVLayout, dtype: str = "float32") -> onnx.ModelProto:
    """drafter_step.onnx: generic rows -> draft-vocab logits + the hidden fed to the next sequential
    step (pre-norm output; post-norm for norm_output heads), as `DrafterModel.forward`."""
    c, w = model.config, ModelWriter(dtype)
    ids = w.input("input_ids", TensorProto.INT64, ["batch", "rows"])
    hidden = w.input("hidden", w.float_type, ["batch", "rows", c.hidden_size])
    positions = w.input("positions", TensorProto.INT64, ["batch", "rows"])
    table, past, present = _drafter_kv(w, model, kv)
    e = w.op("Gather", w.param("embed_tokens.weight", model.embed_tokens.weight), ids, axis=0)
    x = _drafter_layers(w, model, e, hidden, positions, table, past, present, kv.max_len)
    normed = model.norm.write_onnx(w, x, "norm")
    w.op("Identity", normed if c.norm_output else x, outputs=["hidden_out"])
    w.op("Cast", w.linear(normed, model.lm_head, "lm_head"), to=TensorProto.FLOAT, outputs=["logits"])
    w.output("logits", TensorProto.FLOAT, ["batch", "rows", c.draft_vocab_size])
    w.output("hidden_out", w.float_type, ["batch", "rows", c.hidden_size])
    return w.model("peagle_drafter_step")


def export_drafter_fc(model, dtype: str = "float32") -> onnx.ModelProto:
    """drafter_fc.onnx: target taps -> drafter hidden input."""
    c, w = model.config, ModelWriter(dtype)
    aux = w.input("aux", w.float_type, ["batch", "rows", c.num_aux * c.target_hidden_size])
    w.op("Identity", _project(w, model, aux), outputs=["hidden"])
    w.output("hidden", w.float_type, ["batch", "rows", c.hidden_size])
    return w.model("peagle_drafter_fc")
