"""Suite `verify-shapes` (docs/BENCHMARKS.md, "verify-shapes"): what a verify costs by its shape: B requests
x R rows each, one target forward on onnxruntime at a --context length (default target: the cached
SmolLM2-135M). Every shape with B in 1, 2, 4, 8 and R in 1, 2, 3, 4, 8 (B x R <= 32) is a contender,
alternated within --rounds rounds after 3 warm-up runs; the figure is the median ms. Each request has
its own blocks of the paged cache and its rows at positions context .. context + R - 1, so each reads
`context` positions of KV (zeros: the cost, not the values). The cost model of bench/draft_length.py
(and the per-batch costs of adaptive K, peagle_trt/speculative/draft_length.py) is fit to this table.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from peagle_trt.bench.harness import Figure, alternate, finish, summary, table


def forward(ex, b: int, r: int, context: int, blocks: int) -> Callable[[], object]:
    """One target forward of executor `ex` as a verify runs it: `b` requests x `r` rows each at positions
    context .. context + r - 1, request i in blocks i*blocks .. (i + 1)*blocks - 1 of the paged cache."""
    tokens = torch.randint(0, 100, (b, r))
    positions = (context + torch.arange(r)).expand(b, -1).contiguous()
    tables = torch.arange(b * blocks).view(1, b, blocks)  # [1, B, M]
    return lambda: ex.target(tokens, positions, tables)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target dir (default: the cached SmolLM2)")
    p.add_argument("--context", type=int, default=300, help="positions each request has before its rows")
    p.add_argument("--rounds", type=int, default=22, help="alternated rounds (after 3 warm-up runs)")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import KVLayout, SpecConfig
    from peagle_trt.executors.onnxruntime import OrtExecutor

    if args.smoke:  # the demo's code pair target, a short context, two shapes
        from peagle_trt.demo import code_pair

        args.target, args.context, args.rounds = code_pair(), 16, 2
    if args.target is None:
        from peagle_trt.convert.packaged import cached_target

        args.target = cached_target("smollm2")
    target, _ = load_pair(args.target, None, SpecConfig("none", 0)).build()
    kv = KVLayout.for_sequences(8, args.context + 64)
    ex, m = OrtExecutor.from_models(target, None, None, kv=kv), kv.max_blocks
    shapes = [(1, 1), (2, 4)] if args.smoke else [(b, r) for b in (1, 2, 4, 8) for r in (1, 2, 3, 4, 8) if b * r <= 32]

    t = alternate({(b, r): forward(ex, b, r, args.context, m) for b, r in shapes}, args.rounds, warmup=3)
    rows = [{"requests": b, "rows_per_request": r, "rows": b * r, "ms": round(summary(t[(b, r)], 1e3)["median"], 2),
             "spread": round(summary(t[(b, r)])["spread"], 3)} for b, r in shapes]
    ms = {(x["requests"], x["rows_per_request"]): x["ms"] for x in rows}
    where = f"{Path(args.target).name}, onnxruntime, CPU"
    return finish(args, f"Verify cost by shape, context {args.context} (onnxruntime)",
                  [table(["requests", "rows each", "rows", "ms", "spread"],
                         [[x["requests"], x["rows_per_request"], x["rows"], x["ms"], x["spread"]] for x in rows])],
                  {"target": str(args.target), "context": args.context, "rounds": args.rounds, "shapes": rows},
                  [Figure(f"verify forward, {b} request{'s' * (b > 1)} x {r} row{'s' * (r > 1)} ({where})",
                          ms[(b, r)], "ms", "", 1) for b, r in ((1, 1), (8, 4)) if (b, r) in ms])
