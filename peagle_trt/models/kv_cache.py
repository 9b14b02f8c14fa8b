"""The paged KV cache of one model (target or drafter): fixed-size blocks, found through block tables.

Per layer `k[layer]` / `v[layer]` have layout `[blocks + 1, block_size, kv_heads, head_dim]`; the
last block is the trash block that padding rows write to (ops.reference.kv_attention). Layers are
grouped by attention window: group 0 holds the full-attention layers (every drafter layer is in
group 0), group g >= 1 the layers of one sliding window (`windows[g]`). A group's layers share
block tables and a block count; a windowed group needs only its window's worth of blocks per
request (peagle_trt/runtime/blocks.py returns the blocks that slid out). Layers may differ in KV heads and
head size (`layer_shapes`); a KV-shared layer holds no cache of its own: `kv_sources[i] = j != i`
makes `k[i]` / `v[i]` the very tensors of layer j (and puts it in j's group).

Block tables `[G, B, M]` int64 (G groups, B requests, M = ceil(max_len / block_size) entries;
-1 = no block) come from the runtime. Offline forwards (tests, training, benchmarks) may pass
sequence indices `[B]` instead: the static layout of `static(num_seqs, ...)`, where sequence i
owns blocks i*M .. i*M + M - 1 of every group (`tables()` turns them into block tables).

Blocks per group: `KVLayout.group_blocks(windows)` (peagle_trt/config.py, shared with the runtime).

Element type: the model's dtype, or FP8 codes (float8_e4m3fn) when the layout's `cache_dtype` is
"fp8" (`storage_dtype`); then `k_scale[layer]` / `v_scale[layer]` (floats) are the scales
kv_attention stores and reads them with (peagle_trt/ops/reference.py `kv_store` / `kv_load`): the
checkpoint's calibrated k_scale / v_scale where it has them, else 1.0 (`Attention.kv_scales`,
peagle_trt/models/layers.py). A KV-shared layer uses its owner's. Tested by tests/e2e/test_kv_fp8.py.
"""

from __future__ import annotations

import math

import torch

from peagle_trt.config import KVLayout
from peagle_trt.ops.reference import block_rows


def storage_dtype(layout: KVLayout | int, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of a cache laid out by `layout` for a model in `model_dtype`: float8_e4m3fn
    when its cache_dtype is "fp8", else the model's (a static layout, N sequences: the model's)."""
    fp8 = isinstance(layout, KVLayout) and layout.cache_dtype == "fp8"
    return torch.float8_e4m3fn if fp8 else model_dtype


class KVCache:
    def __init__(self, layer_shapes: tuple[tuple[int, int], ...], layer_groups: tuple[int, ...],
                 group_blocks: tuple[int, ...], block_size: int, max_len: int, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", kv_sources: tuple[int, ...] | None = None,
                 scales: tuple[tuple[float, float], ...] | None = None):
        # dtype: the elements' (the model's, or float8_e4m3fn); scales: per layer (k_scale, v_scale), None: 1.0
        sources = kv_sources or tuple(range(len(layer_shapes)))
        scales = scales or ((1.0, 1.0),) * len(layer_shapes)
        self.k, self.v, groups = [], [], []
        self.k_scale, self.v_scale = [], []  # per layer: the FP8 cache's scales (unused by other caches)
        for i, (kv_heads, d) in enumerate(layer_shapes):
            owner = sources[i]
            self.k_scale.append(float(scales[owner][0]))
            self.v_scale.append(float(scales[owner][1]))
            if owner != i:  # KV-shared: the owner's tensors, group and scales (owners come first)
                self.k.append(self.k[owner])
                self.v.append(self.v[owner])
                groups.append(groups[owner])
                continue
            n = group_blocks[layer_groups[i]]
            self.k.append(torch.zeros((n + 1, block_size, kv_heads, d), dtype=dtype, device=device))
            self.v.append(torch.zeros_like(self.k[-1]))
            groups.append(layer_groups[i])
        self.groups = tuple(groups)  # per layer: its group (index into the tables' first axis)
        self.group_blocks = tuple(group_blocks)
        self.block_size, self.max_len = block_size, max_len
        self.max_blocks = math.ceil(max_len / block_size)  # M: table entries per request
        self.device = device

    def tables(self, tables: torch.Tensor) -> torch.Tensor:
        """Block tables [G, B, M] as given, or those of the static layout for sequence indices [B]."""
        if tables.dim() == 3:
            return tables
        m = self.max_blocks
        entries = tables.to(torch.int64)[:, None] * m + torch.arange(m, device=tables.device)  # [B, M]
        return entries.expand(len(self.group_blocks), -1, -1)

    def move(self, tables: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V at positions src [B, R] to dst [B, R] (-1: nothing) in every layer (each
        through its group's table of `tables`): a draft tree's accepted path into place."""
        tables = self.tables(tables)
        owners = {id(k): i for i, k in enumerate(self.k)}.values()  # a KV-shared layer's tensors once
        move_rows([(self.k[i], self.v[i], tables[self.groups[i]]) for i in owners], src, dst)

    @classmethod
    def static_blocks(cls, num_seqs: int, max_len: int, block_size: int) -> int:
        """Blocks of a group in the static layout of `num_seqs` sequences of `max_len` positions."""
        return num_seqs * math.ceil(max_len / block_size)


def move_rows(layers: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    """For each (k_cache, v_cache, table [B, M]) of `layers` (paged, the last block the trash
    block): the rows at positions src [B, R] are copied to positions dst [B, R]; -1 pairs copy the
    trash block onto itself. All rows are read before any is written (overlapping moves are safe)."""
    for k_cache, v_cache, table in layers:
        trash, bs = k_cache.shape[0] - 1, k_cache.shape[1]
        s_block, s_off = block_rows(table, src, trash, bs)
        d_block, d_off = block_rows(table, dst, trash, bs)
        for cache in (k_cache, v_cache):
            cache[d_block, d_off] = cache[s_block, s_off]
