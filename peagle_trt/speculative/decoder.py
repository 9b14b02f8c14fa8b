"""The speculate-verify loop over a batch of sequences, on any executor.

    prefill(seqs): target over each prompt (chunk) -> first token; drafter over it -> K drafts
    step(seqs):    verify [last, d_1..d_K] in one target forward -> accept a drafts + 1 token
                   -> draft the next K in one drafter forward (or K, in eagle3 mode)

With K = 0 (spec mode "none") the same step is plain decoding: one target row, one token.
Greedy output equals the target's own greedy output token for token; sampled output has the
target's distribution (speculative/verify.py). Requests may join (prefill) and leave between steps.
The hot path keeps the batch in tensors: verification is one argmax/compare over [B, K+1] and the
drafter gets the verify outputs as they are (`DraftBatch`), with no per-sequence tensor work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.speculative.drafting import DraftBatch, ParallelDrafter, SequentialDrafter, ints, pad_stack
from peagle_trt.speculative.executor import Executor
from peagle_trt.speculative.sampling import make_generator
from peagle_trt.speculative.stats import SpecStats
from peagle_trt.speculative.verify import verify


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)  # generated ids (prompt excluded)
    drafts: list[int] = field(default_factory=list)  # [K] proposals for positions cur+1..cur+K
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_computed: int = 0  # tokens run through the target (KV final below it): chunked prefill, then = cur
    # position of the token the next verify starts from: the last generated token once decoding
    # (sampled, not yet run through the target); during chunked prefill, the next prompt token
    cur: int = 0
    stop_ids: frozenset = frozenset()  # EOS / end ids that finish this sequence
    # per KV group, the blocks holding positions j*bs .. j*bs + bs - 1 (-1: none); the runtime's
    blocks: list[list[int]] = field(default_factory=list)

    @property
    def prefill_len(self) -> int:
        """Tokens prefill runs through the target: the prompt, or after a preemption (the KV was
        given back) the prompt and every generated token but the last, which the next verify runs."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    def prefill_ids(self, a: int, b: int) -> list[int]:
        """Tokens at positions a .. b-1 of prompt + output."""
        n = len(self.prompt)
        return self.prompt[a:b] if b <= n else self.prompt[a:] + self.output[max(a - n, 0):b - n]

    @property
    def prefilled(self) -> bool:
        n = len(self.output)
        return self.num_computed == len(self.prompt) + (n - 1 if n else 0)  # == prefill_len (hot path)

    def preempt(self) -> None:
        """Forget the KV (its blocks went back to the pool): the next prefill recomputes it from
        the tokens; output, stats and the random stream go on untouched."""
        self.num_computed, self.blocks, self.drafts = 0, [], []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SpecDecoder:
    def __init__(self, executor: Executor, spec: SpecConfig, eos_ids: tuple[int, ...] = (), proposer=None):
        self.ex, self.spec, self.eos_ids = executor, spec, tuple(eos_ids)
        self.k = spec.k
        if proposer is None and self.k:
            proposer = ParallelDrafter(executor) if spec.mode == "peagle" else SequentialDrafter(executor)
        self.proposer = proposer
        # headroom: a verify writes K+1 positions past the last committed one
        self.max_seq_len = executor.kv.max_len - (self.k + 1)

    def new_sequence(self, prompt: list[int], params: SamplingParams) -> Sequence:
        if not prompt:
            raise ConfigError("the prompt is empty; send at least one token")
        if len(prompt) >= self.max_seq_len:
            raise ConfigError(f"the prompt has {len(prompt)} tokens but the maximum sequence length "
                              f"is {self.max_seq_len}; shorten it or raise the maximum "
                              "(--max-seq-len of generate or build)")
        generator = None if params.greedy else make_generator(params.seed, self.ex.device)
        stop_ids = frozenset() if params.ignore_eos else frozenset(self.eos_ids) | frozenset(params.end_ids)
        return Sequence(list(prompt), params, generator, stats=SpecStats(self.k), stop_ids=stop_ids)

    def tables(self, seqs: list[Sequence]) -> torch.Tensor:
        """Block tables [G, B, M] int64 of `seqs` (-1: no block)."""
        out = np.full((len(self.ex.windows), len(seqs), self.ex.kv.max_blocks), -1, dtype=np.int64)
        for b, s in enumerate(seqs):
            for g, blocks in enumerate(s.blocks):
                out[g, b, :len(blocks)] = blocks
        return torch.from_numpy(out).to(self.ex.device)

    def prefill(self, seqs: list[Sequence], chunk: int | None = None) -> None:
        """Run the next `chunk` prompt tokens (all when None) of each sequence through the target
        and the drafter. A sequence whose prompt completes samples its first token and drafts (a
        preempted one recomputing its KV drafts from the token it had: `Sequence.prefill_len`).

        Drafter rows pair token q+1 with target hidden q, so a chunk [a, b) feeds the drafter
        tokens prompt[a+1 .. b] (the next chunk's first token acts as the bonus, its drafts are
        discarded) and the last chunk feeds prompt[a+1 ..] + the sampled first token."""
        ex, dev = self.ex, self.ex.device
        starts = [s.num_computed for s in seqs]
        ends = [s.prefill_len if chunk is None else min(s.prefill_len, a + chunk) for s, a in zip(seqs, starts)]
        tokens = pad_stack([torch.tensor(s.prefill_ids(a, b), device=dev) for s, a, b in zip(seqs, starts, ends)], 0)
        positions = pad_stack([torch.arange(a, b, device=dev) for a, b in zip(starts, ends)], -1)  # [B, C]
        last = torch.tensor([[b - a - 1] for a, b in zip(starts, ends)], device=dev)  # [B, 1]
        tables = self.tables(seqs)  # [G, B, M]
        logits, aux = ex.target(tokens, positions, tables, last)  # [B, 1, V], [B, C, A]
        pending = []  # drafter tokens per sequence, paired row by row with aux
        for i, (s, a, b) in enumerate(zip(seqs, starts, ends)):
            s.stats.target_forwards += 1
            s.num_computed = s.cur = b
            if b < s.prefill_len or s.output:  # more to prefill, or resuming: the next token is known
                pending.append(s.prefill_ids(a + 1, b + 1))
                continue
            first = verify([], logits[i], s.params, s.generator)  # one sampled token, no drafts
            pending.append(s.prompt[a + 1:] + first)
            self._commit(s, first)
        if not self.k:
            return
        batch = DraftBatch.build(seqs, pending, aux, tables, dev)
        partial = [i for i, s in enumerate(seqs) if not s.prefilled]
        if partial:  # fills the drafter KV cache for the chunk; the draft is discarded
            self.proposer.propose(batch.select(partial), 1)
        self._draft(batch.select([i for i, s in enumerate(seqs) if s.prefilled and not s.finished]))

    def step(self, seqs: list[Sequence]) -> None:
        """One speculate-verify iteration for every unfinished sequence of `seqs`."""
        seqs = [s for s in seqs if not s.finished]
        if not seqs:
            return
        ex, dev, k = self.ex, self.ex.device, self.k
        # 1. verify: rows [last generated, d_1..d_K] at positions cur..cur+K, one target forward
        tokens = ints([[s.output[-1]] + s.drafts for s in seqs], dev)  # [B, K+1]
        cur = ints([s.cur for s in seqs], dev)  # [B]
        positions = cur[:, None] + torch.arange(k + 1, device=dev)  # [B, K+1]
        tables = self.tables(seqs)  # [G, B, M]
        logits, aux = ex.target(tokens, positions, tables)  # [B, K+1, V], [B, K+1, A]
        # 2. accept a drafts + one correction/bonus token (greedy: all rows at once)
        target_ids = logits.argmax(dim=-1)  # [B, K+1]
        accepted = (tokens[:, 1:] == target_ids[:, :k]).cumprod(dim=1).sum(dim=1)  # [B]
        emitted = [row[:a + 1] for row, a in zip(target_ids.tolist(), accepted.tolist())]
        for i, s in enumerate(seqs):
            if not s.params.greedy:  # lossless rejection sampling, per sequence
                emitted[i] = verify(s.drafts, logits[i], s.params, s.generator)
            s.stats.target_forwards += 1
            if k:
                s.stats.record_step(k, len(emitted[i]) - 1)
            self._commit(s, emitted[i])
        # 3. draft the next K from the emitted tokens, paired row by row with the verify's taps
        #    (emitted token j pairs with aux[j]); target KV past cur is stale and is overwritten
        #    by the next verify: no rollback
        if k:
            num = ints([len(e) for e in emitted], dev)  # [B] pending rows = emitted tokens
            batch = DraftBatch(seqs, ints([e + [0] * (k + 1 - len(e)) for e in emitted], dev), aux, num,
                               cur + num, tables)
            self._draft(batch.select([i for i, s in enumerate(seqs) if s.finish_reason is None]))

    def _draft(self, batch: DraftBatch) -> None:
        if not batch.seqs:
            return
        for s, drafts in zip(batch.seqs, self.proposer.propose(batch, self.k).tolist()):
            s.drafts = drafts

    def _commit(self, s: Sequence, emitted: list[int]) -> None:
        """Append emitted tokens, stopping at an end id, max_tokens or the maximum length."""
        room = min(s.params.max_tokens - len(s.output), self.max_seq_len - len(s.prompt) - len(s.output))
        stop_at = next((j for j, t in enumerate(emitted) if t in s.stop_ids), None) if s.stop_ids else None
        if stop_at is not None and stop_at < room:
            emitted, s.finish_reason = emitted[:stop_at + 1], "stop"
        elif len(emitted) >= room:
            emitted, s.finish_reason = emitted[:room], "length"
        s.output += emitted
        s.stats.tokens += len(emitted)
        s.cur = s.num_computed = len(s.prompt) + len(s.output) - 1
