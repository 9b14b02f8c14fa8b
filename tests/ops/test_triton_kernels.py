"""The Triton kernels of peagle_trt/ops/triton_kernels against the torch references (ops/reference):
every kernel, on small shapes, under the Triton interpreter on CPU (`-m kernels`, default suite).

What it checks: ragged pending/row counts, K = 1..16, windows crossing block edges, sinks, GQA,
head sizes that are no power of two, read-only layers, bf16/fp16/fp32, FP8 caches (stored codes
equal to torch's rounding: the interpreter's own fp32->fp8 conversion is off in ~2.5% of values, an
upstream bug the kernel works around by rounding to the fp8 grid itself under the interpreter).
Outputs are poisoned with NaN and unused cache blocks hold NaN, so an out-of-bounds write or a
stray read shows. What it cannot check here: speed, races, the driver.
On a GPU the same tests run the compiled kernels: PEAGLE_TRITON_DEVICE=cuda pytest -m kernels
(scripts/gpu_validate.sh).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.ops.conftest import DEVICE, rowwise_dot  # sets TRITON_INTERPRET=1 on CPU, before the kernels are imported

triton = pytest.importorskip("triton", reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

from peagle_trt.ops import reference  # noqa: E402
from peagle_trt.ops.triton_kernels import draft_inputs, draft_sample, kv_attention  # noqa: E402
from peagle_trt.ops.triton_kernels.common import FP8  # noqa: E402

pytestmark = pytest.mark.kernels
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def test_the_kernels_run_where_this_module_says():
    """Under the interpreter when DEVICE is cpu (the kernels were decorated with TRITON_INTERPRET=1)."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(kv_attention.kv_attention_kernel, InterpretedFunction)
    assert interpreted == (DEVICE == "cpu"), "triton was imported before TRITON_INTERPRET=1 was set"


# -- draft_sample --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 1500])
def test_draft_sample(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, 5, vocab, generator=gen).to(dtype)
    logits[0, 0, vocab - 1] = logits[0, 0, 2] = 50.0  # a tie across chunks: the lower index wins
    logits[1, 1] = float("-inf")  # all -inf: index 0
    logits[2, 3, [vocab - 1, 4]] = float("nan")  # NaN is the maximum (torch.argmax): the first NaN wins
    d2t = torch.randint(-3, 9, (vocab,), generator=gen)
    for table in (d2t, None):
        out = torch.full((3, 5), -77, dtype=torch.int64)
        got = draft_sample.draft_sample(logits.to(DEVICE), None if table is None else table.to(DEVICE),
                                        out=out.to(DEVICE))
        want = logits.argmax(-1) if table is None else reference.draft_sample(logits, table)  # None: no mapping
        assert torch.equal(got.cpu(), want)


# -- draft_inputs --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 2, 7, 16])
def test_draft_inputs(dtype, k):
    gen = torch.Generator().manual_seed(k)
    b, p, h, v = 3, 4, 40, 50
    tokens = torch.randint(0, v, (b, p), generator=gen)
    hidden = torch.randn(b, p, h, generator=gen).to(dtype)
    num_pending = torch.tensor([1, 4, 2])  # ragged
    cur = torch.tensor([5, 30, 9])
    embed = torch.randn(v, h, generator=gen).to(dtype)
    h_mask = torch.randn(h, generator=gen)
    r = p + k - 1
    outs = (torch.full((b, r, h), float("nan"), dtype=dtype), torch.full((b, r, h), float("nan"), dtype=dtype),
            torch.full((b, r), -77), torch.full((b, k), -77))
    args = (tokens, hidden, num_pending, cur, embed, h_mask)
    got = draft_inputs.draft_inputs(*(a.to(DEVICE) for a in args), k, 7, out=tuple(o.to(DEVICE) for o in outs))
    want = reference.draft_inputs(*args, k, 7)
    for name, g, w in zip(("embeds", "hidden", "positions", "sample_rows"), got, want):
        assert torch.equal(g.cpu(), w), name


def test_draft_inputs_rejects_a_mask_token_outside_the_vocabulary():
    with pytest.raises(ValueError, match="mask_token_id=50 inside the vocabulary"):
        draft_inputs.draft_inputs(torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, 4), torch.ones(1),
                                  torch.ones(1), torch.zeros(50, 4), torch.zeros(4), 2, 50)


