"""K per step: the batch-size schedule (K = 0 steps included), adaptive K and synthetic acceptance
run the real speculate-verify path; greedy outputs stay identical to target-only decoding while k
changes between steps and differs between requests of one verify (padding rows)."""

from __future__ import annotations

import numpy as np
import pytest

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.runtime.scheduler import Request, Scheduler, generate
from peagle_trt.speculative.draft_length import READINGS, REFRESH, CostTable, DraftLengthPolicy, _at, expected_tokens
from peagle_trt.speculative.stats import SpecStats
from tests.helpers import collect, make_decoder

PROMPTS = [[5, 9, 13, 200, 7], [1, 2, 3], [42] * 12, [300, 301, 302, 303, 7, 7, 9], [11, 400]]
LENGTHS = [60, 12, 35, 48, 20]  # requests finish at different times: the batch shrinks, K grows


@pytest.fixture(scope="module")
def references(tiny):
    plain = make_decoder(tiny, "llama", None, "none", 1, max_len=256)
    return [generate(plain, p, SamplingParams(max_tokens=n, ignore_eos=True)).output for p, n in zip(PROMPTS, LENGTHS)]


def run_all(decoder, chosen: list | None = None) -> tuple[list, list]:
    sched = Scheduler(decoder, prefill_chunk=8)
    outputs: dict = {}
    for i, (p, n) in enumerate(zip(PROMPTS, LENGTHS)):
        sched.add(Request(str(i), p, SamplingParams(max_tokens=n, ignore_eos=True), collect(outputs)))
    while sched.has_work:
        sched.step()
        if chosen is not None:
            chosen.append(sorted({len(r.seq.drafts) for r in sched.running}))
    assert sched.blocks.used_blocks == 0
    done = [outputs[str(i)] for i in range(len(PROMPTS))]
    return [o["ids"] for o in done], [o["stats"] for o in done]


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
def test_schedule_with_plain_steps_is_lossless(tiny, references, mode):
    # batch >= 3: K = 0 (plain decoding, drafter rows deferred, batch-wide probes); 2: K = 1; 1: K = 3
    spec = SpecConfig(mode, 3, ((1, 1, 3), (2, 2, 1), (3, 8, 0)))
    decoder = make_decoder(tiny, "llama", "aws", mode, 3, max_len=256, slots=5, spec=spec)
    chosen: list = []
    outputs, stats = run_all(decoder, chosen)
    assert outputs == references
    seen = {k for ks in chosen for k in ks}
    assert {0, 1, 3} <= seen  # all three regimes ran (mixed k in one verify: the next test)
    assert stats[0].steps < stats[0].target_forwards - 1  # request 0 decoded some steps plainly


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
def test_one_verify_of_drafts_of_different_lengths_is_lossless(tiny, references, mode):
    # every step drops the last drafts of one request: the verify pads its rows (position -1)
    # next to full-length ones; accepted tokens must not change
    decoder = make_decoder(tiny, "llama", "aws", mode, 3, max_len=256, slots=5)
    original, mixed = decoder.step, []

    def step(seqs):
        live = [s for s in seqs if not s.finished and len(s.drafts)]  # drafts: a device row or a list
        if len(live) > 1:
            victim = live[len(mixed) % len(live)]
            victim.drafts = victim.drafts[:len(mixed) % 3]
            mixed.append({len(s.drafts) for s in live})
        original(seqs)

    decoder.step = step
    assert run_all(decoder)[0] == references
    assert any(len(ks) > 1 for ks in mixed)


def test_adaptive_k_is_lossless(tiny, references):
    spec = SpecConfig("peagle", 4, adaptive=True)
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 4, max_len=256, slots=5, spec=spec)
    chosen: list = []
    assert run_all(decoder, chosen)[0] == references
    assert len({k for ks in chosen for k in ks}) > 1  # it explored / adapted


def test_sampled_outputs_with_schedule_are_reproducible(tiny):
    spec = SpecConfig("peagle", 3, ((1, 1, 3), (2, 8, 0)))
    params = [SamplingParams(max_tokens=n, temperature=0.8, seed=i) for i, n in enumerate(LENGTHS)]
    runs = []
    for _ in range(2):
        decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256, slots=5, spec=spec)
        sched, outputs = Scheduler(decoder, prefill_chunk=8), {}
        for i, (p, sp) in enumerate(zip(PROMPTS, params)):
            sched.add(Request(str(i), p, sp, collect(outputs)))
        sched.run_until_idle()
        runs.append([outputs[str(i)]["ids"] for i in range(len(PROMPTS))])
    assert runs[0] == runs[1] and all(len(o) == n for o, n in zip(runs[0], LENGTHS))


