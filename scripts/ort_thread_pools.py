"""One onnxruntime thread pool per process vs one per session, on a real target and a P-EAGLE head:
the measurement behind docs/BENCHMARKS.md "One thread pool for the target and the drafter".

    python scripts/ort_thread_pools.py --peagle HEAD [--target DIR] [--rounds 2]   # ~4 min, JSON last line

Each round runs two child processes, alternating their order: `shared` (the executor as it is,
executors/onnxruntime.py) and `per-session` (the same sessions, each with its own intra-op pool of
onnxruntime's default size: the executor before the change). A child decodes the same HumanEval
requests greedily at batch 1 through the code that serves (`peagle_trt.bench.speculation.generator`)
with none, K = 1 and K = 3, and times every target forward of a decode step, keyed by its rows
and the rows of the verify before it. Figures: tok/s per configuration and the median ms of a
verify of R rows (same rows before it, or after a drafter pass).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def child(args) -> dict:
    from peagle_trt.executors import onnxruntime as ort_executor

    if args.child == "per-session":
        import onnxruntime as ort

        def session(path, threads, weights=None):  # the executor's options, a pool of the session's own
            source = path if isinstance(path, bytes) else str(path)
            return ort.InferenceSession(source, ort_executor.session_options(weights),
                                        providers=["CPUExecutionProvider"])

        ort_executor._session = session
    from peagle_trt.bench.heads import HUMANEVAL_REQUEST, run_batch
    from peagle_trt.bench.prompts import humaneval_prompts
    from peagle_trt.bench.speculation import generator
    from peagle_trt.config import SamplingParams, SpecConfig

    gen_args = SimpleNamespace(target=args.target, peagle=args.peagle, long_tokens=256, backend="onnxruntime",
                               threads=None)
    prompts = [HUMANEVAL_REQUEST.format(prompt=p["prompt"]) for p in humaneval_prompts()][40:40 + args.prompts]
    out = {}
    for name, spec in (("none", SpecConfig("none", 0)), ("K=1", SpecConfig("peagle", 1)),
                       ("K=3", SpecConfig("peagle", 3))):
        gen = generator(gen_args, spec, 1)
        run_batch(gen, prompts[:1], SamplingParams(max_tokens=4), 1)  # warm-up
        ex, ms, last = gen.scheduler.decoder.ex, collections.defaultdict(list), [0]
        forward = ex.target

        def timed(tokens, *rest, forward=forward, ms=ms, last=last):
            t0 = time.perf_counter()
            result = forward(tokens, *rest)
            rows = tokens.shape[1]
            if rows <= 8:  # decode steps, not prefill chunks
                ms[f"{rows} rows after {last[0]}"].append(1e3 * (time.perf_counter() - t0))
            last[0] = rows
            return result

        ex.target = timed
        wall, results = run_batch(gen, prompts, SamplingParams(max_tokens=args.max_tokens), 1)
        out[name] = {"tok_s": round(sum(len(r["token_ids"]) for r in results) / wall, 2),
                     "verify_ms": {k: round(statistics.median(v), 2) for k, v in sorted(ms.items()) if len(v) >= 5}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peagle", type=Path, required=True, help="P-EAGLE head directory")
    p.add_argument("--target", type=Path, default=None, help="target dir (default: the cached SmolLM2)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--child", choices=["shared", "per-session"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.target is None:
        from peagle_trt.convert.packaged import cached_target

        args.target = cached_target("smollm2")
    if args.child:
        print(json.dumps(child(args)))
        return
    runs = collections.defaultdict(list)
    for r in range(args.rounds):
        for mode in (("shared", "per-session") if r % 2 == 0 else ("per-session", "shared")):
            print(f"[ort_thread_pools] round {r + 1}/{args.rounds}: {mode}", file=sys.stderr, flush=True)
            cmd = [sys.executable, __file__, "--peagle", str(args.peagle), "--target", str(args.target),
                   "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens), "--child", mode]
            done = subprocess.run(cmd, check=True, capture_output=True, text=True)
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    summary = {mode: {name: {"tok_s": [run[name]["tok_s"] for run in rs], "verify_ms": rs[-1][name]["verify_ms"]}
                      for name in rs[0]} for mode, rs in runs.items()}
    for name in summary["shared"]:
        ratios = [a / b for a, b in zip(summary["shared"][name]["tok_s"], summary["per-session"][name]["tok_s"])]
        summary.setdefault("shared_over_per_session", {})[name] = round(statistics.median(ratios), 3)
    print(json.dumps({"script": "ort_thread_pools", "date": time.strftime("%Y-%m-%d"), **summary}))


if __name__ == "__main__":
    main()
