"""COD sampling, the (anchor, depth) attention mask and sequence partitioning (the P-EAGLE
paper's training recipe).

A training sequence of N drafter positions becomes a flat list of elements (anchor a, depth d):
depth 0 at every position (the real row: token x_{a+1}, target taps g_a), and for d >= 1 a
sampled subset of chains (mask token + mask_hidden for P-EAGLE; the previous depth's output for
EAGLE-3) at reference position p = a + d. Depth d is drawn only from chains present at depth
d-1 (Conditional-On-Distribution), so every chain (a, 0..d) is contiguous.

Mask: element q sees element k iff (depth_k == 0 and anchor_k <= anchor_q) or
(anchor_k == anchor_q and depth_k <= depth_q): the real prefix up to its anchor plus its own
chain, exactly what a drafting pass sees at inference.

Partitioning splits positions into S buckets; a depth-0 element belongs to bucket(anchor), a
deeper one to bucket(anchor + 1), so a chain is never split. Segment s runs its own elements plus
every depth-0 element of an earlier bucket as context (recomputed, not charged loss); the sum of
the segment losses, each divided by the whole sequence's supervised count, is the flat loss.

Tests: tests/train/test_train_cod.py (chains, mask against the formula, partition coverage).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Elements:
    """The flat multi-depth sequence: one entry per element, depth-0 elements first (in position
    order), then the deeper ones ordered by depth."""
    anchor: torch.Tensor  # [M] int64
    depth: torch.Tensor  # [M] int64

    @property
    def position(self) -> torch.Tensor:
        return self.anchor + self.depth  # [M] reference (RoPE) position

    def __len__(self) -> int:
        return int(self.anchor.numel())

    def select(self, idx: torch.Tensor) -> Elements:
        return Elements(self.anchor[idx], self.depth[idx])

    def to(self, device) -> Elements:
        return Elements(self.anchor.to(device), self.depth.to(device))


def cod_sample(loss_mask: torch.Tensor, depths: int, ratio: float, ratio_min: float,
               generator: torch.Generator) -> Elements:
    """loss_mask [N] bool -> elements: all N positions at depth 0, then for d = 1..depths-1
    int(max(0, n_valid - d) * max(ratio**d, ratio_min)) chains extended by one depth."""
    n = loss_mask.numel()
    valid = loss_mask.bool()
    anchors, levels = [torch.arange(n)], [torch.zeros(n, dtype=torch.long)]
    n_valid = int(valid.sum())
    pool = torch.nonzero(valid).flatten()  # candidate reference positions for the next depth
    for d in range(1, depths):
        pool = pool[pool >= d]  # the anchor p - d must exist
        count = min(int(max(0, n_valid - d) * max(ratio ** d, ratio_min)), len(pool))
        if count <= 0:
            break
        pick = pool[torch.randperm(len(pool), generator=generator)[:count]].sort().values
        anchors.append(pick - d)
        levels.append(torch.full_like(pick, d))
        nxt = pick + 1
        pool = nxt[(nxt < n)]
        pool = pool[valid[pool]]
    return Elements(torch.cat(anchors), torch.cat(levels))


def mask_formula(q: Elements, k: Elements) -> torch.Tensor:
    """The spec's mask_mod, dense: [len(q), len(k)] bool (reference for tests and small inputs)."""
    qa, qd = q.anchor[:, None], q.depth[:, None]
    ka, kd = k.anchor[None], k.depth[None]
    return ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))


def partition(el: Elements, num_positions: int, segments: int) -> list[torch.Tensor]:
    """Indices of the elements each of `segments` segments owns (together: every element once)."""
    bounds = torch.tensor([s * num_positions // segments for s in range(1, segments)], dtype=torch.long)
    key = torch.where(el.depth == 0, el.anchor, el.anchor + 1)
    bucket = torch.bucketize(key, bounds, right=True)  # [M]
    return [torch.nonzero(bucket == s).flatten() for s in range(segments)]


def segment_rows(el: Elements, owned: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of one segment: depth-0 context (all positions up to the segment's last depth-0 or
    chain anchor) followed by the owned deeper elements. Returns (row indices into `el` [R],
    charged [R] bool: True for the owned elements)."""
    own = torch.zeros(len(el), dtype=torch.bool, device=el.anchor.device)
    own[owned] = True
    depth0 = el.depth == 0
    last = int(el.anchor[owned].max()) if owned.numel() else -1
    context = torch.nonzero(depth0 & (el.anchor <= last)).flatten()  # sorted by position
    deep = owned[el.depth[owned] > 0]
    rows = torch.cat([context, deep])
    return rows, own[rows]