def test_synthetic_acceptance_hits_its_mean_length(tiny):
    spec = SpecConfig("peagle", 3, synthetic_rates=(1.0, 0.5, 0.25))  # AL = 1 + 1 + 0.5 + 0.25 = 2.75
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=1024, spec=spec)
    seq = generate(decoder, [1, 2, 3], SamplingParams(max_tokens=900, ignore_eos=True))
    assert len(seq.output) == 900
    assert seq.stats.acceptance_length == pytest.approx(2.75, abs=0.12)
    assert seq.stats.histogram.get(0, 0) == 0  # rate 1.0 at position 1: never zero accepted


def test_adaptive_rule_prefers_free_rows_for_good_drafts_and_none_for_bad():
    lengths = DraftLengthPolicy(SpecConfig("peagle", 4, adaptive=True))
    for c in range(5):  # a memory-bound verify: rows nearly free; one drafter pass 20% of a step
        lengths.verify_cost.record(1, c, 1.0 + 0.02 * c)
        if c:
            lengths.draft_cost.record(1, c, 0.2)
    good, bad = SpecStats(4), SpecStats(4)
    for _ in range(200):  # enough steps to outweigh the prior (M = 16 pseudo-steps at g = 0.5)
        good.record_step(4, 4)
        bad.record_step(4, 0)
    assert lengths.choose([good], 1, 4) == 4
    assert lengths.choose([bad], 1, 4) == 0
    e = expected_tokens([good, bad], lengths.global_stats, 4)
    assert e.shape == (2, 5) and np.all(np.diff(e, axis=1) >= 0) and e[0, 4] > 4.5 and e[1, 4] < 1.2


def test_a_position_seldom_reached_is_assumed_no_better_than_the_one_before():
    server = SpecStats(3)
    for _ in range(84):
        server.record_step(1, 0)
    for _ in range(16):
        server.record_step(1, 1)  # position 1: 16 / 100 accepted; positions 2, 3: never tried
    g1 = (16 + 16 * 0.5) / (100 + 16)
    e = expected_tokens([SpecStats(3)], server, 3)[0]  # a new request: the server's rates
    assert e == pytest.approx([1, 1 + g1, 1 + g1 + g1 ** 2, 1 + g1 + g1 ** 2 + g1 ** 3])


def test_adaptive_rule_respects_the_schedule_cap_and_explores_upwards_while_it_pays():
    lengths = DraftLengthPolicy(SpecConfig("peagle", 4, ((1, 1, 4), (2, 8, 2)), adaptive=True))
    stats = [SpecStats(4), SpecStats(4)]  # no steps: alpha = g = 0.5, E = 1, 1.5, 1.75 tokens
    assert lengths.choose(stats, 2, 4) == 0  # nothing measured: one plain step
    lengths.verify_cost.record(2, 0, 1.0)
    assert lengths.choose(stats, 2, 4) == 1  # one draft more than measured, assumed as cheap: tried
    lengths.verify_cost.record(2, 1, 1.05)
    lengths.draft_cost.record(2, 1, 0.05)
    assert lengths.choose(stats, 2, 4) == 2  # it paid (1.5 / 1.1 > 1 / 1.0): one more, the schedule's cap
    lengths.verify_cost.record(2, 2, 3.0)  # ... found expensive
    lengths.draft_cost.record(2, 2, 0.2)
    assert lengths.choose(stats, 2, 4) == 1
    for _ in range(2):
        lengths.verify_cost.record(2, 1, 2.5)  # k = 1 dearer than it first looked (median 2.5)
    assert lengths.choose(stats, 2, 4) == 0  # measured: nothing beats plain steps
    assert lengths.choose(stats * 3, 6, 4) == 0  # 6 requests, never verified: a plain step first
    for _ in range(3):
        lengths.verify_cost.record(2, 1, 9.0)  # readings 3x too high (a noisy machine) ...
    assert lengths.choose(stats, 2, 4) == 0  # ... change no choice


