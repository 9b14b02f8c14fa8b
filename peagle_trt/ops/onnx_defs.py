"""The ONNX view of the custom ops: `OpSchema`s in domain `peagle` (registered with onnx so
`onnx.checker` accepts the nodes) and model-local FunctionProtos whose bodies compute the same
math as `ops.reference` in standard ONNX ops, so onnxruntime runs an exported file as is.

Each body is specialised for one model (head counts, K, mask token id, whether attention has
sinks are constants inside it); the node also carries them as attributes for the TensorRT
plugin. PEagleKVAttention's optional extensions are backward compatible: an optional 8th input
`sinks` [H], an optional 9th input `tree_mask` [B, S, W] int32 (draft trees: packed ancestor
bits, ops.reference.kv_attention; the target graph always feeds it, a causal mask outside tree
verifies) and an attribute `sliding_window` (default 0 = full attention, read by the body
through an attribute reference, so one body serves sliding and full layers). The Triton kernels
implement them; the TensorRT plugins in plugins/ do not expose them yet (see docs/EXPORT.md). TensorRT must NOT see the
functions (its parser would inline them instead of calling the plugin): `strip_functions`.

FP8 KV caches (`kv_attention_function(fp8=True)`; attributes `k_scale` / `v_scale`, default 1): the
body stores fp8(clamp(value / scale, +-448)) and reads code * scale (ops.reference.kv_store /
kv_load). ONNX allows ScatterND and Gather on no float8 type (any opset through 25; onnxruntime
refuses such a graph at load), so in the graphs onnxruntime runs the caches are uint8 tensors
holding the E4M3 bit patterns: a write rounds through Cast to float8e4m3fn and back, then encodes
the value's bits arithmetically (`_e4m3_bits`) and ScatterND stores them; a read gathers the blocks
and looks the codes up in a 256-entry table of their values times the scale. The TensorRT copy
declares the same caches float8e4m3fn (same bytes): how the plugin tells an FP8 cache
(`strip_functions`). How to test: tests/ops/test_fp8_kv_cache.py (the body against the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, defs, helper

from peagle_trt.ops.names import (
    DOMAIN,
    DOMAIN_VERSION,
    DRAFT_INPUTS,
    DRAFT_SAMPLE,
    KV_ATTENTION,
    MOE,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
)
from peagle_trt.ops.onnx_builder import Builder

OPSET = 19  # FP8 QuantizeLinear / DequantizeLinear need opset >= 19
CONTRIB = "com.microsoft"  # onnxruntime's contrib ops (a PEagleMoE body may call its MoE)
_P = defs.OpSchema.FormalParameter
_A = defs.OpSchema.Attribute
_T = defs.OpSchema.AttrType
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


def _param(name: str, type_str: str) -> defs.OpSchema.FormalParameter:
    if name.endswith("?"):  # optional input
        return _P(name[:-1], type_str, "", param_option=defs.OpSchema.FormalParameterOption.Optional)
    return _P(name, type_str)


_ATTR_DEFAULTS = {"sliding_window": 0, "k_scale": 1.0, "v_scale": 1.0}  # PEagleKVAttention's optional ones


def _attr(name: str, kind, doc: str):
    if name in _ATTR_DEFAULTS:  # optional: full attention, unscaled FP8 caches
        return _A(name, helper.make_attribute(name, _ATTR_DEFAULTS[name]), doc)
    return _A(name, kind, doc)


def _schema(name: str, doc: str, inputs, outputs, attrs) -> defs.OpSchema:
    plugin = [_A("plugin_version", _T.STRING, "TensorRT plugin version"),
              _A("plugin_namespace", _T.STRING, "TensorRT plugin namespace")]
    return defs.OpSchema(
        name, DOMAIN, DOMAIN_VERSION, doc,
        inputs=[_param(n, t) for n, t in inputs], outputs=[_P(n, t) for n, t in outputs],
        type_constraints=[("T", _FLOATS, "activations"), ("I", ["tensor(int64)"], "indices"),
                          ("M", ["tensor(int32)"], "packed bits"),
                          ("C", _FLOATS + ["tensor(uint8)", "tensor(float8e4m3fn)"],
                           "KV caches: the activations' type, or E4M3 codes (uint8 bit patterns for onnxruntime, "
                           "float8e4m3fn in the TensorRT copy)"),
                          ("W", _FLOATS + ["tensor(float8e4m3fn)"], "weights (FP8 or the activations' type)"),
                          ("F", ["tensor(float)"], "float32 logits and scales")],
        attributes=[_attr(a, kind, d) for a, kind, d in attrs] + plugin)


SCHEMAS = [
    _schema(KV_ATTENTION, "attention of new rows over a paged KV cache (block tables), in-place writes",
            [("q", "T"), ("k", "T"), ("v", "T"), ("positions", "I"), ("block_tables", "I"), ("k_cache", "C"),
             ("v_cache", "C"), ("sinks?", "T"), ("tree_mask?", "M")],
            [("out", "T"), ("k_cache_out", "C"), ("v_cache_out", "C")],
            [("num_heads", _T.INT, ""), ("num_kv_heads", _T.INT, ""), ("head_dim", _T.INT, ""),
             ("scale", _T.FLOAT, "softmax scale"),
             ("sliding_window", _T.INT, "attend to keys at positions > p - W only; 0: full attention"),
             ("k_scale", _T.FLOAT, "FP8 caches: stored K = fp8(clamp(K / k_scale, +-448)), read code * k_scale"),
             ("v_scale", _T.FLOAT, "FP8 caches: as k_scale, for V")]),
    _schema(DRAFT_INPUTS, "drafter rows of one parallel pass: pending rows + K-1 mask rows",
            [("pending_ids", "I"), ("pending_hidden", "T"), ("num_pending", "I"), ("cur", "I"),
             ("embed_tokens", "T"), ("h_mask", "T")],
            [("embeds", "T"), ("hidden", "T"), ("positions", "I"), ("sample_rows", "I")],
            [("num_spec_tokens", _T.INT, "K"), ("mask_token_id", _T.INT, "mask token id")]),
    _schema(DRAFT_SAMPLE, "greedy argmax over the draft vocabulary, mapped to target ids by d2t",
            [("logits", "T"), ("d2t", "I")], [("draft_ids", "I")], []),
    _schema(MOE, "sparse mixture-of-experts MLP: routing, routed experts' gate/up, activation, down, weighted sum",
            [("x", "T"), ("router_logits", "F"), ("w13", "W"), ("w2", "W"), ("b13?", "T"), ("b2?", "T"),
             ("expert_scale?", "F"), ("w13_scale?", "F"), ("w2_scale?", "F"), ("a13_scale?", "F"), ("a2_scale?", "F")],
            [("y", "T")],
            [("top_k", _T.INT, "experts per row"), ("routing", _T.INT, "0 softmax-top-k, 1 top-k-softmax"),
             ("renormalize", _T.INT, "softmax-top-k: divide the k weights by their sum"),
             ("activation", _T.INT, "0 SwiGLU, 1 GeGLU (tanh), 2 GPT-OSS clamped SwiGLU"),
             ("swiglu_alpha", _T.FLOAT, "clamped SwiGLU's sigmoid scale"),
             ("swiglu_limit", _T.FLOAT, "clamped SwiGLU's clamp")]),
]

MOE_INPUTS = ["x", "router_logits", "w13", "w2", "b13", "b2", "expert_scale", "w13_scale", "w2_scale", "a13_scale",
              "a2_scale"]


def register_schemas() -> None:
    for schema in SCHEMAS:
        if not defs.has(schema.name, DOMAIN):
            defs.register_schema(schema)


def plugin_attrs(**attrs) -> dict:
    return {**attrs, "plugin_version": PLUGIN_VERSION, "plugin_namespace": PLUGIN_NAMESPACE}


def _function(name: str, b: Builder, inputs: list[str], outputs: list[str], attrs: list[str],
              defaults: list[onnx.AttributeProto] = ()) -> onnx.FunctionProto:
    opsets = [helper.make_opsetid("", OPSET)]
    if any(n.domain == CONTRIB for n in b.nodes):
        opsets.append(helper.make_opsetid(CONTRIB, 1))
    return helper.make_function(DOMAIN, name, inputs, outputs, b.nodes, opsets,
                                attributes=attrs + ["plugin_version", "plugin_namespace"],
                                attribute_protos=list(defaults))


def _attr_tensor(b: Builder, attr: str, kind: str = "int") -> str:
    """A scalar (int64, or float32 for kind="float") holding the calling node's attribute `attr`
    (attribute reference)."""
    out = b.name(attr)
    node = helper.make_node("Constant", [], [out], name=b.name("Constant"))
    value, proto = ("value_int", onnx.AttributeProto.INT) if kind == "int" else ("value_float",
                                                                                 onnx.AttributeProto.FLOAT)
    node.attribute.append(helper.make_attribute_ref(value, proto, ref_attr_name=attr))
    b.nodes.append(node)
    return out


def kv_attention_function(dtype=np.float32, sinks: bool = False, tree: bool = False,
                          fp8: bool = False, heads_in_gemm: bool = True) -> onnx.FunctionProto:
    """Body of PEagleKVAttention over the paged cache (layout [NB+1, bs, KV, d], block NB the trash
    block; block_tables [B, M], -1 = no block; see ops.reference.kv_attention). Head counts, head
    size and scale come from the calling node's attributes, so one body serves layers of different
    shapes (Gemma-4). `sinks`: the body reads the 8th input; `tree`: the 9th (tree_mask): rows
    write slot positions[b, 0] + s and see the context below it plus their tree bits. `fp8`: the
    caches are uint8 E4M3 codes scaled by the attributes k_scale / v_scale (module docstring).
    `heads_in_gemm` (how GQA reads the gathered blocks, [B, L, KV * d] rows): True, two block-diagonal
    products over all KV heads at once, keys [L, KV*d] x q [KV*d, KV*G*S] (q's rows of head h zero outside
    h's d columns) and probs [KV*G*S, L] x values [L, KV*d] keeping each row's own head's d columns:
    no transpose of the context (onnxruntime moves it element by element: 27% of a decode step at 8K
    positions, docs/BENCHMARKS.md "context-decode") and each key read once for all G query heads, at
    KV times the multiply-adds; False (many KV heads): the keys and values transposed head-major, G
    query heads by broadcasting."""
    b = Builder("att_")
    kv1 = b.op("Unsqueeze", _attr_tensor(b, "num_kv_heads"), b.ints(0))  # [1]
    d = _attr_tensor(b, "head_dim")
    d1 = b.op("Unsqueeze", d, b.ints(0))  # [1]
    given = _attr_tensor(b, "scale", "float")  # <= 0 means 1/sqrt(d)
    scale = b.op("Where", b.op("Greater", given, b.const(np.float32(0))), given,
                 b.op("Reciprocal", b.op("Sqrt", b.op("Cast", d, to=onnx.TensorProto.FLOAT))))
    scale = b.op("Cast", scale, to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
    cache_shape = b.op("Shape", "k_cache")
    trash = b.op("Sub", b.op("Gather", cache_shape, b.const(np.int64(0)), axis=0), b.const(np.int64(1)))  # NB
    bs = b.op("Gather", cache_shape, b.const(np.int64(1)), axis=0)  # scalar block size
    m = b.op("Gather", b.op("Shape", "block_tables"), b.const(np.int64(1)), axis=0)  # scalar M
    zero = b.const(np.int64(0))
    slots = "positions"
    if tree:  # row s of a tree lives at slot positions[b, 0] + s (positions: RoPE, by depth)
        base = b.op("Slice", "positions", b.ints(0), b.ints(1), b.ints(1))  # [B, 1]
        rows_s = b.op("Range", zero, b.op("Gather", b.op("Shape", "positions"), b.const(np.int64(1)), axis=0),
                      b.const(np.int64(1)))  # [S]
        slots = b.op("Where", b.op("GreaterOrEqual", "positions", zero), b.op("Add", base, rows_s),
                     b.const(np.int64(-1)))  # [B, S]
    # 1. write K/V at (block_tables[b, p // bs], p % bs) straight into the cache: the ScatterND output
    #    aliases its data input when the caller binds present_* to the past_* buffer (OrtExecutor), so
    #    a step copies nothing; padding rows, rows past the table and entries -1 write the trash block
    pos0 = b.op("Max", slots, zero)  # [B,S]
    entry = b.op("Div", pos0, bs)
    block = b.op("GatherElements", "block_tables", b.op("Min", entry, b.op("Sub", m, b.const(np.int64(1)))),
                 axis=1)  # [B,S]
    valid = b.op("And", b.op("And", b.op("GreaterOrEqual", slots, zero), b.op("Less", entry, m)),
                 b.op("GreaterOrEqual", block, zero))
    block = b.op("Where", valid, block, trash)
    offset = b.op("Where", valid, b.op("Mod", pos0, bs), zero)
    index = b.op("Concat", b.op("Unsqueeze", block, b.ints(2)), b.op("Unsqueeze", offset, b.ints(2)),
                 axis=2)  # [B,S,2] = (block, offset)
    rows = b.op("Concat", b.ints(0, 0), kv1, d1, axis=0)  # [B, S, KV, d]
    k_new, v_new = b.op("Reshape", "k", rows), b.op("Reshape", "v", rows)
    if fp8:  # ops.reference.kv_store, as E4M3 bit patterns (module docstring)
        k_scale, v_scale = _attr_tensor(b, "k_scale", "float"), _attr_tensor(b, "v_scale", "float")
        k_new, v_new = _e4m3_bits(b, k_new, k_scale), _e4m3_bits(b, v_new, v_scale)
    b.op("ScatterND", "k_cache", index, k_new, outputs=["k_cache_out"])
    b.op("ScatterND", "v_cache", index, v_new, outputs=["v_cache_out"])
    # 2. attention of each row over the keys of the blocks spanning positions 0 .. max position
    #    (L = nb * bs keys, gathered block by block through the table; positions past a row are
    #    masked, so no slice to the exact length), causal by position. GQA (`heads_in_gemm`):
    #    block-diagonal products over the gathered [B, L, KV * d] rows, or head-major keys by broadcasting
    live = b.op("Min", b.op("Add", b.op("ReduceMax", slots, keepdims=0), b.const(np.int64(1))),
                b.op("Mul", m, bs))  # scalar: most positions a row sees
    nb = b.op("Div", b.op("Sub", b.op("Add", live, bs), b.const(np.int64(1))), bs)  # blocks spanned
    table = b.op("Slice", "block_tables", b.ints(0), b.op("Unsqueeze", nb, b.ints(0)), b.ints(1))  # [B, nb]
    table = b.op("Where", b.op("GreaterOrEqual", table, zero), table, trash)
    key_pos = b.op("Range", zero, b.op("Mul", nb, bs), b.const(np.int64(1)))  # [L]
    kvd = b.op("Mul", kv1, d1)  # [1] = KV * d

    def read(cache: str, fp8_scale: str | None) -> str:  # [NB+1,bs,KV,d] -> [B, nb, bs, KV, d]
        blocks = b.op("Gather", cache, table, axis=0)
        if fp8_scale is not None:  # ops.reference.kv_load: code * scale in float32, then the compute dtype
            decoded = b.op("Cast", b.op("Mul", b.const(E4M3_VALUES), fp8_scale),
                           to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))  # [256]: by bit pattern
            blocks = b.op("Gather", decoded, b.op("Cast", blocks, to=TensorProto.INT64), axis=0)
        return blocks

    keys = read("k_cache_out", k_scale if fp8 else None)
    values = read("v_cache_out", v_scale if fp8 else None)
    q = b.op("Reshape", "q", b.op("Concat", b.ints(0, 0), kv1, b.ints(-1), d1, axis=0))  # [B,S,KV,G,d]
    if heads_in_gemm:
        # eye [KV, 1, KV, 1]: the rows of KV head h (of q, of the output) meet only head h's keys (values)
        heads = b.op("Range", zero, _attr_tensor(b, "num_kv_heads"), b.const(np.int64(1)))
        eye = b.op("Cast", b.op("Equal", b.op("Unsqueeze", heads, b.ints(1)), b.op("Unsqueeze", heads, b.ints(0))),
                   to=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)))
        eye = b.op("Unsqueeze", eye, b.ints(1, 3))  # [KV, 1, KV, 1]
        keys, values = (b.op("Reshape", t, b.op("Concat", b.ints(0, -1), kvd, axis=0)) for t in (keys, values))
        q_shape = b.op("Shape", b.op("Transpose", q, perm=[0, 2, 3, 1, 4]))  # [5]: B, KV, G, S, d
        q_cols = b.op("Reshape", b.op("Transpose", q, perm=[0, 2, 4, 3, 1]),
                      b.ints(0, 0, 0, 1, -1))  # [B, KV, d, 1, G*S]
        q_diag = b.op("Reshape", b.op("Mul", q_cols, eye),
                      b.op("Concat", b.ints(0), kvd, b.ints(-1), axis=0))  # [B, KV*d, KV*G*S]
        scores = b.op("Transpose", b.op("MatMul", keys, q_diag), perm=[0, 2, 1])  # [B, KV*G*S, L]
        rows_l = b.op("Concat", b.op("Slice", q_shape, b.ints(0), b.ints(4)), b.op("Shape", key_pos), axis=0)
        scores = b.op("Mul", b.op("Reshape", scores, rows_l), scale)  # [B,KV,G,S,L]
    else:
        flat = b.op("Concat", b.ints(0, -1), kv1, b.ints(1), d1, axis=0)  # [B, L, KV, 1, d]
        keys, values = (b.op("Transpose", b.op("Reshape", t, flat), perm=[0, 2, 3, 1, 4])
                        for t in (keys, values))  # [B,KV,1,L,d]: whole d-rows move
        q = b.op("Transpose", q, perm=[0, 2, 3, 1, 4])  # [B,KV,G,S,d]
        # q @ keys^T: onnxruntime fuses this Transpose into the MatMul (FusedMatMul, transB)
        scores = b.op("Mul", b.op("MatMul", q, b.op("Transpose", keys, perm=[0, 1, 2, 4, 3])), scale)  # [B,KV,G,S,L]
    pos = b.op("Unsqueeze", "positions", b.ints(2))  # [B,S,1]
    visible = b.op("LessOrEqual", key_pos, pos) if not tree else _tree_visible(b, key_pos, base)  # [B,S,L]
    window = _attr_tensor(b, "sliding_window")
    in_window = b.op("Or", b.op("Equal", window, zero), b.op("Greater", key_pos, b.op("Sub", pos, window)))
    visible = b.op("And", visible, in_window)
    first_key = b.op("Equal", key_pos, zero)
    padding = b.op("Less", pos, zero)
    visible = b.op("Or", visible, b.op("And", first_key, padding))  # keep padding rows finite
    bias = b.op("Where", visible, b.const(np.asarray(0, dtype=dtype)), b.const(np.asarray(-np.inf, dtype=dtype)))
    scores = b.op("Add", scores, b.op("Unsqueeze", bias, b.ints(1, 2)))  # [B,KV,G,S,L]
    if sinks:  # one extra logit per head joins the softmax and is dropped after it
        sink = b.op("Reshape", "sinks", b.op("Concat", b.ints(1), kv1, b.ints(-1, 1, 1), axis=0))
        sink = b.op("Expand", sink, b.op("Concat", b.op("Slice", b.op("Shape", scores), b.ints(0), b.ints(4)),
                                          b.ints(1), axis=0))  # [B,KV,G,S,1]
        probs = b.op("Softmax", b.op("Concat", scores, sink, axis=-1), axis=-1)
        probs = b.op("Slice", probs, b.ints(0), b.ints(-1), b.ints(-1))
    else:
        probs = b.op("Softmax", scores, axis=-1)
    if heads_in_gemm:  # every row times every head's values, then each row keeps its own head's d columns
        probs = b.op("Reshape", probs, b.op("Concat", b.ints(0, -1), b.op("Shape", key_pos), axis=0))  # [B,KV*G*S,L]
        out = b.op("Reshape", b.op("MatMul", probs, values),
                   b.op("Concat", b.ints(0), kv1, b.ints(-1), kv1, d1, axis=0))  # [B, KV, G*S, KV, d]
        out = b.op("Reshape", b.op("ReduceSum", b.op("Mul", out, eye), b.ints(3), keepdims=0), q_shape)
    else:
        out = b.op("MatMul", probs, values)  # [B,KV,G,S,d]
    out = b.op("Transpose", out, perm=[0, 3, 1, 2, 4])  # [B,S,KV,G,d]
    b.op("Reshape", out, b.ints(0, 0, -1), outputs=["out"])
    inputs = ["q", "k", "v", "positions", "block_tables", "k_cache", "v_cache"] + (["sinks"] if sinks or tree else [])
    inputs += ["tree_mask"] if tree else []
    return _function(KV_ATTENTION, b, inputs, ["out", "k_cache_out", "v_cache_out"],
                     ["num_heads", "num_kv_heads", "head_dim", "scale"],
                     [helper.make_attribute(name, value) for name, value in _ATTR_DEFAULTS.items()])


def _e4m3_table() -> np.ndarray:
    """float32 [256]: the value of each float8_e4m3fn bit pattern (0x7F / 0xFF: NaN)."""
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 15, (codes & 7).astype(np.float64)
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = np.where(codes >= 128, -magnitude, magnitude)
    values[(exponent == 15) & (mantissa == 7)] = np.nan
    return values.astype(np.float32)


E4M3_VALUES = _e4m3_table()
_E4M3_MIN_NORMAL = 2.0 ** -6


def _e4m3_bits(b: Builder, x: str, scale: str) -> str:
    """uint8 E4M3 bit patterns of fp8(clamp(x / scale, +-448)) (x: any float type; divided in float32):
    the bytes torch's float8_e4m3fn holds for ops.reference.kv_store. The value y is rounded by Cast
    to float8e4m3fn and back (nearest even); then its bits: the sign 128 (from 1 / y, so -0 keeps
    it); a normal |y| = (1 + m/8) 2^e (e in -6..8) is 8 (e + 6) + 8 |y| 2^-e, e = floor(log2 |y| +
    0.04) (log2(1 + m/8) has a fraction of at most 0.907, so the floor is e despite Log's last bits);
    a subnormal m 2^-9 is 512 |y|; NaN is 0x7F."""
    f32 = TensorProto.FLOAT
    fmax = b.const(np.float32(448.0))
    x = b.op("Div", b.op("Cast", x, to=f32), scale)
    y = b.op("Cast", b.op("Cast", b.op("Clip", x, b.op("Neg", fmax), fmax), to=TensorProto.FLOAT8E4M3FN), to=f32)
    nan = b.op("IsNaN", y)
    a = b.op("Where", nan, b.const(np.float32(0)), b.op("Abs", y))  # NaN: no out-of-range table index below
    log2 = b.op("Mul", b.op("Log", b.op("Max", a, b.const(np.float32(_E4M3_MIN_NORMAL)))),
                b.const(np.float32(1 / np.log(2))))
    e = b.op("Add", b.op("Floor", b.op("Add", log2, b.const(np.float32(0.04)))), b.const(np.float32(6)))  # e + 6
    inverse = b.const((2.0 ** -np.arange(-6, 9)).astype(np.float32))  # [15]: 2^-e at e + 6
    step = b.op("Gather", inverse, b.op("Cast", e, to=TensorProto.INT64), axis=0)
    normal = b.op("Mul", b.const(np.float32(8)), b.op("Add", e, b.op("Mul", a, step)))
    subnormal = b.op("Mul", a, b.const(np.float32(512)))
    magnitude = b.op("Where", b.op("Less", a, b.const(np.float32(_E4M3_MIN_NORMAL))), subnormal, normal)
    negative = b.op("Less", b.op("Div", b.const(np.float32(1)), y), b.const(np.float32(0)))
    bits = b.op("Where", negative, b.op("Add", magnitude, b.const(np.float32(128))), magnitude)
    bits = b.op("Where", nan, b.const(np.float32(127)), bits)
    return b.op("Cast", bits, to=TensorProto.UINT8)


def _tree_visible(b: Builder, key_pos: str, base: str) -> str:
    """[B,S,L]: key slot p (key_pos [L]) is below the row's base (base [B, 1]: the context), or is
    this forward's row j = p - base whose bit j % 32 of word j // 32 of tree_mask [B,S,W] is set."""
    bit = b.op("Unsqueeze", b.op("Sub", key_pos, base), b.ints(1))  # [B,1,L]
    n_bits = b.op("Mul", b.op("Gather", b.op("Shape", "tree_mask"), b.const(np.int64(2)), axis=0),
                  b.const(np.int64(32)))  # scalar 32 W
    zero = b.const(np.int64(0))
    inside = b.op("And", b.op("GreaterOrEqual", bit, zero), b.op("Less", bit, n_bits))
    index = b.op("Max", b.op("Min", bit, b.op("Sub", n_bits, b.const(np.int64(1)))), zero)  # [B,1,L]
    shape = b.op("Concat", b.op("Shape", "tree_mask", start=0, end=2), b.op("Shape", key_pos), axis=0)
    index = b.op("Expand", index, shape)  # [B,S,L]
    word = b.op("GatherElements", "tree_mask", b.op("Div", index, b.const(np.int64(32))), axis=2)  # int32
    powers = b.const(np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32)).view(np.int32))  # [32]
    flag = b.op("Gather", powers, b.op("Mod", index, b.const(np.int64(32))), axis=0)  # [B,S,L]
    ancestor = b.op("Not", b.op("Equal", b.op("BitwiseAnd", word, flag), b.const(np.int32(0))))
    return b.op("Or", b.op("Less", bit, zero), b.op("And", inside, ancestor))


