"""Suite `step-cost` (docs/BENCHMARKS.md, "step-cost"): where a decode step's time goes at batch 1, in
process on CPU: the trained code pair (--pair, default the demo's) decoding HumanEval prompts one at a
time through the scheduler and speculative decoder the served model runs, for none, P-EAGLE and
EAGLE-3 at the given K, alternated within --rounds rounds (medians). The executor's `target`,
`draft_parallel` and `drafter` are wrapped with timers: target (the verify forward), drafter (one pass
or K passes), other (wall - both). Break-even AL = ms/step over none's ms/step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from peagle_trt.bench.harness import Figure, alternate, finish, progress, reported, table
from peagle_trt.bench.prompts import humaneval_prompts
from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.speculative.stats import SpecStats
from peagle_trt.tokenizer import TextCodec


def timed(obj, name: str, bucket: dict) -> None:
    """Wrap obj.name so that its wall time adds up in bucket[name]."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            bucket[name] = bucket.get(name, 0.0) + time.perf_counter() - t0
    setattr(obj, name, wrapper)


def decoder_for(pair: Path, method: str, k: int) -> tuple[SpecDecoder, dict]:
    spec = SpecConfig(method, k) if method != "none" else SpecConfig("none", 0)
    head = pair / f"drafter-{'peagle' if method == 'none' else method}"
    target, drafter = load_pair(pair, head, spec).build()
    ex = TorchExecutor(target, drafter if method != "none" else None, 1, 512)
    bucket: dict = {}
    for name in ("target", "draft_parallel", "drafter"):
        timed(ex, name, bucket)
    return SpecDecoder(ex, spec), bucket


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", type=Path, default=None,
                   help="target dir holding drafter-peagle/ and drafter-eagle3/ (default: the demo pair)")
    p.add_argument("--configs", default="none,peagle:3,peagle:5,peagle:7,eagle3:3,eagle3:5",
                   help="comma-separated METHOD[:K]")
    p.add_argument("--prompts", type=int, default=16, help="HumanEval prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the figures are medians over them")


def run(args: argparse.Namespace) -> dict:
    if args.pair is None:
        from peagle_trt.demo import code_pair

        args.pair = code_pair()
    if args.smoke:
        args.configs, args.prompts, args.max_tokens, args.rounds = "none,peagle:3,eagle3:3", 2, 8, 1
    codec = TextCodec(args.pair)
    rows = humaneval_prompts()[:args.prompts]
    prompts = [codec.encode_prompt(r["prompt"].rstrip(), chat_template=False)[-224:] for r in rows]
    params = SamplingParams(max_tokens=args.max_tokens)
    configs = [(c.split(":")[0], int(c.split(":")[1]) if ":" in c else 0) for c in args.configs.split(",")]
    decoders = {c: decoder_for(args.pair, *c) for c in configs}
    runs: dict = {c: [] for c in configs}

    def one(c):
        def go() -> float:
            dec, bucket = decoders[c]
            generate(dec, prompts[0], params)  # warm-up
            bucket.clear()
            stats = SpecStats(max(c[1], 1))
            t0 = time.perf_counter()
            for prompt in prompts:
                stats.merge(generate(dec, prompt, params).stats)
            wall = time.perf_counter() - t0
            steps = stats.target_forwards
            ms = {name: 1e3 * bucket.get(name, 0.0) / steps for name in ("target", "draft_parallel", "drafter")}
            runs[c].append({"wall": wall, "tokens": stats.tokens, "steps": steps, "al": stats.acceptance_length,
                            "target": ms["target"], "drafter": ms["draft_parallel"] + ms["drafter"],
                            "step": 1e3 * wall / steps})
            return wall
        return go

    alternate({c: one(c) for c in configs}, args.rounds, warmup=0, clock=reported,
              on_round=lambda r: progress(f"[step-cost] round {r + 1}/{args.rounds}"))
    out = []
    base = statistics.median(r["tokens"] / r["wall"] for r in runs[("none", 0)]) if ("none", 0) in runs else None
    for c in configs:
        med = {key: statistics.median(r[key] for r in runs[c]) for key in ("step", "target", "drafter")}
        tps = statistics.median(r["tokens"] / r["wall"] for r in runs[c])
        out.append({"method": c[0], "K": c[1], "acceptance_length": round(runs[c][0]["al"], 3),
                    "ms_per_step": round(med["step"], 3), "target_ms": round(med["target"], 3),
                    "drafter_ms": round(med["drafter"], 3),
                    "other_ms": round(med["step"] - med["target"] - med["drafter"], 3),
                    "tokens_per_s": round(tps, 1), "speedup": round(tps / base, 3) if base else None})
    best = {m: max((r for r in out if r["method"] == m), key=lambda r: r["speedup"] or 0)
            for m in ("peagle", "eagle3") if any(r["method"] == m for r in out)}
    figures = [Figure(f"code pair, in-process batch 1: {m} K={r['K']} over none (CPU)", r["speedup"], "x")
               for m, r in best.items() if r["speedup"]]
    return finish(args, f"Where a step's time goes, batch 1, {len(prompts)} prompts x {args.max_tokens} tokens, "
                  f"medians of {args.rounds} rounds", [table(
                      ["config", "K", "AL", "ms/step", "target", "drafter", "other", "tok/s", "x none"],
                      [[r["method"], r["K"], f"{r['acceptance_length']:.2f}", f"{r['ms_per_step']:.2f}",
                        f"{r['target_ms']:.2f}", f"{r['drafter_ms']:.2f}", f"{r['other_ms']:.2f}",
                        f"{r['tokens_per_s']:.1f}", f"{r['speedup'] or 0:.2f}"] for r in out])],
                  {"torch_threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
                   "prompts": len(prompts), "max_tokens": args.max_tokens, "rounds": args.rounds, "rows": out},
                  figures)
