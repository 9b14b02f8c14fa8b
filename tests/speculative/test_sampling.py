"""Sampling: logit processing, and speculative sampling keeps the target distribution exactly.

The distribution test drives the real `SpecDecoder` over a Markov target (next-token
distribution T[token], vocabulary 4) with a drafter proposing random tokens (chains, budget trees
and static trees of random candidates), and compares the joint distribution of the first three
generated tokens with the exact chain probabilities by a chi-square statistic. A biased sampler
(always accepting the drafts) must fail the same check.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative import decoder as decoder_mod
from peagle_trt.speculative.accept import TargetAcceptor, Verdict
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.speculative.sampling import probabilities
from tests.helpers import MarkovExecutor

V = 4
T = torch.tensor([[0.50, 0.20, 0.20, 0.10],
                  [0.10, 0.60, 0.25, 0.05],
                  [0.30, 0.30, 0.10, 0.30],
                  [0.05, 0.15, 0.40, 0.40]])


class RandomDrafter:
    def __init__(self, seed: int):
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, batch, k):
        return torch.randint(0, V, (len(batch.seqs), k), generator=self.rng)

    def propose_top(self, batch, k, width):  # random candidates (repeats included), random scores
        ids = torch.randint(0, V, (len(batch.seqs), k, width), generator=self.rng)
        logp = torch.rand(len(batch.seqs), k, width, generator=self.rng).sort(-1, descending=True).values.log()
        return ids, logp


def chi_square_of_first_tokens(k: int, runs: int, temperature: float = 1.0, **tree) -> tuple[float, int]:
    spec = SpecConfig("peagle", k, **tree)
    decoder = SpecDecoder(MarkovExecutor(T), spec, proposer=RandomDrafter(k))
    counts: dict[tuple, int] = {}
    for seed in range(runs):
        seq = generate(decoder, [0], SamplingParams(max_tokens=3, temperature=temperature, seed=seed))
        key = tuple(seq.output)
        counts[key] = counts.get(key, 0) + 1
    p = T ** (1 / temperature)
    p = p / p.sum(-1, keepdim=True)
    stat = 0.0
    for a, b, c in itertools.product(range(V), repeat=3):
        expected = runs * float(p[0, a] * p[a, b] * p[b, c])
        stat += (counts.get((a, b, c), 0) - expected) ** 2 / expected
    return stat, V ** 3 - 1


def threshold(df: int) -> float:
    return df + 4 * math.sqrt(2 * df)  # ~4 sigma above the chi-square mean


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_preserves_target_distribution(k):
    stat, df = chi_square_of_first_tokens(k, runs=6000)
    assert stat < threshold(df), (stat, df)


def test_rejection_sampling_with_temperature(k=2):
    stat, df = chi_square_of_first_tokens(k, runs=6000, temperature=0.7)
    assert stat < threshold(df), (stat, df)


@pytest.mark.parametrize("tree", [{"tree_budget": 3}, {"tree_budget": 6},
                                  {"static_tree": ((0,), (1,), (0, 0), (2,), (1, 0))},
                                  {"tree_budget": 6, "adaptive_tree": True}])
def test_tree_sampling_preserves_target_distribution(tree):
    """Trees (several children per node, repeated tokens among siblings) at T = 1 and 0.7: the
    target's token sampled at each node, then the matching child: exactly the target's law (with
    the adaptive budget too: chains and trees of 3 or 6 nodes from step to step)."""
    k = max(len(p) for p in tree.get("static_tree", ((0, 0),)))
    for temperature in (1.0, 0.7):
        stat, df = chi_square_of_first_tokens(k, runs=5000, temperature=temperature, **tree)
        assert stat < threshold(df), (tree, temperature, stat, df)


class BiasedAcceptor(TargetAcceptor):
    """Accepts the first path's drafts whatever the target says (a chain: all of them), then the
    target's token after them: not lossless."""

    def accept(self, chosen, drafts, ndrafts, parents=None, depth=None):
        tokens, rows, count = [], [], []
        for i, n in enumerate(ndrafts.tolist()):
            up = [-1] + list(range(n - 1)) if parents is None else parents[i, :n].tolist()
            path = [0] if n else []
            while path and path[-1] + 1 < n and up[path[-1] + 1] == path[-1]:
                path.append(path[-1] + 1)
            r = [0] + [j + 1 for j in path]
            tokens.append(drafts[i, path].tolist() + [int(chosen[i, r[-1]])] + [0] * (drafts.shape[1] - len(path)))
            rows.append(r + [0] * (drafts.shape[1] + 1 - len(r)))
            count.append(len(r))
        return Verdict(torch.tensor(tokens), torch.tensor(count), torch.tensor(rows))


@pytest.mark.parametrize("tree", [{}, {"tree_budget": 4}])
def test_the_distribution_check_catches_a_biased_sampler(monkeypatch, tree):
    """Accepting the first path's drafts whatever the target says is not lossless: the check must
    notice (chains and trees)."""
    monkeypatch.setattr(decoder_mod, "TargetAcceptor", BiasedAcceptor)
    stat, df = chi_square_of_first_tokens(2, runs=3000, **tree)
    assert stat > threshold(df)


def test_probabilities_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.75))  # 0.4+0.3 < 0.75 -> keep 3
    torch.testing.assert_close(p, torch.tensor([[4 / 9, 3 / 9, 2 / 9, 0.0]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.7))  # exactly reached with 2
    torch.testing.assert_close(p, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]))


def test_seeded_sampling_is_reproducible_on_the_real_target(tiny):
    from tests.helpers import make_decoder

    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3)
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    a = generate(decoder, [1, 2, 3], params).output
    b = generate(decoder, [1, 2, 3], params).output
    c = generate(decoder, [1, 2, 3], SamplingParams(**{**params.__dict__, "seed": 99})).output
    assert a == b and a != c
