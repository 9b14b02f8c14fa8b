"""Suite `aiperf` (docs/BENCHMARKS.md, "aiperf"): AIPerf (NVIDIA's LLM load generator) against `peagle-trt
serve --openai-port` on the tiny models, per K in --ks (0: no speculation; else P-EAGLE, torch, CPU), one
after the other: two streaming sweeps over --concurrency on /v1/chat/completions, `fixed` (--isl in,
--osl out) and `humaneval`; TTFT, ITL, tok/s, req/s and AIPerf's mean acceptance length, from its
exports (WORKDIR/runs). AIPerf lives in its own venv (its pins conflict with ours): `python3 -m venv
.venv-bench && .venv-bench/bin/pip install aiperf==0.13.0`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path

from peagle_trt.bench.harness import Figure, finish, lines, progress, records, series, serve_child, stdout_to_stderr
from peagle_trt.bench.prompts import humaneval_prompts
from peagle_trt.errors import ConfigError

METRICS = [  # (key in the AIPerf export, label, statistic)
    ("time_to_first_token", "TTFT (ms)", "avg"), ("inter_token_latency", "ITL / TPOT (ms)", "avg"),
    ("output_token_throughput_per_user", "output tokens/s per user (p50)", "p50"),
    ("output_token_throughput", "output tokens/s (total)", "avg"), ("request_throughput", "requests/s", "avg")]


def collect(work: Path) -> list[dict]:
    """One row per AIPerf export under WORK/runs/kK/WORKLOAD[/concurrency_C]/."""
    rows = []
    for export in sorted([*work.glob("runs/k*/*/concurrency_*/profile_export_aiperf.json"),
                          *work.glob("runs/k*/*/profile_export_aiperf.json")]):
        run = json.loads(export.read_text())
        swept = export.parent.name.startswith("concurrency_")
        kdir = export.parents[2] if swept else export.parents[1]
        conc = int(export.parent.name.split("_")[1]) if swept else next(
            p["concurrency"] for p in run["input_config"]["phases"] if p["kind"] == "profiling")
        spec = run.get("spec_decode_acceptance_length")  # AIPerf's mean over requests
        row = {"k": int(kdir.name[1:]), "workload": export.parts[-3] if swept else export.parts[-2],
               "concurrency": conc, "requests": int(run["request_count"]["avg"]),
               "errors": sum(e.get("count", 0) for e in run.get("error_summary") or []),
               "osl_mismatch": int((run.get("osl_mismatch_count") or {}).get("avg", 0)),
               "duration_s": round(run["benchmark_duration"]["avg"], 2),
               "acceptance_length": round(spec["avg"], 4) if spec else None,
               "ttft_p50": round(run["time_to_first_token"]["p50"], 3)}
        rows.append(row | {key: round(run[key][stat], 3) if key in run else None for key, _, stat in METRICS})
    return rows


def sweep(args, k: int, tiny: Path) -> None:
    """Build, serve and run both AIPerf workloads for one K."""
    from peagle_trt.build import RepositoryOptions, build_repository
    from peagle_trt.config import SpecConfig

    repo, out = args.workdir / f"repo-k{k}", args.workdir / "runs" / f"k{k}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with stdout_to_stderr():
        build_repository(tiny / "llama", tiny / "drafter-aws", repo, RepositoryOptions(
            SpecConfig("none", 0) if k == 0 else SpecConfig("peagle", k), backend="torch", max_batch=64,
            max_seq_len=2048), force=True)
    workloads = {"fixed": ["--isl", str(args.isl), "--isl-stddev", "0"],
                 "humaneval": ["--input-file", str(args.workdir / "humaneval.jsonl"),
                               "--custom-dataset-type", "single_turn"]}
    with serve_child(repo, out) as ready:
        progress(f"K={k}: serving on {ready['openai']}")
        common = ["-m", "peagle", "--url", ready["openai"].removesuffix("/v1"), "--endpoint-type", "chat",
                  "--streaming", "--tokenizer", str(tiny / "llama"), "--osl", str(args.osl), "--osl-stddev", "0",
                  "--extra-inputs", "ignore_eos:true", "--extra-inputs", "seed:1", "--concurrency", args.concurrency,
                  "--benchmark-duration", str(args.duration), "--benchmark-grace-period", "120",
                  "--warmup-request-count", "2", "--use-server-token-count", "--no-server-metrics", "--ui", "none",
                  "--random-seed", "1"]
        for name, extra in workloads.items():
            with open(out / f"{name}.log", "w") as log:
                rc = subprocess.run([args.aiperf, "profile", *common, *extra, "--output-artifact-dir",
                                     str(out / name)], stdout=log, stderr=subprocess.STDOUT).returncode
            if rc:
                progress(f"K={k} {name}: aiperf exited {rc}; see {out / (name + '.log')}")


SMOKE = dict(ks="3", concurrency="1", duration=3.0, isl=16, osl=8)  # one K, one point, short


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", type=Path, default=Path("artifacts/bench_aiperf"),
                   help="tiny models, repositories and AIPerf runs")
    p.add_argument("--aiperf", default=None, help="the aiperf executable (default .venv-bench/bin/aiperf)")
    p.add_argument("--ks", default="0,3,7", help="comma-separated K (0 = no speculation)")
    p.add_argument("--concurrency", default="1,4,16,64", help="AIPerf concurrency sweep")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per concurrency point")
    p.add_argument("--isl", type=int, default=128, help="input tokens of the fixed workload")
    p.add_argument("--osl", type=int, default=64, help="output tokens of both workloads")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the servers (see `serving`)")


def run(args: argparse.Namespace) -> dict:
    found = [shutil.which(c) for c in ([args.aiperf] if args.aiperf else [".venv-bench/bin/aiperf", "aiperf"])]
    if not any(found):
        raise ConfigError("AIPerf not found: make its venv with `python3 -m venv .venv-bench && "
                          ".venv-bench/bin/pip install aiperf==0.13.0` (its pins conflict with ours), or pass "
                          "--aiperf PATH")
    args.aiperf = next(f for f in found if f)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
    tiny = args.workdir / "tiny"
    (args.workdir / "runs").mkdir(parents=True, exist_ok=True)
    if not (tiny / "llama").is_dir():
        from peagle_trt.make_tiny import make_all

        with stdout_to_stderr():
            make_all(tiny)
    (args.workdir / "humaneval.jsonl").write_text("".join(
        json.dumps({"type": "single_turn", "text": p["prompt"], "output_length": args.osl}) + "\n"
        for p in humaneval_prompts()))
    for k in args.ks.split(","):
        sweep(args, int(k), tiny)
    rows = collect(args.workdir)
    if not rows:
        raise ConfigError(f"no AIPerf results under {args.workdir}/runs (see the runs' *.log files)")
    rows.sort(key=lambda r: (r["k"], r["workload"], r["concurrency"]))
    plots = [lines(args, key, [("AIPerf, OpenAI endpoint", "concurrency", label, series(
        [r for r in rows if r[key] is not None], "concurrency", key, lambda r: f"K={r['k']} {r['workload']}"))],
        log2x=True) for key, label, _ in METRICS + [("acceptance_length", "acceptance length (tokens/step)", "")]]
    bad = [r for r in rows if r["errors"] or r["osl_mismatch"]]
    top = max(r["concurrency"] for r in rows)
    base = {(r["workload"], r["concurrency"]): r["output_token_throughput"] for r in rows if r["k"] == 0}
    figures = [Figure(f"AIPerf humaneval, K={r['k']} over none, total tok/s at concurrency {top} (tiny, CPU)",
                      r["output_token_throughput"] / base[("humaneval", top)], "x") for r in rows
               if (r["workload"], r["concurrency"]) == ("humaneval", top) and r["k"]
               and r["output_token_throughput"] is not None and base.get(("humaneval", top))]
    columns = ["workload", "k", "concurrency", "requests", "errors", "time_to_first_token", "ttft_p50",
               "inter_token_latency", "output_token_throughput_per_user", "output_token_throughput",
               "request_throughput", "acceptance_length"]
    return finish(args, "AIPerf against the OpenAI endpoint (tiny models, CPU)", [
        "ms, tok/s, req/s; acceptance_length: AIPerf's mean per request (empty: none reported)",
        records(sorted(rows, key=lambda r: (r["workload"], r["k"], r["concurrency"])), columns, 2),
        (f"failed or truncated: {sum(r['errors'] for r in bad)} errors, {sum(r['osl_mismatch'] for r in bad)} "
         f"requests with fewer output tokens than asked, in {len(bad)} of {len(rows)} runs"),
        *plots],
        {"ks": sorted({r["k"] for r in rows}),
         "concurrency": sorted({r["concurrency"] for r in rows}), "rows": rows}, figures)
