"""PEagleKVAttention in Triton: a few new rows per request attending over a paged KV cache.

Contract: `peagle_trt.ops.reference.kv_attention`. Caches [N+1, bs, KV, d] (block N is the trash
block), block tables [B, M] int64 (-1 = no block), positions [B, S] (-1 = padding row). Features:
GQA, any head size d (per-layer head sizes: one compiled variant per d), sliding windows
(keys at positions > p - W), attention sinks (one logit per head in the denominator, no value),
read-only layers (k = v = None), FP8 e4m3 caches with per-tensor scales (stored = value / scale),
draft trees (a packed ancestor mask [B, S, W] int32: rows at KV slots positions[b, 0] + s, each
seeing the context below that slot and the rows whose bits it has).

Two kernels, launched in order on one stream:
  kv_write      one program per (request, row): scatters the new k/v rows into their blocks;
  kv_attention  one program per (request, KV head, tile of BLOCK_M = 16 rows): the S rows x
                G = H/KV query heads of the request that share the KV head form [BLOCK_M, d]
                tiles; keys and values are gathered through the block table BLOCK_N positions
                at a time (any block size) and go through `tl.dot` (the tensor cores; the old
                CUDA kernel's `mma.sync`) with an online softmax in fp32.
Splitting the write out keeps the attention race-free without a grid-wide barrier.

Split over the context (flash-decoding), when batch x KV heads x tiles programs are too few to fill
the GPU (`split_plan`: by shape only, as vLLM's unified attention does):
  kv_attention_split  program (request, KV head, segment x tile): the same tile code (`_attend_tile`:
                      GQA rows sharing each KV block read, paged tables, trees, windows, FP8 cache)
                      over the key steps starting in segment j = [j * chunk, (j + 1) * chunk) (chunk a
                      multiple of BLOCK_N; a tree's steps start at its first slot, so a step straddling
                      a boundary goes to the segment it starts in); stores its unnormalised fp32 state;
  kv_reduce           program (request, row, head): merges the segments (and the sinks), normalises.
Deterministic mode (`ops.deterministic.rows()`) keeps the unsplit kernel: the plan depends on the
batch size, so a row's bits would depend on its batch (the unsplit kernel's do not: key steps at
absolute positions). `num_splits=` forces a count (tests, benchmarks). The TensorRT plugins launch
the unsplit kernel only (aot.py --jit-only compiles and checks the split kernels; launching them needs
the plan, two more launches and a workspace for the partials in tritonLauncher.cpp).
Differences from the reference, outside the runtime's contract: padding rows return zeros (the
reference returns some finite row); a table entry -1 (or past the cache) inside a row's visible
range is masked (the reference reads the trash block).
How to test: tests/ops/test_triton_kernels.py, tests/ops/test_kv_attention_split.py (interpreter; on a GPU
with PEAGLE_TRITON_DEVICE=cuda), tests/plugins/test_kernels_gpu.py (GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_trt.ops import deterministic
from peagle_trt.ops.triton_kernels.common import FP8, check_dtype, interpreted, next_pow2, out_buffer, same_device

LOG2E = 1.4426950408889634
BLOCK_N = 16  # key positions per step (the tl.dot minimum; a decode row reads few keys)
# split-KV plan (`split_plan`): to be tuned in a GPU window (bench kernels, split vs unsplit)
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
        if FP8_CACHE:
            kk = kk / k_scale
            vv = vv / v_scale
            if ROUND_FP8:
                kk = _round_to_e4m3(kk)
                vv = _round_to_e4m3(vv)
        tl.store(k_cache + row + c, kk.to(k_cache.dtype.element_ty), mask=inside)
        tl.store(v_cache + row + c, vv.to(v_cache.dtype.element_ty), mask=inside)


@triton.jit
def _attend_tile(q_ptr, positions_ptr, tables_ptr, k_cache, v_cache, tree_ptr, b, kvh, tile, split, S, M, trash,
                 bs, H, KV, G, qk_scale, k_scale, v_scale, window, W, splits, chunk, D: tl.constexpr,
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
    pos = tl.load(positions_ptr + b * S + tl.minimum(s, S - 1))
    pos = tl.where(row_ok, pos, -1)  # tile rows past S behave as padding rows
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = ((b * S + s) * H + head)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + tl.where(row_ok[:, None] & d_ok[None, :], q_off, 0),
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    dtype = q.dtype
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if TREE:  # keys up to the tile's last row's own slot (base + s); bits pick the tree rows
        base = tl.load(positions_ptr + b * S)
        top = tl.max(tl.where(pos >= 0, base + s, -1), axis=0)
    else:
        top = tl.max(pos, axis=0)
    end = tl.minimum(top + 1, M * bs)
    # with a window: the first key any row of the tile can see, rounded down to a step
    first = tl.maximum(tl.min(tl.where(pos >= 0, pos - window + 1, 2147483647), axis=0), 0)
    lo = tl.where(window > 0, first // BLOCK_N * BLOCK_N, 0)
    if TREE:  # steps aligned on the tree's first row: a step's rows sit in one half of one mask word
        lo = base - (base - lo + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # may start below 0 (masked)
        words = tree_ptr + (b * S + tl.minimum(s, S - 1)) * W  # [BLOCK_M] each tile row's mask
    if SPLIT:  # segment `split` = the steps starting in [split * chunk, (split + 1) * chunk), on the
        # step grid lo + i * BLOCK_N (a step straddling a boundary belongs to the segment it starts in)
        seg_lo = lo + tl.maximum(split * chunk - lo, 0) // BLOCK_N * BLOCK_N
        seg_hi = lo + tl.maximum((split + 1) * chunk - lo, 0) // BLOCK_N * BLOCK_N
        seg_hi = tl.where(split == splits - 1, end, tl.minimum(seg_hi, end))
        lo = seg_lo
        end = seg_hi
    keys = tl.arange(0, BLOCK_N)
    for start in range(lo, end, BLOCK_N):
        kp = start + keys  # [BLOCK_N] key positions
        entry = tl.minimum(tl.maximum(kp, 0) // bs, M - 1)
        block = tl.load(tables_ptr + b * M + entry, mask=(kp >= 0) & (kp < end), other=-1)
        key_ok = (kp >= 0) & (kp < end) & (block >= 0) & (block < trash)  # -1, past the cache: masked
        slot = tl.where(key_ok, block * bs + kp % bs, 0)
        kv_off = (slot * KV + kvh)[:, None] * D + d[None, :]
        kv_mask = key_ok[:, None] & d_ok[None, :]
        kt = tl.load(k_cache + tl.where(kv_mask, kv_off, 0), mask=kv_mask, other=0.0)
        vt = tl.load(v_cache + tl.where(kv_mask, kv_off, 0), mask=kv_mask, other=0.0)
        if FP8_CACHE:
            kt = (kt.to(tl.float32) * k_scale).to(dtype)
            vt = (vt.to(tl.float32) * v_scale).to(dtype)
        scores = _dot(q, tl.trans(kt), IEEE, UPCAST) * qk_scale  # log2 domain
        if TREE:
            # keys start - base + 0..BLOCK_N-1 are rows of this forward when start >= base (one half
            # of mask word (start - base) // 32), else the context (BLOCK_N divides 32)
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
        H, KV, G, qk_scale, k_scale, v_scale, window, W, 1, 0, D, BLOCK_M, BLOCK_D, BLOCK_N, FP8_CACHE, IEEE,
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
    tl.store(out_ptr + tl.where(out_mask, q_off, 0), out.to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def kv_attention_split_kernel(q_ptr, part_acc, part_ml, positions_ptr, tables_ptr, k_cache, v_cache, tree_ptr,
                              S, M, trash, bs, H, KV, G, qk_scale, k_scale, v_scale, window, W, tiles, splits,
                              chunk, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
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
        M, trash, bs, H, KV, G, qk_scale, k_scale, v_scale, window, W, splits, chunk, D, BLOCK_M, BLOCK_D, BLOCK_N,
        FP8_CACHE, IEEE, UPCAST, TREE, True)
    B = tl.num_programs(0).to(tl.int64)
    row = ((split.to(tl.int64) * B + b) * S + s) * H + head  # [BLOCK_M] partial row index
    out_mask = row_ok[:, None] & d_ok[None, :]
    d = tl.arange(0, BLOCK_D)
    tl.store(part_acc + tl.where(out_mask, row[:, None] * D + d[None, :], 0), acc, mask=out_mask)
    tl.store(part_ml + tl.where(row_ok, row, 0) * 2, m_i, mask=row_ok)
    tl.store(part_ml + tl.where(row_ok, row, 0) * 2 + 1, l_i, mask=row_ok)


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
                 num_splits: int | None = None) -> torch.Tensor:
    """See `reference.kv_attention`; writes k/v into the caches in place (k = v = None: read only).

    q [B, S, H*d], k/v [B, S, KV*d] (float32/float16/bfloat16, one dtype); positions [B, S];
    block_tables [B, M]; tree_mask [B, S, W] int32 | None; k_cache/v_cache [N+1, bs, KV, d] contiguous,
    q's dtype or float8_e4m3fn (then k_scale/v_scale dequantize: stored = value / scale).
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
    block_m = 16  # 64-row tiles spill registers from d = 64 on (aot.py's check); more rows, more programs
    tiles = -(-s * group // block_m)
    keys = m * bs  # positions the tables address: known on the host (positions.max() would sync)
    if num_splits is None:
        num_splits = 1 if deterministic.active() else split_plan(b, kvh, tiles, keys, _sms(device))[0]
    if int(num_splits) < 1:
        raise ValueError(f"kv_attention: num_splits must be >= 1 (or None: by shape), got {num_splits}")
    splits, chunk = segments(keys, int(num_splits))
    if q.dtype == torch.float32 and d > 128:  # its split form spills on sm_90a (aot.py --jit-only): unsplit
        splits = 1
    qk_scale = (scale if scale is not None else d ** -0.5) * LOG2E
    sinks_arg = q if sinks is None else sinks.contiguous()
    tree_arg = positions if tree_mask is None else tree_mask.contiguous()
    words = 1 if tree_mask is None else tree_mask.shape[2]
    common = dict(D=d, BLOCK_M=block_m, BLOCK_D=next_pow2(d, 16), BLOCK_N=BLOCK_N, FP8_CACHE=fp8,
                  IEEE=q.dtype == torch.float32, num_warps=4 if d <= 128 else 8,
                  UPCAST=q.dtype == torch.bfloat16 and interpreted(), TREE=tree_mask is not None)
    sizes = (s, m, blocks - 1, bs, h, kvh, group, float(qk_scale), float(k_scale), float(v_scale),
             int(sliding_window), words)
    if splits == 1:
        kv_attention_kernel[(b, kvh, tiles)](q, out, positions, tables, k_cache, v_cache, sinks_arg, tree_arg,
                                             *sizes, HAS_SINKS=sinks is not None, **common)
        return out
    part_acc = torch.empty(splits, b, s, h, d, dtype=torch.float32, device=device)
    part_ml = torch.empty(splits, b, s, h, 2, dtype=torch.float32, device=device)
    if q.dtype == torch.float32 and d >= 128:  # fp32 tiles: 4 warps spill in the split form (aot.py --jit-only)
        common["num_warps"] = 8
    kv_attention_split_kernel[(b, kvh, tiles * splits)](q, part_acc, part_ml, positions, tables, k_cache, v_cache,
                                                        tree_arg, *sizes, tiles, splits, chunk, **common)
    kv_reduce_kernel[(b, s, h)](part_acc, part_ml, out, positions, sinks_arg, b, s, h, splits, D=d,
                                BLOCK_D=next_pow2(d, 16), BLOCK_SPLIT=next_pow2(splits), SPLIT_STEP=SPLIT_STEP,
                                HAS_SINKS=sinks is not None)
    return out


def segments(keys: int, num_splits: int) -> tuple[int, int]:
    """(splits, chunk): `keys` positions cut into segments of `chunk` positions (a multiple of
    BLOCK_N), at most `num_splits` of them, none empty by construction (an empty one is harmless)."""
    if num_splits <= 1 or keys <= BLOCK_N:
        return 1, max(keys, 1)
    chunk = -(-keys // num_splits)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N
    return -(-keys // chunk), chunk


def split_plan(batch: int, kv_heads: int, tiles: int, keys: int, sms: int) -> tuple[int, int]:
    """(splits, chunk) for a launch of batch x kv_heads x tiles programs over `keys` positions on a
    GPU of `sms` multiprocessors: unsplit when the grid already gives each SM WAVES programs, else
    enough segments to do so, each at least MIN_CHUNK positions, at most MAX_SPLITS (the reduce reads
    them all). Shape only: neither the data nor the positions' values."""
    programs = batch * kv_heads * tiles
    if programs >= sms * WAVES or keys < 2 * MIN_CHUNK:
        return 1, max(keys, 1)
    want = min(-(-sms * WAVES // programs), keys // MIN_CHUNK, MAX_SPLITS)
    return segments(keys, want)


def _sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SMS  # the interpreter: an H100 / H200's 132, so the plan reads as on the GPU