def draft_inputs_function(num_spec_tokens: int, mask_token_id: int) -> onnx.FunctionProto:
    """Body of PEagleDraftInputs (see ops.reference.draft_inputs for the row layout)."""
    b = Builder("din_")
    k = num_spec_tokens
    p = b.op("Gather", b.op("Shape", "pending_ids"), b.ints(1), axis=0)  # [1]
    r = b.op("Add", p, b.ints(k - 1))
    j = b.op("Range", b.const(np.int64(0)), b.op("Squeeze", r, b.ints(0)), b.const(np.int64(1)))  # [R]
    n = b.op("Unsqueeze", "num_pending", b.ints(1))  # [B,1]
    real = b.op("Less", j, n)  # [B,R]
    mask = b.op("And", b.op("Not", real), b.op("Less", j, b.op("Add", n, b.ints(k - 1))))
    valid = b.op("Or", real, mask)
    batch = b.op("Gather", b.op("Shape", "pending_ids"), b.ints(0), axis=0)
    idx = b.op("Expand", b.op("Min", j, b.op("Sub", p, b.ints(1))), b.op("Concat", batch, r, axis=0))  # [B,R]
    tokens = b.op("Where", real, b.op("GatherElements", "pending_ids", idx, axis=1), b.ints(mask_token_id))
    tokens = b.op("Where", valid, tokens, b.ints(0))
    valid_f = b.op("Unsqueeze", b.op("CastLike", valid, "h_mask"), b.ints(2))  # [B,R,1]
    b.op("Mul", b.op("Gather", "embed_tokens", tokens, axis=0), valid_f, outputs=["embeds"])
    hidden_idx = b.op("Expand", b.op("Unsqueeze", idx, b.ints(2)), b.op("Shape", b.op("Mul", valid_f, "h_mask")))
    gathered = b.op("GatherElements", "pending_hidden", hidden_idx, axis=1)  # [B,R,H]
    hidden = b.op("Where", b.op("Unsqueeze", real, b.ints(2)), gathered, "h_mask")
    b.op("Mul", hidden, valid_f, outputs=["hidden"])
    pos = b.op("Add", b.op("Sub", b.op("Unsqueeze", "cur", b.ints(1)), n), j)
    b.op("Where", valid, pos, b.ints(-1), outputs=["positions"])
    b.op("Add", b.op("Sub", n, b.ints(1)), b.ints(*range(k)), outputs=["sample_rows"])
    return _function(DRAFT_INPUTS, b, ["pending_ids", "pending_hidden", "num_pending", "cur",
                                              "embed_tokens", "h_mask"],
                     ["embeds", "hidden", "positions", "sample_rows"], ["num_spec_tokens", "mask_token_id"])


