"""Suite `heads` (docs/BENCHMARKS.md, "heads"): a real target (default the cached SmolLM2-135M) and its
two trained heads, P-EAGLE (one parallel drafter pass) vs EAGLE-3 (K sequential passes) vs none, in
process with the code that serves (bench/pair.py: TextGenerator, chat template, onnxruntime). Prompt
sets: HumanEval (164), held-out instructions (modules the heads never saw), long (2K-token module
sources). Phases: (1) per configuration, batch 8: AL pooled over requests, per-position acceptance,
tok/s, T=0.7 at --sampled-ks, held-out and long at --set-ks; every greedy output equals none's
(mismatches 0); (2) batch-1 speed, passes alternated within rounds; (3) --served: none and each head's
best K in one tritonserver, alternated the same way. Suite `acceptance` is this one on the code pair.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from peagle_trt.bench.harness import Figure, finish, plot, progress, stdout_to_stderr, table
from peagle_trt.bench.pair import acceptance_phase, drawing, head_configs, int_list, measure, served
from peagle_trt.errors import ConfigError


def rows_table(rows: list[dict], b1: list[dict]) -> str:
    speed = {r["config"]: r for r in b1}
    body = []
    for r in rows:
        s, h = speed.get(r["config"], {}), r["humaneval"]
        cells = [r["method"], r["K"], f"{h['acceptance_length']:.2f}"]
        cells += [f"{r[key]['acceptance_length']:.2f}" if key in r else ""
                  for key in ("humaneval_t0.7", "heldout", "long")]
        cells += [" ".join(f"{p:.2f}" for p in h["accept_rate_per_pos"]), f"{s['tokens_per_s']:.1f}" if s else "",
                  f"{s['speedup']:.2f}" if s else "", f"{h['tokens_per_s_b8']:.1f}", f"{r['speedup_b8']:.2f}",
                  r["mismatches"]]
        body.append(cells)
    return table(["method", "K", "AL HumanEval", "AL T=0.7", "AL held-out", "AL long", "per-position",
                  "tok/s b1", "x none", "tok/s b8", "x none", "mismatches"], body)


def run_pair(args, label: str, sets: dict, chat_template: bool, max_seq_len: int,
             al_target: str = "", speed_target: str = "") -> dict:
    """The three phases on configurations none + each head at args.ks[method]; the report."""
    configs = head_configs({"peagle": args.peagle, "eagle3": args.eagle3}, args.ks)
    t0 = time.perf_counter()
    with stdout_to_stderr():  # tritonserver and the model build print on fd 1
        rows = acceptance_phase(args, configs, sets, max_seq_len, chat_template)
        b1 = measure(args, configs, {"humaneval": sets["humaneval"][:args.timing_prompts]}, [1], max_seq_len,
                     chat_template)
        best = {m: max((r for r in b1 if r["method"] == m), key=lambda r: r["tokens_per_s"])["K"]
                for m in ("peagle", "eagle3") if args.ks.get(m)}
        serve = None
        if args.served:
            args.workdir.mkdir(parents=True, exist_ok=True)
            serve = served(args, [c for c in configs if c.spec.k == best.get(c.spec.mode, 0)],
                           sets["humaneval"][:args.timing_prompts], max_seq_len, chat_template)
    plot_name = plot(args, "", drawing(rows, b1, f"HumanEval, {label}"))
    sections = [f"HumanEval {len(sets['humaneval'])} prompts, held-out {len(sets.get('heldout', []))}, long "
                f"{len(sets.get('long', []))}; {args.max_tokens} new tokens at most; {args.backend}; batch 1: "
                f"median of {args.rounds} alternated passes over {args.timing_prompts} prompts", rows_table(rows, b1)]
    if serve:
        sections += ["### Served by tritonserver, batch 1 (alternated)", table(
            ["method", "K", "AL", "tok/s b1", "x none", "mismatches"],
            [[r["method"], r["K"], f"{r['acceptance_length']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['speedup']:.2f}",
              r["mismatches"]] for r in serve])]
    sections.append(f"![{plot_name}]({plot_name})" if plot_name else "")
    figures = [Figure(f"{label}, HumanEval AL, {r['method']} K={r['K']}", r["humaneval"]["acceptance_length"], "",
                      al_target) for r in rows if r["method"] == "peagle" and r["K"] == 7]
    figures += [Figure(f"{label}, HumanEval batch 1, {r['method']} K={r['K']} over none ({where}, CPU)", r["speedup"],
                       "x", speed_target) for where, rs in (("in-process", b1), ("served", serve or []))
                for r in rs if r["method"] != "none" and r["K"] == best[r["method"]]]
    return finish(args, f"{label}: P-EAGLE vs EAGLE-3 vs none ({args.backend})", sections,
                  {"target": str(args.target), "peagle": str(args.peagle), "eagle3": str(args.eagle3),
                   "backend": args.backend, "sets": {k: len(v) for k, v in sets.items()}, "max_tokens": args.max_tokens,
                   "rows": rows, "batch1": b1, "best_k_b1": best, "served": serve,
                   "total_s": round(time.perf_counter() - t0, 1)}, figures)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=Path, default=None, help="target dir (default: the cached SmolLM2)")
    p.add_argument("--peagle", type=Path, default=None, help="P-EAGLE head directory (required)")
    p.add_argument("--eagle3", type=Path, default=None, help="EAGLE-3 head directory (required)")
    p.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "torch"])
    p.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads (default: its own)")
    p.add_argument("--ks", default="1,3,5,7,10", help="K of both heads")
    p.add_argument("--sampled-ks", default="3,7", help="K measured at T=0.7 too")
    p.add_argument("--set-ks", default="7", help="K measured on the held-out and long sets too")
    p.add_argument("--humaneval", type=int, default=164, help="HumanEval problems")
    p.add_argument("--heldout", type=int, default=48, help="held-out instructions")
    p.add_argument("--long", type=int, default=6, help="long-context prompts")
    p.add_argument("--long-tokens", type=int, default=2048, help="tokens of module source per long prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--timing-prompts", type=int, default=6, help="HumanEval prompts of a batch-1 pass")
    p.add_argument("--timing-repeats", dest="rounds", type=int, default=3, help="batch-1 rounds (median reported)")
    p.add_argument("--served", action="store_true", help="also the served batch-1 phase (tritonserver)")
    p.add_argument("--workdir", type=Path, default=Path("artifacts/bench_heads"), help="served repository")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.bench.pair import prompt_sets
    from peagle_trt.tokenizer import TextCodec

    if args.smoke:
        from peagle_trt.demo import code_pair

        pair = code_pair()
        args.target, args.peagle, args.eagle3 = pair, pair / "drafter-peagle", pair / "drafter-eagle3"
        args.ks, args.sampled_ks, args.set_ks, args.humaneval, args.heldout, args.long = "3", "3", "3", 4, 2, 1
        args.long_tokens, args.max_tokens, args.timing_prompts, args.rounds, args.backend = 200, 8, 1, 1, "torch"
    if args.target is None:
        from peagle_trt.convert.packaged import cached_target

        args.target = cached_target("smollm2", progress=progress)
    if args.peagle is None or args.eagle3 is None:
        raise ConfigError("pass both heads: --peagle DIR --eagle3 DIR (scripts/make_smollm2_heads.py trains them)")
    ks = int_list(args.ks)
    args.ks, args.sampled_ks, args.set_ks = {"peagle": ks, "eagle3": ks}, int_list(args.sampled_ks), \
        int_list(args.set_ks)
    sets = prompt_sets(args, TextCodec(args.target))
    progress("[heads] prompts: " + ", ".join(f"{k} {len(v)}" for k, v in sets.items()))
    return run_pair(args, f"{Path(args.target).name} heads", sets, True, args.long_tokens + args.max_tokens + 64)

