"""A contiguous KV cache: `num_slots` sequences x up to `max_len` positions per layer, written by position.

Per layer `k[layer]` / `v[layer]` have layout `[slots, kv_heads, T + 1, head_dim]` with T =
`layer_lens[layer]` (default `max_len`; a sliding-window layer may keep fewer positions: it is
then a ring indexed by position % T, see ops.reference.kv_attention). The extra last position
is a trash row that padding rows (position -1) write to, so a padded batch needs no special
write path. These are the views the PEagleKVAttention op reads and writes.

Layers may differ in KV heads and head size (`layer_shapes`), and a KV-shared layer holds no
cache of its own: `kv_sources[i] = j != i` makes `k[i]` / `v[i]` the very tensors of layer j.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 layer_lens: tuple[int, ...] | None = None,
                 layer_shapes: tuple[tuple[int, int], ...] | None = None,
                 kv_sources: tuple[int, ...] | None = None):
        lens = layer_lens or (max_len,) * num_layers
        shapes = layer_shapes or ((num_kv_heads, head_dim),) * num_layers
        sources = kv_sources or tuple(range(num_layers))
        self.k, self.v = [], []
        for i, (n, (kv_heads, d)) in enumerate(zip(lens, shapes)):
            if sources[i] != i:  # KV-shared: the owner's tensors (owners come first)
                self.k.append(self.k[sources[i]])
                self.v.append(self.v[sources[i]])
                continue
            self.k.append(torch.zeros((num_slots, kv_heads, n + 1, d), dtype=dtype, device=device))
            self.v.append(torch.zeros_like(self.k[-1]))
        self.layer_lens = tuple(lens)
        self.max_len = max_len
        self.num_slots = num_slots
