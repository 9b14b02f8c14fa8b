"""Sampling: logit processing, and rejection sampling keeps the target distribution exactly.

The distribution test drives the real `SpecDecoder` over a Markov target (next-token
distribution T[token], vocabulary 4) with a drafter proposing random tokens, and compares the
joint distribution of the first three generated tokens with the exact chain probabilities by a
chi-square statistic. A biased sampler (always accepting the drafts) must fail the same check.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative import verify as verify_mod
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


def chi_square_of_first_tokens(k: int, runs: int, temperature: float = 1.0) -> tuple[float, int]:
    decoder = SpecDecoder(MarkovExecutor(T), SpecConfig("peagle", k), proposer=RandomDrafter(k))
    decoder.k = k
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


def test_the_distribution_check_catches_a_biased_sampler(monkeypatch):
    """Accepting every draft (no rejection) is not lossless: the check must notice."""
    monkeypatch.setattr(verify_mod, "verify_rejection",
                        lambda drafts, logits, params, gen: drafts + [int(logits[-1].argmax())])
    stat, df = chi_square_of_first_tokens(2, runs=3000)
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
