"""FP8 (E4M3) linear in Triton: y = fp8(x / input_scale) @ weight^T * (input_scale * weight_scale) + bias,
reading the FP8 weight as FP8 (no bf16 copy): the small-M GEMM / GEMV of a decode or verify step.

Contract: `peagle_trt.models.fp8.fp8_linear_reference` (ModelOpt's per-tensor FP8: weight
float8_e4m3fn [N, K] = W / weight_scale, activations quantized with the static input_scale, both
scales float32 scalars). The scales are read from their tensors inside the kernel (a `.item()`
would synchronise the stream on every call).

One kernel, program (N tile, M tile): x [BLOCK_M, BLOCK_K] is quantized in registers (divide,
clamp to +-448, round to E4M3), the weight tile [BLOCK_N, BLOCK_K] is loaded as FP8, `tl.dot` multiplies
the two FP8 operands (Hopper / Blackwell FP8 tensor cores) into fp32; the scales, the bias and the
cast to x's dtype are fused into the store. BLOCK_M = 16 for every M (a row's bits never depend
on the other rows: one tile shape and one K order for all M up to the caller's limit); BLOCK_N is
chosen from N alone so that N / BLOCK_N programs fill the GPU at M = 1 (a GEMV is bound by reading
the weight, so it needs many programs in flight; no split-K, which would need atomics).
Under the interpreter (TRITON_INTERPRET=1) the activation is rounded to the E4M3 grid in fp32 by
`_round_to_e4m3` (the interpreter's own fp32 -> fp8 conversion drops a carry) and the dot runs in
fp32 on the exact FP8 values, which is the same product.
Which path a `FP8Linear` takes (this kernel, `torch._scaled_mm`, or the dequantized bf16 matmul)
is decided in peagle_trt/models/fp8.py. How to test: tests/ops/test_fp8_linear.py (interpreter;
on a GPU with PEAGLE_TRITON_DEVICE=cuda).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_trt.ops.triton_kernels.common import FP8, check_dtype, interpreted, out_buffer, same_device
from peagle_trt.ops.triton_kernels.kv_attention import _round_to_e4m3

BLOCK_M = 16  # the tl.dot minimum; rows past M are masked
BLOCK_K = 128
FP8_MAX = 448.0
TARGET_PROGRAMS = 264  # 2 per SM of an H100 / H200 at M = 1 (to be tuned: bench kernels)


@triton.jit
def fp8_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, in_scale_ptr, w_scale_ptr, M, N, K,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    m0 = tl.program_id(1) * BLOCK_M
    rows = m0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
    r_ok = rows < M
    c_ok = cols < N
    in_scale = tl.load(in_scale_ptr).to(tl.float32)
    w_scale = tl.load(w_scale_ptr).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x_mask = r_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + tl.where(x_mask, rows.to(tl.int64)[:, None] * K + ks[None, :], 0), mask=x_mask,
                    other=0.0).to(tl.float32)
        x = tl.minimum(tl.maximum(x / in_scale, -448.0), 448.0)  # [BLOCK_M, BLOCK_K], as ModelOpt clamps
        w_mask = c_ok[:, None] & k_ok[None, :]
        w = tl.load(w_ptr + tl.where(w_mask, cols.to(tl.int64)[:, None] * K + ks[None, :], 0), mask=w_mask,
                    other=0.0)  # [BLOCK_N, BLOCK_K] float8e4nv
        if EMULATE:
            acc += tl.dot(_round_to_e4m3(x), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x.to(tl.float8e4nv), tl.trans(w))
    y = acc * (in_scale * w_scale)
    if HAS_BIAS:
        y += tl.load(bias_ptr + tl.where(c_ok, cols, 0), mask=c_ok, other=0.0).to(tl.float32)[None, :]
    o_mask = r_ok[:, None] & c_ok[None, :]
    tl.store(out_ptr + tl.where(o_mask, rows.to(tl.int64)[:, None] * N + cols[None, :], 0),
             y.to(out_ptr.dtype.element_ty), mask=o_mask)


def block_n(n: int) -> int:
    """BLOCK_N for N output features: the widest of 128 / 64 / 32 / 16 that still gives
    TARGET_PROGRAMS programs at M = 1 (N alone decides: the same tiles for every M)."""
    for bn in (128, 64, 32):
        if -(-n // bn) >= TARGET_PROGRAMS:
            return bn
    return 16


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor,
               bias: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] float32/float16/bfloat16; weight float8_e4m3fn [N, K]; weight_scale / input_scale
    float32 one-element tensors; bias [N] or None. Returns y [..., N] in x's dtype."""
    device = same_device(x, weight, weight_scale, input_scale, bias)
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
    out = out_buffer(out, (*x.shape[:-1], n), x.dtype, device, "fp8_linear")
    flat = x.reshape(-1, k).contiguous()  # [M, K]
    m = flat.shape[0]
    if m == 0 or n == 0:
        return out
    bn = block_n(n)
    ws, xs = weight_scale.float().reshape(1).contiguous(), input_scale.float().reshape(1).contiguous()
    fp8_linear_kernel[(-(-n // bn), -(-m // BLOCK_M))](
        flat, weight.contiguous(), ws if bias is None else bias.contiguous(), out, xs, ws, m, n, k,
        BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=BLOCK_K, HAS_BIAS=bias is not None, EMULATE=interpreted())
    return out