def draft_sample_function() -> onnx.FunctionProto:
    b = Builder("dsm_")
    draft = b.op("ArgMax", "logits", axis=-1, keepdims=0)  # [B,K]
    b.op("Add", draft, b.op("Gather", "d2t", draft, axis=0), outputs=["draft_ids"])
    return _function(DRAFT_SAMPLE, b, ["logits", "d2t"], ["draft_ids"], [])


@dataclass(frozen=True)
class MoEForm:
    """What one model's PEagleMoE body computes (ops.reference.moe's settings, baked in) and how.

    `fp8`: None, or the weight-scale kind of (w13, w2), each "tensor" / "channel" / "block";
    `static_act`: a13_scale / a2_scale given; `bias`, `expert_scale`: the optional inputs present."""
    top_k: int
    routing: str
    renormalize: bool
    activation: str
    swiglu_alpha: float
    swiglu_limit: float
    fp8: tuple[str, str] | None = None
    static_act: bool = False
    bias: bool = False
    expert_scale: bool = False

    @property
    def contrib(self) -> bool:
        """onnxruntime's own com.microsoft::MoE serves it: its CPU kernel (float32, interleaved SwiGLU
        with alpha / beta / limit, softmax then top-k, renormalised or not) computes exactly this
        math, reading only the routed experts. Otherwise the exact dense form (every expert)."""
        return self.fp8 is None and self.activation != "gelu_tanh" and not self.expert_scale


