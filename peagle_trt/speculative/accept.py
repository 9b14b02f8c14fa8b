"""Acceptance on the device: which drafts of a verify the step keeps, as tensor ops over the batch.

    chosen   [B, n+1]  the target's token at every verify row: its argmax (greedy), or one sample
                       of the row's distribution (temperature, top-k, top-p; the request's generator)
    accept   chosen + drafts -> Verdict: from the root, the child holding the target's token, until
             a row has none (speculative/tree.py `walk`, the same rule without per-row Python)
    Verdict  tokens [B, n+1] emitted (accepted drafts, then the correction or bonus), count [B]
             (1 .. n+1), rows [B, n+1] the verify row each emitted token was chosen at (0, then
             1 + each accepted node): emitted j = chosen[rows[j]], and rows[j] pairs it with its
             target taps and KV slot (decoder.py moves an accepted tree path into place with them)

Exact: every row's choice is made independently of the others (a sample reads only its own row
and its request's generator), so choosing every row up front and walking afterwards emits what the
lazy walk emits (greedy: the same tokens; sampling: the same law; tests/speculative/test_sampling.py).
Acceptors (the step's one acceptance seam, `SpecDecoder(acceptor=)`):
  TargetAcceptor     the product's: the tokens the target chooses.
  SyntheticAcceptor  benchmarks: a chain's first a drafts accepted, a drawn from the configured
                     unconditional rates (P(a >= i) = rates[i-1]); then the target's token at row a.
Tested by tests/speculative/test_accept.py (against `walk` on random trees) and every exactness gate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from peagle_trt.speculative.drafting import upload
from peagle_trt.speculative.sampling import probabilities


@dataclass(frozen=True)
class Verdict:
    tokens: torch.Tensor  # [B, n+1] emitted tokens (past count: padding, 0)
    count: torch.Tensor  # [B] emitted tokens per request, 1 .. n+1
    rows: torch.Tensor  # [B, n+1] the verify row of each emitted token (past count: 0)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dim. On CPU through numpy: single-threaded, so it never waits on torch's
    OpenMP threads while onnxruntime's spin (measured: 11 ms per verify on 2 cores, vs 0.03 alone).
    A CPU tensor's numpy view is no device read."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def choose(logits: torch.Tensor, seqs: list) -> torch.Tensor:
    """logits [B, R, V] -> the target's token at every row [B, R]: greedy requests' argmax (one op
    for the batch), a sampling request's rows sampled with its params and generator (no host read;
    a constrained request samples in its grammar walk instead: grammar.py GrammarHook)."""
    chosen = argmax(logits)  # [B, R]
    for i, s in enumerate(seqs):
        if s.params.greedy or s.grammar is not None:
            continue
        if logits.device.type == "cpu":  # row by row: torch runs a few-row op on its thread pool, which
            for r in range(logits.shape[1]):  # waits on busy cores (measured: 9 ms per [4, 4] softmax, loaded)
                chosen[i, r] = torch.multinomial(probabilities(logits[i, r:r + 1], s.params), 1,
                                                 generator=s.generator)[0, 0]
        else:
            probs = probabilities(logits[i], s.params)  # [R, V]
            chosen[i] = torch.multinomial(probs, 1, generator=s.generator).squeeze(-1)
    return chosen


def accept_chain(drafts: torch.Tensor, chosen: torch.Tensor, ndrafts: torch.Tensor) -> Verdict:
    """drafts [B, n] chains (padding past ndrafts [B]), chosen [B, n+1] -> Verdict."""
    b, n = drafts.shape
    j = torch.arange(n, device=drafts.device)
    hit = (drafts == chosen[:, :n]) & (j < ndrafts[:, None])  # [B, n]
    count = 1 + hit.long().cumprod(dim=1).sum(dim=1)  # [B]
    j1 = torch.arange(n + 1, device=drafts.device)
    kept = j1 < count[:, None]  # [B, n+1]
    return Verdict(torch.where(kept, chosen, 0), count, torch.where(kept, j1, 0).expand(b, -1))


def accept_tree(drafts: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, chosen: torch.Tensor) -> Verdict:
    """drafts, parents, depth [B, n] (parent -1: the root; depth 1.., 0 for padding nodes), chosen
    [B, n+1] -> Verdict. One pass per depth: the first child of the current node holding the
    target's token there (a repeated token: the first sibling, as `walk`)."""
    b, n = drafts.shape
    dev = drafts.device
    node = torch.full((b,), -1, dtype=torch.long, device=dev)  # [B] the walk's node (-1: the root)
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    rows = torch.zeros(b, n + 1, dtype=torch.long, device=dev)
    count = torch.ones(b, dtype=torch.long, device=dev)
    for d in range(1, n + 1):
        target = chosen.gather(1, (node + 1)[:, None])  # [B, 1] the target's token at the node's row
        match = (depth == d) & (parents == node[:, None]) & (drafts == target) & alive[:, None]  # [B, n]
        found = match.any(dim=1)
        first = match.long().argmax(dim=1)  # the first matching node
        node = torch.where(found, first, node)
        rows[:, d] = torch.where(found, first + 1, 0)
        count += found.long()
        alive &= found
    kept = torch.arange(n + 1, device=dev) < count[:, None]
    return Verdict(torch.where(kept, chosen.gather(1, rows), 0), count, rows)


