"""Suite `step-cost` (docs/BENCHMARKS.md, "step-cost"): where a decode step's time goes at batch 1, in
process on CPU (bench/pair.py): the trained code pair (--pair, default the demo's) decoding HumanEval
prompts (raw code, the last lines within 224 tokens) one at a time through the generator, scheduler
and speculative decoder the server runs (torch executor), for none, P-EAGLE and EAGLE-3 at the given
K, passes alternated within --rounds rounds (medians). The executor's `target`, `draft_parallel` and
`drafter` are timed: target (the verify forward), drafter (one pass or K passes), other (the rest).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from peagle_trt.bench.harness import Figure, finish, table
from peagle_trt.bench.pair import Config, code_prompts, measure
from peagle_trt.config import SpecConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", type=Path, default=None,
                   help="target dir holding drafter-peagle/ and drafter-eagle3/ (default: the demo pair)")
    p.add_argument("--configs", default="none,peagle:3,peagle:5,peagle:7,eagle3:3,eagle3:5",
                   help="comma-separated METHOD[:K]")
    p.add_argument("--prompts", type=int, default=16, help="HumanEval prompts")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--rounds", type=int, default=3, help="rounds; the figures are medians over them")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.tokenizer import TextCodec

    if args.pair is None:
        from peagle_trt.demo import code_pair

        args.pair = code_pair()
    if args.smoke:
        args.configs, args.prompts, args.max_tokens, args.rounds = "none,peagle:3,eagle3:3", 2, 8, 1
    args.target, args.backend = args.pair, "torch"
    configs = []
    for item in args.configs.split(","):
        method, _, k = item.partition(":")
        spec = SpecConfig(method, int(k)) if method != "none" else SpecConfig("none", 0)
        configs.append(Config(method if method == "none" else f"{method} K={k}", spec,
                              None if method == "none" else args.pair / f"drafter-{method}"))
    prompts = code_prompts(TextCodec(args.pair).tok, args.prompts, 224)
    rows = measure(args, configs, {"humaneval": prompts}, [1], 224 + args.max_tokens + 16, False, timers={})
    best = {m: max((r for r in rows if r["method"] == m), key=lambda r: r["speedup"])
            for m in ("peagle", "eagle3") if any(r["method"] == m for r in rows)}
    figures = [Figure(f"code pair, in-process batch 1: {m} K={r['K']} over none (CPU)", r["speedup"], "x")
               for m, r in best.items()]
    return finish(args, f"Where a step's time goes, batch 1, {len(prompts)} prompts x {args.max_tokens} tokens, "
                  f"medians of {args.rounds} rounds", [table(
                      ["config", "AL", "ms/step", "target", "drafter", "other", "tok/s", "x none"],
                      [[r["config"], f"{r['acceptance_length']:.2f}", f"{r['ms_per_step']:.2f}",
                        f"{r['target_ms']:.2f}", f"{r['drafter_ms']:.2f}", f"{r['other_ms']:.2f}",
                        f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}"] for r in rows])],
                  {"torch_threads": torch.get_num_threads(), "prompts": len(prompts), "max_tokens": args.max_tokens,
                   "rounds": args.rounds, "rows": rows}, figures)