def moe_function(form: MoEForm, dtype: str = "float32") -> onnx.FunctionProto:
    """Body of PEagleMoE (ops.reference.moe) for one model's `form`, in the export `dtype` ("float32" /
    "float16"); its doc string records the form (one form per model)."""
    b = Builder("moe_")
    float_type = TensorProto.FLOAT if dtype == "float32" else TensorProto.FLOAT16
    x = b.op("Cast", "x", to=TensorProto.FLOAT) if dtype != "float32" else "x"
    y = _moe_contrib(b, form, x) if form.contrib else _moe_dense(b, form, x, float_type)
    b.op("Cast", y, to=float_type, outputs=["y"])
    fn = _function(MOE, b, MOE_INPUTS, ["y"], ["top_k", "routing", "renormalize", "activation", "swiglu_alpha",
                                              "swiglu_limit"])
    fn.doc_string = repr(form)
    return fn


def _moe_contrib(b: Builder, form: MoEForm, x: str) -> str:
    """com.microsoft::MoE over w13 re-laid out gate/up interleaved (its CPU kernel's only SwiGLU form;
    a function of the initializers alone, which onnxruntime folds once at session creation)."""
    def interleave(t: str, rank: int) -> str:  # [E, 2I, (H)] gate | up -> g0 u0 g1 u1 ...
        shape = b.op("Shape", t)
        split = b.op("Concat", b.op("Slice", shape, b.ints(0), b.ints(1)), b.ints(2, -1),
                     *([b.op("Slice", shape, b.ints(2), b.ints(3))] if rank == 3 else []), axis=0)
        perm = [0, 2, 1, 3] if rank == 3 else [0, 2, 1]
        return b.op("Reshape", b.op("Transpose", b.op("Reshape", t, split), perm=perm), shape)

    def f32(t: str) -> str:
        return b.op("Cast", t, to=TensorProto.FLOAT)

    clamped = form.activation == "clamped_swiglu"
    attrs = dict(k=form.top_k, activation_type="swiglu", swiglu_fusion=1,
                 normalize_routing_weights=int(form.routing == "topk_softmax" or form.renormalize),
                 activation_alpha=float(form.swiglu_alpha) if clamped else 1.0,
                 activation_beta=1.0 if clamped else 0.0)
    if clamped:
        attrs["swiglu_limit"] = float(form.swiglu_limit)
    inputs = [x, "router_logits", interleave(f32("w13"), 3), interleave(f32("b13"), 2) if form.bias else "",
              f32("w2"), f32("b2") if form.bias else ""]
    return b.op("MoE", *inputs, domain=CONTRIB, **attrs)


