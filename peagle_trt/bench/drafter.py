"""Suite `drafter` (docs/BENCHMARKS.md, "drafter"): one drafting step of K tokens at batch 1 on CPU, P-EAGLE's
parallel pass vs EAGLE-3's K sequential passes: the `gpu` suite's drafting section (bench/gpu.py) on
the `tiny` and `gpt-oss-20b-peagle` heads (random fp32 weights; shapes ASSUMED as gpu.py says).
"""

from __future__ import annotations

import argparse
import os

import torch

from peagle_trt.bench.gpu import ASSUMED, HEADS, section_drafter
from peagle_trt.bench.harness import Figure, finish, records
from peagle_trt.errors import ConfigError

REPEATS = {"tiny": (300, 10), "gpt-oss-20b-peagle": (7, 2)}  # head -> default repeats, warm-up


SMOKE = dict(heads="tiny", ks="1,3", repeats=3, warmup=1, context=16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--heads", default="tiny,gpt-oss-20b-peagle", help=f"comma-separated, from {sorted(REPEATS)}")
    p.add_argument("--ks", default="1,3,7,11", help="comma-separated draft lengths K")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per (head, K, mode); default: "
                   + ", ".join(f"{h} {r}" for h, (r, _) in REPEATS.items()))
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs per (head, K, mode)")
    p.add_argument("--context", type=int, default=512, help="positions already in the KV cache")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def run(args: argparse.Namespace) -> dict:
    heads, ks = args.heads.split(","), [int(k) for k in args.ks.split(",")]
    if set(heads) - set(REPEATS) or min(ks) < 1 or args.context < 3:
        raise ConfigError(f"--heads from {sorted(REPEATS)}, --ks all >= 1, --context >= 3")
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    rows = []
    with torch.inference_mode():
        for h in heads:
            a = argparse.Namespace(batches=(1,), draft_ks=ks, context=args.context, suite=args.suite,
                                   repeats=args.repeats or REPEATS[h][0],
                                   warmup=REPEATS[h][1] if args.warmup is None else args.warmup)
            rows += section_drafter(a, h, torch.device("cpu"), torch.float32)
    k = max(k for k in ks if k <= 7)
    figures = [Figure(f"drafting step, {r['head']} head, P-EAGLE K={k} over K=1", r["par_over_par_k1"], "x", "<= 1.5x")
               for r in rows if r["k"] == k and r["par_over_par_k1"]]
    figures += [Figure(f"drafting step, {r['head']} head, K={k}: EAGLE-3 over P-EAGLE", r["seq_over_par"], "x")
                for r in rows if r["k"] == k]
    return finish(args, "Drafter forward: P-EAGLE parallel vs EAGLE-3 sequential", [
        f"Drafting step, batch 1, context {args.context}, 3 pending rows: median ms",
        records(rows, ["head", "k", "parallel_ms", "sequential_ms", "seq_over_par", "par_over_par_k1"])],
        {"context": args.context, "batch": 1, "dtype": "float32", "rows": rows,
         "heads": {h: {"config": {k: str(v) for k, v in HEADS[h].items()}, "assumed": ASSUMED.get(h)} for h in heads}},
        figures)
