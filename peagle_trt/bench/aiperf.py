"""Suite `aiperf` (docs/BENCHMARKS.md, "aiperf"): AIPerf (NVIDIA's LLM load generator) against
`peagle-trt serve --openai-port` on the tiny models: for K in --ks (0 = no speculation; else P-EAGLE,
torch backend, CPU), two streaming sweeps over --concurrency on /v1/chat/completions (closed loop,
--duration s per point): `fixed` (--isl synthetic tokens in, --osl out, ignore_eos) and `humaneval`
(the 164 prompts). Temperature 1 with a seed (the random tiny models answer greedy requests with ids
beyond their tokenizer, which AIPerf counts as failures). Collected: TTFT, ITL, tok/s per user and in
total, req/s (AIPerf's exports under WORKDIR/runs), and the acceptance length from our Prometheus
counters sampled every second, next to the one AIPerf reads from each response. AIPerf lives in its
own venv (its pins conflict with ours): `python3 -m venv .venv-bench && .venv-bench/bin/pip install
aiperf==0.13.0`; --aiperf names the executable. Sweeps of the K run one after the other (the load
generator owns the timing), so each point records the load average.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from peagle_trt.bench.harness import Figure, finish, free_port, plot, progress, stdout_to_stderr, table
from peagle_trt.bench.prompts import humaneval_prompts
from peagle_trt.errors import ConfigError, ServeError

METRICS = [  # (key in the AIPerf export, label, statistic)
    ("time_to_first_token", "TTFT (ms)", "avg"),
    ("inter_token_latency", "ITL / TPOT (ms)", "avg"),
    ("output_token_throughput_per_user", "output tokens/s per user (p50)", "p50"),
    ("output_token_throughput", "output tokens/s (total)", "avg"),
    ("request_throughput", "requests/s", "avg"),
]


def write_humaneval(out: Path, osl: int) -> None:
    """The 164 HumanEval prompts as AIPerf `single_turn` records."""
    rows = humaneval_prompts()
    with open(out, "w") as f:
        f.writelines(json.dumps({"type": "single_turn", "text": row["prompt"], "output_length": osl}) + "\n"
                     for row in rows)
    progress(f"{len(rows)} HumanEval prompts -> {out}")


def samples(path: Path) -> list[tuple[float, dict[str, float]]]:
    """`# t=EPOCH` headers, each followed by Prometheus lines of our metrics (the run serves one
    model: series are keyed by their name with the labels, {model=..., version=...}, dropped)."""
    out: list[tuple[float, dict[str, float]]] = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        if line.startswith("# t="):
            out.append((float(line[4:]), {}))
        elif out and line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[-1][1][series.split("{", 1)[0]] = float(value)
    return [s for s in out if "peagle_draft_steps_total" in s[1]]


def acceptance(series, start: float, end: float) -> float | None:
    before = [s for t, s in series if t <= start]
    after = [s for t, s in series if t >= end]
    if not before or not after:
        return None
    steps = after[0]["peagle_draft_steps_total"] - before[-1]["peagle_draft_steps_total"]
    accepted = after[0]["peagle_accepted_drafts_total"] - before[-1]["peagle_accepted_drafts_total"]
    return round(1.0 + accepted / steps, 4) if steps > 0 else None


def epoch(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp).replace(tzinfo=datetime.timezone.utc).timestamp()


def collect(work: Path) -> list[dict]:
    rows = []
    # a sweep writes WORKLOAD/concurrency_C/..., a single concurrency WORKLOAD/... directly
    exports = [*work.glob("runs/k*/*/concurrency_*/profile_export_aiperf.json"),
               *work.glob("runs/k*/*/profile_export_aiperf.json")]
    for export in sorted(exports):
        run = json.loads(export.read_text())
        swept = export.parent.name.startswith("concurrency_")
        kdir = export.parents[2] if swept else export.parents[1]
        k, workload = int(kdir.name[1:]), export.parts[-3] if swept else export.parts[-2]
        conc = int(export.parent.name.split("_")[1]) if swept else next(
            p["concurrency"] for p in run["input_config"]["phases"] if p["kind"] == "profiling")
        series = samples(kdir / "metrics.log")
        errors = sum(e.get("count", 0) for e in run.get("error_summary") or [])
        row = {"k": k, "workload": workload, "concurrency": conc,
               "requests": int(run["request_count"]["avg"]), "errors": errors,
               "osl_mismatch": int((run.get("osl_mismatch_count") or {}).get("avg", 0)),
               "duration_s": round(run["benchmark_duration"]["avg"], 2),
               "acceptance_length": acceptance(series, epoch(run["start_time"]), epoch(run["end_time"]))}
        for key, _, stat in METRICS:
            row[key] = round(run[key][stat], 3) if key in run else None
        row["ttft_p50"] = round(run["time_to_first_token"]["p50"], 3)
        # AIPerf's own reading of our per-request metrics.speculative_decoding (its vLLM adapter):
        # the mean over requests, where the Prometheus figure pools steps (long answers weigh more)
        spec = run.get("spec_decode_acceptance_length")
        row["aiperf_acceptance_length"] = round(spec["avg"], 4) if spec else None
        rows.append(row)
    return rows


def drawing(rows: list[dict], key: str, label: str):
    """One metric against concurrency, one line per K and workload (for harness.plot)."""

    def draw(plt):
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        for i, k in enumerate(sorted({r["k"] for r in rows})):
            for workload, style in (("fixed", "-"), ("humaneval", "--")):
                pts = sorted((r["concurrency"], r[key]) for r in rows
                             if r["k"] == k and r["workload"] == workload and r[key] is not None)
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=f"C{i}",
                            label=f"K={k} ({'none' if k == 0 else 'P-EAGLE'}) {workload}")
        ax.set_xscale("log", base=2)
        concs = sorted({r["concurrency"] for r in rows})
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs concurrency (AIPerf, OpenAI endpoint)", fontsize=9)
        return fig

    return draw


def rows_table(rows: list[dict]) -> str:
    def f(x, digits: int) -> str:  # AIPerf leaves a metric out (None) when it has no samples
        return "n/a" if x is None else f"{x:.{digits}f}"

    return table(["workload", "K", "conc", "requests", "errors", "TTFT avg / p50 (ms)", "ITL avg (ms)",
                  "tok/s/user p50", "tok/s total", "req/s", "AL pooled (Prometheus)", "AL per request (AIPerf)"],
                 [[r["workload"], r["k"], r["concurrency"], r["requests"], r["errors"],
                   f"{f(r['time_to_first_token'], 0)} / {f(r['ttft_p50'], 0)}", f(r["inter_token_latency"], 2),
                   f(r["output_token_throughput_per_user"], 0), f(r["output_token_throughput"], 0),
                   f(r["request_throughput"], 2), r["acceptance_length"] or "n/a (no drafts)",
                   r.get("aiperf_acceptance_length") or "n/a"]
                  for r in sorted(rows, key=lambda r: (r["workload"], r["k"], r["concurrency"]))])


class Scraper:
    """Our Prometheus counters (peagle_*), once a second, into a file of `# t=EPOCH` blocks."""

    def __init__(self, url: str, path: Path):
        self.url, self.path, self.stop = url, path, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with open(self.path, "w") as f:
            while not self.stop.is_set():
                f.write(f"# t={time.time():.6f}\n")
                try:
                    with urllib.request.urlopen(self.url, timeout=5) as resp:
                        text = resp.read().decode()
                    f.writelines(line + "\n" for line in text.splitlines() if line.startswith("peagle_"))
                except OSError:
                    pass
                f.flush()
                self.stop.wait(1.0)

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def serve(repo: Path, out: Path, ready_timeout_s: float = 300.0):
    """`peagle-trt serve REPO --openai-port P` in a child process; returns (process, openai URL, metrics URL)."""
    http, grpc, metrics, openai = (free_port() for _ in range(4))
    cmd = [sys.executable, "-m", "peagle_trt.cli", "serve", str(repo), "--http-port", str(http), "--grpc-port",
           str(grpc), "--metrics-port", str(metrics), "--openai-port", str(openai)]
    with open(out / "serve.err", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + ready_timeout_s
    with open(out / "serve.out", "w") as log:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            log.write(line)
            if '"ready": true' in line:
                return proc, f"http://127.0.0.1:{openai}", f"http://127.0.0.1:{metrics}/metrics"
    proc.terminate()
    proc.wait(30)
    raise ServeError(f"`peagle-trt serve {repo}` did not become ready; see {out / 'serve.err'}")


def sweep(args, k: int, tiny: Path) -> None:
    """Build, serve and run both AIPerf workloads for one K."""
    from peagle_trt.config import SpecConfig
    from peagle_trt.repository import RepositoryOptions, build_repository

    repo, out = args.workdir / f"repo-k{k}", args.workdir / "runs" / f"k{k}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = SpecConfig("none", 0) if k == 0 else SpecConfig("peagle", k)
    with stdout_to_stderr():
        build_repository(tiny / "llama", tiny / "drafter-aws", repo,
                         RepositoryOptions(spec, backend="torch", max_batch=64, max_seq_len=2048), force=True)
    proc, openai_url, metrics_url = serve(repo, out)
    progress(f"K={k}: serving on {openai_url}/v1")
    common = ["-m", "peagle", "--url", openai_url, "--endpoint-type", "chat", "--streaming",
              "--tokenizer", str(tiny / "llama"), "--osl", str(args.osl), "--osl-stddev", "0",
              "--extra-inputs", "ignore_eos:true", "--extra-inputs", "seed:1", "--concurrency", args.concurrency,
              "--benchmark-duration", str(args.duration), "--benchmark-grace-period", "120",
              "--warmup-request-count", "2", "--use-server-token-count", "--no-server-metrics", "--ui", "none",
              "--random-seed", "1"]
    workloads = {"fixed": ["--isl", str(args.isl), "--isl-stddev", "0"],
                 "humaneval": ["--input-file", str(args.workdir / "humaneval.jsonl"),
                               "--custom-dataset-type", "single_turn"]}
    try:
        with Scraper(metrics_url, out / "metrics.log"):
            for name, extra in workloads.items():
                with open(out / f"{name}.log", "w") as log:
                    rc = subprocess.run([args.aiperf, "profile", *common, *extra, "--output-artifact-dir",
                                         str(out / name)], stdout=log, stderr=subprocess.STDOUT, check=False)
                if rc.returncode:
                    progress(f"K={k} {name}: aiperf exited {rc.returncode}; see {out / (name + '.log')}")
    finally:
        proc.terminate()  # SIGTERM: the server drains and exits
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    progress(f"K={k}: done")


def find_aiperf(path: str | None) -> str:
    for candidate in ([path] if path else [".venv-bench/bin/aiperf", "aiperf"]):
        found = shutil.which(candidate)
        if found:
            return found
    raise ConfigError(f"AIPerf not found ({path or '.venv-bench/bin/aiperf or aiperf on PATH'}): make its venv "
                      "with `python3 -m venv .venv-bench && .venv-bench/bin/pip install aiperf==0.13.0`, or pass "
                      "--aiperf PATH (aiperf's pins conflict with ours: keep it in its own venv)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--workdir", type=Path, default=Path("artifacts/bench_aiperf"),
                    help="tiny models, repositories and AIPerf runs (default artifacts/bench_aiperf)")
    ap.add_argument("--aiperf", default=None, help="the aiperf executable (default .venv-bench/bin/aiperf)")
    ap.add_argument("--ks", default="0,3,7", help="comma-separated K (0 = no speculation)")
    ap.add_argument("--concurrency", default="1,4,16,64", help="AIPerf concurrency sweep")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per concurrency point")
    ap.add_argument("--isl", type=int, default=128, help="input tokens of the fixed workload")
    ap.add_argument("--osl", type=int, default=64, help="output tokens of both workloads")
    ap.add_argument("--report-only", action="store_true", help="only read WORKDIR/runs and report")
    ap.add_argument("--threads", type=int, default=1,
                    help="OMP_NUM_THREADS of the servers (tiny models: one intra-op thread, see `serving`)")


def run(args: argparse.Namespace) -> dict:
    if args.smoke:  # one K, one concurrency, a short window, short outputs
        args.ks, args.concurrency, args.duration, args.isl, args.osl = "3", "1", 3.0, 16, 8
    if not args.report_only:
        args.aiperf = find_aiperf(args.aiperf)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
        tiny = args.workdir / "tiny"
        (args.workdir / "runs").mkdir(parents=True, exist_ok=True)
        if not (tiny / "llama").is_dir():
            from peagle_trt.tiny import make_all

            with stdout_to_stderr():
                make_all(tiny)
        write_humaneval(args.workdir / "humaneval.jsonl", args.osl)
        for k in (int(x) for x in args.ks.split(",") if x.strip()):
            sweep(args, k, tiny)
    rows = collect(args.workdir)
    if not rows:
        raise ConfigError(f"no AIPerf results under {args.workdir}/runs (see the runs' *.log files)")
    plots = [plot(args, key, drawing(rows, key, label))
             for key, label, _ in METRICS + [("acceptance_length", "acceptance length (tokens/step)", "")]]
    bad = [r for r in rows if r["errors"] or r["osl_mismatch"]]
    top = max(r["concurrency"] for r in rows)
    base = {(r["workload"], r["concurrency"]): r["output_token_throughput"] for r in rows if r["k"] == 0}
    figures = [Figure(f"AIPerf humaneval, K={r['k']} over none, total tok/s at concurrency {top} (tiny, CPU)",
                      r["output_token_throughput"] / base[("humaneval", top)], "x") for r in rows
               if (r["workload"], r["concurrency"]) == ("humaneval", top) and r["k"]
               and r["output_token_throughput"] is not None and base.get(("humaneval", top))]
    return finish(args, "AIPerf against the OpenAI endpoint (tiny models, CPU)", [
        rows_table(rows),
        (f"failed or truncated: {sum(r['errors'] for r in bad)} errors, {sum(r['osl_mismatch'] for r in bad)} "
         f"requests with fewer output tokens than asked, in {len(bad)} of {len(rows)} runs"),
        "\n".join(f"![{p}]({p})" for p in plots if p)],
        {"report_only": args.report_only, "ks": sorted({r["k"] for r in rows}),
         "concurrency": sorted({r["concurrency"] for r in rows}), "rows": rows}, figures)
