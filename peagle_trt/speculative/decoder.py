"""The speculate-verify loop over a batch of sequences, on any executor.

    prefill(seqs): target over each prompt (chunk) -> first token; drafter over it -> k drafts
    step(seqs):    verify [last, d_1..d_n] in one target forward -> accept a drafts + 1 token
                   -> draft the next k in one drafter forward (or k, in eagle3 mode)

The drafts of a sequence form a tree (speculative/tree.py: `Sequence.parents`; empty: a chain of
k, the default): with a tree budget, the best prefixes of the drafter's per-position candidates
(the budget per drafting call: tree_size.py, fixed, by batch size, or adaptive).
Every verify runs the tree path: rows by depth with an ancestor mask; a chain is the tree with
one child per node (its accepted rows are already in place, nothing moves).

k <= K is chosen per drafting call (draft_length.py: fixed, by batch size, or adaptive); rows of
sequences with fewer drafts are padding (position -1). With k = 0 the step is plain decoding: one
target row, one token; the drafter then gets that step's rows later (`Sequence.undrafted`).
Greedy output equals the target's own greedy output token for token; sampled output has the
target's distribution (speculative/accept.py). Requests may join (prefill) and leave between steps.

The step, on the device: verify -> accept -> commit -> propose, one upload, one read.
    verify   rows [B, n+1] from the last tokens and the drafts, which stay on the device between
             steps (`Sequence.drafts`: a row of the drafting pass's output); what the host knows
             (last tokens, positions, drafts per request, block tables, a tree's parents, depths
             and mask) goes up in ONE non-blocking copy from pinned memory (drafting.py `upload`);
             attention spans from the host's positions (ops.reference.key_span), so no forward
             reads the device back
    accept   `acceptor` (accept.py): the target's token at every row, the accepted path, as tensor
             ops; ONE device-to-host copy per step brings back tokens, rows and counts (a chain's
             one host wait: bench gpu's host_syncs)
    commit   host bookkeeping only (stops, stats, the draft policy's StepReport); a tree's accepted
             KV and taps move on the device
    propose  the drafter reads the emitted tokens and counts where they are (`DraftBatch`)
Seams: the draft policy (draft_policy.py: k, tree budget; chosen before a drafting pass, told
after a verify), the acceptor (the product's `TargetAcceptor`, a benchmark's `SyntheticAcceptor`),
and the grammar hook for constrained requests (grammar.py `GrammarHook`): such a request drafts a
chain of the drafter's best candidates the grammar allows (`draft_candidates` per depth), and each
verify row its walk reads is under the grammar after its committed tokens plus the drafts before
the row (greedy: the row's argmax when allowed, else the masked row's), on the host.
tests/speculative/test_host_reads.py counts the step's uploads and device reads (one each per step;
a request finishing adds one non-blocking upload, a tree one read of its candidates) and refuses
data-dependent ops (nonzero, bool indexing, item, ...) in the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.ops.reference import key_span, pack_tree_mask
from peagle_trt.speculative.accept import SyntheticAcceptor, TargetAcceptor, Verdict, choose
from peagle_trt.speculative.draft_policy import DraftPolicy, StepReport
from peagle_trt.speculative.drafting import DraftBatch, ParallelDrafter, SequentialDrafter, pad_rows, pad_stack, upload
from peagle_trt.speculative.executor import Executor
from peagle_trt.speculative.grammar import GrammarHook, GrammarState, first_token_mask
from peagle_trt.speculative.sampling import make_generator
from peagle_trt.speculative.stats import SpecStats
from peagle_trt.speculative.tree import best_tree, chain, depths, static_nodes, tokens_of
from peagle_trt.speculative.verify import verify

__all__ = ["Sequence", "SpecDecoder"]


@dataclass(eq=False)
class Sequence:
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    output: list[int] = field(default_factory=list)  # generated ids (prompt excluded)
    # [n] proposed tokens: a chain for cur+1..cur+n, or tree nodes; a row of the drafting pass's
    # [B, k] device tensor (chains: never read back, the verify reads it there) or a list
    drafts: list[int] | torch.Tensor = field(default_factory=list)
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


@dataclass(frozen=True)
class VerifyRows:
    """One verify's inputs (decoder.step), on the device."""
    tokens: torch.Tensor  # [B, n+1] the last generated token, then the drafts (padding 0)
    positions: torch.Tensor  # [B, n+1] RoPE positions (-1: padding)
    cur: torch.Tensor  # [B] row 0's position
    ndrafts: torch.Tensor  # [B] drafts per request
    tables: torch.Tensor  # [G, B, M] block tables
    drafts: torch.Tensor  # [B, n]
    parents: torch.Tensor | None  # [B, n] a tree's (-1: the root), None for chains
    depth: torch.Tensor | None  # [B, n] a tree's node depths (0: padding)
    mask: torch.Tensor | None  # [B, n+1, W] a tree's ancestor bits
    levels: list[int]  # per request the depth of its drafts (host)


