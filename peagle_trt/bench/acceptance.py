"""Suite `acceptance` (docs/BENCHMARKS.md, "acceptance"): suite `heads` (bench/heads.py) on the trained
code pair (`peagle-trt demo`'s, or --pair: a target directory holding drafter-peagle/ and
drafter-eagle3/), torch backend: HumanEval's prompts as raw code (no chat template; trailing
whitespace dropped, cut to their last lines within --prompt-tokens), none vs P-EAGLE at --peagle-k vs
EAGLE-3 at --eagle3-k. Batch 8: AL pooled over requests, per-position acceptance, tok/s, T=0.7
(unless --skip-sampled), outputs compared token for token with none; batch 1: passes alternated
within --timing-repeats rounds, in process and (--served, the default) with none and each head's
best K in one tritonserver. Targets (issue 13): P-EAGLE AL at K=7 >= 2.5, batch-1 speed-up >= 1.5x.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peagle_trt.bench.heads import run_pair
from peagle_trt.bench.pair import code_prompts, int_list


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pair", type=Path, default=None,
                   help="target dir holding drafter-peagle/ and drafter-eagle3/ (default: the demo pair)")
    p.add_argument("--workdir", type=Path, default=Path("artifacts/bench_acceptance"), help="served repository")
    p.add_argument("--backend", default="torch", choices=["torch", "onnxruntime"])
    p.add_argument("--prompts", type=int, default=164, help="HumanEval prompts")
    p.add_argument("--timing-prompts", type=int, default=40, help="prompts of a batch-1 pass")
    p.add_argument("--timing-repeats", dest="rounds", type=int, default=3, help="batch-1 rounds (median reported)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=224, help="prompts are cut to their last lines within this")
    p.add_argument("--peagle-k", default="1,3,5,7,10")
    p.add_argument("--eagle3-k", default="1,3,5,7")
    p.add_argument("--skip-sampled", action="store_true", help="no T=0.7 pass")
    p.add_argument("--served", action=argparse.BooleanOptionalAction, default=True,
                   help="the served batch-1 phase (tritonserver)")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.tokenizer import TextCodec

    if args.pair is None:
        from peagle_trt.demo import code_pair

        args.pair = code_pair()
    if args.smoke:  # none and one K per head, a few short prompts, one batch-1 pass
        args.peagle_k, args.eagle3_k, args.prompts, args.max_tokens = "3", "3", 4, 8
        args.timing_prompts, args.rounds, args.skip_sampled = 2, 1, True
    args.target, args.peagle, args.eagle3 = args.pair, args.pair / "drafter-peagle", args.pair / "drafter-eagle3"
    args.ks = {"peagle": int_list(args.peagle_k), "eagle3": int_list(args.eagle3_k)}
    args.sampled_ks, args.set_ks = [] if args.skip_sampled else sorted({0, *args.ks["peagle"], *args.ks["eagle3"]}), []
    prompts = code_prompts(TextCodec(args.pair).tok, args.prompts, args.prompt_tokens)
    return run_pair(args, "code pair", {"humaneval": prompts}, False, args.prompt_tokens + args.max_tokens + 16,
                    ">= 2.5", ">= 1.5x")
