"""Helpers shared by the Triton kernel launchers: output buffers, dtype checks, block sizes.

Kept free of `triton.language` so the launch-side checks read the same with or without a GPU.
How to test: tests/ops/test_triton_kernels.py.
"""

from __future__ import annotations

import os

import torch

FP8 = getattr(torch, "float8_e4m3fn", None)
ACTIVATIONS = (torch.float32, torch.float16, torch.bfloat16)


def next_pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor) (Triton block shapes are powers of two)."""
    p = floor
    while p < n:
        p *= 2
    return p


def out_buffer(out: torch.Tensor | None, shape, dtype: torch.dtype, device: torch.device,
               what: str) -> torch.Tensor:
    """`out` checked against the expected contiguous layout, or a new empty tensor."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if (tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device != device
            or not out.is_contiguous()):
        raise ValueError(f"{what}: out must be a contiguous {dtype} tensor of shape {tuple(shape)} on {device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    return out


def check_dtype(t: torch.Tensor, what: str, allowed: tuple[torch.dtype, ...] = ACTIVATIONS) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{what}: dtype {t.dtype} is not one of {allowed}")


def same_device(*tensors: torch.Tensor | None) -> torch.device:
    """The one device of `tensors` (None entries skipped); ValueError when they differ."""
    present = [t for t in tensors if t is not None]
    device = present[0].device
    for t in present:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device (got {t.device} and {device})")
    return device


def interpreted() -> bool:
    """True when the kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
