"""Drafting: K draft tokens per sequence, from the drafter in ONE pass (P-EAGLE) or K passes (EAGLE-3).

Row layout of the parallel pass for one sequence (EAGLE shift: the row at RoPE position q pairs
the token at q+1 with the target hidden at q). After a verify at positions P..P+K that accepted
a drafts and emitted b, the pending tokens are [d_1..d_a, b] (n = a+1) and cur = P+a+1:

    row      0 .. n-2            n-1 ("NTP")       n .. n+K-2 ("MTP", K-1 mask rows)
    token    d_1 .. d_a          b                 mask_token_id
    hidden   fc(aux_P..)         fc(aux_{P+a})     h_mask = fc(mask_hidden)
    position P .. P+a-1          P+a = cur-1       cur .. cur+K-2
    drafts come from rows n-1 .. n+K-2  ->  tokens for positions cur+1 .. cur+K

Worked example (K=4, P=10, a=2): rows (d1,h10,@10) (d2,h11,@11) (b,h12,@12)* (M,hm,@13)*
(M,hm,@14)* (M,hm,@15)*; the starred rows give the 4 drafts for positions 14..17.
Every row writes its K/V at its own position, overwriting last step's speculative mask rows.
"""

from __future__ import annotations

import torch


def pad_stack(rows: list[torch.Tensor], pad: float | int) -> torch.Tensor:
    """Ragged [n_i, ...] tensors -> [B, max n_i, ...] padded with `pad`."""
    width = max(r.shape[0] for r in rows)
    out = rows[0].new_full((len(rows), width, *rows[0].shape[1:]), pad)
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
    return out


class ParallelDrafter:
    """P-EAGLE: all K drafts of every sequence from one drafter forward (`Executor.draft_parallel`)."""

    def __init__(self, executor):
        self.ex = executor

    def propose(self, seqs: list, k: int) -> list[list[int]]:
        ex, dev = self.ex, self.ex.device
        tokens = pad_stack([torch.tensor(s.pending, device=dev) for s in seqs], 0)  # [B, P]
        aux = pad_stack([s.pending_aux for s in seqs], 0.0)  # [B, P, 3 * H_t]
        num_pending = torch.tensor([len(s.pending) for s in seqs], device=dev)  # [B]
        cur = torch.tensor([s.cur for s in seqs], device=dev)  # [B]
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        drafts = ex.draft_parallel(tokens, aux, num_pending, cur, slots, k)  # [B, K]
        for s in seqs:
            s.stats.drafter_forwards += 1
        return drafts.tolist()


class SequentialDrafter:
    """EAGLE-3 baseline: the same head run K times, feeding back its own pre-norm output."""

    def __init__(self, executor):
        self.ex = executor

    def propose(self, seqs: list, k: int) -> list[list[int]]:
        ex, dev = self.ex, self.ex.device
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        last = torch.tensor([len(s.pending) - 1 for s in seqs], device=dev)  # NTP row per sequence
        tokens = pad_stack([torch.tensor(s.pending, device=dev) for s in seqs], 0)
        hidden = pad_stack([ex.project(s.pending_aux) for s in seqs], 0.0)
        positions = pad_stack([torch.arange(s.cur - len(s.pending), s.cur, device=dev) for s in seqs], -1)
        out = []
        for step in range(k):
            logits, prenorm = ex.drafter(tokens, hidden, positions, slots)  # [B, S, V_d], [B, S, H]
            idx = last if step == 0 else torch.zeros_like(last)
            rows = torch.arange(len(seqs), device=dev)
            draft = ex.to_target_ids(logits[rows, idx].argmax(dim=-1))  # [B]
            out.append(draft)
            # next pass: one row (previous draft, its pre-norm hidden) at the next position
            tokens, hidden = draft[:, None], prenorm[rows, idx][:, None]
            positions = torch.tensor([[s.cur + step] for s in seqs], device=dev)
        for s in seqs:
            s.stats.drafter_forwards += k
        return torch.stack(out, dim=1).tolist()  # [B, K]
