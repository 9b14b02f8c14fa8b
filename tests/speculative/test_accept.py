"""Device acceptance (speculative/accept.py) against the host walk it replaces (speculative/tree.py
`walk`): random chains and trees (repeated sibling tokens included), padded in one batch, give the
walk's emitted tokens and accepted path; synthetic acceptance keeps a chain's first a drafts."""

from __future__ import annotations

import random

import torch

from peagle_trt.speculative.accept import SyntheticAcceptor, TargetAcceptor, accept_chain
from peagle_trt.speculative.tree import chain, depths, walk


def random_tree(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(-1, i) if rng.random() < 0.6 else i - 1 for i in range(n))


def test_tree_acceptance_is_the_walk():
    rng = random.Random(0)
    for _ in range(50):
        b, n = rng.randrange(1, 6), rng.randrange(0, 9)
        ns = [rng.randrange(0, n + 1) for _ in range(b)]
        trees = [random_tree(rng, m) for m in ns]
        drafts = [[rng.randrange(3) for _ in range(m)] for m in ns]  # a 3-token vocabulary: many repeats
        chosen = torch.randint(0, 3, (b, n + 1), generator=torch.Generator().manual_seed(rng.randrange(99)))
        def pad(rows, v):
            return torch.tensor([r + [v] * (n - len(r)) for r in rows], dtype=torch.long).reshape(b, n)
        verdict = TargetAcceptor().accept(chosen, pad(drafts, 0), torch.tensor(ns), pad([list(t) for t in trees], -1),
                                          pad([depths(t) for t in trees], 0))
        for i in range(b):
            path, emitted = walk(drafts[i], trees[i], chosen[i].tolist().__getitem__)
            c = int(verdict.count[i])
            assert verdict.tokens[i, :c].tolist() == emitted
            assert verdict.rows[i, :c].tolist() == [0] + [j + 1 for j in path]


def test_chain_acceptance_is_the_walk():
    rng = random.Random(1)
    for _ in range(50):
        b, n = rng.randrange(1, 6), rng.randrange(0, 6)
        ns = [rng.randrange(0, n + 1) for _ in range(b)]
        drafts = torch.randint(0, 2, (b, n), generator=torch.Generator().manual_seed(rng.randrange(99)))
        chosen = torch.randint(0, 2, (b, n + 1), generator=torch.Generator().manual_seed(rng.randrange(99)))
        verdict = accept_chain(drafts, chosen, torch.tensor(ns))
        for i in range(b):
            path, emitted = walk(drafts[i, :ns[i]].tolist(), chain(ns[i]), chosen[i].tolist().__getitem__)
            c = int(verdict.count[i])
            assert verdict.tokens[i, :c].tolist() == emitted and verdict.rows[i, :c].tolist() == list(range(c))


def test_synthetic_acceptance_keeps_the_first_drafts_then_the_target():
    acceptor = SyntheticAcceptor((1.0, 1.0, 0.0))  # always the first two of three
    drafts, chosen = torch.tensor([[7, 8, 9], [5, 6, 0]]), torch.tensor([[1, 2, 3, 4], [1, 2, 3, 0]])
    verdict = acceptor.accept(chosen, drafts, torch.tensor([3, 0]))
    assert verdict.count.tolist() == [3, 1]
    assert verdict.tokens[0, :3].tolist() == [7, 8, 3] and verdict.tokens[1, :1].tolist() == [1]
