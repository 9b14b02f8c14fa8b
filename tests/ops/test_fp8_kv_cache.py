"""The FP8 (E4M3) KV cache's one semantics, peagle_trt/ops/reference.py `kv_store` / `kv_load`
(stored = fp8(clamp(value / scale, +-448)) divided in float32, read = code * scale in float32 then
the compute dtype), what `kv_attention` does with it, and the ONNX body checked against it
(peagle_trt/ops/onnx_defs.py): the body stores the very bytes torch's float8_e4m3fn holds (as uint8
bit patterns, ONNX having no ScatterND / Gather on float8) and attends as the reference does. The
Triton kernel's check: tests/ops/test_triton_kernels.py (test_kv_attention_fp8_cache)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from peagle_trt.ops import deterministic, reference
from peagle_trt.ops.names import DOMAIN, DOMAIN_VERSION, KV_ATTENTION
from peagle_trt.ops.onnx_builder import Builder
from peagle_trt.ops.onnx_defs import (
    E4M3_VALUES,
    OPSET,
    _e4m3_bits,
    kv_attention_function,
    plugin_attrs,
    register_schemas,
)
from peagle_trt.ops.reference import kv_load, kv_store, pack_tree_mask

FP8 = torch.float8_e4m3fn
H, KV, D, BS = 4, 2, 8, 4


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.uint8).numpy()


def _session(model: onnx.ModelProto):
    import onnxruntime as ort

    from peagle_trt.executors.onnxruntime import session_options

    options = session_options()
    options.use_per_session_threads = False  # the process's shared pool (peagle_trt/executors/onnxruntime.py)
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_store_and_load_define_the_cache():
    x = torch.tensor([0.0, -0.0, 1e-4, 0.3, -5.0, 22.4, 22.5, -1e6, float("nan")])
    codes = kv_store(x, FP8, 0.05)
    assert codes.dtype == FP8
    assert torch.equal(codes.float()[:-1], torch.tensor([0.0, -0.0, 0.001953125, 6.0, -96.0, 448.0, 448.0, -448.0]))
    assert torch.isnan(codes.float()[-1])
    back = kv_load(codes, 0.05, torch.bfloat16)  # code * scale in float32, rounded once
    torch.testing.assert_close(back, (codes.float() * 0.05).to(torch.bfloat16), equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(kv_load(codes, 1.0, torch.float32), codes.float(), equal_nan=True, rtol=0, atol=0)
    # other caches: the model's dtype, no scale
    assert torch.equal(kv_store(x, torch.float16, 0.05)[:-1], x[:-1].to(torch.float16))
    assert torch.equal(kv_load(x.to(torch.float16), 0.05, torch.float32)[:-1], x[:-1].to(torch.float16).float())


def _paged(gen, rows: list[list[int]], m: int = 5):
    """A batch over a paged cache: positions [B, S] (-1 padding), block tables [B, m] (a -1 entry at
    the end of request 1), q / k / v."""
    b, s = len(rows), len(rows[0])
    positions = torch.tensor(rows)
    tables = torch.randperm(b * m, generator=gen).view(b, m)
    tables[1, -1] = -1
    q = torch.randn(b, s, H * D, generator=gen)
    k = torch.randn(b, s, KV * D, generator=gen) * 3
    v = torch.randn(b, s, KV * D, generator=gen)
    k[0, 0, :2] = 500.0  # past 448 * k_scale: saturates
    return q, k, v, positions, tables


def _prefill(gen, tables, k_scale, v_scale):
    """FP8 caches holding a 12-position context for each request (written by the reference) over
    stale codes elsewhere (finite garbage, as a step's rejected drafts leave)."""
    b = tables.shape[0]
    kc = (torch.randn(int(tables.max()) + 2, BS, KV, D, generator=gen) * 100).to(FP8)
    vc = (torch.randn(kc.shape, generator=gen) * 100).to(FP8)
    ctx = torch.arange(12).expand(b, -1)
    reference.kv_attention(torch.randn(b, 12, H * D, generator=gen), torch.randn(b, 12, KV * D, generator=gen),
                           torch.randn(b, 12, KV * D, generator=gen), ctx, tables, kc, vc, H, KV, D,
                           k_scale=k_scale, v_scale=v_scale)
    return kc, vc


@pytest.mark.parametrize("rows_mode", ["batched", "deterministic"])
def test_reference_attends_over_what_it_stored(rows_mode):
    """kv_attention on an FP8 cache = kv_attention on a float32 cache holding kv_load(kv_store(.))
    with the new rows' k / v replaced by their stored values: the write is kv_store, the read kv_load
    (the row's own new key included), in both of its paths."""
    gen = torch.Generator().manual_seed(0)
    q, k, v, positions, tables = _paged(gen, [[12, 13, 14], [12, 13, -1]])
    ks, vs = 0.05, 0.02
    kc, vc = _prefill(gen, tables, ks, vs)
    kc_f, vc_f = kv_load(kc, ks, torch.float32), kv_load(vc, vs, torch.float32)
    k_f, v_f = kv_load(kv_store(k, FP8, ks), ks, torch.float32), kv_load(kv_store(v, FP8, vs), vs, torch.float32)
    mode = deterministic.rows if rows_mode == "deterministic" else torch.no_grad
    with mode():
        got = reference.kv_attention(q, k, v, positions, tables, kc, vc, H, KV, D, k_scale=ks, v_scale=vs)
        want = reference.kv_attention(q, k_f, v_f, positions, tables, kc_f, vc_f, H, KV, D)
    real = positions >= 0
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=0)
    torch.testing.assert_close(kv_load(kc, ks, torch.float32), kc_f, rtol=0, atol=0)  # the same writes


