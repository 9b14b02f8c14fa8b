"""The speculate-verify loop over a batch of sequences, on any executor.

    prefill(seqs): target over each prompt (chunk) -> first token; drafter over it -> k drafts
    step(seqs):    verify [last, d_1..d_n] in one target forward -> accept a drafts + 1 token
                   -> draft the next k in one drafter forward (or k, in eagle3 mode)

The drafts of a sequence form a tree (speculative/tree.py: `Sequence.parents`; empty: a chain of
k, the default): with a tree budget, the best prefixes of the drafter's per-position candidates
(the budget per drafting call: tree_budget.py, fixed, by batch size, or adaptive).
Every verify runs the tree path: rows by depth with an ancestor mask; a chain is the tree with
one child per node (its accepted rows are already in place, nothing moves).

k <= K is chosen per drafting call (draft_length.py: fixed, by batch size, or adaptive); rows of
sequences with fewer drafts are padding (position -1). With k = 0 the step is plain decoding: one
target row, one token; the drafter then gets that step's rows later (`Sequence.undrafted`).
Greedy output equals the target's own greedy output token for token; sampled output has the
target's distribution (speculative/verify.py). Requests may join (prefill) and leave between steps.
A constrained request (structured output) carries a grammar matcher (speculative/grammar.py): it
drafts a chain of the drafter's best candidates the grammar allows (`draft_candidates` per depth),
and each verify row its walk reads is under the grammar after its committed tokens plus the drafts
before the row (greedy: the row's argmax when allowed, else the masked row's).
The hot path keeps the batch in tensors: verification is one argmax/compare over [B, K+1] and the
drafter gets the verify outputs as they are (`DraftBatch`), with no per-sequence tensor work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.ops.reference import pack_tree_mask
from peagle_trt.speculative.draft_length import DraftLengths
from peagle_trt.speculative.drafting import DraftBatch, ParallelDrafter, SequentialDrafter, ints, pad_stack
from peagle_trt.speculative.executor import Executor
from peagle_trt.speculative.grammar import GrammarState, first_token_mask
from peagle_trt.speculative.sampling import make_generator, probabilities, sample
from peagle_trt.speculative.stats import SpecStats
from peagle_trt.speculative.tree import best_tree, chain, depths, static_nodes, tokens_of, walk
from peagle_trt.speculative.tree_budget import TreeBudgets
from peagle_trt.speculative.verify import verify


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)  # generated ids (prompt excluded)
    drafts: list[int] = field(default_factory=list)  # [n] proposed tokens: a chain for cur+1..cur+n, or tree nodes
    parents: tuple = ()  # per draft its parent draft (-1: the last generated token); () a chain
    stats: SpecStats = field(default_factory=SpecStats)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_computed: int = 0  # tokens run through the target (KV final below it): chunked prefill, then = cur
    # position of the token the next verify starts from: the last generated token once decoding
    # (sampled, not yet run through the target); during chunked prefill, the next prompt token
    cur: int = 0
    stop_ids: frozenset = frozenset()  # EOS / end ids that finish this sequence
    # per KV group, the blocks holding positions j*bs .. j*bs + bs - 1 (-1: none); the runtime's
    blocks: list[list[int]] = field(default_factory=list)
    # rows the drafter has not seen after k = 0 steps: (tokens, their target taps as [n_i, A]
    # chunks); replaced, never mutated
    undrafted: tuple = ()
    grammar: GrammarState | None = None  # structured output: the matcher at `output`

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
        self.num_computed, self.blocks, self.drafts, self.parents, self.undrafted = 0, [], [], (), ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim. On CPU through numpy: single-threaded, so it never waits on torch's
    OpenMP threads while onnxruntime's spin (measured: 11 ms per verify on 2 cores, vs 0.03 alone)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


class SpecDecoder:
    # a constrained request's drafts: per depth, the first of the drafter's top candidates the
    # grammar allows (1: the drafter's own top-1 chain, cut at the first draft the grammar refuses)
    draft_candidates: int = 256

    def __init__(self, executor: Executor, spec: SpecConfig, eos_ids: tuple[int, ...] = (), proposer=None):
        self.ex, self.spec, self.eos_ids = executor, spec, tuple(eos_ids)
        self.k = spec.k
        if proposer is None and self.k:
            proposer = ParallelDrafter(executor) if spec.mode == "peagle" else SequentialDrafter(executor)
        self.proposer = proposer
        self.lengths = DraftLengths(spec)
        self.budgets = TreeBudgets(spec, self.lengths.verify_cost, self.lengths.draft_cost)
        self.adaptive = spec.adaptive or spec.adaptive_tree  # a rule reads the steps' costs
        self._time_verify = self.adaptive  # the next verify's time feeds the adaptive rule (only it reads it)
        self.batch = 1  # running requests (the scheduler sets it each step): the K schedule's key
        self.synthetic = torch.Generator().manual_seed(0) if spec.synthetic_rates else None
        # headroom: a verify writes up to span + 1 positions from the last committed one
        self.max_seq_len = executor.kv.max_len - (self.span + 1)
        if spec.tree and len(executor.windows) > 1:
            raise ConfigError("draft trees need a full-attention target for now (this one has sliding-window "
                              f"layers, windows {list(executor.windows[1:])}); use a chain (no tree keys)")

    @property
    def span(self) -> int:
        """The most draft rows one verify writes past the root: K, or a draft tree's most nodes."""
        return max(self.k, self.spec.max_nodes)

    def new_sequence(self, prompt: list[int], params: SamplingParams, compiled=None) -> Sequence:
        """`compiled`: the request's compiled grammar (speculative/grammar.py Grammars), None when free."""
        if not prompt:
            raise ConfigError("the prompt is empty; send at least one token")
        if len(prompt) >= self.max_seq_len:
            raise ConfigError(f"the prompt has {len(prompt)} tokens but the maximum sequence length "
                              f"is {self.max_seq_len}; shorten it or raise the maximum "
                              "(--max-seq-len of generate or build)")
        generator = None if params.greedy else make_generator(params.seed, self.ex.device)
        stop_ids = frozenset() if params.ignore_eos else frozenset(self.eos_ids) | frozenset(params.end_ids)
        state = None if compiled is None else GrammarState(compiled, stop_ids)
        return Sequence(list(prompt), params, generator, stats=SpecStats(self.k), stop_ids=stop_ids, grammar=state)

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
            if s.grammar is not None:
                first_token_mask(s, logits[i])
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
        t0 = time.perf_counter()  # the verify's cost for the adaptive rule: this step up to its drafting
        ex, dev = self.ex, self.ex.device
        trees = [s.parents[:len(s.drafts)] or chain(len(s.drafts)) for s in seqs]  # parents of each node
        levels = [depths(t) for t in trees]  # depth (1 ..) of each node
        ns = [len(t) for t in trees]
        n = max(ns)
        # 1. verify: row 0 the last generated token at position cur, row 1 + j draft j at cur + its
        #    depth (its KV at slot cur + 1 + j), one target forward; each row sees its ancestors
        tokens = ints([[s.output[-1]] + s.drafts + [0] * (n - len(s.drafts)) for s in seqs], dev)  # [B, n+1]
        cur = ints([s.cur for s in seqs], dev)  # [B]
        depth = ints([[0] + d + [-1] * (n - len(d)) for d in levels], dev)  # [B, n+1], -1: padding
        positions = torch.where(depth >= 0, cur[:, None] + depth, -1)  # [B, n+1]
        mask = None if not any(s.parents for s in seqs) else torch.from_numpy(  # chains: causal by position
            pack_tree_mask(trees, n + 1)).to(dev)  # [B, n+1, ceil((n+1)/32)] ancestor bits
        tables = self.tables(seqs)  # [G, B, M]
        logits, aux = ex.target(tokens, positions, tables, tree_mask=mask)  # [B, n+1, V], [B, n+1, A]
        # 2. accept: from the root, the target's token at each row (argmax, or a sample of its
        #    distribution; a constrained request's under its grammar), then to the child holding it;
        #    the first token without one ends the step
        target_ids = argmax(logits).tolist()  # [B, n+1]
        self.lengths.steps_at_k[n] += 1
        self.budgets.steps_at_budget[n if mask is not None else 0] += 1
        emitted, rows = [], []  # per sequence: its tokens, the verify rows they pair with (root + path)
        taken = []  # (k, nodes, accepted path) of the requests that drafted the rule's tree or chain
        for i, s in enumerate(seqs):
            token_at = self._row_token(s, logits[i], target_ids[i])  # row -> the target's token there
            if self.synthetic is not None and ns[i]:  # benchmarks (chains): accept by the configured rates
                path = list(range(self._synthetic_accepts(ns[i])))
                if s.grammar is not None:  # its matcher walks the accepted drafts to the row after them
                    s.grammar.take(s.drafts[:len(path)])
                e = [s.drafts[j] for j in path] + [token_at(len(path))]
            else:  # greedy, or exactly the target's distribution: one sample per emitted token
                path, e = walk(s.drafts, trees[i], token_at)
            s.stats.target_forwards += 1
            if ns[i]:  # the tree's size and depth (a chain: both k)
                s.stats.record_step(ns[i], len(e) - 1, max(levels[i]))
                self.lengths.record(s.stats, max(levels[i]), len(e) - 1)
                if self.spec.adaptive_tree and s.grammar is None and self.synthetic is None:
                    taken.append((max(levels[i]), ns[i], path))
            self._commit(s, e)
            emitted.append(e)
            rows.append([0] + [j + 1 for j in path])
        if self._time_verify:
            self.lengths.verify_cost.record(len(seqs), n, time.perf_counter() - t0)
        self._time_verify = self.adaptive
        if self.spec.adaptive_tree:
            self.budgets.record(taken)
        # 3. off a chain, the accepted rows' target KV moves to slots cur + 1 .. (where the next
        #    verify reads it) and their taps to rows 1 ..; other rows are stale, overwritten later
        moved = [i for i, r in enumerate(rows) if r[-1] != len(r) - 1 and not seqs[i].finished]
        if moved:
            path_rows = ints([rows[i] + [-1] * (n + 1 - len(rows[i])) for i in moved], dev)  # [b, n+1]
            at = cur[moved][:, None]  # [b, 1] the verify's root slot
            src = torch.where(path_rows >= 0, at + path_rows, -1)
            dst = torch.where(path_rows >= 0, at + torch.arange(n + 1, device=dev), -1)
            ex.move_kv(tables[:, moved], src, dst)
            index = ints([r + [0] * (n + 1 - len(r)) for r in rows], dev)  # [B, n+1]
            aux = torch.gather(aux, 1, index[..., None].expand(-1, -1, aux.shape[-1]))
        # 4. draft the next k from the emitted tokens, paired row by row with the verify's taps
        #    (emitted token j pairs with aux[j]); target KV past cur is stale and is overwritten
        #    by the next verify: no rollback
        if self.k:
            live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
            self._draft_after_verify([seqs[i] for i in live], [emitted[i] for i in live], aux[live] if
                                     len(live) < len(seqs) else aux, cur[live] if len(live) < len(seqs) else cur,
                                     tables[:, live] if len(live) < len(seqs) else tables)

    @staticmethod
    def _row_token(s: Sequence, logits: torch.Tensor, argmax_ids: list[int]):
        """row -> the target's token at verify row `row` of `s` (logits [n+1, V], their argmaxes): the
        argmax (greedy) or a sample of the row's distribution; for a constrained request under its
        grammar after the rows before (GrammarState.pick: called in the walk's order)."""
        def of(row: torch.Tensor) -> int:  # a row [1, V]: its argmax, or a sample of its distribution
            return int(argmax(row)[0]) if s.params.greedy else int(sample(probabilities(row, s.params), s.generator))

        if s.grammar is not None:
            return lambda r: s.grammar.pick(logits[r:r + 1], argmax_ids[r] if s.params.greedy else None, of)
        return argmax_ids.__getitem__ if s.params.greedy else lambda r: of(logits[r:r + 1])

    def _draft_after_verify(self, seqs: list[Sequence], emitted: list[list[int]], aux: torch.Tensor,
                            cur: torch.Tensor, tables: torch.Tensor) -> None:
        """Draft for `seqs` (aux [B, k+1, A] of their verify, cur [B] its first position). At k = 0
        the rows wait in `Sequence.undrafted` until one request holds `probe_rows` of them; then
        every request drafts its rows and one token (draft_length.py: the probe)."""
        if not seqs:
            return
        t0, dev = time.perf_counter(), self.ex.device
        k = self.lengths.choose([s.stats for s in seqs], self.batch, self.k)
        if k == 0 or any(s.undrafted for s in seqs):
            for i, (s, e) in enumerate(zip(seqs, emitted)):
                tokens, rows = s.undrafted or ((), ())
                s.undrafted, s.drafts = (tokens + tuple(e), rows + (aux[i, :len(e)],)), []
            if k == 0:
                if max(len(s.undrafted[0]) for s in seqs) < self.lengths.probe_rows:
                    return
                self.lengths.probed()
            pending = [s.undrafted[0] for s in seqs]
            batch = DraftBatch(seqs, pad_stack([ints(p, dev) for p in pending], 0),
                               pad_stack([torch.cat(s.undrafted[1]) for s in seqs], 0.0),
                               ints([len(p) for p in pending], dev), ints([s.cur for s in seqs], dev), tables)
            for s in seqs:
                s.undrafted = ()
            # at k = 0 adaptive K drafts one token (a probe: acceptance measured again), a
            # schedule's K = 0 none (its steps decode plainly; the pass only fills the drafter's
            # cache). Neither this pass (its deferred rows) nor the next verify (measured slower
            # after such a pass) is the cost of a k: not timed
            self._draft(batch, k or int(self.spec.adaptive))
            self._time_verify = False
            return
        num = ints([len(e) for e in emitted], dev)  # [B] pending rows = emitted tokens
        batch = DraftBatch(seqs, ints([e + [0] * (aux.shape[1] - len(e)) for e in emitted], dev), aux, num,
                           cur + num, tables)
        self._draft(batch, k, since=t0 if self.adaptive else None)

    def _synthetic_accepts(self, k: int) -> int:
        """Drafts accepted under the configured unconditional rates r (P(first i accepted) = r_i)."""
        u, rates = float(torch.rand((), generator=self.synthetic)), self.spec.synthetic_rates
        return sum(1 for r in rates[:k] if u < r)

    def _draft(self, batch: DraftBatch, k: int | None = None, since: float | None = None) -> None:
        """k drafts for every sequence of `batch` (None: the rule's choice for them). `since`: when
        a decode step's drafting began; the time from then, this pass included, feeds the adaptive
        rule (a prefill's pass also reads its prompt rows: not the cost of drafting)."""
        if not batch.seqs:
            return
        if k is None:
            k = self.lengths.choose([s.stats for s in batch.seqs], self.batch, self.k)
        # the tree's nodes (0: the chain of k): fixed, by batch size or adaptive (tree_budget.py)
        budget, static = self.budgets.choose(len(batch.seqs), self.batch, k), self.spec.static_tree
        guided = self.draft_candidates if any(s.grammar is not None for s in batch.seqs) else 1
        if k and (budget or static or guided > 1):  # each position's top candidates (speculative/tree.py)
            nodes = static_nodes(tuple(p for p in static if len(p) <= k)) if static else None
            width = max(r for _, r in nodes) + 1 if static else budget
            top_ids, top_logp = self.proposer.propose_top(batch, k, max(width, guided))  # [B, k, W'] each
            top_ids, top_logp = top_ids.cpu().numpy(), top_logp.float().cpu().numpy()
            for i, s in enumerate(batch.seqs):
                if s.grammar is not None:  # a chain of the best candidates its grammar allows
                    s.drafts, s.parents = s.grammar.draft(top_ids[i, :k, :guided]), ()
                elif width:
                    s.drafts, s.parents = tokens_of(nodes or best_tree(top_logp[i][:, :width], budget, k, spine=k),
                                                    top_ids[i, :, :width].tolist())
                else:
                    s.drafts, s.parents = top_ids[i, :k, 0].tolist(), ()
        else:
            drafts = self.proposer.propose(batch, max(k, 1)).tolist()
            for s, d in zip(batch.seqs, drafts):  # a constrained request's: cut at the first its grammar refuses
                s.drafts, s.parents = d[:k] if s.grammar is None else s.grammar.draft([[t] for t in d[:k]]), ()
        if since is not None:  # keyed by rows per request: a chain's k, a tree's nodes
            self.lengths.draft_cost.record(len(batch.seqs), max(budget or k, 1), time.perf_counter() - since)

    def _commit(self, s: Sequence, emitted: list[int]) -> None:
        """Append emitted tokens, stopping at an end id, max_tokens or the maximum length (a
        constrained request's matcher took the verify walk's tokens: GrammarState.advance)."""
        room = min(s.params.max_tokens - len(s.output), self.max_seq_len - len(s.prompt) - len(s.output))
        stop_at = next((j for j, t in enumerate(emitted) if t in s.stop_ids), None) if s.stop_ids else None
        if stop_at is not None and stop_at < room:
            emitted, s.finish_reason = emitted[:stop_at + 1], "stop"
        elif len(emitted) >= room:
            emitted, s.finish_reason = emitted[:room], "length"
        if s.grammar is not None:  # committed tokens advance the matcher; its end token ends the request
            end = s.grammar.advance(emitted)
            if end is not None:
                emitted, s.finish_reason = emitted[:end], "stop"
        s.output += emitted
        s.stats.tokens += len(emitted)
        s.cur = s.num_computed = len(s.prompt) + len(s.output) - 1