def _moe_dense(b: Builder, form: MoEForm, x: str, float_type: int) -> str:
    """Every expert on every row, weighted by the row's routing weight (0 off its top-k): exact for
    FP8 experts (dequantized weights, the op's activation quantization), GeGLU and expert scales."""
    f32 = TensorProto.FLOAT
    logits = "router_logits"
    k = b.ints(form.top_k)
    if form.routing == "softmax_topk":  # TopK: equal values keep the lower index first (as the op)
        vals, ids = b.op("TopK", b.op("Softmax", logits, axis=-1), k, axis=-1, outputs=2)
        if form.renormalize:
            vals = b.op("Div", vals, b.op("ReduceSum", vals, b.ints(-1), keepdims=1))
    else:
        vals, ids = b.op("TopK", logits, k, axis=-1, outputs=2)
        vals = b.op("Softmax", vals, axis=-1)
    if form.expert_scale:
        vals = b.op("Mul", vals, b.op("Gather", "expert_scale", ids, axis=0))
    dense = b.op("ScatterElements", b.op("Mul", logits, b.const(np.float32(0))), ids, vals, axis=-1)  # [N, E]
    route = b.op("Unsqueeze", b.op("Transpose", dense, perm=[1, 0]), b.ints(2))  # [E, N, 1]
    w13, w2 = (fp8_weight(b, w, form.fp8[i] if form.fp8 else None, scale)
               for i, (w, scale) in enumerate((("w13", "w13_scale"), ("w2", "w2_scale"))))
    kinds = form.fp8 or (None, None)
    rows = b.op("Unsqueeze", x, b.ints(0))  # [1, N, H]
    if kinds[0]:
        rows = fp8_act_quant(b, rows, "a13_scale" if form.static_act else None, kinds[0] == "block")
    gu = b.op("MatMul", rows, b.op("Transpose", w13, perm=[0, 2, 1]))  # [E, N, 2I]
    if form.bias:
        gu = b.op("Add", gu, b.op("Unsqueeze", b.op("Cast", "b13", to=f32), b.ints(1)))
    gate, up = b.op("Split", gu, num_outputs=2, axis=-1, outputs=2)
    if form.activation == "silu":
        h = b.op("Mul", b.silu(gate), up)
    elif form.activation == "gelu_tanh":
        h = b.op("Mul", b.gelu_tanh(gate), up)
    else:
        limit = b.const(np.float32(form.swiglu_limit))
        g = b.op("Min", gate, limit)
        u = b.op("Max", b.op("Min", up, limit), b.op("Neg", limit))
        glu = b.op("Mul", g, b.op("Sigmoid", b.op("Mul", g, b.const(np.float32(form.swiglu_alpha)))))
        h = b.op("Mul", b.op("Add", u, b.const(np.float32(1.0))), glu)
    if float_type != f32:  # h is rounded once to the activations' type
        h = b.op("Cast", b.op("Cast", h, to=float_type), to=f32)
    if kinds[1]:
        h = fp8_act_quant(b, h, "a2_scale" if form.static_act else None, kinds[1] == "block")
    out = b.op("MatMul", h, b.op("Transpose", w2, perm=[0, 2, 1]))  # [E, N, H]
    if form.bias:
        out = b.op("Add", out, b.op("Unsqueeze", b.op("Cast", "b2", to=f32), b.ints(1)))
    return b.op("ReduceSum", b.op("Mul", out, route), b.ints(0), keepdims=0)  # [N, H]


