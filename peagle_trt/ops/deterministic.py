"""Deterministic (row- and batch-invariant) torch forwards: a row's result is a function of that
row's own inputs and of its own request's KV cache, never of how many rows, requests or drafts
share the forward, nor of the thread count.

Why it is needed: a CPU BLAS picks its kernel, its blocking and its thread split by the shape of
the GEMM. Measured with torch's MKL (2026-11-26, AMD EPYC): row 0 of a [M, 576] x [576, 576]
product is NOT bitwise the same for M = 1, M = 2..3 and M >= 4 (449 to 512 of 576 outputs differ
in the last bits), while within one fixed shape a row's result does not depend on its position in
the block nor on the other rows. A target-only decode step runs M = 1 per request, a verify step
M = K + 1, a batch M = sum of the rows; in FP8 the E4M3 activation rounding turns such a last-bit
difference into a different token at a near-tie (docs/EXPORT.md, "Cross-backend numerics").

What `rows()` changes, for the forwards run inside it (and only there; the default path is the
plain, faster one):

- every `F.linear` (nn.Linear, FP8Linear, MoE experts, lm_heads) runs on blocks of exactly
  `ROW_BLOCK` rows (the last block zero-padded), one GEMM call per block, bias added afterwards:
  the GEMM shape, hence the kernel and its summation order, is the same for every row of every call;
- attention (`ops.reference.kv_attention`, which asks `active()`) runs one query row at a time over
  exactly that row's visible keys: no padding to the batch's longest request, no causal block
  shared with other rows;
- torch runs on `THREADS` intra-op thread(s) (restored on exit): no reduction is split by the
  thread count. Norms, softmax and the other reductions are over the last axis of one row, whose
  order torch fixes by the axis length alone.

Guaranteed: on one machine (one CPU model, one torch / BLAS build), the same request gives the
same bits alone, in any batch, with any number of drafts, loaded or idle. NOT guaranteed: the same
bits across CPU models or BLAS builds (MKL's AVX-512 and AVX2 kernels sum in different orders).
Tested by tests/executors/test_deterministic.py.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

ROW_BLOCK = 8  # rows per GEMM call: a batch-1 decode pays 8 rows of compute (memory-bound anyway)
THREADS = 1  # intra-op threads inside rows(): one fixed split, whatever the machine has

_ACTIVE = contextvars.ContextVar("peagle_deterministic", default=False)


def active() -> bool:
    """True inside `rows()`."""
    return _ACTIVE.get()


def linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed on blocks of exactly ROW_BLOCK rows.

    x [..., in], weight [out, in] -> [..., out]. Each block is a fresh contiguous (aligned) buffer,
    so a row's bits depend on the row and the weight only."""
    flat = x.reshape(-1, x.shape[-1])  # [N, in]
    n = flat.shape[0]
    if n == 0:
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    padded = flat.new_zeros(-(-n // ROW_BLOCK) * ROW_BLOCK, flat.shape[1])  # [N', in], N' % ROW_BLOCK == 0
    padded[:n] = flat
    wt = weight.t()
    out = torch.cat([padded[i:i + ROW_BLOCK].matmul(wt) for i in range(0, padded.shape[0], ROW_BLOCK)])[:n]
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


class _Linears(TorchFunctionMode):
    """Routes F.linear to `linear_rows`; every other torch function runs unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return linear_rows(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def rows():
    """Run the torch forwards inside deterministically (see the module docstring)."""
    threads = torch.get_num_threads()
    token = _ACTIVE.set(True)
    if threads != THREADS:
        torch.set_num_threads(THREADS)
    try:
        with _Linears():
            yield
    finally:
        if threads != THREADS:
            torch.set_num_threads(threads)
        _ACTIVE.reset(token)
