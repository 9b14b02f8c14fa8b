"""A contiguous KV cache: `num_slots` sequences x up to `max_len` positions per layer, written by position.

Per layer `k[layer]` / `v[layer]` have layout `[slots, kv_heads, T + 1, head_dim]` with T =
`layer_lens[layer]` (default `max_len`; a sliding-window layer may keep fewer positions: it is
then a ring indexed by position % T, see ops.reference.kv_attention). The extra last position
is a trash row that padding rows (position -1) write to, so a padded batch needs no special
write path. These are the views the PEagleKVAttention op reads and writes.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 layer_lens: tuple[int, ...] | None = None):
        lens = layer_lens or (max_len,) * num_layers
        self.k = [torch.zeros((num_slots, num_kv_heads, n + 1, head_dim), dtype=dtype, device=device)
                  for n in lens]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.layer_lens = tuple(lens)
        self.max_len = max_len
        self.num_slots = num_slots
