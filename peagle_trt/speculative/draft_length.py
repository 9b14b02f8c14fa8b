"""How many drafts to verify next step: K fixed, capped by the batch-size schedule, or adaptive.

The verify forward is padded to the longest draft of its batch ([B, k + 1] rows) and the drafter
emits up to K per pass, so a step's cost depends on the batch's k, not on each request's: the rule
picks one k per drafting call (per step), from every request's own acceptance.

    cap   = SpecConfig.k_for_batch(B)                      (B: running requests; K without schedule)
    fixed : k = cap
    adaptive: k = argmax_{c in 0..cap}  sum_i E_i(c) / (T_verify(B * (c + 1)) + T_draft(B, c))
        E_i(c)   = 1 + sum_{j=1..c} prod_{l<=j} alpha_il       expected tokens of request i
        alpha_il = (hits_il + M * g_l) / (tries_il + M)        its acceptance at position l, given
                   the drafts before l were accepted, shrunk towards the server's g_l (M = 16)
        T_*      = measured wall times of a decode step's two halves, host work included: its
                   verify (from the step's start through acceptance and commit) and its drafting
                   (this rule, the drafter's inputs, the pass); per shape, the median of the last
                   15 readings (`CostTable`). A shape not yet measured is estimated optimistically:
                   a verify as the largest measured one of no more rows, a drafter pass as the
                   cheapest measured for this batch (0 when none), so a k is tried only when it
                   could win. A verify is also held under any measured one of more rows (costs
                   grow with rows). The first step (no verify of <= B rows measured) is plain.
    Every REFRESH-th choice takes the runner-up k: costs move and are noisy (a shared machine), and
    a k left aside after one bad reading gets measured again.
A request left at k = 0 keeps its target rows for the drafter (decoder.py, `Sequence.undrafted`).
Once one of them holds `probe_rows` rows, the whole batch drafts its rows and one token each: the
drafter's caches stay filled and every request's acceptance is measured again, in one 2-row
verify. The interval doubles with each probe (16 .. 64 rows) until the rule picks k > 0.
"""

from __future__ import annotations

import collections
import statistics

import numpy as np

from peagle_trt.config import SpecConfig
from peagle_trt.speculative.stats import SpecStats

PRIOR_WEIGHT = 16.0  # M: pseudo-steps of the server's acceptance in each request's estimate
PROBE_ROWS, MAX_PROBE_ROWS = 16, 64  # rows a k = 0 batch defers before it drafts one token
READINGS = 15  # the last timings of a shape whose median is its cost
REFRESH = 32  # every REFRESH-th choice takes the runner-up k, so that its cost and acceptance stay measured


class CostTable:
    """Measured seconds by a shape key (verify rows, or (batch, k) of a drafter pass): the median of
    its last `READINGS` readings, robust to the spikes of a shared machine."""

    def __init__(self):
        self.readings: dict = {}
        self.seconds: dict = {}  # key -> the median of its readings

    def record(self, key, seconds: float) -> None:
        last = self.readings.setdefault(key, collections.deque(maxlen=READINGS))
        last.append(seconds)
        self.seconds[key] = statistics.median(last)

    def verify(self, rows: int) -> float | None:
        """A verify of `rows` rows (None: nothing of <= rows measured). Its cost grows with rows, so
        it is at least the largest measured shape below and at most any measured shape above: an
        unmeasured shape takes the first bound (optimism), and a noisy high reading is capped by
        the second (a shape left aside after one bad reading is not left aside for ever)."""
        below = [r for r in self.seconds if r <= rows]
        if not below:
            return None
        above = [v for r, v in self.seconds.items() if r > rows]
        return min([self.seconds[max(below)], *above])

    def cheapest_pass(self, batch: int, k: int) -> float:
        """A drafter pass of `batch` requests drafting k: as measured, else the cheapest pass measured
        for that batch (one pass whatever k), else 0."""
        if (batch, k) in self.seconds:
            return self.seconds[(batch, k)]
        return min((v for (b, _), v in self.seconds.items() if b == batch), default=0.0)


class DraftLengths:
    def __init__(self, spec: SpecConfig):
        self.spec, self.k = spec, spec.k
        self.verify_cost, self.draft_cost = CostTable(), CostTable()
        self.global_stats = SpecStats(spec.k, keep_steps=False)  # every step of every request
        self.steps_at_k: collections.Counter = collections.Counter()  # verify steps by their k (metrics)
        self.probe_rows = PROBE_ROWS  # deferred rows that trigger the next probe at k = 0
        self.choices = 0  # adaptive choices made (every REFRESH-th takes the runner-up)

    def choose(self, stats: list[SpecStats], batch: int, k_max: int) -> int:
        """k <= k_max (the decoder's K) for the next verify of requests with these stats, `batch`
        requests running."""
        cap = min(k_max, self.spec.k_for_batch(batch)) if self.spec.k_schedule else k_max
        if not self.spec.adaptive or cap == 0:
            return cap
        b = len(stats)
        if self.verify_cost.verify(b) is None:  # a batch size never verified: one plain step first
            return 0
        gain = expected_tokens(stats, self.global_stats, cap).sum(axis=0)  # [cap + 1]
        cost = np.array([self.verify_cost.verify(b * (c + 1)) + (self.draft_cost.cheapest_pass(b, c) if c else 0.0)
                         for c in range(cap + 1)])
        order = np.argsort(-(gain / cost), kind="stable")  # best first
        if order[0]:
            self.probe_rows = PROBE_ROWS
        self.choices += 1
        return int(order[1] if self.choices % REFRESH == 0 else order[0])

    def probed(self) -> None:
        """A probe was drafted at k = 0: wait twice as long for the next one."""
        self.probe_rows = min(2 * self.probe_rows, MAX_PROBE_ROWS)

    def record(self, stats: SpecStats, k: int, accepted: int) -> None:
        self.global_stats.record_step(k, accepted)


def expected_tokens(stats: list[SpecStats], server: SpecStats, cap: int) -> np.ndarray:
    """E_i(c) for c = 0..cap, [B, cap + 1]: tokens a step of c drafts is expected to emit."""
    def first(values: list) -> list:  # the first `cap` counts, zero-padded
        return (list(values) + [0] * cap)[:cap]

    g = (np.array(first(server.hits)) + PRIOR_WEIGHT * 0.5) / (np.array(first(server.tries)) + PRIOR_WEIGHT)
    hits = np.array([first(s.hits) for s in stats], dtype=np.float64)  # [B, cap]
    tries = np.array([first(s.tries) for s in stats], dtype=np.float64)
    alpha = (hits + PRIOR_WEIGHT * g) / (tries + PRIOR_WEIGHT)  # [B, cap]
    out = np.ones((len(stats), cap + 1))
    out[:, 1:] += np.cumsum(np.cumprod(alpha, axis=1), axis=1)
    return out