def fp8_weight(b: Builder, w: str, kind: str | None, scale: str) -> str:
    """FP8 weights [E, N, K] in float32: codes times their scale by its kind ([E], [E, N] or blocks
    [E, N/128, K/128]); a function of the initializers alone, which onnxruntime folds once."""
    w32 = b.op("Cast", w, to=TensorProto.FLOAT)
    if kind == "tensor":
        return b.op("Mul", w32, b.op("Unsqueeze", scale, b.ints(1, 2)))
    if kind == "channel":
        return b.op("Mul", w32, b.op("Unsqueeze", scale, b.ints(2)))
    if kind == "block":  # [E, N/128, K/128] -> [E, N, K]: each scale over its 128 x 128 block
        s5 = b.op("Unsqueeze", scale, b.ints(2, 4))  # [E, nb, 1, kb, 1]
        sshape = b.op("Shape", scale)
        full = b.op("Concat", b.op("Slice", sshape, b.ints(0), b.ints(2)), b.ints(128),
                    b.op("Slice", sshape, b.ints(2), b.ints(3)), b.ints(128), axis=0)
        s = b.op("Reshape", b.op("Expand", s5, full), b.op("Concat", b.op("Slice", sshape, b.ints(0), b.ints(1)),
                                                            b.ints(-1), b.op("Mul", b.op("Slice", sshape, b.ints(2),
                                                                                         b.ints(3)), b.ints(128)),
                                                            axis=0))
        wshape = b.op("Shape", w)
        s = b.op("Slice", s, b.ints(0, 0), b.op("Slice", wshape, b.ints(1), b.ints(3)), b.ints(1, 2))
        return b.op("Mul", w32, s)
    return w32


