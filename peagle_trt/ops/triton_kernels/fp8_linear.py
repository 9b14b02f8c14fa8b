"""FP8 (E4M3) linear in Triton: y = fp8(x / input_scale) @ weight^T * (input_scale * weight_scale) + bias,
reading the FP8 weight as FP8 (no bf16 copy): the small-M GEMM / GEMV of a decode or verify step.

Contract: `peagle_trt.models.fp8.fp8_linear_reference` (ModelOpt's per-tensor FP8: weight
float8_e4m3fn [N, K] = W / weight_scale, activations quantized with the static input_scale, both
scales float32 scalars; fp32 accumulation, one rounding to x's dtype). The scales are read from
their tensors inside the kernel (a `.item()` would synchronise the stream on every call).

Design. At M <= 64 rows the product is bound by reading the weight (N x K bytes): the weight must
stream at HBM speed, everything else hides behind it.
  swap-AB     the weight is the MMA's first operand. Program (row block, N tile, K segment):
              acc [BLOCK_N, 16] += dot(w [BLOCK_N, BLOCK_K], trans(codes(x) [16, BLOCK_K])); the
              weight fills the MMA's 64-row side, the batch its 16-wide side (M = 1 wastes MMA
              lanes, not bandwidth). BLOCK_N >= 64 keeps sm_90a on wgmma.
  mma         "f16" (default): both FP8 operands widened to fp16 in registers (exact: E4M3 is a
              subset of fp16), an fp16 MMA with fp32 accumulation (sm_90a wgmma m64n16k16, the
              weight a register operand; sm_100a tcgen05 kind::f16): exact products summed in fp32,
              as `fp8_linear_reference` (in another order). "fp8": the FP8 MMA on the tiles in
              shared memory (sm_90a wgmma m64n16k32 e4m3, both operands K-major; tcgen05
              kind::f8f6f4): no widening, but sm_90's FP8 MMA sums with fewer bits than fp32, so each
              BLOCK_K dot is promoted to the fp32 accumulator every PROMOTE_K = 128 products
              (`max_num_imprecise_acc`, as DeepSeek-V3's FP8 GEMMs do; ptxas then waits for each
              wgmma); expected (unmeasured) ~1e-4 relative off the reference: inside 16-bit
              activations' tolerance, outside fp32's.
              Compute is not the bound at M <= 64 (a few % of the MMA peak either way).
  row groups  a program serves up to ROW_GROUPS 16-row groups (64 rows) from each weight tile it
              loads (and widens) once, one dot of the same shape per group.
  x codes     IEEE divide (div.rn, as torch; Triton's `/` is div.full, off by up to 2 ulp), clamp
              to +-448, round to E4M3: in the GEMM's registers (QUANT_X: once per N tile, no extra
              launch) or first, by `fp8_quantize_kernel` into an [M, K] FP8 buffer (`prequant`:
              once, then read as FP8). Both give the same codes.
  pipeline    the K loop is `tl.range(..., num_stages=NUM_STAGES)`: weight tiles stream into shared
              memory by cp.async (LDGSTS: 16-byte copies for the FP8 MMA and on sm_100a, 8-byte for
              sm_90a's register operand), NUM_STAGES - 1 in flight. Offsets are plain: the old
              kernel's `tl.where(mask, offset, 0)` pointers hid their contiguity and made every
              weight load a 1-byte load. ALIGNED (K a multiple of BLOCK_K, N of 16, 16-byte aligned
              tensors: real layers) drops the K mask and states the alignment (`tl.multiple_of`),
              so the ahead-of-time compile (variants.py) builds what the JIT does.
  split-K     when N / 128 tiles cannot fill NUM_SMS (o / down projections: N = 4096), K is cut into
              up to MAX_SPLIT_K segments of whole BLOCK_K steps (`split_k_for`); each program stores
              its fp32 partial into a workspace [SPLIT_K, M, N] and `fp8_splitk_reduce_kernel` adds
              the segments in segment order, scales, adds the bias and rounds. No atomics.

A row's bits never depend on the other rows: they are fixed by its 16-row group's dot (its MMA
kind), BLOCK_K and the split-K segments (its K order), and `choose_config` takes those from (N, K)
alone. M picks the regime ("gemv": M <= 16, one group, x quantized in the GEMM; "small": up to four
groups per weight tile, x quantized first), which moves work between programs and kernels, not a
row's products - given an MMA whose output element depends on its own row and column only (the
GPU's; the interpreter test models it with tests/ops/conftest.py `rowwise_dot`). A `config=`
override with another mma, BLOCK_K or SPLIT_K gives other bits (equal within that config).
Deterministic mode (`ops.deterministic.rows()`) does not run this kernel: models/fp8.py
`choose_path` takes the dequantizing path there.

Configs: `FP8Config` (block_n, block_k, split_k, row_groups, num_warps, num_stages, prequant, mma);
`choose_config(m, n, k)` the default; `CANDIDATES` the configs per regime `bench kernels` times on a GPU
(`fp8_linear(..., config=c)` for each); variants.py compiles them all (`aot.py --jit-only`).
Triton versions: the GPU image's Triton (3.6 on the H100 / H200 image; 3.9 is pinned here and cannot
be carried there: 1 GB) compiles this kernel otherwise: the weight loop is not staged through shared
memory the same way (16 KB shared, ~254 registers at sm_90a) and the 4-row-group tiles of the "small"
regime spill 192-1064 B (1-row-group tiles do not); a window's sweep of CANDIDATES is on that Triton.
UNMEASURED: no timing of this design exists yet. The defaults come from the sm_90a / sm_100a
PTX and SASS (read on a CPU box) and bandwidth arithmetic; `bench kernels` times CANDIDATES on a GPU
against bf16 (targets: <= 0.65x at M = 1, <= 1x at M = 64) and sets the defaults, NUM_SMS,
MIN_SPLIT_CHUNK and models/fp8.py TRITON_MAX_M.

Under the interpreter (TRITON_INTERPRET=1) the activation is rounded to the E4M3 grid in fp32 by
`_round_to_e4m3` (the interpreter's own fp32 -> fp8 conversion drops a carry) and the dot runs in
fp32 on the exact FP8 values, which is the same product.
Which path a `FP8Linear` takes (this kernel, `torch._scaled_mm`, or the dequantized bf16 matmul)
is decided in peagle_trt/models/fp8.py. How to test: tests/ops/test_fp8_linear.py (interpreter;
on a GPU with PEAGLE_TRITON_DEVICE=cuda).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from peagle_trt.errors import ConfigError
from peagle_trt.ops.triton_kernels.common import FP8, check_dtype, interpreted, out_buffer, same_device
from peagle_trt.ops.triton_kernels.kv_attention import _round_to_e4m3

GROUP_ROWS = 16  # activation rows per dot: the MMA's narrow side (a row's group shape, every M)
PROMOTE_K = tl.constexpr(128)  # products per imprecise FP8 accumulation before the fp32 add (sm_90 wgmma)
NUM_SMS = 132  # H100 / H200: the programs one wave needs (split-K target; a constant, not queried)
SPLIT_TILE_N = 128  # the N tile split-K counts programs with, whatever a config's block_n
MIN_SPLIT_CHUNK = 1024  # fewest K per split-K segment (8 steps of 128: room for the pipeline)
MAX_SPLIT_K = 8
ELEMENTWISE_BLOCK = 1024  # elements per program of the quantize and reduce kernels


@dataclass(frozen=True)
class FP8Config:
    """One launch configuration of the FP8 GEMM (module docstring). Changing mma, block_k or split_k
    changes a row's arithmetic (other, equally valid bits); the other fields only move work around.

    block_n     output features per program, the MMA's wide side: 64, 128 or 256 (>= 64 keeps sm_90
                on wgmma; 128 is two m64 halves, one per warpgroup with 8 warps)
    block_k     K per pipeline step: 128 or 256 (a multiple of PROMOTE_K)
    split_k     K segments, reduced in order by a second kernel; None = `split_k_for(n, k)`
    row_groups  most 16-row groups one program serves from each weight tile (1, 2, 4; fewer if M has fewer)
    num_warps   4 or 8
    num_stages  pipeline depth: num_stages - 1 weight tiles in flight per program (2..8)
    prequant    quantize x in a separate kernel first (its codes then read as FP8 by every N tile)
                instead of in each program's registers (16 x K divisions per program and row group)
    mma         "f16": the FP8 operands widened (exactly) to fp16 for an fp16 MMA, fp32 accumulation;
                "fp8": the FP8 MMA itself, promoted to fp32 every PROMOTE_K (module docstring)"""
    block_n: int = 128
    block_k: int = 128
    split_k: int | None = None
    row_groups: int = 1
    num_warps: int = 8
    num_stages: int = 4
    prequant: bool = False
    mma: str = "f16"

    def __post_init__(self):
        if self.block_n not in (64, 128, 256):
            raise ConfigError(f"FP8Config.block_n must be 64, 128 or 256 (wgmma rows), got {self.block_n}")
        if self.block_k not in (128, 256):
            raise ConfigError(f"FP8Config.block_k must be 128 or 256 (PROMOTE_K steps), got {self.block_k}")
        if self.split_k is not None and not 1 <= self.split_k <= 64:
            raise ConfigError(f"FP8Config.split_k must be None (by shape) or 1..64, got {self.split_k}")
        if self.row_groups not in (1, 2, 4):
            raise ConfigError(f"FP8Config.row_groups must be 1, 2 or 4, got {self.row_groups}")
        if self.mma not in ("f16", "fp8"):
            raise ConfigError(f"FP8Config.mma must be 'f16' or 'fp8', got {self.mma!r}")
        if self.num_warps not in (4, 8) or not 2 <= self.num_stages <= 8:
            raise ConfigError(f"FP8Config: num_warps must be 4 or 8 and num_stages 2..8, got {self.num_warps} / "
                              f"{self.num_stages}")


# Per regime, the configs `bench kernels` times (`fp8_linear(..., config=c)` for each c); the first of
# each is the default (`choose_config`). The mma = "fp8", block_k = 256 and split_k = 1 entries
# change a row's arithmetic (other bits); the others only move work.
CANDIDATES = {
    "gemv": (  # M <= 16: one row group; the weight stream is everything
        FP8Config(128, 128, None, 1, 8, 4),
        FP8Config(128, 128, None, 1, 8, 4, mma="fp8"),  # no widening; imprecise FP8 accumulation
        FP8Config(64, 128, None, 1, 4, 4),  # twice the N tiles, one warpgroup each
        FP8Config(128, 128, None, 1, 8, 6),  # 5 weight tiles in flight
        FP8Config(128, 256, None, 1, 8, 3),
        FP8Config(128, 128, 1, 1, 8, 4),  # no split-K: what the reduce launch buys
    ),
    "small": (  # 16 < M <= 64: up to 4 row groups share each weight tile
        FP8Config(64, 128, None, 4, 4, 4, prequant=True),  # the default: no spill on Triton 3.6 nor 3.9
        FP8Config(128, 128, None, 4, 8, 4, prequant=True, mma="fp8"),
        FP8Config(128, 128, None, 4, 8, 4, prequant=True),  # spills 192 B on Triton 3.6 (sm_90a)
        FP8Config(128, 128, None, 4, 8, 4),  # x quantized per N tile: no quantize launch
        FP8Config(128, 128, None, 1, 8, 4, prequant=True),  # a program per group: the tile re-read (L2)
        FP8Config(256, 128, None, 4, 8, 3, prequant=True),
    ),
}


def regime(m: int) -> str:
    """"gemv" (M <= 16: one row group) or "small" (more: several share the weight tiles)."""
    return "gemv" if m <= GROUP_ROWS else "small"


def split_k_for(n: int, k: int) -> int:
    """K segments for an N x K weight: enough that N / SPLIT_TILE_N tiles x segments reach NUM_SMS
    programs, each segment at least MIN_SPLIT_CHUNK deep, at most MAX_SPLIT_K. Shape only, and the
    same for every config (block_n and M do not enter: a row's bits)."""
    tiles = -(-n // SPLIT_TILE_N)
    if tiles >= NUM_SMS:
        return 1
    return max(1, min(-(-NUM_SMS // tiles), k // MIN_SPLIT_CHUNK, MAX_SPLIT_K))


def choose_config(m: int, n: int, k: int) -> FP8Config:
    """The default config for [M, K] x [N, K]^T: the regime's first candidate with its row groups cut
    to M's and split_k resolved. block_k and split_k come from (N, K) alone (module docstring)."""
    base = CANDIDATES[regime(m)][0]
    need = -(-m // GROUP_ROWS)
    groups = next(g for g in (1, 2, 4) if g >= min(need, base.row_groups))
    return resolve(replace(base, row_groups=groups), n, k)


def resolve(config: FP8Config, n: int, k: int) -> FP8Config:
    """config with split_k fixed (None: `split_k_for`), at most one segment per K step."""
    split = split_k_for(n, k) if config.split_k is None else config.split_k
    return replace(config, split_k=max(1, min(split, -(-k // config.block_k))))


@triton.jit
def _codes(x, in_scale, EMULATE: tl.constexpr):
    """E4M3 codes of x / in_scale (fp32 in): IEEE divide (as torch), clamp to +-448 (as ModelOpt),
    round to nearest even; fp8, or (EMULATE) fp32 on the E4M3 grid."""
    x = tl.minimum(tl.maximum(tl.div_rn(x, in_scale), -448.0), 448.0)
    if EMULATE:
        q = _round_to_e4m3(x)
    else:
        q = x.to(tl.float8e4nv)
    return q


@triton.jit
def _group_dot(acc, w, x_ptr, rows, ks, M, K, in_scale, QUANT_X: tl.constexpr, MMA_FP8: tl.constexpr,
               ALIGNED: tl.constexpr, EMULATE: tl.constexpr):
    """acc [BLOCK_N, 16] += w [BLOCK_N, BLOCK_K] @ codes(x[rows, ks])^T: one row group; w in the dot's
    operand type. x holds activations (QUANT_X: quantized here) or their codes (fp8, `fp8_quantize_kernel`)."""
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * K  # [16, 1]
    if ALIGNED:  # full K steps, 16-byte aligned rows: 16-byte loads, no K mask
        x = tl.load(tl.multiple_of(x_rows, [16, 1]) + ks[None, :], mask=(rows < M)[:, None], other=0.0)
    else:
        x = tl.load(x_rows + ks[None, :], mask=(rows < M)[:, None] & (ks < K)[None, :], other=0.0)
    if QUANT_X:
        x = _codes(x.to(tl.float32), in_scale, EMULATE)  # [16, BLOCK_K]
    if EMULATE:
        acc = tl.dot(w, tl.trans(x.to(tl.float32)), acc, input_precision="ieee")
    elif MMA_FP8:
        acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=PROMOTE_K)
    else:
        acc = tl.dot(w, tl.trans(x.to(tl.float16)), acc)
    return acc


@triton.jit
def _group_store(acc, out_ptr, part_ptr, bias_ptr, rows, cols, M, N, split, scale,
                 SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ALIGNED: tl.constexpr):
    """acc [BLOCK_N, 16] (columns = rows of x) to out[rows, cols] (scaled, bias, x's dtype) or,
    split-K, unscaled to the workspace part[split, rows, cols] (fp32)."""
    mask = (cols < N)[:, None] & (rows < M)[None, :]
    if SPLIT:
        base = part_ptr + (split.to(tl.int64) * M + rows)[None, :] * N  # [1, 16]
        if ALIGNED:
            base = tl.multiple_of(base, [16, 16])
        tl.store(base + cols[:, None], acc, mask=mask)
    else:
        y = acc * scale
        if HAS_BIAS:
            y += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
        base = out_ptr + rows.to(tl.int64)[None, :] * N  # [1, 16]
        if ALIGNED:
            base = tl.multiple_of(base, [16, 16])
        tl.store(base + cols[:, None], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp8_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, in_scale_ptr, w_scale_ptr, M, N, K, seg_steps,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROW_GROUPS: tl.constexpr,
                      NUM_STAGES: tl.constexpr, QUANT_X: tl.constexpr, MMA_FP8: tl.constexpr,
                      SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ALIGNED: tl.constexpr,
                      EMULATE: tl.constexpr):
    # program (row block of ROW_GROUPS x 16 rows, N tile, K segment of seg_steps steps of BLOCK_K)
    m0 = tl.program_id(0) * (ROW_GROUPS * 16)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    split = tl.program_id(2)
    k_lo = split * seg_steps * BLOCK_K  # a multiple of BLOCK_K, as the compiler can see
    k_hi = tl.minimum(k_lo + seg_steps * BLOCK_K, K)
    in_scale = tl.load(in_scale_ptr).to(tl.float32)
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
    if ALIGNED:
        w_rows = tl.multiple_of(w_rows, [16, 1])
    c_ok = (cols < N)[:, None]
    r = tl.arange(0, 16)
    acc0 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc1 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc2 = tl.zeros([BLOCK_N, 16], tl.float32)
    acc3 = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        if ALIGNED:
            w = tl.load(w_rows + ks[None, :], mask=c_ok, other=0.0)  # [BLOCK_N, BLOCK_K] fp8
        else:
            w = tl.load(w_rows + ks[None, :], mask=c_ok & (ks < K)[None, :], other=0.0)
        if EMULATE:  # the dot's operand, converted once for all row groups
            w = w.to(tl.float32)
        elif not MMA_FP8:
            w = w.to(tl.float16)  # exact: every E4M3 value is an fp16 value
        acc0 = _group_dot(acc0, w, x_ptr, m0 + r, ks, M, K, in_scale, QUANT_X, MMA_FP8, ALIGNED, EMULATE)
        if ROW_GROUPS > 1:
            acc1 = _group_dot(acc1, w, x_ptr, m0 + 16 + r, ks, M, K, in_scale, QUANT_X, MMA_FP8, ALIGNED, EMULATE)
        if ROW_GROUPS > 2:
            acc2 = _group_dot(acc2, w, x_ptr, m0 + 32 + r, ks, M, K, in_scale, QUANT_X, MMA_FP8, ALIGNED, EMULATE)
            acc3 = _group_dot(acc3, w, x_ptr, m0 + 48 + r, ks, M, K, in_scale, QUANT_X, MMA_FP8, ALIGNED, EMULATE)
    scale = in_scale * tl.load(w_scale_ptr).to(tl.float32)
    _group_store(acc0, out_ptr, part_ptr, bias_ptr, m0 + r, cols, M, N, split, scale, SPLIT, HAS_BIAS, ALIGNED)
    if ROW_GROUPS > 1:
        _group_store(acc1, out_ptr, part_ptr, bias_ptr, m0 + 16 + r, cols, M, N, split, scale, SPLIT, HAS_BIAS,
                     ALIGNED)
    if ROW_GROUPS > 2:
        _group_store(acc2, out_ptr, part_ptr, bias_ptr, m0 + 32 + r, cols, M, N, split, scale, SPLIT, HAS_BIAS,
                     ALIGNED)
        _group_store(acc3, out_ptr, part_ptr, bias_ptr, m0 + 48 + r, cols, M, N, split, scale, SPLIT, HAS_BIAS,
                     ALIGNED)


@triton.jit
def fp8_quantize_kernel(x_ptr, q_ptr, in_scale_ptr, total, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    """q = codes(x / in_scale), flat: the activation side once, for a GEMM with QUANT_X off."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(q_ptr + offs, _codes(x, tl.load(in_scale_ptr).to(tl.float32), EMULATE).to(q_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def fp8_splitk_reduce_kernel(part_ptr, bias_ptr, out_ptr, in_scale_ptr, w_scale_ptr, M, N,
                             SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr):
    """out[m, n] = (part[0, m, n] + part[1, m, n] + ...) * scales + bias, segments in order."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat over [M, N]
    total = M.to(tl.int64) * N
    ok = offs < total
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(part_ptr + s * total + offs, mask=ok, other=0.0)
    y = acc * (tl.load(in_scale_ptr).to(tl.float32) * tl.load(w_scale_ptr).to(tl.float32))
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


def _aligned(n: int, k: int, block_k: int, *tensors: torch.Tensor | None) -> bool:
    """K a multiple of BLOCK_K (no partial step), N of 16, every tensor 16-byte aligned: ALIGNED's
    hints hold (real layers; the JIT would find the same divisibility by itself)."""
    return n % 16 == 0 and k % block_k == 0 and all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _check(x, weight, weight_scale, input_scale, bias) -> tuple[int, int]:
    """(N, K) of a valid call; TypeError / ValueError naming what is wrong."""
    check_dtype(x, "fp8_linear x")
    if FP8 is None or weight.dtype != FP8 or weight.dim() != 2:
        raise TypeError(f"fp8_linear: weight must be a 2-D float8_e4m3fn tensor, got {weight.dtype} "
                        f"{tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} does not match weight [{n}, {k}] (last dim must be {k})")
    if weight_scale.numel() != 1 or input_scale.numel() != 1:
        raise ValueError("fp8_linear: weight_scale and input_scale must be per-tensor (one element each), got "
                         f"{tuple(weight_scale.shape)} / {tuple(input_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"fp8_linear: bias must be [{n}], got {tuple(bias.shape)}")
    return n, k


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               config: FP8Config | None = None) -> torch.Tensor:
    """x [..., K] float32/float16/bfloat16; weight float8_e4m3fn [N, K]; weight_scale / input_scale
    float32 one-element tensors; bias [N] or None. Returns y [..., N] in x's dtype.
    config: None = `choose_config(M, N, K)`; an `FP8Config` (e.g. from CANDIDATES) runs as given."""
    device = same_device(x, weight, weight_scale, input_scale, bias)
    n, k = _check(x, weight, weight_scale, input_scale, bias)
    out = out_buffer(out, (*x.shape[:-1], n), x.dtype, device, "fp8_linear")
    if out.numel() == 0:
        return out
    if k == 0:  # an empty sum: the bias alone
        return out.copy_(torch.zeros(n, device=device) if bias is None else bias.expand_as(out))
    flat = x.reshape(-1, k).contiguous()  # [M, K]
    m = flat.shape[0]
    cfg = choose_config(m, n, k) if config is None else resolve(config, n, k)
    steps = -(-k // cfg.block_k)
    seg_steps = -(-steps // cfg.split_k)  # K steps per segment
    splits = -(-steps // seg_steps)  # segments that hold a step (<= split_k)
    w, b = weight.contiguous(), None if bias is None else bias.contiguous()
    ws, xs = weight_scale.float().reshape(1).contiguous(), input_scale.float().reshape(1).contiguous()
    emulate = interpreted()
    if cfg.prequant:  # the codes once: [M, K] float8_e4m3fn
        codes = torch.empty((m, k), dtype=FP8, device=device)
        fp8_quantize_kernel[(-(-m * k // ELEMENTWISE_BLOCK),)](flat, codes, xs, m * k, BLOCK=ELEMENTWISE_BLOCK,
                                                               EMULATE=emulate)
        flat = codes
    part = torch.empty((splits, m, n), dtype=torch.float32, device=device) if splits > 1 else out
    grid = (-(-m // (GROUP_ROWS * cfg.row_groups)), -(-n // cfg.block_n), splits)
    fp8_linear_kernel[grid](
        flat, w, ws if b is None else b, out, part, xs, ws, m, n, k, seg_steps,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROW_GROUPS=cfg.row_groups, NUM_STAGES=cfg.num_stages,
        QUANT_X=not cfg.prequant, MMA_FP8=cfg.mma == "fp8", SPLIT=splits > 1, HAS_BIAS=b is not None,
        ALIGNED=_aligned(n, k, cfg.block_k, flat, w, b, out, part), EMULATE=emulate, num_warps=cfg.num_warps)
    if splits > 1:
        fp8_splitk_reduce_kernel[(-(-m * n // ELEMENTWISE_BLOCK),)](
            part, ws if b is None else b, out, xs, ws, m, n, SPLIT_K=splits, BLOCK=ELEMENTWISE_BLOCK,
            HAS_BIAS=b is not None)
    return out
