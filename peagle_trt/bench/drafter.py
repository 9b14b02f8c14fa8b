"""Suite `drafter` (docs/BENCHMARKS.md, "drafter"): one drafting step of K tokens, batch 1, on CPU:
P-EAGLE's one parallel forward (ParallelDrafter -> TorchExecutor.draft_parallel: the n = 3 pending
rows + K-1 mask rows, lm_head on the K sampled rows) against EAGLE-3's K sequential forwards
(SequentialDrafter), both through the real drafting classes on an executor holding only the drafter,
after a --context prefill, alternated per K. Heads: `tiny` and `gpt-oss-20b-peagle` (random weights
of the GPT-OSS-20B P-EAGLE shape; intermediate size and rope ASSUMED: bench/gpu.py, HEADS). ~1.5 min,
~6.5 GB RSS.
"""

from __future__ import annotations

import argparse
import os

import torch

from peagle_trt.bench.gpu import ASSUMED, HEADS, DrafterOnlyExecutor, build_head, draft_batch
from peagle_trt.bench.harness import Figure, alternate, finish, progress, summary, table
from peagle_trt.errors import ConfigError
from peagle_trt.speculative.drafting import ParallelDrafter, SequentialDrafter

PENDING = 3  # a = 2 accepted drafts + the bonus token
DRAFTER_HEADS = {"tiny": (300, 10), "gpt-oss-20b-peagle": (7, 2)}  # head -> default repeats, warm-up


def bench_head(name: str, ks: list[int], context: int, repeats: int | None, warmup: int | None) -> list[dict]:
    repeats = repeats or DRAFTER_HEADS[name][0]
    warmup = DRAFTER_HEADS[name][1] if warmup is None else warmup
    model = build_head(name, torch.device("cpu"), torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    progress(f"[{name}] built: {n_params / 1e6:.1f} M params ({n_params * 4 / 2**30:.2f} GiB fp32)"
             + (f"; ASSUMED: {ASSUMED[name]}" if name in ASSUMED else ""))
    ex = DrafterOnlyExecutor(model, 1, context + max(ks) + 8, "reference")
    batch = draft_batch(model, 1, PENDING, context, torch.device("cpu"))  # pending rows at context-3 .. context-1
    par_drafter, seq_drafter = ParallelDrafter(ex), SequentialDrafter(ex)
    parallel, sequential = (lambda k: par_drafter.propose(batch, k)), (lambda k: seq_drafter.propose(batch, k))
    rows = []
    for k in ks:
        t = alternate({"parallel": lambda: parallel(k), "sequential": lambda: sequential(k)}, repeats, warmup)
        par, seq = summary(t["parallel"], 1e3), summary(t["sequential"], 1e3)
        rows.append(dict(head=name, k=k, parallel_ms=par["median"], sequential_ms=seq["median"],
                         parallel_ms_min=par["min"], sequential_ms_min=seq["min"], parallel_spread=par["spread"],
                         sequential_spread=seq["spread"], parallel_rows=PENDING + k - 1, sequential_forwards=k,
                         repeats=repeats, warmup=warmup))
        progress(f"[{name}] K={k:<2d} parallel {par['median']:9.2f} ms   sequential {seq['median']:9.2f} ms")
    base = next((r["parallel_ms"] for r in rows if r["k"] == 1), None)
    for r in rows:
        r["seq_over_par"] = r["sequential_ms"] / r["parallel_ms"]
        r["par_over_par_k1"] = r["parallel_ms"] / base if base else None
    return rows


def rows_table(rows: list[dict]) -> str:
    body = [[r["head"], r["k"], f"{r['parallel_ms']:.2f}", f"{r['sequential_ms']:.2f}", f"{r['seq_over_par']:.2f}x",
             f"{r['par_over_par_k1']:.2f}x" if r["par_over_par_k1"] is not None else "n/a"] for r in rows]
    return table(["head", "K", "parallel ms", "sequential ms", "seq/par", "par K/par K=1"], body)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--heads", default="tiny,gpt-oss-20b-peagle",
                        help=f"comma-separated heads from {sorted(DRAFTER_HEADS)} (--smoke: tiny)")
    parser.add_argument("--ks", default="1,3,7,11", help="comma-separated draft lengths K")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repetitions per (head, K, mode); default: "
                             + ", ".join(f"{h} {r}" for h, (r, _) in DRAFTER_HEADS.items()))
    parser.add_argument("--warmup", type=int, default=None, help="warm-up runs per (head, K, mode)")
    parser.add_argument("--context", type=int, default=512, help="positions already in the KV cache")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def run(args: argparse.Namespace) -> dict:
    if args.smoke:  # tiny head, two K, a few repeats
        args.heads, args.ks, args.repeats, args.warmup = "tiny", "1,3", 3, 1
        args.context = 16
    heads = [h.strip() for h in args.heads.split(",") if h.strip()]
    ks = [int(k) for k in args.ks.split(",")]
    unknown = [h for h in heads if h not in DRAFTER_HEADS]
    if unknown:
        raise ConfigError(f"unknown heads {unknown}; choose --heads from {sorted(DRAFTER_HEADS)}")
    if min(ks) < 1 or args.context < PENDING:
        raise ConfigError(f"--ks must all be >= 1 and --context >= {PENDING}")

    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    rows = []
    with torch.inference_mode():
        for name in heads:
            rows += bench_head(name, ks, args.context, args.repeats, args.warmup)
    sections = [f"Drafting step, batch 1, context {args.context}, {PENDING} pending rows: median ms", rows_table(rows)]
    figures = [Figure(f"drafting step, {r['head']} head, P-EAGLE K={r['k']} over K=1", r["par_over_par_k1"], "x",
                      "<= 1.5x") for r in rows if r["k"] == max(k for k in ks if k <= 7) and r["par_over_par_k1"]]
    figures += [Figure(f"drafting step, {r['head']} head, K={r['k']}: EAGLE-3 over P-EAGLE", r["seq_over_par"], "x")
                for r in rows if r["k"] == max(k for k in ks if k <= 7)]
    heads_info = {h: dict(config={k: str(v) for k, v in HEADS[h].items()}, assumed=ASSUMED.get(h)) for h in heads}
    return finish(args, "Drafter forward: P-EAGLE parallel vs EAGLE-3 sequential", sections,
                  dict(context=args.context, batch=1, dtype="float32", heads=heads_info, rows=rows),
                  figures)
