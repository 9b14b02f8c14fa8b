"""MXFP4 (OCP microscaling FP4) weights as the released GPT-OSS checkpoints store their experts.

`X_blocks` uint8 [..., rows, G, 16]: 32 FP4 (E2M1) codes per block, two per byte, the LOW nibble
first; `X_scales` uint8 [..., rows, G]: one E8M0 exponent per block of 32 (value 2^(s - 127)).
Dequantized: [..., rows, G * 32] with element = FP4_VALUES[code] * 2^(s - 127), exactly
representable in float32 (no rounding anywhere). transformers stores the result transposed, as
[..., G * 32, rows] (= [experts, in, out]); `dequantize` returns that layout.

Test: tests/models/test_families.py packs known values and checks the exact round trip.
"""

from __future__ import annotations

import torch

from peagle_trt.errors import CheckpointError

# E2M1 codes 0..15: sign bit 3, two exponent bits, one mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, what: str = "mxfp4 tensor") -> torch.Tensor:
    """blocks uint8 [..., R, G, 16], scales uint8 [..., R, G] -> float32 [..., G * 32, R]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"{what}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise CheckpointError(f"{what}: MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} "
                              "do not match (expected blocks [..., rows, G, 16], scales [..., rows, G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., R, G, 16, 2] low nibble first
    values = lut[codes].flatten(-2)  # [..., R, G, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(-1, -2).contiguous()  # [..., G*32, R]


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """values float [..., G * 32, R] -> (blocks, scales) as `dequantize` reads them. Each block of
    32 takes the exponent that puts its largest magnitude within FP4's +-6, and every value the
    nearest FP4 code (values already on that grid round-trip exactly). For make-tiny and tests."""
    rows = values.float().transpose(-1, -2)  # [..., R, G*32]
    *lead, r, n = rows.shape
    if n % 32:
        raise ValueError(f"MXFP4 packs blocks of 32 values; the input axis has {n}")
    blocks = rows.reshape(*lead, r, n // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2.0 ** -126)  # [..., R, G]
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exp)[..., None]
    lut = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs()[..., None] - lut).abs().argmin(-1)  # nearest magnitude, [..., R, G, 32]
    codes = (codes | ((scaled < 0).long() << 3)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exp + 127).to(torch.uint8).contiguous()
