"""Rotary position embeddings: inverse frequencies for the RoPE types our checkpoints use.

`RopeConfig` (peagle_trt/architecture.py) reads both config spellings (transformers 5
`rope_parameters`, older `rope_theta` + `rope_scaling`). `inv_freq` returns the per-pair frequencies and the cos/sin
scale (YaRN's attention factor); `apply_rope` rotates q/k with the rotate-half convention.
Tests compare against transformers' own models, which must give identical logits.
"""

from __future__ import annotations

import math

import torch

from peagle_trt.architecture import ROPE_TYPES, RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """([head_dim // 2] float32 inverse frequencies, cos/sin scale) of `rope`."""
    base = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    return _INV_FREQ[rope.rope_type](rope, base, head_dim)


def _default(rope: RopeConfig, inv: torch.Tensor, dim: int) -> tuple[torch.Tensor, float]:
    return inv, 1.0


def _linear(rope: RopeConfig, inv: torch.Tensor, dim: int) -> tuple[torch.Tensor, float]:
    return inv / float(rope.params["factor"]), 1.0


def _llama3(rope: RopeConfig, inv: torch.Tensor, dim: int) -> tuple[torch.Tensor, float]:
    p = rope.params
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_ctx = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled), 1.0


def _yarn(rope: RopeConfig, inv: torch.Tensor, dim: int) -> tuple[torch.Tensor, float]:
    p = rope.params
    old_ctx = p.get("original_max_position_embeddings") or rope.max_position_embeddings
    factor = p.get("factor") or rope.max_position_embeddings / old_ctx

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = p.get("attention_factor")
    if attn is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    return inv / factor * (1 - extrapolate) + inv * extrapolate, float(attn)


def _proportional(rope: RopeConfig, inv: torch.Tensor, dim: int) -> tuple[torch.Tensor, float]:
    """Gemma-4 full layers: only the first partial_rotary_factor * dim / 2 pairs rotate (at the
    frequencies of the full head size); the other pairs get frequency 0 (cos 1, sin 0: unrotated)."""
    rotated = int(float(rope.params.get("partial_rotary_factor", 1.0)) * dim // 2)
    inv = torch.cat((inv[:rotated], torch.zeros(dim // 2 - rotated)))
    return inv / float(rope.params.get("factor", 1.0)), 1.0


_INV_FREQ = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn,
             "proportional": _proportional}


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for `positions` [...] -> two [..., head_dim] tensors."""
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, S, d] by cos/sin [B, S, d] (rotate-half convention)."""
    cos, sin = cos[:, None], sin[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin

assert set(_INV_FREQ) == set(ROPE_TYPES), "architecture.ROPE_TYPES lists the rope types computed here"
