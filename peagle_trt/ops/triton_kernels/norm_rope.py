"""RMSNorm and rotary embedding (RoPE) in Triton: one launch each where torch launches 8 and ~10.

A decode step replayed from a CUDA graph has no host cost left; its time is the sum of its kernels, and
a layer's small elementwise ops (two RMSNorms of ~8 kernels each, q/k per-head norms, RoPE's slices,
negation, concatenation, products and sum for q and for k) are a few microseconds apiece at batch 1: on
a 32-layer model, over a thousand launches around the weight reads (docs/BENCHMARKS.md "gpu": a
graph-replayed batch-1 decode at 0.40 of the bandwidth floor). These two kernels replace them in the
torch executor when it runs on the kernels (`ops.kernels.routed()`); TensorRT fuses its own.

Contracts (the references, peagle_trt/models/layers.py):
  rms_norm(x [..., N], weight [N] | None, eps)   `layers.rms_norm`: in fp32, x * rsqrt(mean(x^2) + eps),
                                                 rounded to x's dtype, times the weight (one more rounding
                                                 to the product's dtype, as torch's bf16 product rounds);
  rope(x [B, S, heads, d], cos, sin [B, S, d])   `layers.rope`: rotate-half, x * cos + rotate(x) * sin,
                                                 each product and the sum rounded to x's dtype as
                                                 torch's ops round; returns [B, S, heads * d] contiguous.
rope is the reference to the bit (elementwise, no FMA contraction: `enable_fp_fusion=False`); rms_norm
to rounding (its sum runs in another order than torch's reduction). Programs: rms_norm one per row
(all of its N in one block); rope one per (row of B x S, block of heads).
How to test: tests/ops/test_norm_rope.py (interpreter; on a GPU with PEAGLE_TRITON_DEVICE=cuda).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_trt.ops.triton_kernels.common import check_dtype, interpreted, next_pow2, same_device


@triton.jit
def _round(x, dt: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 x rounded to dt (nearest, ties to even), as a GPU's conversion does. EMULATE: the
    interpreter's own fp32 -> bf16 conversion truncates, so bf16 is rounded on the bits first."""
    if EMULATE and dt == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # round the low 16 bits away, ties to even
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dt)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=ok, other=0.0).to(tl.float32)
    y = x * tl.math.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = _round(y, x_ptr.dtype.element_ty, EMULATE)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        y = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * N + cols, _round(y.to(tl.float32), out_ptr.dtype.element_ty, EMULATE), mask=ok)


@triton.jit
def rope_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, heads, x_row, x_head, HALF: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * S + s
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    j = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF] the first half's columns
    ok = (h < heads)[:, None] & (j < HALF)[None, :]
    base = x_ptr + row * x_row + h.to(tl.int64)[:, None] * x_head + j[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + row * 2 * HALF + j, mask=j < HALF, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + row * 2 * HALF + HALF + j, mask=j < HALF, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + row * 2 * HALF + j, mask=j < HALF, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + row * 2 * HALF + HALF + j, mask=j < HALF, other=0.0)[None, :]
    dt = x1.dtype
    # out[:half] = x1 * cos1 + (-x2) * sin1; out[half:] = x2 * cos2 + x1 * sin2; each op rounded to dt
    y1 = _round(_round(x1.to(tl.float32) * c1.to(tl.float32), dt, EMULATE).to(tl.float32)
                + _round(-x2.to(tl.float32) * s1.to(tl.float32), dt, EMULATE).to(tl.float32), dt, EMULATE)
    y2 = _round(_round(x2.to(tl.float32) * c2.to(tl.float32), dt, EMULATE).to(tl.float32)
                + _round(x1.to(tl.float32) * s2.to(tl.float32), dt, EMULATE).to(tl.float32), dt, EMULATE)
    out = out_ptr + row * heads * 2 * HALF + h.to(tl.int64)[:, None] * 2 * HALF + j[None, :]
    tl.store(out, y1, mask=ok)
    tl.store(out + HALF, y2, mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., N] float32/float16/bfloat16, weight [N] or None -> [..., N] in the dtype torch gives
    `weight * x` (x's when no weight)."""
    device = same_device(x, weight)
    check_dtype(x, "rms_norm x")
    n = x.shape[-1]
    if weight is not None and weight.shape != (n,):
        raise ValueError(f"rms_norm: weight must be [{n}], got {tuple(weight.shape)}")
    dtype = x.dtype if weight is None else torch.promote_types(weight.dtype, x.dtype)
    flat = x.reshape(-1, n).contiguous()
    out = torch.empty(flat.shape, dtype=dtype, device=device)
    if flat.numel():
        block = next_pow2(n, 16)
        rms_norm_kernel[(flat.shape[0],)](flat, flat if weight is None else weight.contiguous(), out, n, float(eps),
                                          BLOCK=block, HAS_WEIGHT=weight is not None, EMULATE=interpreted(),
                                          num_warps=8 if block >= 4096 else 4 if block >= 1024 else 1)
    return out.view(x.shape)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, d] (its last dim contiguous), cos / sin [B, S, d] of x's dtype -> [B, S, heads * d]."""
    device = same_device(x, cos, sin)
    check_dtype(x, "rope x")
    b, s, heads, d = x.shape
    if d % 2 or cos.shape != (b, s, d) or sin.shape != (b, s, d) or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"rope: x {tuple(x.shape)} {x.dtype} needs an even head size and cos / sin [{b}, {s}, {d}] "
                         f"of its dtype, got {tuple(cos.shape)} {cos.dtype} / {tuple(sin.shape)} {sin.dtype}")
    if x.stride(3) != 1 or x.stride(0) != s * x.stride(1):
        x = x.contiguous()
    out = torch.empty(b, s, heads * d, dtype=x.dtype, device=device)
    if out.numel():
        block_h = min(next_pow2(heads), 16)
        rope_kernel[(b * s, -(-heads // block_h))](x, cos.contiguous(), sin.contiguous(), out, heads, x.stride(1),
                                                   x.stride(2), HALF=d // 2, BLOCK_H=block_h,
                                                   BLOCK_HALF=next_pow2(d // 2, 16), EMULATE=interpreted(),
                                                   enable_fp_fusion=False)
    return out