def test_costs_are_a_monotone_curve_of_recent_readings_per_batch_size():
    table = CostTable()
    assert table.curve(1) is None and _at(None, 3) == 0.0 and table.frontier(1) == 1
    table.record(1, 0, 1.0)
    table.record(1, 2, 2.0)
    table.record(4, 0, 5.0)  # four requests: their own curve, never mixed with one request's
    c = table.curve(1)
    assert [_at(c, k) for k in (0, 1, 2, 4)] == pytest.approx([1.0, 1.5, 2.0, 2.5])  # linear; above: half the slope
    assert table.frontier(1) == 3 and table.frontier(4) == 1
    assert _at(table.curve(4), 7) == _at(table.curve(4), 0) == 5.0  # one k read: flat both ways
    table.record(1, 1, 3.0)  # noise inverts k = 1 and k = 2: pooled, the curve never falls
    assert [_at(table.curve(1), k) for k in (0, 1, 2)] == pytest.approx([1.0, 2.5, 2.5])
    for _ in range(READINGS):  # only the last READINGS readings count
        table.record(1, 3, 2.0)
        table.record(1, 4, 2.5)
    c = table.curve(1)
    assert [k for k, _ in c] == [3, 4] and _at(c, 1) == pytest.approx(1.0)  # below: the first slope
    assert _at(c, 0) == pytest.approx(1.0)  # ... down to half the lowest k's cost: never free (no 1 / 0 rate)


def test_probes_back_off_while_the_rule_stays_at_zero():
    lengths = DraftLengthPolicy(SpecConfig("peagle", 4, adaptive=True))
    intervals = [lengths.probe_rows]
    for _ in range(6):
        lengths.probed()
        intervals.append(lengths.probe_rows)
    assert intervals == [16, 32, 64, 64, 64, 64, 64]
    lengths.verify_cost.record(1, 0, 1.0)
    lengths.verify_cost.record(1, 1, 1.0)
    lengths.draft_cost.record(1, 1, 0.01)
    good = SpecStats(4)
    for _ in range(20):
        good.record_step(4, 4)
    assert lengths.choose([good], 1, 4) > 0 and lengths.probe_rows == 16  # speculating again: reset


def test_a_near_tie_keeps_the_last_k_of_its_batch_size():
    def rule(draft_seconds: float, last: int) -> int:
        lengths = DraftLengthPolicy(SpecConfig("peagle", 1, adaptive=True))
        lengths.verify_cost.record(1, 0, 1.0)
        lengths.verify_cost.record(1, 1, 1.0)
        lengths.draft_cost.record(1, 1, draft_seconds)
        lengths.last[1] = last
        return lengths.choose([SpecStats(1)], 1, 1)  # E = 1 and 1.5 tokens: k = 1 at 1.5 / (1 + draft)

    assert rule(0.485, last=0) == 0 and rule(0.485, last=1) == 1  # within 1%: kept either way
    assert rule(0.40, last=0) == 1 and rule(0.60, last=1) == 0  # 7% better / 6% worse: switched


def test_every_refresh_th_choice_measures_the_runner_up_again():
    lengths = DraftLengthPolicy(SpecConfig("peagle", 2, adaptive=True))
    for c, seconds in ((0, 1.0), (1, 1.05), (2, 2.0)):
        lengths.verify_cost.record(1, c, seconds)
    for c in (1, 2):
        lengths.draft_cost.record(1, c, 0.05)
    stats = [SpecStats(2)]  # no steps: alpha = g = 0.5, E = 1, 1.5, 1.75 tokens
    picks = [lengths.choose(stats, 1, 2) for _ in range(2 * REFRESH)]
    # tokens per second: k = 0: 1.0, k = 1: 1.5 / 1.1 = 1.36 (best), k = 2: 1.75 / 2.05 = 0.85
    assert [i for i, k in enumerate(picks) if k != 1] == [REFRESH - 1, 2 * REFRESH - 1]
    assert picks[REFRESH - 1] == 0  # the runner-up


def test_a_refresh_is_one_step_and_the_hold_stays_with_the_best():
    """The runner-up within the hold (k = 0, 2% worse) is measured for one step, then k = 1 again:
    were the refresh held, k = 0 would run until the next refresh."""
    lengths = DraftLengthPolicy(SpecConfig("peagle", 1, adaptive=True))
    lengths.verify_cost.record(1, 0, 1.0)
    lengths.verify_cost.record(1, 1, 1.0)
    lengths.draft_cost.record(1, 1, 0.47)  # k = 1: 1.5 / 1.47 = 1.02 tokens per second, k = 0: 1.0
    picks = [lengths.choose([SpecStats(1)], 1, 1) for _ in range(2 * REFRESH)]
    assert [i for i, k in enumerate(picks) if k != 1] == [REFRESH - 1, 2 * REFRESH - 1]