class SpecDecoder:
    # a constrained request's drafts: per depth, the first of the drafter's top candidates the
    # grammar allows (1: the drafter's own top-1 chain, cut at the first draft the grammar refuses)
    draft_candidates: int = 256

    def __init__(self, executor: Executor, spec: SpecConfig, eos_ids: tuple[int, ...] = (), proposer=None,
                 acceptor=None):
        """`proposer`: the drafter (None: spec.mode's); `acceptor`: which drafts a verify keeps
        (speculative/accept.py; None: the target's choice, or synthetic rates when spec sets them)."""
        self.ex, self.spec, self.eos_ids = executor, spec, tuple(eos_ids)
        self.num_spec_tokens = spec.num_spec_tokens
        if proposer is None and self.num_spec_tokens:
            proposer = ParallelDrafter(executor) if spec.mode == "peagle" else SequentialDrafter(executor)
        self.proposer = proposer
        if acceptor is None:
            acceptor = SyntheticAcceptor(spec.synthetic_rates) if spec.synthetic_rates else TargetAcceptor()
        self.acceptor = acceptor
        self.policy = DraftPolicy(spec)  # K by batch, adaptive K, tree budgets: chosen before, told after
        self.draft_length, self.tree_size = self.policy.draft_length, self.policy.tree_size  # (metrics read them)
        self._time_verify = self.policy.adaptive  # the next verify's time feeds the adaptive rule (only it reads it)
        self.batch = 1  # running requests (the scheduler sets it each step): the K schedule's key
        # headroom: a verify writes up to max_draft_rows + 1 positions from the last committed one
        self.max_seq_len = executor.kv.max_len - (self.max_draft_rows + 1)
        if spec.tree and len(executor.windows) > 1:
            raise ConfigError("draft trees need a full-attention target for now (this one has sliding-window "
                              f"layers, windows {list(executor.windows[1:])}); use a chain (no tree keys)")

    @property
    def max_draft_rows(self) -> int:
        """The most draft rows one verify writes past the root: K, or a draft tree's most nodes."""
        return max(self.num_spec_tokens, self.spec.max_nodes)

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
        return Sequence(list(prompt), params, generator, stats=SpecStats(self.num_spec_tokens), stop_ids=stop_ids,
                        grammar=state)

    def tables(self, seqs: list[Sequence]) -> np.ndarray:
        """Block tables [G, B, M] int64 of `seqs` (-1: no block), on the host (`upload` takes them)."""
        out = np.full((len(self.ex.windows), len(seqs), self.ex.kv.max_blocks), -1, dtype=np.int64)
        for b, s in enumerate(seqs):
            for g, blocks in enumerate(s.blocks):
                out[g, b, :len(blocks)] = blocks
        return out

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
        tables, = upload([self.tables(seqs)], dev)  # [G, B, M]
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
        if not self.num_spec_tokens:
            return
        batch = DraftBatch.build(seqs, pending, aux, tables, dev)
        partial = [i for i, s in enumerate(seqs) if not s.prefilled]
        if partial:  # fills the drafter KV cache for the chunk; the draft is discarded
            self.proposer.propose(batch.select(partial), 1)
        self._draft(batch.select([i for i, s in enumerate(seqs) if s.prefilled and not s.finished]))

    def step(self, seqs: list[Sequence]) -> None:
        """One speculate-verify iteration for every unfinished sequence of `seqs`: verify -> accept
        -> commit -> propose, with ONE host-to-device copy (the verify's host ints, non-blocking:
        drafting.upload) and ONE device-to-host read (the accepted tokens and counts)."""
        seqs = [s for s in seqs if not s.finished]
        if not seqs:
            return
        t0, b = time.perf_counter(), len(seqs)  # the verify's cost (adaptive rules): up to its drafting
        ns = [len(s.drafts) for s in seqs]  # drafts per request (host-known: the drafts stay on the device)
        n, tree = max(ns), any(s.parents for s in seqs)
        # 1. verify: row 0 the last generated token at position cur, row 1 + j draft j at cur + its
        #    depth (its KV at slot cur + 1 + j), one target forward; each row sees its ancestors.
        #    The host's ints (tokens, positions, drafts per request, tables, a tree's shape): ONE upload
        v = self._verify_inputs(seqs, ns, n, tree)
        with key_span(max(s.cur + m for s, m in zip(seqs, ns)) + 1):  # the host knows the slots
            logits, aux = self.ex.target(v.tokens, v.positions, v.tables, tree_mask=v.mask)  # [B, n+1, V], [.., A]
        # 2. accept on the device: the target's token at every row (argmax or a sample), the walk from
        #    the root to the child holding it; the ONE read brings back tokens [B, n+1], rows, count [B]
        verdict = self.acceptor.accept(choose(logits, seqs), v.drafts, v.ndrafts, v.parents, v.depth)
        read = torch.cat([verdict.tokens, verdict.rows, verdict.count[:, None]], 1).tolist()  # [B, 2n+3]
        emitted = [r[:r[-1]] for r in read]  # per request its tokens
        paths = [[j - 1 for j in r[n + 2:n + 1 + r[-1]]] for r in read]  # accepted node indices
        verdict = self._constrained(seqs, logits, emitted, paths, verdict, n)  # the grammar hook (host)
        # 3. commit: host bookkeeping (stops, stats, the policy's report); a tree's path into place
        accepted = []  # (depth, nodes, path, measured) of the requests that drafted
        for s, m, e, path, level in zip(seqs, ns, emitted, paths, v.levels):
            s.stats.target_forwards += 1
            if m:  # the tree's size and depth (a chain: both k)
                s.stats.record_step(m, len(path), level)
                accepted.append((level, m, tuple(path), self.acceptor.exact and s.grammar is None))
            self._commit(s, e)
        verify_s = time.perf_counter() - t0 if self._time_verify else None
        self.policy.observe(StepReport(b, n, tree, verify_s, tuple(accepted)))
        self._time_verify = self.policy.adaptive
        if tree:
            aux = self._place_path(v, verdict, aux)  # [B, n+1, A] taps of the emitted tokens
        # 4. propose the next k from the emitted tokens, paired row by row with the verify's taps
        #    (emitted token j pairs with aux[j]); target KV past cur is stale and is overwritten
        #    by the next verify: no rollback
        live = [i for i, s in enumerate(seqs) if s.finish_reason is None]
        if self.num_spec_tokens and live:
            idx = slice(None) if len(live) == b else upload([live], self.ex.device)[0]  # [b'] the requests going on
            self._draft_after_verify([seqs[i] for i in live], [emitted[i] for i in live], aux[idx], v.cur[idx],
                                     v.tables[:, idx], verdict.tokens[idx], verdict.count[idx])

    def _verify_inputs(self, seqs: list[Sequence], ns: list[int], num_drafts: int, tree: bool) -> VerifyRows:
        """The verify's rows: the last tokens and the drafts, their positions (a chain's by row, a
        tree's by depth, -1 padding), block tables; a tree's parents, depths, mask. `ns`: each
        request's drafts; `num_drafts`: their most, the padded row count (n in the shapes). What
        the host holds goes up in ONE upload; drafts left on the device by the last pass stay there."""
        dev, b, n = self.ex.device, len(seqs), num_drafts
        rows = [s.drafts for s in seqs]  # device rows of the last drafting pass, or lists (trees, grammar)
        stacked = all(isinstance(d, torch.Tensor) and len(d) == n for d in rows)
        trees = [s.parents[:m] or chain(m) for s, m in zip(seqs, ns)] if tree else []
        levels = [depths(t) for t in trees]
        held = n and not stacked  # some drafts are host lists (trees, grammar) or a pass of another k
        listed = [pad_rows([[] if isinstance(d, torch.Tensor) else d for d in rows], n)] if held else []  # [B, n]
        shape = [pad_rows(trees, n, -1), pad_rows(levels, n), pack_tree_mask(trees, n + 1)] if tree else []
        head, tables, *rest = upload([[[s.output[-1], s.cur, m] for s, m in zip(seqs, ns)],  # [B, 3]
                                      self.tables(seqs), *listed, *shape], dev)  # [G, B, M], ..
        listed, shape = (rest[0], rest[1:]) if held else (None, rest)
        cur, ndrafts = head[:, 1], head[:, 2]  # [B] row 0's position, [B] drafts per request
        if stacked:
            drafts = torch.stack(rows)  # [B, n] the last pass's device rows
        elif held:
            drafts = self._drafts(rows, listed, n)
        else:
            drafts = torch.zeros(b, 0, dtype=torch.long, device=dev)  # [B, 0] plain decoding
        j = torch.arange(n + 1, device=dev)  # [n+1]
        if tree:  # rows by depth with an ancestor mask (a chain is causal by position)
            parents, depth, mask = shape  # [B, n] (-1: the root), [B, n] (0: padding), [B, n+1, ceil((n+1)/32)]
            mask = mask.to(torch.int32)  # packed bits (the upload's int64 holds each word's value)
            row_depth = torch.cat([torch.zeros_like(cur)[:, None], torch.where(depth > 0, depth, -1)], 1)
            levels = [max(d, default=0) for d in levels]
        else:
            parents = depth = mask = None
            row_depth = torch.where(j <= ndrafts[:, None], j, -1)  # [B, n+1], -1: padding
            levels = ns
        positions = torch.where(row_depth >= 0, cur[:, None] + row_depth, -1)  # [B, n+1]
        return VerifyRows(torch.cat([head[:, :1], drafts], dim=1), positions, cur, ndrafts, tables, drafts,
                          parents, depth, mask, levels)

    @staticmethod
    def _drafts(rows: list, listed: torch.Tensor, n: int) -> torch.Tensor:
        """Drafts [B, n]: `listed` [B, n] holds the rows that were lists (uploaded); a row left on
        the device by a drafting pass of another k is padded to n there."""
        if not any(isinstance(d, torch.Tensor) for d in rows):
            return listed
        return torch.stack([torch.nn.functional.pad(d, (0, n - len(d))) if isinstance(d, torch.Tensor) else listed[i]
                            for i, d in enumerate(rows)])

    def _constrained(self, seqs: list[Sequence], logits: torch.Tensor, emitted: list, paths: list,
                     verdict: Verdict, num_drafts: int) -> Verdict:
        """Constrained requests walk their rows on the host under their grammar (GrammarHook.walk;
        emitted and paths updated in place); the verdict then comes from the host's lists."""
        constrained = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not constrained:
            return verdict
        for i in constrained:  # a synthetic acceptor's count stands: the walk takes its drafts
            forced = None if self.acceptor.exact else len(paths[i])
            paths[i], emitted[i] = GrammarHook.walk(seqs[i], logits[i], list(seqs[i].drafts), seqs[i].parents, forced)
        width = num_drafts + 1
        rows = [[0] + [j + 1 for j in p] for p in paths]  # the verify row of each emitted token
        return Verdict(*upload([pad_rows(emitted, width), [len(e) for e in emitted], pad_rows(rows, width)],
                               self.ex.device))  # [B, n+1], [B], [B, n+1]

    def _place_path(self, v: VerifyRows, verdict: Verdict, aux: torch.Tensor) -> torch.Tensor:
        """A tree's accepted rows: their target KV from slots cur + rows to cur + 0 .. (where the next
        verify reads it) on the device; returns their taps [B, n+1, A] in emitted order (a chain's
        rows are in place already: moved onto themselves). A request that finished this step moves
        too: the prefix cache takes its full blocks (runtime/blocks.py commit), and the device
        needs no word of which requests went on."""
        j = torch.arange(verdict.rows.shape[1], device=self.ex.device)
        kept = j < verdict.count[:, None]  # [B, n+1]
        at = v.cur[:, None]
        self.ex.move_kv(v.tables, torch.where(kept, at + verdict.rows, -1), torch.where(kept, at + j, -1))
        return torch.gather(aux, 1, verdict.rows[..., None].expand(-1, -1, aux.shape[-1]))

    def _draft_after_verify(self, seqs: list[Sequence], emitted: list[list[int]], aux: torch.Tensor,
                            cur: torch.Tensor, tables: torch.Tensor, tokens: torch.Tensor, num: torch.Tensor) -> None:
        """Draft for `seqs` (aux [B, k+1, A] of their verify, cur [B] its first position, tokens
        [B, k+1] their emitted tokens, num [B] how many, on the device). At k = 0 the rows wait in
        `Sequence.undrafted` until one request holds `probe_rows` of them; then every request
        drafts its rows and one token (draft_length.py: the probe)."""
        t0, dev = time.perf_counter(), self.ex.device
        k = self.policy.choose([s.stats for s in seqs], self.batch, self.num_spec_tokens)
        if k == 0 or any(s.undrafted for s in seqs):
            for i, (s, e) in enumerate(zip(seqs, emitted)):
                rows_before, taps = s.undrafted or ((), ())
                s.undrafted, s.drafts = (rows_before + tuple(e), taps + (aux[i, :len(e)],)), []
            if k == 0:
                if max(len(s.undrafted[0]) for s in seqs) < self.draft_length.probe_rows:
                    return
                self.draft_length.probed()
            pending = [s.undrafted[0] for s in seqs]
            tokens, num, cur = upload([pad_rows(pending, max(map(len, pending))), [len(p) for p in pending],
                                       [s.cur for s in seqs]], dev)  # [B, P], [B], [B]
            batch = DraftBatch(seqs, tokens, pad_stack([torch.cat(s.undrafted[1]) for s in seqs], 0.0), num, cur,
                               tables, max(s.cur for s in seqs))
            for s in seqs:
                s.undrafted = ()
            # at k = 0 adaptive K drafts one token (a probe: acceptance measured again), a
            # schedule's K = 0 none (its steps decode plainly; the pass only fills the drafter's
            # cache). Neither this pass (its deferred rows) nor the next verify (measured slower
            # after such a pass) is the cost of a k: not timed
            self._draft(batch, k or int(self.spec.adaptive))
            self._time_verify = False
            return
        since = t0 if self.policy.adaptive else None
        top = max(s.cur for s in seqs)  # committed: cur + num
        self._draft(DraftBatch(seqs, tokens, aux, num, cur + num, tables, top), k, since=since)

    def _draft(self, batch: DraftBatch, k: int | None = None, since: float | None = None) -> None:
        """k drafts for every sequence of `batch` (None: the rule's choice for them), left on the
        device (`Sequence.drafts` a row of the pass's [B, k]; a tree's or a constrained request's
        on the host). `since`: when a decode step's drafting began; the time from then, this pass
        included, feeds the adaptive rule (a prefill's pass also reads its prompt rows: not the
        cost of drafting)."""
        if not batch.seqs:
            return
        if k is None:
            k = self.policy.choose([s.stats for s in batch.seqs], self.batch, self.num_spec_tokens)
        # the tree's nodes (0: the chain of k): fixed, by batch size or adaptive (tree_size.py)
        budget, static = self.policy.budget(len(batch.seqs), self.batch, k), self.spec.static_tree
        guided = self.draft_candidates if any(s.grammar is not None for s in batch.seqs) else 1
        if k and (budget or static or guided > 1):  # each position's top candidates (speculative/tree.py)
            nodes = static_nodes(tuple(p for p in static if len(p) <= k)) if static else None
            width = max(r for _, r in nodes) + 1 if static else budget
            top_ids, top_logp = self.proposer.propose_top(batch, k, max(width, guided))  # [B, k, W'] each
            both = torch.stack([top_ids.double(), top_logp.double()]).cpu().numpy()  # ONE read (ids < 2^53: exact)
            top_ids, top_logp = both[0].astype(np.int64), both[1].astype(np.float32)
            for i, s in enumerate(batch.seqs):
                if s.grammar is not None:  # a chain of the best candidates its grammar allows
                    s.drafts, s.parents = GrammarHook.draft(s, top_ids[i, :k, :guided]), ()
                elif width:
                    s.drafts, s.parents = tokens_of(nodes or best_tree(top_logp[i][:, :width], budget, k, spine=k),
                                                    top_ids[i, :, :width].tolist())
                else:
                    s.drafts, s.parents = top_ids[i, :k, 0].tolist(), ()
        else:
            drafts = self.proposer.propose(batch, max(k, 1))[:, :k]  # [B, k]
            drafts = drafts.to(self.ex.device, torch.long)  # a no-op for the drafters, which draft on the device
            for i, s in enumerate(batch.seqs):  # a constrained request's: cut at the first its grammar refuses
                s.drafts, s.parents = drafts[i] if s.grammar is None else GrammarHook.draft(
                    s, [[t] for t in drafts[i].tolist()]), ()
        if since is not None:  # keyed by rows per request: a chain's k, a tree's nodes
            self.policy.observe_draft(len(batch.seqs), max(budget or k, 1), time.perf_counter() - since)

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
