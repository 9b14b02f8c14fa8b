"""How many drafts to verify next step: K fixed, capped by the batch-size schedule, or adaptive.

The verify forward is padded to the longest draft of its batch ([B, k + 1] rows) and the drafter
emits up to K per pass, so a step's cost depends on the batch's k, not on each request's: the rule
picks one k per drafting call (per step), from every request's own acceptance.

    cap   = SpecConfig.k_for_batch(B)                      (B: running requests; K without schedule)
    fixed : k = cap
    adaptive: k = argmax_{c in 0..cap}  sum_i E_i(c) / (T_verify(B * (c + 1)) + T_draft(B, c))
        E_i(c)   = 1 + sum_{j=1..c} prod_{l<=j} alpha_il       expected tokens of request i
        alpha_il = (hits_il + M * g_l) / (tries_il + M)        its acceptance at position l, given
                   the drafts before l were accepted, shrunk towards the server's g_l (M = 4)
        T_*      = the measured wall time of such forwards (EMA, `CostTable`); a shape not yet
                   measured is assumed as cheap as the nearest smaller one measured (optimism: it
                   gets tried once, then its real cost is known).
A request left at k = 0 keeps its target rows for the drafter (decoder.py, `Sequence.undrafted`)
and drafts one token once `PROBE_ROWS` have piled up: the drafter's cache stays filled and the
request's acceptance is measured again.
"""

from __future__ import annotations

import collections

import numpy as np

from peagle_trt.config import SpecConfig
from peagle_trt.speculative.stats import SpecStats

PRIOR_WEIGHT = 4.0  # M: pseudo-steps of the server's acceptance in each request's estimate
PROBE_ROWS = 16  # rows a k = 0 request defers before it drafts one token
EMA = 0.3  # weight of a new timing in the cost tables


class CostTable:
    """Measured seconds of forwards, by an integer shape key (rows, or (batch, k))."""

    def __init__(self):
        self.seconds: dict = {}

    def record(self, key, seconds: float) -> None:
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def estimate(self, key) -> float:
        if key in self.seconds:
            return self.seconds[key]
        below = [k for k in self.seconds if _le(k, key)]
        return self.seconds[max(below)] if below else 0.0


def _le(a, b) -> bool:
    if isinstance(a, tuple):  # (batch, k): same batch, fewer drafts
        return a[0] == b[0] and a[1] <= b[1]
    return a <= b


class DraftLengths:
    def __init__(self, spec: SpecConfig):
        self.spec, self.k = spec, spec.k
        self.verify_cost, self.draft_cost = CostTable(), CostTable()
        self.global_stats = SpecStats(spec.k, keep_steps=False)  # every step of every request
        self.steps_at_k: collections.Counter = collections.Counter()  # verify steps by their k (metrics)

    def choose(self, stats: list[SpecStats], batch: int, k_max: int) -> int:
        """k <= k_max (the decoder's K) for the next verify of requests with these stats, `batch`
        requests running."""
        cap = min(k_max, self.spec.k_for_batch(batch)) if self.spec.k_schedule else k_max
        if not self.spec.adaptive or cap == 0:
            return cap
        b = len(stats)
        gain = expected_tokens(stats, self.global_stats, cap).sum(axis=0)  # [cap + 1]
        cost = np.array([self.verify_cost.estimate(b * (c + 1)) + (self.draft_cost.estimate((b, c)) if c else 0.0)
                         for c in range(cap + 1)])
        if not cost.all():  # nothing measured yet at some k: try the largest unmeasured one
            return int(np.flatnonzero(cost == 0)[-1])
        return int(np.argmax(gain / cost))

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
