"""A contiguous KV cache: `num_slots` sequences x `max_len` positions per layer, written by position.

Layout `[layers, slots, kv_heads, max_len + 1, head_dim]`; the extra last position is a trash
row that padding rows (position -1) write to, so a padded batch needs no special write path.
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

    def write_and_read(self, layer: int, slots: torch.Tensor, positions: torch.Tensor,
                       k_new: torch.Tensor, v_new: torch.Tensor, length: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k/v_new [B, kv_heads, S, d] at `positions` [B, S] of `slots` [B]; return the
        first `length` positions of those slots, [B, kv_heads, length, d] each."""
        write_pos = torch.where(positions >= 0, positions, self.trash)  # [B, S]
        rows = slots[:, None]  # [B, 1] broadcast against [B, S]
        self.k[layer][rows, :, write_pos] = k_new.transpose(1, 2).to(self.k.dtype)
        self.v[layer][rows, :, write_pos] = v_new.transpose(1, 2).to(self.v.dtype)
        return self.k[layer, slots, :, :length], self.v[layer, slots, :, :length]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
