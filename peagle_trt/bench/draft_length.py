"""Suite `draft-length` (docs/BENCHMARKS.md, "draft-length"): the adaptive rule (peagle_trt/speculative/draft_length.py,
seeing only what it sees in the decoder) against every fixed K on a simulated server, no model run: every
configuration meets the same requests, acceptance draws (by request kind, per head in HEADS) and load
curve (x 1 + drift sin(t / 7 s), x exp(N(0, noise)) per reading); step costs (ms) model the measured
SmolLM2-135M shapes; k = 0 defers rows to one catch-up pass with a probe token, as the decoder does.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass, field

from peagle_trt.bench.harness import Figure, finish, table
from peagle_trt.config import SpecConfig
from peagle_trt.speculative.draft_length import DraftLengthPolicy
from peagle_trt.speculative.stats import SpecStats

K_MAX, TOKENS = 7, 96
FIXED_KS = (0, 1, 2, 3, 5, 7)
HEADS = {  # acceptance at each position given the drafts before it were accepted, by request kind
    "weak": {"code": (0.30, 0.09, 0.02), "prose": (0.42, 0.10, 0.02), "long": (0.30, 0.08)},
    "good": {"code": (0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55), "prose": (0.5, 0.4, 0.3, 0.25, 0.2, 0.2, 0.2),
             "long": (0.35, 0.2, 0.1, 0.1, 0.1, 0.1, 0.1)},
}
CONTEXT = {"code": 150, "prose": 100, "long": 2000}  # prompt tokens by kind
WORKLOADS = {"code": ("code",), "prose": ("prose",), "mixed": ("code", "prose", "long")}


def verify_ms(b: int, k: int, context: int) -> float:  # fit to `peagle-trt bench verify-shapes`
    return 8.0 + b * (3.3 + 1.4 * k) + 0.01 * context * (1 + 0.25 * k)


def draft_ms(b: int, k: int, deferred_rows: int = 0) -> float:  # fit to the `draft_slots` figures
    return 1.2 + 0.08 * b + 0.3 * k + 0.05 * deferred_rows


@dataclass
class Request:
    kind: str
    context: int
    left: int = TOKENS
    deferred: int = 0  # rows waiting for the drafter (steps at k = 0)
    stats: SpecStats = field(default_factory=lambda: SpecStats(K_MAX))


def simulate(policy: int | None, kinds: list[str], head: str, batch: int, seed: int,
             noise: float, drift: float) -> float:
    """Tokens per simulated second serving `kinds` in a closed loop of `batch`: fixed K = `policy`,
    or the adaptive rule (policy None)."""
    accept_rng, noise_rng = random.Random(seed), random.Random(seed + 1)
    lengths = DraftLengthPolicy(SpecConfig("peagle", K_MAX, adaptive=True)) if policy is None else None
    queue, active, clock, tokens = list(kinds), [], 0.0, 0
    while queue or active:
        while queue and len(active) < batch:
            kind = queue.pop(0)
            active.append(Request(kind, CONTEXT[kind]))
        b, context = len(active), sum(r.context for r in active)
        k = policy if lengths is None else lengths.choose([r.stats for r in active], b, K_MAX)
        load = 1 + drift * math.sin(clock / 7.0)

        def seconds(ms: float) -> float:
            return ms * load * math.exp(noise_rng.gauss(0.0, noise)) / 1e3

        t_verify, t_draft = seconds(verify_ms(b, k, context)), 0.0
        for r in active:
            accepted = 0
            for rate in HEADS[head][r.kind][:k]:
                if accept_rng.random() >= rate:
                    break
                accepted += 1
            if k and lengths is not None:  # what the decoder records for the rule
                r.stats.record_step(k, accepted)
                lengths.record(r.stats, k, accepted)
            emitted = min(accepted + 1, r.left)
            r.left, r.context, tokens = r.left - emitted, r.context + emitted, tokens + emitted
            if k == 0:
                r.deferred += emitted
        deferred = sum(r.deferred for r in active)
        if k:  # the drafter reads this step's rows (and any deferred ones)
            t_draft = seconds(draft_ms(b, k, deferred))
        elif lengths is not None and max(r.deferred for r in active) >= lengths.probe_rows:
            t_draft = seconds(draft_ms(b, 1, deferred))  # the deferred rows and a probe token
            lengths.probed()
        if t_draft:  # every deferred row drafted
            for r in active:
                r.deferred = 0
        if lengths is not None:
            lengths.verify_cost.record(b, k, t_verify)
            if k:
                lengths.draft_cost.record(b, k, t_draft)
        clock += t_verify + t_draft
        active = [r for r in active if r.left > 0]
    return tokens / clock


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--noise", type=float, default=0.08, help="sigma of each reading's log-normal noise")
    p.add_argument("--drift", type=float, default=0.1, help="amplitude of the load curve (0.1: +-10%%)")
    p.add_argument("--seeds", type=int, default=3, help="acceptance and noise draws per cell (mean taken)")


def run(args: argparse.Namespace) -> dict:
    seeds, n1 = (1, 3) if args.smoke else (args.seeds, 30)  # requests at batch 1 (x3 at batch 8)
    rows = []
    for head in HEADS:
        for batch, n in ((1, n1), (8, 3 * n1)):
            for workload, cycle in WORKLOADS.items():
                kinds = [cycle[i % len(cycle)] for i in range(n)]
                rate = {p: statistics.fmean(simulate(p, kinds, head, batch, s, args.noise, args.drift)
                                            for s in range(seeds)) for p in (*FIXED_KS, None)}
                best = max(FIXED_KS, key=rate.get)
                rows.append({"head": head, "batch": batch, "workload": workload, "best_fixed": f"K={best}",
                             "best_fixed_tokens_per_s": round(rate[best], 1),
                             "adaptive_over_best_fixed": round(rate[None] / rate[best], 3),
                             **{f"K={p}": round(rate[p] / rate[best], 3) for p in FIXED_KS}})
    cols = ["head", "batch", "workload", "best_fixed", "adaptive_over_best_fixed", *(f"K={p}" for p in FIXED_KS)]
    worst = min(rows, key=lambda r: r["adaptive_over_best_fixed"])
    return finish(args, "Adaptive K on a simulated server (ratios to the best fixed K)",
                  [table(cols, [[r[c] for c in cols] for r in rows])],
                  {"seeds": seeds, "rows": rows},
                  [Figure("adaptive K over the best fixed K, simulated server, worst cell",
                          worst["adaptive_over_best_fixed"], "x", ">= 0.97x", 3)])
