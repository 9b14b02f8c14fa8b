"""PEagleKVAttention in Triton: a few new rows per request attending over a paged KV cache.

Contract: `peagle_trt.ops.reference.kv_attention`. Caches [N+1, bs, KV, d] (block N is the trash
block), block tables [B, M] int64 (-1 = no block), positions [B, S] (-1 = padding row). Features:
GQA, any head size d (per-layer head sizes: one compiled variant per d), sliding windows
(keys at positions > p - W), attention sinks (one logit per head in the denominator, no value),
read-only layers (k = v = None), FP8 e4m3 caches with per-tensor scales (`reference.kv_store` /
`kv_load`: stored = fp8(clamp(value / scale, +-448)), read = code * scale in fp32, then q's dtype),
draft trees (a packed ancestor mask [B, S, W] int32: rows at KV slots positions[b, 0] + s, each
seeing the context below that slot and the rows whose bits it has).

Two kernels, launched in order on one stream:
  kv_write      one program per (request, row): scatters the new k/v rows into their blocks;
  kv_attention  one program per (request, KV head, tile of BLOCK_M rows): the S rows x G = H/KV
                query heads of the request that share the KV head form [BLOCK_M, d] tiles (one
                tile holds a whole verify's rows, up to 64, so each KV block is read once per KV
                head: `tiles_for`); keys and values are gathered through the block table BLOCK_N
                positions a step (several blocks of any size), prefetched `num_stages` steps ahead
                (cp.async), and go through `tl.dot` (the tensor cores) with an online softmax in fp32.
Splitting the write out keeps the attention race-free without a grid-wide barrier. Pointers are
plain base + offset under a mask (an offset clamped with tl.where hides its contiguity: the loads
fell to 2 bytes each, seen in the sm_90a PTX), so K/V rows load 16 bytes at a time.

Split over the context (flash-decoding), when batch x KV heads x tiles programs are too few to fill
the GPU (`split_plan`: the count by shape only, as vLLM's unified attention does):
  kv_attention_split  program (request, KV head, segment x tile): the same tile code (`_attend_tile`:
                      GQA rows sharing each KV block read, paged tables, trees, windows, FP8 cache)
                      over segment j of the tile's own key steps (from its first visible key to its
                      last row's position, read on the device, cut into `splits` equal runs: every
                      segment has work at any context, a CUDA graph's fixed plan included; a tree's
                      steps start at its first slot); stores its unnormalised fp32 state;
  kv_reduce           program (request, row, head): merges the segments (and the sinks), normalises.
Deterministic mode (`ops.deterministic.rows()`) keeps the unsplit kernel and 16-row tiles: the plan
and the tile height depend on the batch, so a row's bits would depend on its batch (the unsplit
kernel's do not: key steps at absolute positions). `num_splits=` forces a count and `config=` a
tiling (tests, `bench kernels`' sweep). The TensorRT plugins launch the unsplit kernel with 16-row
tiles (aot.py --jit-only compiles and checks the split kernels; launching them needs the plan, two
more launches and a workspace for the partials in tritonLauncher.cpp).
Differences from the reference, outside the runtime's contract: padding rows return zeros (the
reference returns some finite row); a table entry -1 (or past the cache) inside a row's visible
range is masked (the reference reads the trash block).
How to test: tests/ops/test_triton_kernels.py, tests/ops/test_kv_attention_split.py (interpreter; on a GPU
with PEAGLE_TRITON_DEVICE=cuda), tests/plugins/test_kernels_gpu.py (GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from peagle_trt.ops import deterministic, reference
from peagle_trt.ops.triton_kernels.common import FP8, check_dtype, interpreted, next_pow2, out_buffer, same_device

LOG2E = 1.4426950408889634
# split-KV plan (`split_plan`) and tiles (`tiles_for`): unmeasured: `bench kernels` sweeps them on a GPU
WAVES = 2  # programs per SM the unsplit grid must reach before it is left unsplit
MIN_CHUNK = 256  # fewest key positions per segment (fewer: the partials' traffic outweighs the gain)
MAX_SPLITS = 64  # most segments (the reduce reads all their maxima in one vector)
SPLIT_STEP = 8  # segments the reduce merges per step
DEFAULT_SMS = 132  # H100 / H200, used off the GPU (interpreter)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST: the operands go through fp32 (the interpreter's tl.dot
    multiplies bf16 operands as raw bits; bf16 values are exact in fp32, so only the speed differs).
    IEEE: full fp32 products for fp32 operands (no TF32), as the reference computes."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _round_to_e4m3(x):
    """x (fp32) rounded to the nearest float8 e4m3 value (ties to even), still in fp32. Used under
    the interpreter only, whose own fp32->fp8 conversion drops the carry into the exponent when the
    mantissa rounds up (7.8 -> 4.0); values already on the fp8 grid convert exactly there."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; subnormals below 2^-6
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    y = x / step  # exact: a power-of-two divisor
    y = (y + 12582912.0) - 12582912.0  # round to the nearest integer, ties to even (1.5 * 2^23)
    return y * step


