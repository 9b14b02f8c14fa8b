"""Suites `verify-shapes` and `deterministic` (docs/BENCHMARKS.md, one section each), presets of this
module (PRESETS): one float32 target forward (default: the cached SmolLM2-135M) of B requests x R rows
each at --context cached positions per request, per contender (CONTENDERS: an executor and how it runs)
and shape, all alternated; medians in ms and each contender's ratio to the one it is compared with.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch

from peagle_trt.bench.harness import Figure, alternate, finish, lines, options, records, summary
from peagle_trt.errors import ConfigError

# name -> (executor, deterministic, torch on one thread, the contender it is compared with)
CONTENDERS = {"torch": ("torch", False, False, ""), "torch 1 thread": ("torch", False, True, ""),
              "torch deterministic": ("torch", True, False, "torch 1 thread"),
              "onnxruntime": ("onnxruntime", False, False, ""),
              "onnxruntime deterministic": ("onnxruntime", True, False, "onnxruntime")}
GRID = ",".join(f"{b}x{r}" for b in (1, 2, 4, 8) for r in (1, 2, 3, 4, 8) if b * r <= 32)
PRESETS = {  # suite -> its defaults
    "verify-shapes": dict(contenders="onnxruntime", shapes=GRID, context=300, rounds=22, warmup=3,
                          figure_shapes="1x1,8x4"),
    "deterministic": dict(contenders=",".join(CONTENDERS), shapes="1x1,8x1,1x4,8x4", context=128, rounds=9,
                          figure_shapes="8x4,1x1"),
}


SMOKE = dict(target="code-pair", context=16, rounds=2, shapes="1x1,2x4", figure_shapes="1x1,2x4")


def forward(ex, b: int, r: int, context: int) -> Callable[[], object]:
    """One target forward of executor `ex` as a verify runs it: `b` requests x `r` rows each at positions
    context .. context + r - 1, request i in blocks i*M .. (i + 1)*M - 1 of every KV group."""
    m, device = ex.kv.max_blocks, ex.device
    tokens = torch.randint(0, 100, (b, r), device=device)
    positions = (context + torch.arange(r, device=device)).expand(b, -1).contiguous()
    tables = torch.arange(b * m, device=device).view(1, b, m).expand(len(ex.windows), -1, -1).contiguous()
    return lambda: ex.target(tokens, positions, tables)


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


def shape_name(b: int, r: int) -> str:
    return f"decode, batch {b}" if r == 1 else f"verify ({r} rows), batch {b}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    options(p, target="smollm2", context=128, rounds=9, warmup=1)
    p.add_argument("--contenders", default="onnxruntime", help=f"comma-separated, from {list(CONTENDERS)}")
    p.add_argument("--shapes", default="1x1", help="comma-separated REQUESTSxROWS")
    p.add_argument("--figure-shapes", default="1x1", help="the shapes of the headline figures")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import KVLayout, SpecConfig
    from peagle_trt.executors.onnxruntime import OrtExecutor
    from peagle_trt.executors.torch import TorchExecutor

    names = args.contenders.split(",")
    if set(names) - set(CONTENDERS):
        raise ConfigError(f"unknown --contenders {sorted(set(names) - set(CONTENDERS))}; from {list(CONTENDERS)}")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    target, _ = load_pair(args.target, None, SpecConfig("none", 0)).build()
    kv = KVLayout.for_sequences(max(b for b, _ in shapes), args.context + max(r for _, r in shapes))
    calls = {}
    for c in names:
        backend, deterministic, single, _ = CONTENDERS[c]
        ex = (TorchExecutor(target, None, kv, deterministic=deterministic) if backend == "torch" else
              OrtExecutor.from_models(target, None, None, kv, deterministic=deterministic))
        for b, r in shapes:
            calls[c, b, r] = one_thread(forward(ex, b, r, args.context)) if single else forward(ex, b, r, args.context)
    stats = {key: summary(t, 1e3) for key, t in alternate(calls, args.rounds, args.warmup).items()}
    rows = []
    for b, r in shapes:
        row = {"shape": shape_name(b, r), "requests": b, "rows_per_request": r}
        for c in names:
            base = CONTENDERS[c][3]
            row[c] = round(stats[c, b, r]["median"], 2)
            row[f"{c} spread"] = round(stats[c, b, r]["spread"], 3)
            if base in names:
                row[f"{c} over {base}"] = round(stats[c, b, r]["median"] / stats[base, b, r]["median"], 3)
        rows.append(row)
    where = f"{Path(args.target).name}, {'CPU' if len(names) > 1 else names[0] + ', CPU'}"
    wanted = [tuple(map(int, s.split("x"))) for s in args.figure_shapes.split(",")]
    ratios = [c for c in names[::-1] if CONTENDERS[c][3] in names]
    picked = [(b, r, row) for b, r in wanted for row in rows if (row["requests"], row["rows_per_request"]) == (b, r)]
    figures = [Figure(f"{c} over {CONTENDERS[c][3]}: {shape_name(b, r)} ({where})",
                      row[f"{c} over {CONTENDERS[c][3]}"], "x") for c in ratios for b, r, row in picked]
    if not ratios:  # one contender: its milliseconds
        figures = [Figure(f"verify forward, {b} request{'s' * (b > 1)} x {r} row{'s' * (r > 1)} ({where})",
                          row[names[0]], "ms", "", 1) for b, r, row in picked]
    png = lines(args, "", [("One target forward", "requests x rows each", "ms per forward (median)",
                            {c: ([f"{b}x{r}" for b, r in shapes], [row[c] for row in rows]) for c in names})])
    return finish(args, f"One target forward by shape and contender, context {args.context}, medians of "
                  f"{args.rounds} rounds (ms; X over Y: the ratio to the contender it is compared with)",
                  [records(rows, ["shape", *names, *(f"{c} over {CONTENDERS[c][3]}" for c in ratios)]), png],
                  {"rows": rows}, figures)
