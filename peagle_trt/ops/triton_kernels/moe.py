"""PEagleMoE in Triton: a sparse mixture-of-experts MLP run on the device from routing to sum, reading
nothing back to the host (every buffer sized from shapes, no data-dependent shape: CUDA-graph capturable).

Contract: `peagle_trt.ops.reference.moe` (same signature; bf16 / fp16 / fp32 weights, or FP8 E4M3 with
per-tensor, per-channel or 128 x 128 block scales). Launched in order on one stream:
  moe_route_kernel     program per row: float32 routing (softmax-top-k, optionally renormalised, or
                       top-k-softmax; GPT-OSS's router bias is already in the logits), the k experts by
                       descending logit, ties to the lower id (the reference's rule), weights times
                       expert_scale -> weights [P] f32, ids [P] i32 (pair p = t * k + j, P = T * k);
  moe_quant_kernel     (FP8 per channel / per block only) program per row: dynamic activation scales
                       and E4M3 codes of x [T, H] (later of h [P, I]);
  moe_align_kernel     ONE program: counts the pairs per expert, pads each expert's group to BLOCK_M,
                       writes `sorted` [S] (pair ids grouped by expert in pair order, padding slots = P),
                       the expert of every BLOCK_M block [S / BLOCK_M] and the padded total [1] (kept on
                       the device). S = P + min(E, P) * (BLOCK_M - 1) bounds the padded total from shapes
                       alone (each non-empty group pads by at most BLOCK_M - 1; at most min(E, P) groups
                       are non-empty: tighter than P + E * (BLOCK_M - 1) and as shape-only). One program,
                       no atomics: the layout is a function of the ids alone;
  moe_gate_up_kernel   grouped GEMM over the routed experts only: program (block, I tile) reads its
                       block's expert and the padded total on the device and returns at once past the
                       total; gate and up tiles of w13[e] against the block's rows of x, fp32
                       accumulation, FP8 scales, bias, the activation (silu, gelu_tanh, clamped SwiGLU)
                       in fp32, h [P, I] rounded once to x's dtype;
  moe_down_kernel      the same over w2[e] and h -> o [P, H] float32 (bias added; unweighted);
  moe_sum_kernel       program per (row, H tile): y[t] = sum over j = 0..k-1 IN ORDER of w[t, j] * o[t*k+j]
                       in fp32, rounded once. No atomics anywhere.
FP8: weights are read as E4M3 and widened to fp16 in registers (exact) for an fp16 MMA with fp32
accumulation (the products exact, as the reference's). Per tensor: x quantized in the GEMM's registers
with the expert's static a13_scale (IEEE divide, clamp +-448, round to nearest even), acc * (a * s)
after the K loop; per channel: codes from moe_quant_kernel, acc * (a[t] * s[e, n]) after the loop;
block: BLOCK_K = 128, each K step's partial sum scaled by a[t, g] * s[e, n // 128, g] (vLLM's layout
of DeepSeek-style block scales).
Determinism: a row's bits do not depend on T or on the other rows. Its routing, quantization and sum
are its own program's; in the GEMMs its products are summed in BLOCK_K steps, and BLOCK_K and the MMA
kind come from the dtype and scale kind alone (`choose_tiles`), whatever BLOCK_M / BLOCK_N the shape
picks - given an MMA whose output element depends on its own row and column only (the GPU's;
tests/ops/conftest.py `rowwise_dot` models it under the interpreter). A `config=` with another
BLOCK_K gives other (equally valid) bits.
Tiles (`choose_tiles`, UNMEASURED; `bench kernels` sweeps them on a GPU with `config=`): "small" while
the average rows per expert T*k/E <= 16 (decode and verify: each routed expert's rows in one 16-row
block, as vLLM's published H200 tile for E = 128, N = 768 FP8 blocks with BLOCK_K 128; 64-wide N tiles
where vLLM takes 128, to give a decode step's few experts more programs), "large" (64-row blocks) past
it; registers and spills checked by aot.py. The workspace (align buffers,
codes, h, o) is allocated here from shapes; the C launcher takes it from TensorRT
(`peagle_moe_workspace_size`, plugins/src/launcher/tritonLauncher.cpp, the same layout).
Under the interpreter (TRITON_INTERPRET=1): E4M3 rounding by `_round_to_e4m3` and fp32 dots on the
exact values (EMULATE), bf16 dots through fp32 (UPCAST), as the other kernels.
How to test: tests/ops/test_moe_kernel.py (interpreter; on a GPU with PEAGLE_TRITON_DEVICE=cuda),
tests/ops/test_triton_aot.py (the cubins), `peagle-trt bench kernels` (speed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from peagle_trt.errors import ConfigError
from peagle_trt.ops import reference
from peagle_trt.ops.triton_kernels.common import FP8, interpreted, next_pow2, out_buffer
from peagle_trt.ops.triton_kernels.fp8_linear import _codes

KINDS = {"none": 0, "tensor": 1, "channel": 2, "block": 3}  # QUANT constexpr of the GEMMs
STATIC_CHANNEL = 4  # QUANT of per-channel weight scales with static activation scales (ModelOpt's experts stacked)
GROUP = reference.FP8_GROUP  # 128: block scales, dynamic activation groups
ALIGN_TILE = 4096  # elements of the align kernel's [CHUNK, BLOCK_E] one-hot tile
SUM_BLOCK = 512  # output columns per program of the sum
SMALL_ROWS = 16  # "small" tiles while T * k <= SMALL_ROWS * E (at most 16 rows per expert on average)


@dataclass(frozen=True)
class MoETiles:
    """One launch configuration of both grouped GEMMs (module docstring). block_k changes a row's
    arithmetic (the K steps its products are summed in); the other fields only move work around.

    block_m     rows (routed pairs) per program and the alignment unit of an expert's group: 16..128
    block_n     output features per program: 16..256
    block_k     K per step: 32..256; 128 with FP8 block scales (one scale group per step)
    num_warps   4 or 8
    num_stages  software pipeline depth of the K loop (1..8)"""
    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        pow2 = {16, 32, 64, 128, 256}
        if self.block_m not in pow2 - {256} or self.block_n not in pow2 or self.block_k not in pow2 - {16}:
            raise ConfigError(f"MoETiles: block_m must be 16..128, block_n 16..256, block_k 32..256 (powers of two), "
                              f"got {self.block_m} / {self.block_n} / {self.block_k}")
        if self.num_warps not in (4, 8) or not 1 <= self.num_stages <= 8:
            raise ConfigError(f"MoETiles: num_warps must be 4 or 8 and num_stages 1..8, got {self.num_warps} / "
                              f"{self.num_stages}")


def block_k_for(dtype: torch.dtype, kind: str) -> int:
    """K per step, from the activation dtype and the scale kind alone (a row's arithmetic)."""
    if kind != "none":
        return GROUP
    return 32 if dtype == torch.float32 else 64


def regime(rows: int, top_k: int, experts: int) -> str:
    """"small" while the average rows per expert T * k / E is at most 16 (decode, verify), else "large"."""
    return "small" if rows * top_k <= SMALL_ROWS * experts else "large"


def regime_tiles(name: str, dtype: torch.dtype, kind: str) -> MoETiles:
    """The tiles of a regime: small = 16-row blocks, 64-wide N tiles, 4 warps, 4 stages; large = 64-row
    blocks (32 in fp32), 8 warps (4 spill the two fp32 accumulators of gate/up on sm_90a), 3 stages.
    fp32 (FMA dots, operands in registers) takes 8 warps in both (4 spill on sm_100a). BLOCK_K from
    `block_k_for` (dtype and kind only). Checked by aot.py: no spills on sm_90a / sm_100a."""
    k = block_k_for(dtype, kind)
    fp32 = dtype == torch.float32
    if name == "small":
        return MoETiles(16, 64, k, 8 if fp32 else 4, 4)
    return MoETiles(32 if fp32 else 64, 64, k, 8, 3)


def choose_tiles(rows: int, top_k: int, experts: int, dtype: torch.dtype, kind: str) -> MoETiles:
    """The default tiles for T = `rows` (`regime`, `regime_tiles`). plugins/src/launcher/tritonLauncher.cpp
    applies the same rule to the compiled variants (variants.py)."""
    return regime_tiles(regime(rows, top_k, experts), dtype, kind)


def slots_for(pairs: int, experts: int, block_m: int) -> int:
    """Length of the aligned pair list: a bound on the padded total from shapes alone."""
    return pairs + min(experts, pairs) * (block_m - 1)


def workspace_bytes(tokens: int, hidden: int, experts: int, inter: int, top_k: int, dtype: torch.dtype, kind: str,
                    block_m: int = 64) -> int:
    """Bytes of the plugin's workspace for `tokens` rows (plugins/src/launcher/tritonLauncher.cpp,
    MoeLayout; the C API sizes it with the largest BLOCK_M, 64): routing weights and ids, the aligned
    pair list, the block experts, the total, x's and h's E4M3 codes and scales (dynamic kinds), h and o,
    each 256-byte aligned. This module allocates the same buffers as separate tensors."""
    pairs = tokens * top_k
    slots = slots_for(pairs, experts, block_m)
    dynamic = kind in ("channel", "block")
    h_groups, i_groups = (1, 1) if kind == "channel" else (-(-hidden // GROUP), -(-inter // GROUP))
    act = torch.tensor([], dtype=dtype).element_size()
    sizes = [pairs * 4, pairs * 4, slots * 4, -(-slots // block_m) * 4, 4,
             tokens * hidden if dynamic else 0, tokens * h_groups * 4 if dynamic else 0, pairs * inter * act,
             pairs * inter if dynamic else 0, pairs * i_groups * 4 if dynamic else 0, pairs * hidden * 4]
    return sum(-(-n // 256) * 256 for n in sizes)


# -- kernels --------------------------------------------------------------------------------------

@triton.jit
def moe_route_kernel(logits_ptr, scale_ptr, weights_ptr, ids_ptr, E, top_k, routing, renormalize, has_scale,
                     BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr):
    """Row t: its k experts by descending float32 logit (ties: the lower id) and their weights."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    v = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    avail = e < E
    j = tl.arange(0, BLOCK_TOPK)
    picked = tl.zeros([BLOCK_TOPK], tl.int32)
    top = tl.full([BLOCK_TOPK], float("-inf"), tl.float32)
    for i in range(top_k):
        best = tl.max(tl.where(avail, v, float("-inf")), axis=0)
        idx = tl.min(tl.where(avail & (v == best), e, BLOCK_E), axis=0)
        idx = tl.where(idx == BLOCK_E, tl.min(tl.where(avail, e, BLOCK_E), axis=0), idx)  # only NaNs left
        avail = avail & (e != idx)
        picked = tl.where(j == i, idx, picked)
        top = tl.where(j == i, best, top)
    live = j < top_k
    if routing == 0:  # softmax over all experts, then the picks (renormalised: over their sum)
        m = tl.max(v, axis=0)
        z = tl.sum(tl.where(e < E, tl.exp(v - m), 0.0), axis=0)
        w = tl.exp(top - m) / z
        if renormalize != 0:
            w = w / tl.sum(tl.where(live, w, 0.0), axis=0)
    else:  # softmax over the k picked logits
        ex = tl.where(live, tl.exp(top - tl.max(top, axis=0)), 0.0)
        w = ex / tl.sum(ex, axis=0)
    if has_scale != 0:
        w = w * tl.load(scale_ptr + picked, mask=live, other=1.0)
    tl.store(weights_ptr + t * top_k + j, w, mask=live)
    tl.store(ids_ptr + t * top_k + j, picked, mask=live)


@triton.jit
def moe_align_kernel(ids_ptr, sorted_ptr, expert_ptr, total_ptr, pairs, num_blocks, BLOCK_M: tl.constexpr,
                     BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """One program: the pairs grouped by expert (pair order within a group), each group padded to
    BLOCK_M with the sentinel `pairs`; the expert of each block (-1 past the total); the total."""
    e = tl.arange(0, BLOCK_E)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, pairs, CHUNK):
        ids = tl.load(ids_ptr + p0 + c, mask=p0 + c < pairs, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # inclusive
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(total_ptr, total)
    r = tl.arange(0, BLOCK_M)
    pad_slot = (starts + counts)[:, None] + r[None, :]  # [BLOCK_E, BLOCK_M]: each group's padding slots
    tl.store(sorted_ptr + pad_slot, tl.zeros([BLOCK_E, BLOCK_M], tl.int32) + pairs,
             mask=r[None, :] < (padded - counts)[:, None])
    for b0 in range(0, num_blocks, CHUNK):
        start = (b0 + c) * BLOCK_M
        expert = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)  # groups that end before it
        tl.store(expert_ptr + b0 + c, tl.where(start < total, expert, -1), mask=b0 + c < num_blocks)
    running = starts
    for p0 in range(0, pairs, CHUNK):
        ids = tl.load(ids_ptr + p0 + c, mask=p0 + c < pairs, other=-1)
        onehot = (ids[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, BLOCK_E]
        before = tl.cumsum(onehot, axis=0) - onehot  # earlier pairs of this chunk in the same group
        slot = tl.sum(onehot * (running[None, :] + before), axis=1)
        tl.store(sorted_ptr + slot, p0 + c, mask=p0 + c < pairs)
        running += tl.sum(onehot, axis=0)


@triton.jit
def moe_quant_kernel(x_ptr, codes_ptr, scales_ptr, K, groups, PER_ROW: tl.constexpr, EMULATE: tl.constexpr):
    """Row r of x [R, K]: dynamic E4M3 codes. PER_ROW: one scale max(amax, 1e-12) / 448 for the row
    (scales [R]); else one per 128-column group (scales [R, groups])."""
    r = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, 128)
    row = x_ptr + r * K
    if PER_ROW:
        amax = tl.zeros([128], tl.float32)
        for k0 in range(0, K, 128):
            amax = tl.maximum(amax, tl.abs(tl.load(row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)))
        a = tl.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)
        tl.store(scales_ptr + r, a)
        for k0 in range(0, K, 128):
            x = tl.load(row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
            tl.store(codes_ptr + r * K + k0 + cols, _codes(x, a, EMULATE).to(codes_ptr.dtype.element_ty),
                     mask=k0 + cols < K)
    else:
        for g in range(0, groups):
            k = g * 128 + cols
            x = tl.load(row + k, mask=k < K, other=0.0).to(tl.float32)
            a = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12), 448.0)
            tl.store(scales_ptr + r * groups + g, a)
            tl.store(codes_ptr + r * K + k, _codes(x, a, EMULATE).to(codes_ptr.dtype.element_ty), mask=k < K)


@triton.jit
def _mm(a, w, acc, FP8W: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, EMULATE: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T, fp32 accumulation. FP8W: E4M3 operands
    widened exactly to fp16 (fp32 under the interpreter); UPCAST: bf16 through fp32 (interpreter)."""
    if FP8W:
        if EMULATE:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a.to(tl.float16), tl.trans(w.to(tl.float16)), acc)
    elif UPCAST:
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _act(g, u, activation, alpha, limit):
    """0 silu(g) * u; 1 gelu_tanh(g) * u; 2 GPT-OSS's clamped SwiGLU (u + 1) * g * sigmoid(alpha g)."""
    if activation == 0:
        h = g * _sigmoid(g) * u
    elif activation == 1:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2 / pi) (g + 0.044715 g^3)
        h = 0.5 * g * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0)) * u  # 1 + tanh(z), overflow-safe
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        h = (u + 1.0) * (g * _sigmoid(alpha * g))
    return h


@triton.jit
def _rows(sorted_ptr, expert_ptr, pairs, BLOCK_M: tl.constexpr):
    """This program's block (inside the padded total): (expert, pair ids [BLOCK_M], live rows)."""
    pid = tl.program_id(0)
    pair = tl.load(sorted_ptr + pid * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.load(expert_ptr + pid).to(tl.int64), pair, pair < pairs


@triton.jit
def moe_gate_up_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, as_ptr, bias_ptr, h_ptr, sorted_ptr, expert_ptr, total_ptr,
                       pairs, top_k, H, inter, k_groups, n_groups, activation, alpha, limit, has_bias,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       NUM_STAGES: tl.constexpr, QUANT: tl.constexpr, ALIGNED: tl.constexpr, IEEE: tl.constexpr,
                       UPCAST: tl.constexpr, EMULATE: tl.constexpr):
    """h[pair, n] = act(x[t] @ w13[e, n]^T, x[t] @ w13[e, inter + n]^T) for the block's pairs (t = pair // k).
    x: activations (QUANT 0, 1, 4) or their E4M3 codes (2, 3) with scales xs [T] / [T, k_groups];
    ws: w13_scale ([E], [E, 2I] or [E, n_groups, k_groups]); as: a13_scale [E] (QUANT 1, 4: static
    activation scales, with per-tensor or per-channel weight scales)."""
    if tl.program_id(0) * BLOCK_M >= tl.load(total_ptr):  # past the padded total: nothing to do
        return
    e, pair, row_ok = _rows(sorted_ptr, expert_ptr, pairs, BLOCK_M)
    tok = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    x_rows = x_ptr + tok[:, None] * H  # [BLOCK_M, 1]
    w_gate = w_ptr + (e * 2 * inter + cols)[:, None].to(tl.int64) * H  # [BLOCK_N, 1]
    w_up = w_gate + inter * H  # one expert's rows: in int32's range
    if ALIGNED:  # H a multiple of BLOCK_K, 16-byte aligned rows: full vector loads, no K mask
        x_rows = tl.multiple_of(x_rows, [16, 1])
        w_gate = tl.multiple_of(w_gate, [16, 1])
        w_up = tl.multiple_of(w_up, [16, 1])
    a_static = 1.0
    if QUANT == 1 or QUANT == 4:
        a_static = tl.load(as_ptr + e)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < H) | ALIGNED
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_gate + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(w_up + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANT == 1 or QUANT == 4:
            a = _codes(a.to(tl.float32), a_static, EMULATE)
        if QUANT == 3:  # one 128-group per step: its partial sums scaled by a[t, g] * s[e, n // 128, g]
            g = k0 // BLOCK_K
            xa = tl.load(xs_ptr + tok * k_groups + g, mask=row_ok, other=0.0)
            sg = tl.load(ws_ptr + (e * n_groups + cols // 128) * k_groups + g, mask=col_ok, other=0.0)
            su = tl.load(ws_ptr + (e * n_groups + (inter + cols) // 128) * k_groups + g, mask=col_ok, other=0.0)
            zero = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_g += _mm(a, wg, zero, True, IEEE, UPCAST, EMULATE) * (xa[:, None] * sg[None, :])
            acc_u += _mm(a, wu, zero, True, IEEE, UPCAST, EMULATE) * (xa[:, None] * su[None, :])
        else:
            acc_g = _mm(a, wg, acc_g, QUANT != 0, IEEE, UPCAST, EMULATE)
            acc_u = _mm(a, wu, acc_u, QUANT != 0, IEEE, UPCAST, EMULATE)
    if QUANT == 1:
        s = a_static * tl.load(ws_ptr + e)
        acc_g = acc_g * s
        acc_u = acc_u * s
    if QUANT == 2 or QUANT == 4:  # per-channel weight scales; activations per row (2) or static (4)
        if QUANT == 2:
            xa = tl.load(xs_ptr + tok, mask=row_ok, other=0.0)[:, None]
        else:
            xa = tl.zeros([BLOCK_M, 1], tl.float32) + a_static
        acc_g = acc_g * (xa * tl.load(ws_ptr + e * 2 * inter + cols, mask=col_ok, other=0.0)[None, :])
        acc_u = acc_u * (xa * tl.load(ws_ptr + e * 2 * inter + inter + cols, mask=col_ok, other=0.0)[None, :])
    if has_bias != 0:
        acc_g += tl.load(bias_ptr + e * 2 * inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + e * 2 * inter + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    h = _act(acc_g, acc_u, activation, alpha, limit)
    out = h_ptr + pair.to(tl.int64)[:, None] * inter + cols[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_down_kernel(h_ptr, hs_ptr, w_ptr, ws_ptr, as_ptr, bias_ptr, o_ptr, sorted_ptr, expert_ptr, total_ptr,
                    pairs, H, inter, k_groups, n_groups, has_bias, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, QUANT: tl.constexpr, ALIGNED: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr, EMULATE: tl.constexpr):
    """o[pair, n] = h[pair] @ w2[e, n]^T (+ b2[e, n]) in float32 for the block's pairs; h as activations
    (QUANT 0, 1, 4) or codes with scales hs [P] / [P, k_groups] (2, 3); ws: w2_scale; as: a2_scale (1, 4)."""
    if tl.program_id(0) * BLOCK_M >= tl.load(total_ptr):  # past the padded total: nothing to do
        return
    e, pair, row_ok = _rows(sorted_ptr, expert_ptr, pairs, BLOCK_M)
    row = tl.where(row_ok, pair, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    h_rows = h_ptr + row[:, None] * inter
    w_rows = w_ptr + (e * H + cols)[:, None].to(tl.int64) * inter
    if ALIGNED:
        h_rows = tl.multiple_of(h_rows, [16, 1])
        w_rows = tl.multiple_of(w_rows, [16, 1])
    a_static = 1.0
    if QUANT == 1 or QUANT == 4:
        a_static = tl.load(as_ptr + e)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in tl.range(0, inter, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < inter) | ALIGNED
        a = tl.load(h_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANT == 1 or QUANT == 4:
            a = _codes(a.to(tl.float32), a_static, EMULATE)
        if QUANT == 3:
            g = k0 // BLOCK_K
            ha = tl.load(hs_ptr + row * k_groups + g, mask=row_ok, other=0.0)
            s = tl.load(ws_ptr + (e * n_groups + cols // 128) * k_groups + g, mask=col_ok, other=0.0)
            acc += _mm(a, w, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), True, IEEE, UPCAST, EMULATE) * (
                ha[:, None] * s[None, :])
        else:
            acc = _mm(a, w, acc, QUANT != 0, IEEE, UPCAST, EMULATE)
    if QUANT == 1:
        acc = acc * (a_static * tl.load(ws_ptr + e))
    if QUANT == 2 or QUANT == 4:
        if QUANT == 2:
            ha = tl.load(hs_ptr + row, mask=row_ok, other=0.0)[:, None]
        else:
            ha = tl.zeros([BLOCK_M, 1], tl.float32) + a_static
        acc = acc * (ha * tl.load(ws_ptr + e * H + cols, mask=col_ok, other=0.0)[None, :])
    if has_bias != 0:
        acc += tl.load(bias_ptr + e * H + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + row[:, None] * H + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_sum_kernel(o_ptr, weights_ptr, y_ptr, H, top_k, BLOCK: tl.constexpr):
    """y[t, cols] = sum over j = 0..k-1 in order of w[t, j] * o[t * k + j, cols], fp32, rounded once."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in range(top_k):
        w = tl.load(weights_ptr + t * top_k + j)
        acc += w * tl.load(o_ptr + (t * top_k + j) * H + cols, mask=ok, other=0.0)
    tl.store(y_ptr + t * H + cols, acc.to(y_ptr.dtype.element_ty), mask=ok)


# -- launcher -------------------------------------------------------------------------------------

def _aligned(k: int, block_k: int, *tensors: torch.Tensor) -> bool:
    """K a multiple of BLOCK_K and every tensor 16-byte aligned: ALIGNED's hints hold."""
    return k % block_k == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)


def route(router_logits: torch.Tensor, top_k: int, routing: str = "softmax_topk", renormalize: bool = False,
          expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_route_kernel: logits [T, E] -> (weights [T, k] float32, ids [T, k] int32), as
    `reference.moe_route` (the same ids in the same order; weights to float32 rounding)."""
    t, e = router_logits.shape
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t:
        scale = weights if expert_scale is None else expert_scale.contiguous()  # unread without a scale
        moe_route_kernel[(t,)](router_logits.contiguous(), scale, weights, ids, e, top_k,
                               reference.MOE_ROUTINGS.index(routing), int(renormalize), int(expert_scale is not None),
                               BLOCK_E=next_pow2(e, 16), BLOCK_TOPK=next_pow2(top_k, 2))
    return weights, ids


def align(ids: torch.Tensor, experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align_kernel over pair ids [P] int32 (pair p = t * k + j) -> (sorted [S] int32: pair ids grouped
    by expert in pair order, each group padded to block_m with the sentinel P; block_expert
    [ceil(S / block_m)] int32: each block's expert, -1 past the total; total [1] int32: the padded
    count, on the device). S = `slots_for(P, experts, block_m)`: shapes only."""
    p = ids.numel()
    slots = slots_for(p, experts, block_m)
    blocks = -(-slots // block_m)
    i32 = dict(dtype=torch.int32, device=ids.device)
    sorted_ids, block_expert, total = torch.empty(slots, **i32), torch.empty(blocks, **i32), torch.zeros(1, **i32)
    if p:
        block_e = next_pow2(experts, 16)
        moe_align_kernel[(1,)](ids.contiguous(), sorted_ids, block_expert, total, p, blocks, BLOCK_M=block_m,
                               BLOCK_E=block_e, CHUNK=max(16, ALIGN_TILE // block_e))
    return sorted_ids, block_expert, total


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, expert_scale: torch.Tensor | None = None,
        w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
        a13_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None, *, top_k: int,
        routing: str = "softmax_topk", renormalize: bool = False, activation: str = "silu",
        swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, out: torch.Tensor | None = None,
        config: MoETiles | None = None) -> torch.Tensor:
    """See `reference.moe` (same arguments and result). out: y [T, H] in x's dtype, contiguous;
    config: the GEMMs' tiles (None: `choose_tiles`). Reads nothing back to the host."""
    shape = reference.moe_check(x, router_logits, w13, w2, b13, b2, expert_scale, w13_scale, w2_scale, a13_scale,
                                a2_scale, top_k=top_k, routing=routing, activation=activation)
    t, h, e, i, k, kind = (shape.tokens, shape.hidden, shape.experts, shape.inter, shape.top_k, shape.scale_kind)
    out = out_buffer(out, (t, h), x.dtype, x.device, "moe")
    if t == 0:
        return out
    tiles = config or choose_tiles(t, k, e, x.dtype, kind)
    if kind == "block" and tiles.block_k != GROUP:
        raise ConfigError(f"moe: block-FP8 scales need block_k = {GROUP} (one scale group per step), got {tiles}")
    emulate, p = interpreted(), t * k
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights, ids = route(router_logits, k, routing, renormalize, expert_scale)  # [T, k] each
    sorted_ids, block_expert, total = align(ids.view(-1), e, tiles.block_m)
    blocks = block_expert.numel()
    quant = STATIC_CHANNEL if kind == "channel" and a13_scale is not None else KINDS[kind]
    dynamic = quant in (KINDS["channel"], KINDS["block"])
    xa, xs = _quantize(x, kind, emulate) if dynamic else (x, weights)  # the GEMM's operand and its scales
    unused = weights  # a pointer for absent optional inputs (never read)
    common = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, NUM_STAGES=tiles.num_stages,
                  QUANT=quant, IEEE=x.dtype == torch.float32, UPCAST=x.dtype == torch.bfloat16 and emulate,
                  EMULATE=emulate, num_warps=tiles.num_warps)
    hidden = torch.empty(p, i, dtype=x.dtype, device=x.device)  # h [P, I]
    moe_gate_up_kernel[(blocks, -(-i // tiles.block_n))](
        xa, xs, w13, _or(w13_scale, unused), _or(a13_scale, unused), _or(b13, unused), hidden, sorted_ids,
        block_expert, total, p, k, h, i, -(-h // GROUP), -(-2 * i // GROUP),
        reference.MOE_ACTIVATIONS.index(activation), float(swiglu_alpha), float(swiglu_limit), int(b13 is not None),
        ALIGNED=_aligned(h, tiles.block_k, xa, w13), **common)
    ha, hs = _quantize(hidden, kind, emulate) if dynamic else (hidden, weights)
    o = torch.empty(p, h, dtype=torch.float32, device=x.device)  # [P, H] unweighted expert outputs
    moe_down_kernel[(blocks, -(-h // tiles.block_n))](
        ha, hs, w2, _or(w2_scale, unused), _or(a2_scale, unused), _or(b2, unused), o, sorted_ids, block_expert, total,
        p, h, i, -(-i // GROUP), -(-h // GROUP), int(b2 is not None), ALIGNED=_aligned(i, tiles.block_k, ha, w2),
        **common)
    moe_sum_kernel[(t, -(-h // SUM_BLOCK))](o, weights, out, h, k, BLOCK=SUM_BLOCK)
    return out


def _or(t: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if t is None else t.contiguous()


def _quantize(rows: torch.Tensor, kind: str, emulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic E4M3 codes [R, K] and scales ([R] per channel, [R, ceil(K/128)] per block) of rows [R, K]."""
    r, k = rows.shape
    groups = -(-k // GROUP)
    codes = torch.empty(r, k, dtype=FP8, device=rows.device)
    scales = torch.empty((r,) if kind == "channel" else (r, groups), dtype=torch.float32, device=rows.device)
    moe_quant_kernel[(r,)](rows, codes, scales, k, groups, PER_ROW=kind == "channel", EMULATE=emulate)
    return codes, scales
