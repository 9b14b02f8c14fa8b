"""Suite `deterministic` (docs/BENCHMARKS.md, "deterministic"): what deterministic mode costs (docs/SERVING.md,
"Deterministic mode"). One float32 target forward (default: the cached SmolLM2-135M) for decode (1 row per
request) and verify (K + 1 = 4 rows per request) at batch 1 and 8, each request at --context cached
positions (bench/verify_shapes.py's `forward`), on the torch and onnxruntime executors over the same
weights, each plain and deterministic, plus plain torch on one thread (deterministic torch runs on one
thread: that contender separates the cost of its fixed row blocks and row-wise attention from the thread
count). Every (contender, shape) is timed once per round, all alternated within --rounds rounds after a
warm-up; figures are medians in ms. Headline: deterministic over plain (torch: over torch on one thread)
at verify batch 8 and decode batch 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from peagle_trt.bench.harness import Figure, alternate, finish, plot, summary, table
from peagle_trt.bench.verify_shapes import forward

SHAPES = {"decode, batch 1": (1, 1), "decode, batch 8": (8, 1), "verify (4 rows), batch 1": (1, 4),
          "verify (4 rows), batch 8": (8, 4)}
# contender -> (its executor's name, the contender it is compared with: "" for none)
CONTENDERS = {"torch": ("torch", ""), "torch 1 thread": ("torch", ""),
              "torch deterministic": ("torch deterministic", "torch 1 thread"),
              "onnxruntime": ("onnxruntime", ""),
              "onnxruntime deterministic": ("onnxruntime deterministic", "onnxruntime")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target dir (default: the cached SmolLM2)")
    p.add_argument("--context", type=int, default=128, help="positions each request has before its rows")
    p.add_argument("--rounds", type=int, default=9, help="alternated rounds (after one warm-up run)")


def one_thread(fn):
    """`fn` run with torch on one intra-op thread (restored after)."""
    def call():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn()
        finally:
            torch.set_num_threads(threads)
    return call


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import KVLayout, SpecConfig
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.executors.torch import TorchExecutor

    if args.smoke:  # the demo's code pair target, a short context
        from peagle_trt.demo import code_pair

        args.target, args.context, args.rounds = code_pair(), 16, 2
    if args.target is None:
        from peagle_trt.convert.packaged import cached_target

        args.target = cached_target("smollm2")
    target, _ = load_pair(args.target, None, SpecConfig("none", 0)).build()
    kv = KVLayout.for_sequences(8, args.context + 8)
    executors = {"torch": TorchExecutor(target, None, kv),
                 "torch deterministic": TorchExecutor(target, None, kv, deterministic=True),
                 "onnxruntime": OrtExecutor.from_models(target, None, None, kv),
                 "onnxruntime deterministic": OrtExecutor.from_models(target, None, None, kv, deterministic=True)}
    calls = {}
    for c, (ex, _) in CONTENDERS.items():
        for s, (b, r) in SHAPES.items():
            fn = forward(executors[ex], b, r, args.context, kv.max_blocks)
            calls[c, s] = one_thread(fn) if c == "torch 1 thread" else fn
    t = alternate(calls, args.rounds)
    stats = {key: summary(samples, 1e3) for key, samples in t.items()}
    ms = {s: {c: round(stats[c, s]["median"], 1) for c in CONTENDERS} for s in SHAPES}
    spread = {s: {c: round(stats[c, s]["spread"], 3) for c in CONTENDERS} for s in SHAPES}
    ratio = {s: {c: round(stats[c, s]["median"] / stats[base, s]["median"], 3)
                 for c, (_, base) in CONTENDERS.items() if base} for s in SHAPES}
    rows = [[s] + [f"{ms[s][c]:.1f}" + (f" ({ratio[s][c]:.2f}x)" if c in ratio[s] else "") for c in CONTENDERS]
            for s in SHAPES]
    note = ("ms, median; in brackets: torch deterministic over torch on 1 thread, "
            "onnxruntime deterministic over onnxruntime")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(8, 4))
        for i, c in enumerate(CONTENDERS):
            ax.bar([j + 0.16 * i for j in range(len(SHAPES))], [ms[s][c] for s in SHAPES], 0.16, label=c)
        ax.set_xticks([j + 0.32 for j in range(len(SHAPES))], list(SHAPES), fontsize=8)
        ax.set_ylabel("ms per forward (median)")
        return fig

    where = f"{Path(args.target).name} fp32, CPU"
    figures = [Figure(f"{c} over {base}: {s} ({where})", ratio[s][c], "x", "", 2)
               for c, (_, base) in list(CONTENDERS.items())[::-1] if base
               for s in ("verify (4 rows), batch 8", "decode, batch 1")]
    png = plot(args, "", draw)
    return finish(args, f"Deterministic mode: cost of one target forward, context {args.context}",
                  [table(["forward", *CONTENDERS], rows), note, f"![ms per forward]({png})" if png else ""],
                  {"target": str(args.target), "context": args.context, "rounds": args.rounds,
                   "ms_median": ms, "spread": spread, "ratio": ratio}, figures)