@triton.jit
def kv_write_kernel(k_ptr, v_ptr, positions_ptr, tables_ptr, k_cache, v_cache, S, M, trash, bs,
                    k_scale, v_scale, KVD, BLOCK: tl.constexpr, FP8_CACHE: tl.constexpr,
                    ROUND_FP8: tl.constexpr, TREE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    pos = tl.load(positions_ptr + b * S + s)
    if TREE:  # tree rows write at slot positions[b, 0] + s (positions are RoPE positions by depth)
        pos = tl.where(pos >= 0, tl.load(positions_ptr + b * S) + s, -1)
    entry = tl.maximum(pos, 0) // bs
    block = tl.load(tables_ptr + b * M + tl.minimum(entry, M - 1))
    valid = (pos >= 0) & (entry < M) & (block >= 0) & (block < trash)  # entries past the cache: as -1
    block = tl.where(valid, block, trash)
    offset = tl.where(valid, tl.maximum(pos, 0) % bs, 0)
    row = (block * bs + offset) * KVD
    cols = tl.arange(0, BLOCK)
    for start in range(0, KVD, BLOCK):
        c = start + cols
        inside = c < KVD
        kk = tl.load(k_ptr + (b * S + s) * KVD + c, mask=inside, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + (b * S + s) * KVD + c, mask=inside, other=0.0).to(tl.float32)
        if FP8_CACHE:  # reference.kv_store: fp8(clamp(value / scale, +-448)), divided in fp32
            kk = tl.minimum(tl.maximum(kk / k_scale, -448.0), 448.0)
            vv = tl.minimum(tl.maximum(vv / v_scale, -448.0), 448.0)
            if ROUND_FP8:
                kk = _round_to_e4m3(kk)
                vv = _round_to_e4m3(vv)
        tl.store(k_cache + row + c, kk.to(k_cache.dtype.element_ty), mask=inside)
        tl.store(v_cache + row + c, vv.to(v_cache.dtype.element_ty), mask=inside)


@triton.jit
def _attend_tile(q_ptr, positions_ptr, tables_ptr, k_cache, v_cache, tree_ptr, b, kvh, tile, split, S, M, trash,
                 bs, H, KV, G, qk_scale, k_scale, v_scale, window, W, splits, D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP8_CACHE: tl.constexpr,
                 IEEE: tl.constexpr, UPCAST: tl.constexpr, TREE: tl.constexpr, SPLIT: tl.constexpr):
    """One [BLOCK_M, D] tile (S rows x G heads of KV head kvh) over its key steps: all of them, or
    (SPLIT) those of context segment `split`. Returns the unnormalised online-softmax state
    (acc [BLOCK_M, BLOCK_D], m_i, l_i [BLOCK_M], log2 domain) and the tile's row bookkeeping."""
    # tile row m = (query row s = m // G, head kvh*G + m % G); axis 2 tiles S*G rows past BLOCK_M
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    s = rows // G
    head = kvh * G + rows % G
    row_ok = s < S
    pos = tl.load(positions_ptr + b * S + tl.minimum(s, S - 1)).to(tl.int32)  # key positions in int32:
    pos = tl.where(row_ok, pos, -1)  # cheap // and % by bs; tile rows past S behave as padding rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = ((b * S + s) * H + head)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    dtype = q.dtype
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if TREE:  # keys up to the tile's last row's own slot (base + s); bits pick the tree rows
        base = tl.load(positions_ptr + b * S).to(tl.int32)
        top = tl.max(tl.where(pos >= 0, base + s, -1), axis=0)
    else:
        top = tl.max(pos, axis=0)
    end = tl.minimum(top + 1, M * bs)
    # with a window: the first key any row of the tile can see, rounded down to a step
    first = tl.maximum(tl.min(tl.where(pos >= 0, pos - window + 1, 2147483647), axis=0), 0)
    lo = tl.where(window > 0, first // BLOCK_N * BLOCK_N, 0)
    if TREE:  # steps aligned on the tree's first row: a step's rows sit in one mask word
        lo = base - (base - lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # may start below 0 (masked)
        words = tree_ptr + (b * S + tl.minimum(s, S - 1)) * W  # [BLOCK_M] each tile row's mask
    if SPLIT:  # segment `split` of the tile's own steps lo, lo + BLOCK_N, .. < end, cut in `splits`
        # runs of equal length (from the positions on the device: balanced at any context, a
        # graph's static plan included; segments past the last step are empty)
        per = tl.cdiv(tl.cdiv(end - lo, BLOCK_N), splits) * BLOCK_N
        lo = lo + split * per
        end = tl.minimum(lo + per, end)
    keys = tl.arange(0, BLOCK_N)
    for start in range(lo, end, BLOCK_N):
        kp = start + keys  # [BLOCK_N] key positions
        entry = tl.minimum(tl.maximum(kp, 0) // bs, M - 1)
        block = tl.load(tables_ptr + b * M + entry, mask=(kp >= 0) & (kp < end), other=-1)
        key_ok = (kp >= 0) & (kp < end) & (block >= 0) & (block < trash)  # -1, past the cache: masked
        slot = tl.where(key_ok, block * bs + kp % bs, 0)
        kv_off = (slot * KV + kvh)[:, None] * D + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_cache + kv_off, mask=kv_mask, other=0.0)
        vt = tl.load(v_cache + kv_off, mask=kv_mask, other=0.0)
        if FP8_CACHE:
            kt = (kt.to(tl.float32) * k_scale).to(dtype)
            vt = (vt.to(tl.float32) * v_scale).to(dtype)
        scores = _dot(q, tl.trans(kt), IEEE, UPCAST) * qk_scale  # log2 domain
        if TREE:
            # keys start - base + 0..BLOCK_N-1 are rows of this forward when start >= base (in
            # mask word (start - base) // 32), else the context (BLOCK_N divides 32)
            rel = (start - base) + tl.zeros([BLOCK_M], tl.int64)  # per row (a scalar mask trips the interpreter)
            ok = row_ok & (rel >= 0) & (rel < W * 32)
            word = tl.load(words + tl.where(ok, rel // 32, 0), mask=ok, other=0)  # [BLOCK_M] int32
            shift = tl.where(ok, rel % 32, 0)[:, None] + keys[None, :]  # [BLOCK_M, BLOCK_N] in 0..31
            ancestor = ((word[:, None] >> shift) & 1) == 1
            visible = ((start < base) | ancestor) & (pos[:, None] >= 0) & key_ok[None, :]
        else:
            visible = (kp[None, :] <= pos[:, None]) & key_ok[None, :]
        if window > 0:
            visible = visible & (kp[None, :] > pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(dtype), vt, IEEE, UPCAST)
        m_i = m_new
    return acc, m_i, l_i, pos, row_ok, head, q_off, d_ok, s


@triton.jit
def kv_attention_kernel(q_ptr, out_ptr, positions_ptr, tables_ptr, k_cache, v_cache, sinks_ptr, tree_ptr,
                        S, M, trash, bs, H, KV, G, qk_scale, k_scale, v_scale, window, W,
                        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_N: tl.constexpr, HAS_SINKS: tl.constexpr, FP8_CACHE: tl.constexpr,
                        IEEE: tl.constexpr, UPCAST: tl.constexpr, TREE: tl.constexpr):
    """The unsplit form: one program per (request, KV head, tile) over the whole context (the
    plugins' kernel; arguments fixed by plugins/src/launcher/tritonLauncher.cpp)."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    acc, m_i, l_i, pos, row_ok, head, q_off, d_ok, s = _attend_tile(
        q_ptr, positions_ptr, tables_ptr, k_cache, v_cache, tree_ptr, b, kvh, tl.program_id(2), 0, S, M, trash, bs,
        H, KV, G, qk_scale, k_scale, v_scale, window, W, 1, D, BLOCK_M, BLOCK_D, BLOCK_N, FP8_CACHE, IEEE,
        UPCAST, TREE, False)
    if HAS_SINKS:  # one extra logit per head in the denominator, carrying no value
        sink = tl.load(sinks_ptr + tl.where(row_ok, head, 0)).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    live = (pos >= 0) & (l_i > 0)
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    out = tl.where(live[:, None], out, 0.0)
    out_mask = row_ok[:, None] & d_ok[None, :]
    tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def kv_attention_split_kernel(q_ptr, part_acc, part_ml, positions_ptr, tables_ptr, k_cache, v_cache, tree_ptr,
                              S, M, trash, bs, H, KV, G, qk_scale, k_scale, v_scale, window, W, tiles, splits,
                              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_N: tl.constexpr, FP8_CACHE: tl.constexpr, IEEE: tl.constexpr,
                              UPCAST: tl.constexpr, TREE: tl.constexpr):
    """The split form (flash-decoding): program (request, KV head, segment * tiles + tile) runs one
    context segment and stores its unnormalised state: part_acc [splits, B, S, H, D] fp32 and
    part_ml [splits, B, S, H, 2] fp32 (running max, log2 domain; sum). `kv_reduce_kernel` merges."""
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2) // tiles
    acc, m_i, l_i, pos, row_ok, head, q_off, d_ok, s = _attend_tile(
        q_ptr, positions_ptr, tables_ptr, k_cache, v_cache, tree_ptr, b, kvh, tl.program_id(2) % tiles, split, S,
        M, trash, bs, H, KV, G, qk_scale, k_scale, v_scale, window, W, splits, D, BLOCK_M, BLOCK_D, BLOCK_N,
        FP8_CACHE, IEEE, UPCAST, TREE, True)
    B = tl.num_programs(0).to(tl.int64)
    row = ((split.to(tl.int64) * B + b) * S + s) * H + head  # [BLOCK_M] partial row index
    out_mask = row_ok[:, None] & d_ok[None, :]
    d = tl.arange(0, BLOCK_D)
    tl.store(part_acc + row[:, None] * D + d[None, :], acc, mask=out_mask)
    tl.store(part_ml + row * 2, m_i, mask=row_ok)
    tl.store(part_ml + row * 2 + 1, l_i, mask=row_ok)


@triton.jit
def kv_reduce_kernel(part_acc, part_ml, out_ptr, positions_ptr, sinks_ptr, B, S, H, splits, D: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_SPLIT: tl.constexpr, SPLIT_STEP: tl.constexpr,
                     HAS_SINKS: tl.constexpr):
    """Merges the segments of one (request, row, head): program (b, s, head). Sinks join here.
    The maxima of all segments first ([BLOCK_SPLIT]), then the sums SPLIT_STEP segments at a time
    ([SPLIT_STEP, BLOCK_D] tiles: a [64, 256] fp32 tile would spill)."""
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2).to(tl.int64)
    j = tl.arange(0, BLOCK_SPLIT)
    m_j = tl.load(part_ml + tl.where(j < splits, ((j.to(tl.int64) * B + b) * S + s) * H + head, 0) * 2,
                  mask=j < splits, other=float("-inf"))
    m = tl.max(m_j, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    l_i = tl.zeros([SPLIT_STEP], tl.float32)
    acc = tl.zeros([SPLIT_STEP, BLOCK_D], tl.float32)
    for j0 in range(0, splits, SPLIT_STEP):
        jj = j0 + tl.arange(0, SPLIT_STEP)
        ok = jj < splits
        row = tl.where(ok, ((jj.to(tl.int64) * B + b) * S + s) * H + head, 0)  # [SPLIT_STEP]
        w = tl.exp2(tl.load(part_ml + row * 2, mask=ok, other=float("-inf")) - m_safe)  # empty segments: 0
        l_i += tl.load(part_ml + row * 2 + 1, mask=ok, other=0.0) * w
        mask = ok[:, None] & d_ok[None, :]
        acc += tl.load(part_acc + row[:, None] * D + d[None, :], mask=mask, other=0.0) * w[:, None]
    total = tl.sum(l_i, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_safe)
    out = tl.sum(acc, axis=0)  # [BLOCK_D]
    pos = tl.load(positions_ptr + b * S + s)
    live = (pos >= 0) & (total > 0)
    out = tl.where(live, out / tl.where(live, total, 1.0), 0.0)
    tl.store(out_ptr + ((b * S + s) * H + head) * D + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def kv_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, positions: torch.Tensor,
                 block_tables: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int,
                 num_kv_heads: int, head_dim: int, scale: float | None = None, sliding_window: int = 0,
                 sinks: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None, *,
                 k_scale: float = 1.0, v_scale: float = 1.0, out: torch.Tensor | None = None,
                 num_splits: int | None = None, config: Tiles | None = None) -> torch.Tensor:
    """See `reference.kv_attention`; writes k/v into the caches in place (k = v = None: read only).

    q [B, S, H*d], k/v [B, S, KV*d] (float32/float16/bfloat16, one dtype); positions [B, S];
    block_tables [B, M]; tree_mask [B, S, W] int32 | None; k_cache/v_cache [N+1, bs, KV, d] contiguous,
    q's dtype or float8_e4m3fn (then k_scale/v_scale scale them: `reference.kv_store` / `kv_load`).
    num_splits: context segments (flash-decoding); None picks them by shape (`split_plan`: 1 under
    deterministic mode or when the unsplit grid fills the GPU), 1 forces the unsplit kernel.
    Returns out [B, S, H*d]."""
    device = same_device(q, k, v, positions, block_tables, k_cache, v_cache, sinks, tree_mask)
    b, s, _ = q.shape
    h, kvh, d = int(num_heads), int(num_kv_heads), int(head_dim)
    if h % kvh or q.shape[-1] != h * d:
        raise ValueError(f"kv_attention: q {tuple(q.shape)} does not match num_heads={h}, head_dim={d}, "
                         f"or num_heads is not a multiple of num_kv_heads={kvh}")
    if (k is None) != (v is None) or (k is not None and (k.shape != (b, s, kvh * d) or v.shape != k.shape)):
        raise ValueError(f"kv_attention: k / v must both be [{b}, {s}, {kvh * d}] or both None")
    if positions.shape != (b, s) or block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"kv_attention: positions {tuple(positions.shape)} / block_tables "
                         f"{tuple(block_tables.shape)} must be [{b}, {s}] / [{b}, M]")
    if (k_cache.dim() != 4 or k_cache.shape[2:] != (kvh, d) or v_cache.shape != k_cache.shape
            or v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        raise ValueError(f"kv_attention: caches do not match: they must be contiguous [blocks + 1, block_size, "
                         f"{kvh}, {d}] of one "
                         f"dtype, got {tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"kv_attention: sinks must be [{h}], got {tuple(sinks.shape)}")
    if tree_mask is not None and (tree_mask.dim() != 3 or tree_mask.shape[:2] != (b, s)
                                  or tree_mask.dtype != torch.int32):
        raise ValueError(f"kv_attention: tree_mask must be int32 [{b}, {s}, words], got "
                         f"{tuple(tree_mask.shape)} {tree_mask.dtype}")
    check_dtype(q, "kv_attention q")
    if k is not None and (k.dtype != q.dtype or v.dtype != q.dtype):
        raise TypeError(f"kv_attention: q, k and v must share a dtype (got {q.dtype}, {k.dtype}, {v.dtype})")
    fp8 = FP8 is not None and k_cache.dtype == FP8
    if k_cache.dtype != q.dtype and not fp8:
        raise TypeError(f"kv_attention: cache dtype {k_cache.dtype} must be q's ({q.dtype}) or float8_e4m3fn")
    if fp8 and not (k_scale > 0 and v_scale > 0):
        raise ValueError(f"kv_attention: FP8 caches need positive scales, got k_scale={k_scale}, v_scale={v_scale}")
    blocks, bs = k_cache.shape[0], k_cache.shape[1]
    m = block_tables.shape[1]
    out = out_buffer(out, q.shape, q.dtype, device, "kv_attention")
    if b * s == 0:
        return out
    positions, tables = positions.to(torch.int64).contiguous(), block_tables.to(torch.int64).contiguous()
    q = q.contiguous()
    if k is not None:
        kv_write_kernel[(b, s)](k.contiguous(), v.contiguous(), positions, tables, k_cache, v_cache, s, m,
                                blocks - 1, bs, float(k_scale), float(v_scale), KVD=kvh * d,
                                BLOCK=min(next_pow2(kvh * d, 16), 1024), FP8_CACHE=fp8,
                                ROUND_FP8=fp8 and interpreted(), TREE=tree_mask is not None)
    group = h // kvh
    det = deterministic.active()
    t = config or tiles_for(s * group, d, q.dtype, tree_mask is not None, fixed_rows=det)
    if tree_mask is not None and 32 % t.block_n:
        raise ValueError(f"kv_attention: a draft tree's tiling needs block_n dividing 32, got {t}")
    tiles = -(-s * group // t.block_m)
    span = reference.current_span()  # the host's key span (the step's), else what the tables address
    keys = m * bs if span is None else min(span, m * bs)
    if num_splits is None:  # deterministic mode: unsplit (the plan depends on the batch)
        num_splits = 1 if det else split_plan(b, kvh, tiles, keys, _sms(device))
    if int(num_splits) < 1:
        raise ValueError(f"kv_attention: num_splits must be >= 1 (or None: by shape), got {num_splits}")
    splits = int(num_splits)
    if q.dtype == torch.float32 and d > 128:  # its split form spills on sm_90a (aot.py --jit-only): unsplit
        splits = 1
    qk_scale = (scale if scale is not None else d ** -0.5) * LOG2E
    sinks_arg = q if sinks is None else sinks.contiguous()
    tree_arg = positions if tree_mask is None else tree_mask.contiguous()
    words = 1 if tree_mask is None else tree_mask.shape[2]
    common = dict(D=d, BLOCK_M=t.block_m, BLOCK_D=next_pow2(d, 16), BLOCK_N=t.block_n, FP8_CACHE=fp8,
                  IEEE=q.dtype == torch.float32, num_warps=t.num_warps, num_stages=t.num_stages,
                  UPCAST=q.dtype == torch.bfloat16 and interpreted(), TREE=tree_mask is not None)
    sizes = (s, m, blocks - 1, bs, h, kvh, group, float(qk_scale), float(k_scale), float(v_scale),
             int(sliding_window), words)
    if splits == 1:
        kv_attention_kernel[(b, kvh, tiles)](q, out, positions, tables, k_cache, v_cache, sinks_arg, tree_arg,
                                             *sizes, HAS_SINKS=sinks is not None, **common)
        return out
    part_acc = torch.empty(splits, b, s, h, d, dtype=torch.float32, device=device)
    part_ml = torch.empty(splits, b, s, h, 2, dtype=torch.float32, device=device)
    kv_attention_split_kernel[(b, kvh, tiles * splits)](q, part_acc, part_ml, positions, tables, k_cache, v_cache,
                                                        tree_arg, *sizes, tiles, splits, **common)
    kv_reduce_kernel[(b, s, h)](part_acc, part_ml, out, positions, sinks_arg, b, s, h, splits, D=d,
                                BLOCK_D=next_pow2(d, 16), BLOCK_SPLIT=next_pow2(splits), SPLIT_STEP=SPLIT_STEP,
                                HAS_SINKS=sinks is not None)
    return out


@dataclass(frozen=True)
class Tiles:
    """One launch's tiling: query rows (S x G of one KV head) per program, key positions per step
    (a step gathers block_n / block_size cache blocks through the table), warps, pipeline stages
    (cp.async prefetch of the next steps' keys and values)."""
    block_m: int = 16
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3


def tiles_for(rows: int, d: int, dtype: torch.dtype, tree: bool, fixed_rows: bool = False) -> Tiles:
    """The tiling of `rows` = S x G query rows per KV head at head size d: all of a verify's rows
    (up to 64) in one tile, so each KV block is read once per KV head; 16 rows when `fixed_rows`
    (deterministic mode and the plugins: one tile shape whatever the batch; fp32, whose taller tiles
    spill). Keys per step: 16 KB of a 16-bit K tile (128 at d = 64, 64 at d = 128, 32 at d = 256); 32
    for trees (one ancestor-mask word per step) and fp32 (registers). Checked by aot.py (all variants
    and --jit-only): no spills on sm_90a / sm_100a."""
    block_m = 16 if fixed_rows or dtype == torch.float32 else min(64, next_pow2(max(rows, 16)))
    block_n = 32 if tree or dtype == torch.float32 else min(128, 64 * 128 // next_pow2(d))  # 16 KB of bf16 K
    warps = 4 if block_m * max(d, block_n) <= 32 * 128 and dtype != torch.float32 else 8
    return Tiles(block_m, block_n, warps, 2 if d > 128 else 3)


def split_plan(batch: int, kv_heads: int, tiles: int, keys: int, sms: int) -> int:
    """Segments for a launch of batch x kv_heads x tiles programs over up to `keys` positions on a
    GPU of `sms` multiprocessors: 1 (unsplit) when the grid already gives each SM WAVES programs,
    else enough to do so, each at least MIN_CHUNK positions of `keys`, at most MAX_SPLITS (the
    reduce reads them all). Shape only: each program cuts its own tile's key steps on the device."""
    programs = batch * kv_heads * tiles
    if programs >= sms * WAVES or keys < 2 * MIN_CHUNK:
        return 1
    return min(-(-sms * WAVES // programs), keys // MIN_CHUNK, MAX_SPLITS)


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS  # the interpreter: an H100 / H200's 132, so the plan reads as on the GPU
