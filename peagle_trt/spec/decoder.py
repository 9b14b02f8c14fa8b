"""The speculate-verify loop over a batch of sequences, on any executor.

    prefill(seqs): target over each prompt -> first token; drafter over the prompt -> K drafts
    step(seqs):    verify [last, d_1..d_K] in one target forward -> accept a drafts + 1 token
                   -> draft the next K in one drafter forward (or K, in eagle3 mode)

With K = 0 (spec mode "none") the same step is plain decoding: one target row, one token.
Greedy output equals the target's own greedy output token for token; sampled output has the
target's distribution (spec/verify.py). Requests may join (prefill) and leave between steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.spec.drafting import ParallelDrafter, SequentialDrafter, pad_stack
from peagle_trt.spec.sampling import make_generator
from peagle_trt.spec.stats import SpecStats
from peagle_trt.spec.verify import verify


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    slot: int
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)  # generated ids (prompt excluded)
    pending: list[int] = field(default_factory=list)  # tokens not yet run through the drafter
    pending_aux: torch.Tensor | None = None  # [len(pending), 3 * H_t] target taps paired with them
    drafts: list[int] = field(default_factory=list)  # [K] proposals for positions cur+1..cur+K
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_computed: int = 0  # prompt tokens already run through the target (chunked prefill)
    # position of the token the next verify starts from: the last generated token once decoding
    # (sampled, not yet run through the target); during chunked prefill, the next prompt token
    cur: int = 0

    @property
    def prefilled(self) -> bool:
        return self.num_computed == len(self.prompt)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecoder:
    def __init__(self, executor, spec: SpecConfig, eos_ids: tuple[int, ...] = (), proposer=None):
        self.ex, self.spec, self.eos_ids = executor, spec, tuple(eos_ids)
        self.k = spec.k
        if proposer is None and self.k:
            proposer = ParallelDrafter(executor) if spec.mode == "peagle" else SequentialDrafter(executor)
        self.proposer = proposer
        # headroom: a verify writes K+1 positions past the last committed one
        self.max_seq_len = executor.max_len - (self.k + 1)

    def new_sequence(self, prompt: list[int], params: SamplingParams, slot: int) -> Sequence:
        if not prompt:
            raise ConfigError("the prompt is empty; send at least one token")
        if len(prompt) >= self.max_seq_len:
            raise ConfigError(f"the prompt has {len(prompt)} tokens but the maximum sequence length "
                              f"is {self.max_seq_len}; shorten it or raise the maximum")
        generator = None if params.greedy else make_generator(params.seed, self.ex.device)
        return Sequence(list(prompt), params, slot, generator, stats=SpecStats(self.k))

    def prefill(self, seqs: list[Sequence], chunk: int | None = None) -> None:
        """Run the next `chunk` prompt tokens (all when None) of each sequence through the target
        and the drafter. A sequence whose prompt completes samples its first token and drafts.

        Drafter rows pair token q+1 with target hidden q, so a chunk [a, b) feeds the drafter
        tokens prompt[a+1 .. b] (the next chunk's first token acts as the bonus, its drafts are
        discarded) and the last chunk feeds prompt[a+1 ..] + the sampled first token."""
        ex, dev = self.ex, self.ex.device
        ends = [len(s.prompt) if chunk is None else min(len(s.prompt), s.num_computed + chunk) for s in seqs]
        tokens = pad_stack([torch.tensor(s.prompt[s.num_computed:b], device=dev)
                            for s, b in zip(seqs, ends)], 0)  # [B, C_max]
        positions = pad_stack([torch.arange(s.num_computed, b, device=dev) for s, b in zip(seqs, ends)], -1)
        last = torch.tensor([[b - s.num_computed - 1] for s, b in zip(seqs, ends)], device=dev)  # [B, 1]
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        logits, aux = ex.target(tokens, positions, slots, last)  # [B, 1, V], [B, C_max, A]
        partial, done = [], []
        for i, (s, b) in enumerate(zip(seqs, ends)):
            s.stats.target_forwards += 1
            a, s.num_computed, s.cur = s.num_computed, b, b
            if b < len(s.prompt):
                s.pending, s.pending_aux = s.prompt[a + 1:b + 1], aux[i, :b - a]
                partial.append(s)
                continue
            first = verify([], logits[i], s.params, s.generator)  # one sampled token, no drafts
            s.pending, s.pending_aux = s.prompt[a + 1:] + first, aux[i, :b - a]
            self._commit(s, first)
            done.append(s)
        if partial and self.k:
            self.proposer.propose(partial, 1)  # fills the drafter KV cache; the draft is discarded
        self._draft([s for s in done if not s.finished])

    def step(self, seqs: list[Sequence]) -> None:
        """One speculate-verify iteration for every unfinished sequence of `seqs`."""
        seqs = [s for s in seqs if not s.finished]
        if not seqs:
            return
        ex, dev, k = self.ex, self.ex.device, self.k
        # 1. verify: rows [last generated, d_1..d_K] at positions cur..cur+K, one target forward
        tokens = torch.tensor([[s.output[-1]] + s.drafts for s in seqs], device=dev)  # [B, K+1]
        cur = torch.tensor([s.cur for s in seqs], device=dev)
        positions = cur[:, None] + torch.arange(k + 1, device=dev)  # [B, K+1]
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        logits, aux = ex.target(tokens, positions, slots)  # [B, K+1, V], [B, K+1, A]
        # 2. accept: a drafts + one correction/bonus token; emitted token j pairs with aux[j]
        for i, s in enumerate(seqs):
            s.stats.target_forwards += 1
            emitted = verify(s.drafts, logits[i], s.params, s.generator)
            if k:
                s.stats.record_step(k, len(emitted) - 1)
            s.pending, s.pending_aux = emitted, aux[i, :len(emitted)]
            self._commit(s, emitted)
        # 3. draft the next K for the sequences still running (target KV past cur is stale and
        #    is overwritten by the next verify: no rollback)
        self._draft([s for s in seqs if not s.finished])

    def _draft(self, seqs: list[Sequence]) -> None:
        if not self.k or not seqs:
            for s in seqs:
                s.drafts = []
            return
        for s, drafts in zip(seqs, self.proposer.propose(seqs, self.k)):
            s.drafts = drafts

    def _commit(self, s: Sequence, emitted: list[int]) -> None:
        """Append emitted tokens, stopping at an end id, max_tokens or the maximum length."""
        p = s.params
        for token in emitted:
            s.output.append(token)
            s.cur = len(s.prompt) + len(s.output) - 1
            s.stats.tokens += 1
            if not p.ignore_eos and (token in self.eos_ids or token in p.end_ids):
                s.finish_reason = "stop"
            elif len(s.output) >= p.max_tokens or s.cur + 1 >= self.max_seq_len:
                s.finish_reason = "length"
            if s.finished:
                return