def fp8_act_quant(b: Builder, x: str, static: str | None, block: bool) -> str:
    """x [.., N, K] float32 as code(x) * a (ops.reference.moe_quantize_act): a static per-expert scale
    [E], else per row, or per row and 128-column group."""
    fmax = b.const(np.float32(448.0))
    if static is not None:
        a = b.op("Unsqueeze", static, b.ints(1, 2))  # [E, 1, 1]
        return _fake_quant(b, x, a, fmax)
    if not block:
        a = b.op("Div", b.op("Max", b.op("ReduceMax", b.op("Abs", x), b.ints(-1), keepdims=1),
                             b.const(np.float32(1e-12))), fmax)
        return _fake_quant(b, x, a, fmax)
    shape = b.op("Shape", x)
    kdim = b.op("Slice", shape, b.ints(-1), b.ints(2 ** 62))  # [1] K
    pad = b.op("Mod", b.op("Sub", b.ints(128), b.op("Mod", kdim, b.ints(128))), b.ints(128))
    zeros = b.op("ConstantOfShape", b.op("Sub", b.op("Shape", shape), b.ints(1)),
                 value=helper.make_tensor("z", TensorProto.INT64, [1], [0]))
    pads = b.op("Concat", zeros, b.ints(0), zeros, pad, axis=0)  # pad the last axis at its end
    padded = b.op("Pad", x, pads)
    groups = b.op("Reshape", padded, b.op("Concat", b.op("Slice", shape, b.ints(0), b.ints(-1)), b.ints(-1, 128),
                                          axis=0))  # [.., N, G, 128]
    a = b.op("Div", b.op("Max", b.op("ReduceMax", b.op("Abs", groups), b.ints(-1), keepdims=1),
                         b.const(np.float32(1e-12))), fmax)
    q = b.op("Reshape", _fake_quant(b, groups, a, fmax), b.op("Shape", padded))
    return b.op("Slice", q, b.ints(0), kdim, b.ints(-1))


