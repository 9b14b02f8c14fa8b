"""How many drafts to verify next step: K fixed, capped by the batch-size schedule, or adaptive.

The verify forward is padded to the longest draft of its batch ([B, k + 1] rows) and the drafter
emits up to K per pass, so a step's cost depends on the batch's k, not on each request's: the rule
picks one k per drafting call (per step), from every request's own acceptance.

    cap   = SpecConfig.k_for_batch(B)                      (B: running requests; K without schedule)
    fixed : k = cap
    adaptive: k = argmax_{c in 0..cap}  sum_i E_i(c) / (T_verify(B, c) + T_draft(B, c))
        E_i(c)   = 1 + sum_{j=1..c} prod_{l<=j} alpha_il       expected tokens of request i
        alpha_il = (hits_il + M * g_l) / (tries_il + M)        its acceptance at position l, given
                   the drafts before l were accepted, shrunk towards the server's g_l (M = 16)
        g_l      = (hits_l + M * g_{l-1}) / (tries_l + M)      the server's, g_0 = 1/2: a position
                   seldom reached is assumed no better than the one before it
        T_*      = measured wall times of a decode step's two halves, host work included: its
                   verify of B requests with c drafts each (from the step's start through
                   acceptance and commit) and its drafting (this rule, the drafter's inputs, the
                   pass; 0 at c = 0). Per B, each is the median per c of B's last 32 readings,
                   made non-decreasing in c (`CostTable`); between the c read linear, below them
                   the first segment's slope (down to half the lowest read), above them half the
                   last segment's slope (flat after one c): an untried c looks cheaper than the
                   trend says (optimism), and c goes up to one more than the most read, so
                   untried k are explored upwards, one at a time, while they could pay. A drafter
                   pass with no reading costs 0; a batch size with no verify reading takes a plain
                   step.
    A batch size keeps its last k while that is within 3% of the best (HOLD: near ties flip with
    the noise, and leaving k = 0 costs a pass over every deferred row, which T does not see).
    Every REFRESH-th choice takes the runner-up k for that one step: costs move and are noisy (a
    shared machine), and a k left aside after one bad reading gets measured again. The hold stays
    with the best: were the runner-up held, a k a few percent worse would run until the next
    refresh (measured: a quarter of the steps at k = 2 where k = 1 was 6% faster).
Why per B and over recent readings, not per verify row count over all time: a verify's cost is
mostly per request (each reads its own context's KV), so B requests x (c + 1) rows cost far more
than one request with as many rows (measured 26.6 ms for 4 x 1 rows, 20.3 ms for 1 x 4); and a
shape chosen rarely keeps old readings, from shorter contexts or a quieter machine, that a table
of all-time medians would compare with fresh ones (docs/BENCHMARKS.md, "Speculation controls").
A request left at k = 0 keeps its target rows for the drafter (decoder.py, `Sequence.undrafted`).
Once one of them holds `probe_rows` rows, the whole batch drafts its rows, so that the drafter's
caches stay filled; under adaptive K also one token each (a probe: every request's acceptance
measured again, in one 2-row verify). The interval doubles with each such pass (16 .. 64 rows)
until the rule picks k > 0.
"""

from __future__ import annotations

import collections
import statistics

import numpy as np

from peagle_trt.config import SpecConfig
from peagle_trt.speculative.stats import SpecStats

PRIOR_WEIGHT = 16.0  # M: pseudo-steps of the server's acceptance in each request's estimate
PROBE_ROWS, MAX_PROBE_ROWS = 16, 64  # rows a k = 0 batch defers before it drafts one token
READINGS = 32  # the last readings of a batch size that its costs are fit to
REFRESH = 32  # every REFRESH-th choice takes the runner-up k, so that its cost and acceptance stay measured
HOLD = 0.03  # a k within this fraction of the best expected tokens per second is kept