def test_e4m3_bits_equal_torch_float8():
    """The ONNX body's encoding: bit for bit torch's float8_e4m3fn rounding of value / scale (every
    code's value, the midpoints between neighbours and the floats next to them, zeros of both signs,
    saturation, NaN, and values over 12 decades)."""
    b = Builder("t_")
    b.op("Identity", _e4m3_bits(b, "x", b.const(np.float32(0.37))), outputs=["y"])
    graph = helper.make_graph(b.nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, ["n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    session = _session(model)
    grid = np.unique(E4M3_VALUES[np.isfinite(E4M3_VALUES)]).astype(np.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(0)
    values = np.concatenate([grid, mids, np.nextafter(mids, -np.inf), np.nextafter(mids, np.inf),
                             [0.0, -0.0, 1e-30, -1e-30, 449.0, 465.0, -1e9, np.inf, -np.inf, np.nan],
                             rng.standard_normal(20000) * 10.0 ** rng.uniform(-7, 5, 20000)]).astype(np.float32)
    x = values * np.float32(0.37)  # value / scale = values (within a rounding)
    got = session.run(None, {"x": x})[0]
    want = _bits(kv_store(torch.from_numpy(x), FP8, 0.37))
    assert np.array_equal(got, want), np.flatnonzero(got != want)[:10]
    assert np.array_equal(E4M3_VALUES, torch.arange(256, dtype=torch.uint8).view(FP8).float().numpy(), equal_nan=True)


def _node_model(tree: bool, attrs: dict, heads_in_gemm: bool = True) -> onnx.ModelProto:
    """One PEagleKVAttention node over uint8 (E4M3) caches, its function body attached."""
    register_schemas()
    u8, f32, i64 = TensorProto.UINT8, TensorProto.FLOAT, TensorProto.INT64
    cache = ["blocks", BS, KV, D]
    inputs = [helper.make_tensor_value_info(n, t, s) for n, t, s in (
        ("q", f32, ["b", "s", H * D]), ("k", f32, ["b", "s", KV * D]), ("v", f32, ["b", "s", KV * D]),
        ("positions", i64, ["b", "s"]), ("block_tables", i64, ["b", "m"]), ("k_cache", u8, cache),
        ("v_cache", u8, cache))]
    names = [i.name for i in inputs]
    if tree:
        inputs.append(helper.make_tensor_value_info("tree_mask", TensorProto.INT32, ["b", "s", 1]))
        names += ["", "tree_mask"]
    node = helper.make_node(KV_ATTENTION, names, ["out", "k_out", "v_out"], domain=DOMAIN,
                            **plugin_attrs(num_heads=H, num_kv_heads=KV, head_dim=D, scale=D ** -0.5, **attrs))
    outputs = [helper.make_tensor_value_info("out", f32, ["b", "s", H * D]),
               helper.make_tensor_value_info("k_out", u8, cache), helper.make_tensor_value_info("v_out", u8, cache)]
    opsets = [helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, DOMAIN_VERSION)]
    model = helper.make_model(helper.make_graph([node], "kv", inputs, outputs), opset_imports=opsets,
                              functions=[kv_attention_function(np.float32, tree=tree, fp8=True,
                                                                 heads_in_gemm=heads_in_gemm)])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("heads_in_gemm", [True, False])  # block-diagonal GQA products, or head-major keys
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("scales", [(0.05, 0.02), None])  # None: the attributes left out (default 1.0)
def test_onnx_body_equals_reference(tree, scales, heads_in_gemm):
    gen = torch.Generator().manual_seed(1)
    q, k, v, positions, tables = _paged(gen, [[12, 13, 14], [12, 13, -1]])
    ks, vs = scales or (1.0, 1.0)
    kc, vc = _prefill(gen, tables, ks, vs)
    mask = torch.from_numpy(pack_tree_mask([(-1, -1), (-1,)], 3)) if tree else None
    if tree:
        positions = torch.tensor([[12, 13, 13], [12, 13, -1]])  # two siblings; a chain and a padding row
    model = _node_model(tree, {"k_scale": ks, "v_scale": vs} if scales else {}, heads_in_gemm)
    session = _session(model)
    feeds = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "positions": positions.numpy(),
             "block_tables": tables.numpy(), "k_cache": _bits(kc).copy(), "v_cache": _bits(vc).copy()}
    if tree:
        feeds["tree_mask"] = mask.numpy()
    out, k_out, v_out = session.run(None, feeds)
    want = reference.kv_attention(q, k, v, positions, tables, kc, vc, H, KV, D, D ** -0.5, tree_mask=mask,
                                  k_scale=ks, v_scale=vs)
    assert np.array_equal(k_out, _bits(kc)) and np.array_equal(v_out, _bits(vc))  # the same bytes, stale ones kept
    real = (positions >= 0).numpy()
    np.testing.assert_allclose(out[real], want.numpy()[real], rtol=1e-5, atol=1e-6)