def _fake_quant(b: Builder, x: str, a: str, fmax: str) -> str:
    """fp8(clamp(x / a, -448, 448)) * a, E4M3 rounding to nearest even."""
    codes = b.op("Cast", b.op("Clip", b.op("Div", x, a), b.op("Neg", fmax), fmax), to=TensorProto.FLOAT8E4M3FN)
    return b.op("Mul", b.op("Cast", codes, to=TensorProto.FLOAT), a)


MOE_ABSENT = "peagle_moe_absent"  # the TensorRT copy's 0-element float32 tensor in a PEagleMoE node's empty slot


def strip_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """The TensorRT copy: same graph, no model-local functions (plugins resolve by op_type), and no
    empty optional inputs, an empty slot not being a tensor TensorRT can hand over: PEagleKVAttention
    drops them (the plugin takes tree_mask as its 8th input: the plugins have no sinks); PEagleMoE,
    whose plugin reads its optional inputs by position, gets a 0-element float32 tensor in an empty
    slot before a present one, and its empty tail is dropped (plugins/src/plugins/moePlugin.cpp).
    uint8 KV caches (past_* / present_*: E4M3 bit patterns, module docstring) become float8e4m3fn."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.functions[:]
    for value in (*copy.graph.input, *copy.graph.output):
        if value.name.startswith(("past_", "present_")) and value.type.tensor_type.elem_type == TensorProto.UINT8:
            value.type.tensor_type.elem_type = TensorProto.FLOAT8E4M3FN
    absent = False
    for node in copy.graph.node:
        if node.domain != DOMAIN or "" not in node.input:
            continue
        inputs = list(node.input)
        if node.op_type == KV_ATTENTION:
            inputs = [name for name in inputs if name]
        elif node.op_type == MOE:
            while inputs and not inputs[-1]:
                inputs.pop()
            absent = absent or "" in inputs
            inputs = [name or MOE_ABSENT for name in inputs]
        del node.input[:]
        node.input.extend(inputs)
    if absent:
        copy.graph.initializer.append(helper.make_tensor(MOE_ABSENT, TensorProto.FLOAT, [0], []))
    return copy
