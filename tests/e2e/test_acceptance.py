"""Acceptance machinery with structural drafters, on the real tiny target.

oracle       proposes the target's own continuation: AL = K+1, 1/(K+1) target forwards per token
always-wrong AL = 1, output still exact
Bernoulli(a) each depth correct with probability a: AL ~ (1 - a^(K+1)) / (1 - a), p_i ~ a^(i+1)
Plus the structural costs: drafter forwards per step (1 parallel, K sequential), K+1 verify rows.
"""

from __future__ import annotations

import math

import pytest
import torch

from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.stats import SpecStats
from tests.helpers import CountingExecutor, ScriptedDrafter, greedy, make_decoder, new_sequence, reference_outputs

PROMPTS = [[5, 9, 13], [100, 3, 77, 21, 8, 400], list(range(30, 52))]


@pytest.fixture(scope="module")
def refs(tiny):
    return reference_outputs(make_decoder(tiny, "llama", None, "none", 1, max_len=1024), PROMPTS, 400)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_oracle_drafter_accepts_everything(tiny, refs, k):
    steps = 6
    n = 1 + steps * (k + 1)  # prefill token + `steps` full acceptances
    oracle = ScriptedDrafter(refs, 512, lambda i, rng: True)
    decoder = make_decoder(tiny, "llama", None, "none", k, proposer=oracle)
    decoder.num_spec_tokens = k  # a target-only executor driven by a structural drafter
    for prompt in PROMPTS:
        seq = generate(decoder, prompt, greedy(n))
        assert seq.output == refs[tuple(prompt)][:n]
        assert seq.stats.acceptance_length == k + 1
        assert seq.stats.accept_rate_per_pos == [1.0] * k
        verify_forwards = seq.stats.target_forwards - 1  # minus the prefill
        assert verify_forwards / (len(seq.output) - 1) == pytest.approx(1 / (k + 1))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_always_wrong_drafter_accepts_nothing_and_stays_exact(tiny, refs, k):
    wrong = ScriptedDrafter(refs, 512, lambda i, rng: False)
    decoder = make_decoder(tiny, "llama", None, "none", k, proposer=wrong)
    decoder.num_spec_tokens = k
    for prompt in PROMPTS:
        seq = generate(decoder, prompt, greedy(25))
        assert seq.output == refs[tuple(prompt)][:25]
        assert seq.stats.acceptance_length == 1.0 and seq.stats.accepted == 0
        assert seq.stats.target_forwards == 25  # one token per target forward


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_bernoulli_drafter_matches_geometric_acceptance(tiny, refs, alpha):
    k = 3
    bern = ScriptedDrafter(refs, 512, lambda i, rng: bool(torch.rand((), generator=rng) < alpha),
                           seed=int(alpha * 10))
    decoder = make_decoder(tiny, "llama", None, "none", k, max_len=1024, proposer=bern)
    decoder.num_spec_tokens = k
    total = SpecStats(k)
    while total.steps < 1500:
        for prompt in PROMPTS:
            seq = generate(decoder, prompt, greedy(300))
            assert seq.output == refs[tuple(prompt)][:300]
            total.merge(seq.stats)
    expected = (1 - alpha ** (k + 1)) / (1 - alpha)
    # per-step accepted count a in [0, K]; its variance bounds the tolerance (4 sigma)
    mean_a = expected - 1
    var_a = sum((j ** 2) * (alpha ** j) * ((1 - alpha) if j < k else 1) for j in range(k + 1)) - mean_a ** 2
    tol = 4 * math.sqrt(var_a / total.steps)
    assert abs(total.acceptance_length - expected) < tol, (total.acceptance_length, expected, tol)
    for i, rate in enumerate(total.accept_rate_per_pos):
        p = alpha ** (i + 1)
        assert abs(rate - p) < 4 * math.sqrt(p * (1 - p) / total.steps) + 1e-9, (i, rate, p)
    assert total.acceptance_length == pytest.approx(1 + sum(total.accept_rate_per_pos))


@pytest.mark.parametrize("mode,k,per_step", [("peagle", 1, 1), ("peagle", 3, 1), ("peagle", 7, 1),
                                             ("eagle3", 1, 1), ("eagle3", 3, 3), ("eagle3", 7, 7)])
def test_drafter_forwards_per_step(tiny, mode, k, per_step):
    decoder = make_decoder(tiny, "llama", "aws", mode, k)
    decoder.ex = counting = CountingExecutor(decoder.ex)
    decoder.proposer.ex = counting
    seq = generate(decoder, [7, 8, 9, 10], greedy(20))
    draft_calls = seq.stats.steps  # one drafting per verify step (after prefill and each step but the last)
    assert counting.drafter_calls == per_step * draft_calls == seq.stats.drafter_forwards
    assert counting.target_calls == seq.stats.target_forwards == seq.stats.steps + 1


def test_verify_has_k_plus_1_rows(tiny):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 5)
    shapes = []
    inner = decoder.ex.target
    decoder.ex.target = lambda tokens, *a, **kw: (shapes.append(tuple(tokens.shape)), inner(tokens, *a, **kw))[1]
    generate(decoder, [1, 2, 3], greedy(8))
    assert shapes[0] == (1, 3) and set(shapes[1:]) == {(1, 6)}


@pytest.mark.parametrize("k", [1, 3, 7, 11])
def test_parallel_first_draft_equals_sequential_first_draft(tiny, k):
    par = make_decoder(tiny, "qwen3", "speculators", "peagle", k)
    seq_dec = make_decoder(tiny, "qwen3", "speculators", "eagle3", k)
    for prompt in ([3], [4, 5, 6, 7, 8], list(range(50, 90))):
        a = new_sequence(par, prompt, greedy(50))
        b = new_sequence(seq_dec, prompt, greedy(50))
        par.prefill([a])
        seq_dec.prefill([b])
        assert a.output == b.output and a.drafts[0] == b.drafts[0]
        for _ in range(3):  # same emitted tokens -> same pending rows -> same first draft
            if a.output != b.output or a.stats.accepted != b.stats.accepted:
                break
            assert a.drafts[0] == b.drafts[0]
            par.step([a])
            seq_dec.step([b])
