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

from dataclasses import dataclass

import numpy as np
import torch

from peagle_trt.ops.reference import key_span


def upload(parts: list, device) -> list[torch.Tensor]:
    """Host ints -> int64 tensors of the same shapes on `device`, in ONE host-to-device copy that
    does not block the host. `parts`: rectangular nested lists or numpy arrays. On CPU the tensors
    are the parts' numpy arrays (no copy at all: the block tables are large); elsewhere `packed`.
    tests/speculative/test_host_reads.py counts one upload per call of this function."""
    arrays = [np.asarray(p, dtype=np.int64) for p in parts]
    device = torch.device(device)
    if device.type == "cpu":
        return [torch.from_numpy(a) for a in arrays]
    return views(packed(arrays, pin=device.type == "cuda").to(device, non_blocking=True), arrays)


def packed(arrays: list[np.ndarray], pin: bool) -> torch.Tensor:
    """The arrays one after another in one flat host buffer [sum of sizes]: for parts [B, 3] and
    [G, B, M], [B*3 | G*B*M]. Pinned (`pin`), a CUDA copy from it is asynchronous (a pageable one
    waits for the stream). A fresh pinned buffer per call is safe: torch's caching host allocator
    records the copy's stream on the block and does not hand it out again before the copy has run."""
    host = torch.empty(sum(a.size for a in arrays), dtype=torch.int64, pin_memory=pin)
    np.concatenate([a.ravel() for a in arrays], out=host.numpy())
    return host


def views(flat: torch.Tensor, arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """`flat` [sum of sizes] (a `packed` buffer or its copy) -> one contiguous view per array, its shape."""
    return [v.view(a.shape) for v, a in zip(flat.split([a.size for a in arrays]), arrays)]


def pad_rows(rows: list, width: int, pad: int = 0) -> list[list[int]]:
    """Ragged host rows -> rectangular [B, width] lists, padded with `pad`."""
    return [list(r) + [pad] * (width - len(r)) for r in rows]


def pad_stack(rows: list[torch.Tensor], pad: float | int) -> torch.Tensor:
    """Ragged [n_i, ...] tensors -> [B, max n_i, ...] padded with `pad`."""
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad)


@dataclass
class DraftBatch:
    """The pending rows of B sequences for one drafting pass, padded (row j of `tokens` pairs
    with row j of `aux`; rows past num_pending are padding)."""
    seqs: list
    tokens: torch.Tensor  # [B, P] pending ids: accepted drafts + bonus (or a prompt chunk)
    aux: torch.Tensor  # [B, P, 3 * H_t] the target taps paired with them
    num_pending: torch.Tensor  # [B]
    cur: torch.Tensor  # [B] pending rows sit at positions cur-n .. cur-1
    tables: torch.Tensor  # [G, B, M] block tables
    top_cur: int | None = None  # max(cur) as the host knows it (None: unknown, read from the device)

    @classmethod
    def build(cls, seqs: list, pending: list[list[int]], aux: torch.Tensor, tables: torch.Tensor,
              device) -> DraftBatch:
        tokens, num, cur = upload([pad_rows(pending, aux.shape[1]), [len(p) for p in pending], [s.cur for s in seqs]],
                                  device)  # [B, P], [B], [B]
        return cls(seqs, tokens, aux, num, cur, tables, max((s.cur for s in seqs), default=None))

    def select(self, rows: list[int]) -> DraftBatch:
        if len(rows) == len(self.seqs):
            return self
        idx, = upload([rows], self.tokens.device)
        seqs = [self.seqs[i] for i in rows]  # top_cur: a batch built from its sequences' cur keeps it
        top = None if self.top_cur is None else max((s.cur for s in seqs), default=None)
        return DraftBatch(seqs, self.tokens[idx], self.aux[idx], self.num_pending[idx], self.cur[idx],
                          self.tables[:, idx], top)


def span(b: DraftBatch, extra: int) -> int | None:
    """Keys a drafter pass reads: max(b.cur) + extra from the host (ops.reference.key_span; the
    decoder's batches know their cur), None (read on the device) for a batch that does not."""
    return None if b.top_cur is None else b.top_cur + extra


class ParallelDrafter:
    """P-EAGLE: all K drafts of every sequence from one drafter forward (`Executor.draft_parallel`)."""

    def __init__(self, executor):
        self.ex = executor

    def propose(self, b: DraftBatch, k: int) -> torch.Tensor:
        with key_span(span(b, k - 1)):  # rows at cur - n .. cur + k - 2
            drafts = self.ex.draft_parallel(b.tokens, b.aux, b.num_pending, b.cur, b.tables, k)  # [B, K]
        for s in b.seqs:
            s.stats.drafter_forwards += 1
        return drafts

    def propose_top(self, b: DraftBatch, k: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each of the k positions' top `width` candidates: target ids, log-probs [B, K, W] (a tree's)."""
        with key_span(span(b, k - 1)):
            top = self.ex.draft_parallel_top(b.tokens, b.aux, b.num_pending, b.cur, b.tables, k, width)
        for s in b.seqs:
            s.stats.drafter_forwards += 1
        return top


class SequentialDrafter:
    """EAGLE-3 baseline: the same head run K times, feeding back its own output
    (pre-norm, or post-norm for norm_output heads: `DrafterModel.feedback`)."""

    def __init__(self, executor):
        self.ex = executor

    def propose(self, b: DraftBatch, k: int) -> torch.Tensor:
        return self._run(b, k, 0)[0]

    def propose_top(self, b: DraftBatch, k: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each step's top `width` candidates (target ids, log-probs [B, K, W]); the chain of argmaxes
        is what the steps feed back, so depth j's candidates follow the top-1 path."""
        return self._run(b, k, width)[1:]

    def _run(self, b: DraftBatch, k: int, width: int):
        ex, dev = self.ex, self.ex.device
        j = torch.arange(b.tokens.shape[1], device=dev)[None]
        n = b.num_pending[:, None]
        tokens, hidden = b.tokens, ex.project(b.aux)  # [B, P], [B, P, H]
        positions = torch.where(j < n, b.cur[:, None] - n + j, torch.full_like(j, -1))  # [B, P]
        last = b.num_pending - 1  # the NTP row of each sequence
        rows = torch.arange(len(b.seqs), device=dev)
        out, top_ids, top_logp = [], [], []
        for step in range(k):  # pass 0: rows up to cur - 1; pass i: one row at cur + i - 1
            with key_span(span(b, step)):
                logits, fed_back = ex.drafter(tokens, hidden, positions, b.tables)  # [B, S, V_d], [B, S, H]
            idx = last if step == 0 else torch.zeros_like(last)
            draft = ex.to_target_ids(logits[rows, idx].argmax(dim=-1))  # [B]
            out.append(draft)
            if width:
                logp, top = torch.log_softmax(logits[rows, idx].float(), -1).topk(min(width, logits.shape[-1]), -1)
                top_ids.append(ex.to_target_ids(top))  # [B, W]
                top_logp.append(logp)
            # next pass: one row (previous draft, its pre-norm hidden) at the next position
            tokens, hidden = draft[:, None], fed_back[rows, idx][:, None]
            positions = (b.cur + step)[:, None]
        for s in b.seqs:
            s.stats.drafter_forwards += k
        if not width:
            return torch.stack(out, dim=1), None, None  # [B, K]
        return None, torch.stack(top_ids, dim=1), torch.stack(top_logp, dim=1)  # [B, K, W] each
