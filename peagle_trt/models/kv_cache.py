"""A contiguous KV cache: `num_slots` sequences x `max_len` positions per layer, written by position.

Layout `[layers, slots, kv_heads, max_len + 1, head_dim]`; the extra last position is a trash
row that padding rows (position -1) write to, so a padded batch needs no special write path.
`k[layer]` / `v[layer]` are the per-layer views the PEagleKVAttention op reads and writes.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        shape = (num_layers, num_slots, num_kv_heads, max_len + 1, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.num_slots = num_slots

    @property
    def trash(self) -> int:
        return self.max_len
