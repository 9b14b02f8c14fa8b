"""KV-cache memory of a build (what `build` prints and `inspect` reports), for the paged cache.

The cache is `num_blocks` blocks of `block_size` positions for the full-attention target layers
and the drafter (KV group 0: a block holds those positions in every such layer), plus, per
sliding window, a group sized for `max_batch` requests holding their window
(peagle_trt/models/kv_cache.py). KV-shared layers (Gemma-4) read another layer's cache and hold none;
layers may differ in KV heads and head size. Every group also keeps one trash block. An element
takes the model dtype's `dtype_bytes`, or 1 byte when the layout's cache_dtype is "fp8" (E4M3 codes:
a quarter of float32, half of float16 / bfloat16).

    kv_memory(target_cfg, drafter_cfg, kv_layout, dtype_bytes=2) -> KVMemory
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from peagle_trt.config import KVLayout
from peagle_trt.models.target import kv_groups


@dataclass(frozen=True)
class KVMemory:
    block_size: int
    num_blocks: int
    target_bytes_per_block: int  # full-attention target layers, one block of each
    drafter_bytes_per_block: int
    window_bytes: int  # every windowed group, all its blocks
    full_layers: int
    windowed_layers: int
    shared_layers: int = 0  # layers reading another layer's cache (no memory of their own)
    cache_dtype: str = "auto"  # KVLayout.cache_dtype: the model's dtype, or fp8 (1 byte per element)
    element_bytes: int = 2  # bytes per cached K or V element

    @property
    def bytes_per_block(self) -> int:
        return self.target_bytes_per_block + self.drafter_bytes_per_block

    @property
    def bytes_per_position(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def total_bytes(self) -> int:
        return (self.num_blocks + 1) * self.bytes_per_block + self.window_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_per_block": self.bytes_per_block, "total_bytes": self.total_bytes}

    def describe(self) -> str:
        mib = 1 / 2 ** 20
        shared = f", {self.shared_layers} KV-shared" if self.shared_layers else ""
        windows = f"; windowed layers {self.window_bytes * mib:.2f} MiB ({self.windowed_layers})" \
            if self.windowed_layers else ""
        element = "FP8 E4M3" if self.cache_dtype == "fp8" else "model-dtype"
        return (f"KV cache: {self.num_blocks} blocks x {self.block_size} positions x "
                f"{self.bytes_per_block * mib:.3f} MiB ({self.full_layers} full target layers{shared}, drafter "
                f"{self.drafter_bytes_per_block * mib:.3f} MiB) = {self.num_blocks * self.block_size} positions"
                f"{windows}; total {self.total_bytes * mib:.2f} MiB ({self.element_bytes}-byte {element} elements)")


def _block_bytes(kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    return 2 * kv_heads * head_dim * block_size * dtype_bytes  # K and V


def kv_memory(target, drafter, kv: KVLayout, dtype_bytes: int = 2) -> KVMemory:
    """`target`: a TargetConfig; `drafter`: a DrafterConfig or None; dtype_bytes: the model dtype's
    (an FP8 cache, kv.cache_dtype "fp8", takes 1)."""
    dtype_bytes = 1 if kv.cache_dtype == "fp8" else dtype_bytes
    windows, groups = kv_groups(target)
    counts = kv.group_blocks(windows)
    owners = [i for i in range(target.num_layers) if target.attention(i).kv_source == i]
    per_block = {i: _block_bytes(target.attention(i).num_kv_heads, target.attention(i).head_dim, kv.block_size,
                                 dtype_bytes) for i in owners}
    full = [i for i in owners if groups[i] == 0]
    windowed = [i for i in owners if groups[i] != 0]
    drafter_bytes = 0 if drafter is None else \
        drafter.num_layers * _block_bytes(drafter.num_kv_heads, drafter.head_dim, kv.block_size, dtype_bytes)
    return KVMemory(kv.block_size, kv.num_blocks, sum(per_block[i] for i in full), drafter_bytes,
                    sum(per_block[i] * (counts[groups[i]] + 1) for i in windowed), len(full), len(windowed),
                    target.num_layers - len(owners), kv.cache_dtype, dtype_bytes)