class CostTable:
    """Seconds of a step half by shape (requests b, drafts k). Per b, the medians per k of b's last
    `READINGS` readings, made non-decreasing in k (pooled where noise inverts them), so that shapes
    are compared as measured at one time (a verify gets dearer as the contexts grow, and with the
    machine's load) and a spike moves no median far. Between the k read: linear; below them: the
    first segment's slope, down to half the lowest k's cost (never free); above them: half the last
    segment's slope (optimism), flat when only one k was read."""

    def __init__(self):
        self.readings: dict[int, collections.deque] = {}  # b -> (k, seconds), newest last

    def record(self, b: int, k: int, seconds: float) -> None:
        self.readings.setdefault(b, collections.deque(maxlen=READINGS)).append((k, seconds))

    def curve(self, b: int) -> list[tuple[int, float]] | None:
        """[(k, seconds)] by rising k for batch size b, non-decreasing; None before a reading."""
        if not self.readings.get(b):
            return None
        by_k: dict[int, list] = collections.defaultdict(list)
        for k, sec in self.readings[b]:
            by_k[k].append(sec)
        blocks: list[list] = []  # [ks, value, weight]: pool adjacent violators (weights = readings)
        for k in sorted(by_k):
            blocks.append([[k], statistics.median(by_k[k]), len(by_k[k])])
            while len(blocks) > 1 and blocks[-2][1] > blocks[-1][1]:
                (ks1, v1, w1), (ks2, v2, w2) = blocks.pop(-2), blocks.pop()
                blocks.append([ks1 + ks2, (v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2])
        return [(k, v) for ks, v, _ in blocks for k in ks]

    def frontier(self, b: int) -> int:
        """One draft more than the most among b's readings (1 when it has none)."""
        return 1 + max((k for k, _ in self.readings.get(b, ())), default=0)


def _at(curve: list[tuple[int, float]] | None, k: int) -> float:
    """A cost curve's seconds for k drafts (0 without a curve: nothing measured yet, optimism)."""
    if not curve:
        return 0.0
    (k0, c0), (k_last, c_last) = curve[0], curve[-1]
    if len(curve) == 1:  # one point: flat both ways
        return c_last
    if k >= k_last:  # half the last segment's slope: optimistic (a step's marginal rows cost less and less)
        (kp, cp) = curve[-2]
        return c_last + 0.5 * (c_last - cp) / (k_last - kp) * (k - k_last)
    if k <= k0:
        slope = (curve[1][1] - c0) / (curve[1][0] - k0)
        return max(0.5 * c0, c0 - slope * (k0 - k))  # optimistic, never free
    (ka, ca), (kb, cb) = next((p, q) for p, q in zip(curve, curve[1:]) if p[0] <= k <= q[0])
    return ca + (cb - ca) * (k - ka) / (kb - ka)


class DraftLengthPolicy:
    def __init__(self, spec: SpecConfig):
        self.spec, self.num_spec_tokens = spec, spec.num_spec_tokens
        self.verify_cost, self.draft_cost = CostTable(), CostTable()
        self.global_stats = SpecStats(spec.num_spec_tokens, keep_steps=False)  # every step of every request
        self.steps_at_k: collections.Counter = collections.Counter()  # verify steps by their k (metrics)
        self.probe_rows = PROBE_ROWS  # deferred rows that trigger the next probe at k = 0
        self.choices = 0  # adaptive choices made (every REFRESH-th takes the runner-up)
        self.last: dict[int, int] = {}  # batch size -> the k chosen last for it

    def choose(self, stats: list[SpecStats], batch: int, k_max: int) -> int:
        """k <= k_max (the decoder's K) for the next verify of requests with these stats, `batch`
        requests running."""
        cap = min(k_max, self.spec.k_for_batch(batch)) if self.spec.k_schedule else k_max
        if not self.spec.adaptive or cap == 0:
            return cap
        b = len(stats)
        verify, draft = self.verify_cost.curve(b), self.draft_cost.curve(b)
        if verify is None:
            return 0  # a batch size never verified: one plain step first
        top = min(cap, self.verify_cost.frontier(b))  # untried k are tried upwards, one at a time
        gain = expected_tokens(stats, self.global_stats, top).sum(axis=0)  # [top + 1]
        cost = np.array([_at(verify, c) + (_at(draft, c) if c else 0.0) for c in range(top + 1)])
        # a near tie keeps this batch size's last k: switching has costs the rule does not see
        # (leaving k = 0 drafts every deferred row)
        last = self.last.get(b)
        order = ranked(gain / cost, last if last is not None and last <= top else None)
        if order[0]:
            self.probe_rows = PROBE_ROWS
        self.choices += 1
        self.last[b] = order[0]  # a refresh measures the runner-up once; the hold stays with the best
        return order[1] if self.choices % REFRESH == 0 else order[0]

    def probed(self) -> None:
        """A probe was drafted at k = 0: wait twice as long for the next one."""
        self.probe_rows = min(2 * self.probe_rows, MAX_PROBE_ROWS)

    def record(self, stats: SpecStats, k: int, accepted: int) -> None:
        self.global_stats.record_step(k, accepted)


def ranked(rate: np.ndarray, last: int | None) -> list[int]:
    """Indices of `rate` (expected tokens per second), best first; `last` (the previous choice)
    first while within HOLD of the best."""
    order = [int(c) for c in np.argsort(-rate, kind="stable")]
    if last is not None and rate[last] >= (1 - HOLD) * rate[order[0]]:
        order.remove(last)
        order.insert(0, last)
    return order


def expected_tokens(stats: list[SpecStats], server: SpecStats, cap: int) -> np.ndarray:
    """E_i(c) for c = 0..cap, [B, cap + 1]: tokens a step of c drafts is expected to emit."""
    def first(values: list) -> list:  # the first `cap` counts, zero-padded
        return (list(values) + [0] * cap)[:cap]

    g, prior = np.empty(cap), 0.5  # the server's rate per position, shrunk towards the one before
    for pos, (h, t) in enumerate(zip(first(server.hits), first(server.tries))):
        g[pos] = prior = (h + PRIOR_WEIGHT * prior) / (t + PRIOR_WEIGHT)
    hits = np.array([first(s.hits) for s in stats], dtype=np.float64)  # [B, cap]
    tries = np.array([first(s.tries) for s in stats], dtype=np.float64)
    alpha = (hits + PRIOR_WEIGHT * g) / (tries + PRIOR_WEIGHT)  # [B, cap]
    out = np.ones((len(stats), cap + 1))
    out[:, 1:] += np.cumsum(np.cumprod(alpha, axis=1), axis=1)
    return out
