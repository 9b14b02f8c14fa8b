"""`peagle-trt bench SUITE [options]` (`--help`: the suites) and `peagle-trt bench report [--write]
[--record-run RUN.json --commit SHA]` (the headline table of docs/BENCHMARKS.md from docs/results.json,
and a run saved elsewhere recorded into it: peagle_trt/bench/results.py). A suite is imported only
when it runs (heavy optional dependencies stay out of every other command); its report goes to stdout and
OUTPUT_DIR/bench_SUITE.md, its results to OUTPUT_DIR/bench_SUITE.json and the LAST stdout line (printed by
peagle_trt/cli.py); `--record FILE` copies its headline figures into the results file.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import time
from pathlib import Path

from peagle_trt.bench import results as results_file
from peagle_trt.bench.harness import model_dir, stem

# suite name -> (its module in this package, one line); the order is docs/BENCHMARKS.md's. Suites that
# share a module differ by its PRESETS[name] (the defaults of their options)
SUITES: dict[str, tuple[str, str]] = {
    "drafter": ("gpu", "drafter forward on CPU: P-EAGLE parallel pass vs EAGLE-3 sequential passes, by K"),
    "scheduler": ("scheduler", "Scheduler.step() host overhead per step with a no-op executor"),
    "serving": ("serving", "streaming: Triton gRPC vs in-process (and the OpenAI frontend with --openai)"),
    "backends": ("backends", "CPU: quantize and export times, torch vs onnxruntime step time, fp32 vs FP8"),
    "gpu": ("gpu", "GPU: drafting, verify MBU, iteration overhead, projected tokens/s (needs CUDA; --smoke on CPU)"),
    "kernels": ("kernels", "GPU: the Triton kernels alone (CUDA graphs), achieved bandwidth vs the roofline"),
    "aiperf": ("aiperf", "OpenAI endpoint under AIPerf: sweep K x concurrency on HumanEval, report + plots"),
    "families": ("families", "MoE targets at real widths on CPU: layer slices, cost per expert, bytes per step"),
    "moe": ("moe", "a mid-size MoE target on CPU vs its dense twin: decode, P-EAGLE, verify rows, both backends"),
    "seeds": ("seeds", "GPU: the seeds' MoE targets at real shapes: none / EAGLE-3 / P-EAGLE, verify cost, adaptive K"),
    "acceptance": ("heads", "trained code pair: acceptance length and speed-up on HumanEval, P-EAGLE vs EAGLE-3"),
    "heads": ("heads", "real model + trained heads: P-EAGLE vs EAGLE-3 vs none by K (AL, b1/b8 speed, served)"),
    "step-cost": ("heads", "trained code pair: where a decode step's time goes (target, drafter, other)"),
    "fp8-quality": ("fp8_quality", "real model: FP8 (ModelOpt) against float32 on held-out text, top-1 and KL"),
    "decode": ("decode", "real model: decode and verify vs transformers and the roofline, batch 8 vs 1"),
    "context-decode": ("context_decode", "real model: decode, verify and drafter forward by context, 512 to 8K"),
    "kv-fp8": ("kv_fp8", "real model: FP8 (E4M3) KV cache vs float32's, decode speed and greedy agreement"),
    "long-context": ("long_context", "real model + trained heads vs context length (512-8K): AL, decode tok/s, TTFT"),
    "paged": ("paged", "real model: paged KV vs contiguous slots at a fixed budget, prefix-reuse TTFT, block size"),
    "speculation": ("speculation", "real model: speed vs synthetic acceptance length; adaptive K vs fixed K"),
    "verify-shapes": ("forwards", "real model: one verify forward by shape (requests x rows), adaptive K's costs"),
    "deterministic": ("forwards", "real model: deterministic mode's cost, torch and onnxruntime, decode and verify"),
    "draft-length": ("draft_length", "adaptive K on a simulated server: the rule vs every fixed K, noise controlled"),
    "structured": ("structured", "structured output: free vs a regex/JSON schema, P-EAGLE vs none, masks, compile"),
    "trees": ("trees", "trained code pair: P-EAGLE draft trees (budgets B) vs chains (K): AL, tok/s (b1, b8)"),
    "curves": ("curves", "training recipes at equal CPU time, from the curve.jsonl `peagle-trt train` writes"),
    "train-memory": ("train_memory", "one training step's peak memory by tokens per sequence, partitioned or not"),
}


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `bench` on an argparse subparsers object; sets func=cmd_bench."""
    listing = "\n".join(f"  {name:<12} {line}" for name, (_, line) in SUITES.items())
    listing += ("\n  report       the headline table of docs/BENCHMARKS.md from docs/results.json (--write, --results,"
                "\n               --record-run RUN.json --commit SHA: a run saved elsewhere)")
    b = sub.add_parser("bench", help="run a benchmark suite (markdown report, JSON last line)",
                       description="Run one benchmark suite (docs/BENCHMARKS.md has one section per suite).",
                       epilog=f"suites:\n{listing}\n\n`peagle-trt bench SUITE --help` lists a suite's options.",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("suite", choices=sorted([*SUITES, "report"]), metavar="SUITE", help="one of the suites below")
    b.add_argument("options", nargs=argparse.REMAINDER, help="the suite's options (SUITE --help)")
    b.set_defaults(func=cmd_bench)
    return b


def suite_parser(name: str):
    """(the argparse parser of suite `name`: common + suite options, its module)."""
    module_name, line = SUITES[name]
    module = importlib.import_module(f"peagle_trt.bench.{module_name}")
    parser = argparse.ArgumentParser(prog=f"peagle-trt bench {name}", description=f"{line}\n\n{module.__doc__}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = parser.add_argument_group("common options (every suite)")
    common.add_argument("--output-dir", type=Path, default=None,
                        help=f"write bench_{name.replace('-', '_')}.md / .json (and plots) here")
    common.add_argument("--smoke", action="store_true",
                        help="a tiny size that only proves the suite runs (figures mean nothing)")
    common.add_argument("--record", type=Path, default=None, metavar="RESULTS_JSON",
                        help="replace this suite's headline figures in RESULTS_JSON (docs/results.json)")
    module.add_arguments(parser)
    parser.set_defaults(**getattr(module, "PRESETS", {}).get(name, {}))
    return parser, module


def run_suite(name: str, argv: list[str]) -> dict:
    """Parse `argv` for suite `name`, run it and write OUTPUT_DIR/bench_SUITE.json; returns the results
    (JSON-safe: values json cannot write become strings)."""
    parser, module = suite_parser(name)
    args = parser.parse_args(argv)
    args.suite = name
    if args.smoke:  # a tiny size that only proves the suite runs
        vars(args).update(getattr(module, "SMOKE", {}))
    if "target" in vars(args):
        args.target = model_dir(args.target)
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results = json.loads(json.dumps({**module.run(args), "total_s": round(time.perf_counter() - t0, 1), "argv": argv},
                                    default=str))
    if args.output_dir is not None:
        (args.output_dir / f"{stem(name)}.json").write_text(json.dumps(results, indent=1) + "\n")
    if args.record is not None:
        results_file.record(args.record, name, argv, results)
    return results


def report(argv: list[str]) -> dict:
    """`peagle-trt bench report`: print (or --write) the headline table rendered from the results file."""
    parser = argparse.ArgumentParser(prog="peagle-trt bench report",
                                     description="The headline table of docs/BENCHMARKS.md, from docs/results.json.")
    parser.add_argument("--results", type=Path, default=Path("docs/results.json"))
    parser.add_argument("--write", type=Path, nargs="?", const=Path("docs/BENCHMARKS.md"), default=None,
                        help="put the table between the marker lines of this file (default docs/BENCHMARKS.md)")
    parser.add_argument("--record-run", type=Path, default=None, metavar="RUN_JSON",
                        help="first record a saved run (OUTPUT_DIR/bench_SUITE.json, e.g. from a GPU machine)")
    parser.add_argument("--commit", default=None, help="--record-run: the commit that run measured")
    parser.add_argument("--argv", default=None,
                        help="--record-run: the run's options, for a run that did not save them")
    args = parser.parse_args(argv)
    if args.record_run is not None:
        results_file.record_run(args.results, args.record_run, args.commit,
                                None if args.argv is None else shlex.split(args.argv))
    table = results_file.render(results_file.load(args.results))
    print(table, flush=True)
    if args.write is not None:
        results_file.write(args.write, table)
    return {"figures": table.count("\n") - 1, "written": None if args.write is None else str(args.write)}


def cmd_bench(args: argparse.Namespace) -> dict:
    if args.suite == "report":
        return report(args.options)
    return run_suite(args.suite, args.options)