class TargetAcceptor:
    """Keeps what the target chooses (greedy: its argmax; sampling: its law): the product's."""

    exact = True  # its acceptance measures the drafts (adaptive tree budgets read it)

    def accept(self, chosen: torch.Tensor, drafts: torch.Tensor, ndrafts: torch.Tensor, parents: torch.Tensor | None,
               depth: torch.Tensor | None) -> Verdict:
        # chosen [B, n+1]; drafts [B, n]; ndrafts [B] (on the device); parents, depth [B, n] for trees (None: chains)
        if parents is None:
            return accept_chain(drafts, chosen, ndrafts)
        return accept_tree(drafts, parents, depth, chosen)


class SyntheticAcceptor:
    """Benchmarks: a chain accepts its first a drafts, P(a >= i) = rates[i-1], then the target's token.
    Draws one uniform per request and step from its own generator on the host (no device read; the
    draws go up in one non-blocking upload, drafting.upload): a = min(the rates above the uniform,
    the request's drafts), which is the count of rates[:k] above it since the rates do not increase
    (SpecConfig checks)."""

    exact = False

    def __init__(self, rates: tuple[float, ...], seed: int = 0):
        self.rates = np.asarray(rates, dtype=np.float64)  # [K]
        self.generator = torch.Generator().manual_seed(seed)

    def accept(self, chosen: torch.Tensor, drafts: torch.Tensor, ndrafts: torch.Tensor, parents=None,
               depth=None) -> Verdict:
        # chosen [B, n+1]; drafts [B, n] chains; ndrafts [B] (on the device)
        b, dev = drafts.shape[0], chosen.device
        u = torch.rand(b, generator=self.generator, dtype=torch.float64).numpy()  # [B] host draws
        above, = upload([(u[:, None] < self.rates).sum(axis=1)], dev)  # [B] rates above each draw
        a_dev = torch.minimum(above, ndrafts)[:, None]  # [B, 1] accepted drafts
        j = torch.arange(chosen.shape[1], device=dev)[None]  # [1, n+1]
        drafted = torch.cat([drafts.to(chosen.dtype), chosen.new_zeros(b, 1)], dim=1)  # [B, n+1]
        tokens = torch.where(j < a_dev, drafted, chosen.gather(1, a_dev))
        kept = j <= a_dev
        return Verdict(torch.where(kept, tokens, 0), (a_dev + 1).squeeze(1), torch.where(kept, j, 0).expand_as(tokens))