# -- kv_attention --------------------------------------------------------------------------------

def _paged_case(gen, b_rows: list[list[int]], h: int, kv: int, d: int, bs: int, dtype, window: int = 0):
    """q/k/v for rows at the given positions (-1 = padding), block tables giving each request its
    own blocks (entries slid out of `window` are -1), caches with random contents in the used
    blocks, NaN in the unused ones, zeros in the trash block."""
    b, s = len(b_rows), len(b_rows[0])
    positions = torch.tensor(b_rows)
    m = (int(positions.max()) + bs) // bs + 1
    tables = torch.full((b, m), -1, dtype=torch.int64)
    used = 0
    for i, rows in enumerate(b_rows):
        top = max(rows)
        first = max(top - s + 1 - window + 1, 0) // bs if window else 0  # keep what any row can see
        for e in range(first, top // bs + 1):
            tables[i, e] = used
            used += 1
    n = used + 2  # two unused blocks
    k_cache = torch.full((n + 1, bs, kv, d), float("nan"))
    v_cache = torch.full((n + 1, bs, kv, d), float("nan"))
    k_cache[:used] = torch.randn(used, bs, kv, d, generator=gen)
    v_cache[:used] = torch.randn(used, bs, kv, d, generator=gen)
    k_cache[n] = v_cache[n] = 0.0
    q = torch.randn(b, s, h * d, generator=gen).to(dtype)
    k = torch.randn(b, s, kv * d, generator=gen).to(dtype)
    v = torch.randn(b, s, kv * d, generator=gen).to(dtype)
    return q, k, v, positions, tables, k_cache.to(dtype), v_cache.to(dtype)


def _check_attention(got, want, positions, dtype):
    live = positions >= 0
    assert torch.isfinite(got).all(), "a NaN reached the output (stray read or unwritten row)"
    torch.testing.assert_close(got.cpu()[live].float(), want[live].float(), atol=TOL[dtype], rtol=TOL[dtype])


def _run(q, k, v, positions, tables, kc, vc, h, kv, d, **kw):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    dev = [None if t is None else t.to(DEVICE) for t in (q, k, v, positions, tables, kc, vc)]
    got = kv_attention.kv_attention(*dev, h, kv, d, out=out, **{
        key: (val.to(DEVICE) if isinstance(val, torch.Tensor) else val) for key, val in kw.items()})
    return got.cpu(), dev[5].cpu(), dev[6].cpu()


def _same_writes(got: torch.Tensor, want: torch.Tensor) -> None:
    """Every cache block equal, bit for bit, but the trash block (the last): padding rows all write
    there, in an order a GPU leaves unspecified (the interpreter runs programs in order, as the
    reference does, so a full comparison passed there and failed on an H200)."""
    torch.testing.assert_close(got[:-1], want[:-1], equal_nan=True, atol=0, rtol=0)


CASES = {  # rows per request (-1 = padding), heads, kv heads, head size, block size
    "decode-ragged": ([[9], [2], [-1]], 4, 2, 16, 4),
    "verify-k3": ([[20, 21, 22, 23], [5, 6, -1, -1]], 4, 1, 24, 8),
    "draft-k16": ([list(range(30, 47))], 2, 2, 16, 16),
    "head-size-40": ([[11, 12], [3, -1]], 6, 3, 40, 4),
    "verify-k16-two-tiles": ([list(range(40, 57))], 4, 1, 16, 8),  # 17 rows x 4 heads > one 64-row tile
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window,with_sinks", [(0, False), (6, False), (0, True), (9, True)])
def test_kv_attention(dtype, case, window, with_sinks):
    rows, h, kv, d, bs = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}/{window}".encode()))  # hash() of a str varies per process
    q, k, v, positions, tables, kc, vc = _paged_case(gen, rows, h, kv, d, bs, dtype, window)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    scale = 0.3 if case == "verify-k3" else None
    got, kc_got, vc_got = _run(q, k, v, positions, tables, kc.clone(), vc.clone(), h, kv, d, scale=scale,
                               sliding_window=window, sinks=sinks)
    want = reference.kv_attention(q, k, v, positions, tables, kc, vc, h, kv, d, scale, window, sinks)
    _same_writes(kc_got, kc)  # same writes, nothing else
    _same_writes(vc_got, vc)
    _check_attention(got, want, positions, dtype)


def test_kv_attention_read_only_layer():
    """k = v = None: attends over what another layer wrote; the cache is not touched."""
    gen = torch.Generator().manual_seed(3)
    q, _, _, positions, tables, kc, vc = _paged_case(gen, [[5, 6, 7], [12, -1, -1]], 4, 2, 16, 4, torch.float32)
    got, kc_got, _ = _run(q, None, None, positions, tables, kc.clone(), vc.clone(), 4, 2, 16, sliding_window=5)
    want = reference.kv_attention(q, None, None, positions, tables, kc, vc, 4, 2, 16, None, 5)
    torch.testing.assert_close(kc_got, kc, equal_nan=True, atol=0, rtol=0)
    _check_attention(got, want, positions, torch.float32)


@pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,with_sinks", [(0, False), (6, True)])
def test_kv_attention_fp8_cache(dtype, window, with_sinks):
    """The reference's FP8 cache (reference.kv_store / kv_load): the kernel stores exactly its codes
    fp8(clamp(value / scale, +-448)), saturated ones included, and attends over code * scale as it does."""
    rows, h, kv, d, bs = CASES["verify-k3"]
    gen = torch.Generator().manual_seed(8)
    q, k, v, positions, tables, kc, vc = _paged_case(gen, rows, h, kv, d, bs, dtype, window)
    k, v = k.clone(), v.clone()
    k[..., :3] *= 40  # past 448 * k_scale: stored as +-448
    k_scale, v_scale = 0.05, 0.03
    kc8, vc8 = reference.kv_store(kc, FP8, k_scale), reference.kv_store(vc, FP8, v_scale)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    got, kc_got, vc_got = _run(q, k, v, positions, tables, kc8.clone(), vc8.clone(), h, kv, d,
                               sliding_window=window, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    want_k, want_v = kc8.clone(), vc8.clone()
    want = reference.kv_attention(q.float(), k.float(), v.float(), positions, tables, want_k, want_v, h, kv, d,
                                  None, window, sinks, k_scale=k_scale, v_scale=v_scale)
    assert bool((want_k.float().abs() == 448).any())  # the clamp was exercised (the poison: NaN codes)
    for name, g, w in (("k", kc_got[:-1], want_k[:-1]), ("v", vc_got[:-1], want_v[:-1])):  # trash aside
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"{name} cache: a code differs from kv_store"
    _check_attention(got, want.to(dtype), positions, dtype)


def test_draft_inputs_clamps_bad_token_ids():
    """A real row with an id outside the vocabulary reads the nearest table row, never past the table
    (the reference raises; on a GPU an unchecked gather would read foreign memory)."""
    embed = torch.randn(10, 16)
    tokens = torch.tensor([[3, 10 + 5, -4]])
    got = draft_inputs.draft_inputs(*(t.to(DEVICE) for t in (tokens, torch.randn(1, 3, 16), torch.tensor([3]),
                                                              torch.tensor([3]), embed, torch.zeros(16))), 1, 0)
    assert torch.equal(got[0].cpu()[0], embed[[3, 9, 0]])


@pytest.mark.parametrize("window,with_sinks", [(0, False), (6, True)])
def test_kv_attention_row_is_batch_invariant(window, with_sinks, monkeypatch):
    """Deterministic mode's property for the kernel (a fixed split): a query row's output, bit for
    bit, does not depend on the rows sharing its tile (a verify's later rows, a second tile) nor on
    the other requests of the launch. Key steps start at absolute multiples of BLOCK_N, and steps a
    row cannot see leave its online-softmax state exactly unchanged (alpha = 1, p = 0).

    The guarantee holds given a `tl.dot` whose output element depends on its own row and column
    only, as on a GPU (where this test runs on the compiled kernel, bit for bit). Under the
    interpreter `tl.dot` is numpy's BLAS, whose FMA kernels (OpenBLAS Haswell/Zen: AMD EPYC) give a
    row other last bits by its place in the tile, so there the test runs on `rowwise_dot`, the
    GPU's per-element contract (tests/ops/conftest.py); `test_batch_invariance_check_sees_a_row_dependent_dot`
    shows the check still catches arithmetic that depends on a row's place."""
    if DEVICE == "cpu":
        rowwise_dot(monkeypatch)
    _check_row_is_batch_invariant(window, with_sinks)


def _check_row_is_batch_invariant(window, with_sinks):
    gen = torch.Generator().manual_seed(11)
    h, kv, d, bs = 4, 2, 16, 8
    _, _, _, _, tables, kc, vc = _paged_case(gen, [[40], [40]], h, kv, d, bs, torch.float32, 0)
    sinks = torch.randn(h, generator=gen) if with_sinks else None
    q = torch.randn(2, 20, h * d, generator=gen)
    kw = {"sliding_window": window, "sinks": sinks}

    def row(qs, positions, tables_):  # the first row's output
        got, _, _ = _run(qs, None, None, torch.tensor(positions), tables_, kc, vc, h, kv, d, **kw)
        return got[0, 0]

    for p, j in ((20, 0), (33, 5)):  # row j of the verify below sits at position p
        alone = row(q[:1, j:j + 1], [[p]], tables[:1])
        verify = list(range(p - j, p - j + 20))  # 20 rows x 2 heads per KV head: two 16-row tiles
        assert torch.equal(row(q[:1, j:], [verify[j:]], tables[:1]), alone)
        got, _, _ = _run(q, None, None, torch.tensor([verify, list(range(20, 40))]), tables, kc, vc, h, kv, d, **kw)
        assert torch.equal(got[0, j], alone), (p, j)


@pytest.mark.skipif(DEVICE != "cpu", reason="replaces the interpreter's tl.dot")
def test_batch_invariance_check_sees_a_row_dependent_dot(monkeypatch):
    """The check above is no weaker on `rowwise_dot`: with a dot that sums a tile's rows 8 and up
    in another order (a row at p = 33 sits there in the verify and at the top when alone), it fails."""
    rowwise_dot(monkeypatch, tail_reversed_from=8)
    with pytest.raises(AssertionError, match="33, 5"):
        _check_row_is_batch_invariant(0, False)


TREES = {  # parents of each request's nodes (rows: root + nodes, padded), cur, heads, kv heads, d, bs
    "tree-6-and-chain": ([(-1, -1, 0, 0, 2, 1), (-1, 0, 1)], [21, 4], 4, 2, 16, 8),
    "tree-40-two-words": ([tuple(range(-1, 19)) + tuple([-1] * 20), (-1,)], [3, 30], 2, 1, 16, 16),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(TREES))
@pytest.mark.parametrize("window", [0, 64])
def test_kv_attention_tree_mask(dtype, case, window):
    """Draft-tree rows (RoPE positions by depth, slots positions[b, 0] + s, packed ancestor bits)."""
    from peagle_trt.ops.reference import pack_tree_mask
    from peagle_trt.speculative.tree import depths

    trees, cur, h, kv, d, bs = TREES[case]
    rows = max(len(t) for t in trees) + 1
    positions = [[c] + [c + x for x in depths(t)] + [-1] * (rows - 1 - len(t)) for t, c in zip(trees, cur)]
    slots = [[c + s for s in range(rows)] for c in cur]  # the blocks must cover the slots
    gen = torch.Generator().manual_seed(7)
    q, k, v, _, tables, kc, vc = _paged_case(gen, slots, h, kv, d, bs, dtype)
    positions = torch.tensor(positions)
    mask = torch.from_numpy(pack_tree_mask(trees, rows))
    got, kc_got, vc_got = _run(q, k, v, positions, tables, kc.clone(), vc.clone(), h, kv, d,
                               sliding_window=window, tree_mask=mask)
    want = reference.kv_attention(q, k, v, positions, tables, kc, vc, h, kv, d, None, window, None, mask)
    _same_writes(kc_got, kc)
    _same_writes(vc_got, vc)
    _check_attention(got, want, positions, dtype)
