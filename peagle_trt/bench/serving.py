"""Suite `serving` (docs/BENCHMARKS.md, "Streaming serving" and "OpenAI endpoint", --openai): streaming
generation through a real tritonserver against the same engine in-process.

What: the same set of greedy requests (default 16 prompts x 64 output tokens, ignore_eos) served
  triton       by `tritonserver` (the one bundled in nvidia-pytriton, loopback) running the `peagle`
               Python model of a repository built with `peagle_trt.repository.build_repository`,
               streamed over gRPC with `peagle_trt.serving.client.stream_generate` (the client
               `peagle-trt generate --url` uses: one gRPC connection + stream per request);
  in-process   by `TextGenerator.load(*read_options(repo))` on the same repository, started with
               `engine.start()` (the same background stepping thread) and fed with `engine.submit`.
  openai       (--openai) by the OpenAI-compatible frontend (peagle_trt/openai_frontend, uvicorn, in
               its own process as under `peagle-trt serve --openai-port`) in front of the same
               tritonserver: streamed /v1/completions over HTTP (httpx, one pooled client per
               worker thread), SSE events parsed, token ids through the `return_token_ids` extension.
Each path is driven as a closed loop at concurrency C (C requests in flight; when one finishes the
next prompt is submitted), for C = 1 and 8. Reported per path and C: wall time of the whole set,
output tokens/s (all output tokens / wall), mean TTFT (submit -> first streamed non-empty text,
the same definition on both paths; in-process the time to the first token ids is also given) and
mean request latency; then the Triton/in-process ratios of wall time (ratio of the medians; the
per-round ratios are printed too) and of TTFT; with --openai also OpenAI/Triton (the frontend's cost;
target <= 1.10 at C=16). Target: Triton at
most 10% slower (wall-time ratio <= 1.10). The script also checks that both paths produced the
same token ids for every prompt (greedy decoding is deterministic).

Why: the Triton model is a thin adapter over TextGenerator; this measures what the serving layer
(gRPC, Triton's decoupled Python backend, response tensors, IPC to the backend stub) adds.

Models: `peagle_trt.tiny.make_all` (seeded random llama target, hidden 64, 8 layers, vocab 512;
AWS-layout P-EAGLE drafter), repository with SpecConfig("peagle", 3), max_batch 8,
max_seq_len 512, float32 on CPU. CAUTION: with such tiny models a decode step costs only a few
milliseconds on CPU, so fixed per-request and per-response costs (connection setup, tokenization,
response tensors, IPC) weigh far more than they would next to a real model on a GPU; the ratios
here are an upper bound of the serving overhead, not a prediction for production.
Torch threads: both paths run with ONE intra-op thread by default (--torch-threads 1; the server
gets OMP_NUM_THREADS=1, checked in its processes' environment and reported). On this 2-core VM
torch's default (2 threads) made the tiny-model engine about 1.2-2.5x slower and its run-to-run
times vary 2x (OpenMP overhead on tiny ops), which swamped the effect being measured.
Also note tritonserver, its Python-backend stub and the benchmark's client threads share the
same CPU cores as the model in the Triton path, while in-process only the engine thread runs.

CPU columns (median over rounds): CPU seconds used during a run by the benchmark process (the
engine in-process; the gRPC client threads for Triton) and by the tritonserver process tree (server
+ Python-backend stub: the engine for Triton); "other CPU" is the largest share of all CPU capacity
used by anything else during a run (noise: figures with more than a few % should be re-run).

Order: after one untimed warm-up pass per path, --repeats rounds; in each round both paths run at
each C, alternating which goes first. Reported: the median wall time over rounds; TTFT and
latency means over all requests of all rounds.

Run (about 1 minute on 2 idle cores, incl. ~7 s model build + server start):
    peagle-trt bench serving
    peagle-trt bench serving --prompts 16 --max-tokens 64 --concurrency 1,8 --repeats 3
    peagle-trt bench serving --openai --prompts 48 --concurrency 1,16 --max-batch 16
Output: a markdown table on stdout, then as the LAST line one JSON object (env info + `rows`).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from peagle_trt.bench.common import closed_loop, cpu_model, free_port, progress, stdout_to_stderr
from peagle_trt.bench.report import emit, markdown_table
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.repository import RepositoryOptions, build_repository
from peagle_trt.serving.client import stream_generate
from peagle_trt.serving.generator import TextGenerator
from peagle_trt.serving.options import read_options
from peagle_trt.serving.server import ServeOptions, TritonServer
from peagle_trt.tiny import CORPUS, make_all

TARGET_RATIO = 1.10


def make_prompts(n: int) -> list[str]:
    return [f"{CORPUS[i % len(CORPUS)]} Request {i}: continue." for i in range(n)]


def run_inprocess(engine: TextGenerator, prompts: list[str], params: SamplingParams, conc: int,
                  tag: str) -> tuple[float, list[dict]]:
    """Closed loop over the engine's submit API; returns (wall seconds, per-request records)."""
    done: queue.Queue = queue.Queue()
    recs = [{"ids": [], "text_t": None, "ids_t": None} for _ in prompts]

    def launch(i: int) -> None:
        rec = recs[i]

        def on_event(ev) -> None:
            now = time.perf_counter()
            if ev.token_ids and rec["ids_t"] is None:
                rec["ids_t"] = now
            if ev.text and rec["text_t"] is None:
                rec["text_t"] = now
            rec["ids"] += ev.token_ids
            if ev.finished:
                rec["end"] = now
                rec["finish_reason"] = ev.finish_reason
                done.put(i)

        rec["start"] = time.perf_counter()
        engine.submit(f"{tag}-{i}", prompts[i], params, on_event)

    t0 = time.perf_counter()
    nxt = min(conc, len(prompts))
    for i in range(nxt):
        launch(i)
    for _ in range(len(prompts)):
        done.get(timeout=600)
        if nxt < len(prompts):
            launch(nxt)
            nxt += 1
    wall = time.perf_counter() - t0
    return wall, [summarize(r) for r in recs]


def run_triton(url: str, prompts: list[str], params: SamplingParams, conc: int) -> tuple[float, list[dict]]:
    """Closed loop: `conc` client threads, each streaming one request at a time with stream_generate."""
    recs = [{"ids": [], "text_t": None, "ids_t": None} for _ in prompts]

    def run_one(i: int, _) -> None:
        rec = recs[i]

        def on_text(piece: str) -> None:
            if rec["text_t"] is None:
                rec["text_t"] = time.perf_counter()

        rec["start"] = time.perf_counter()
        out = stream_generate(url, prompts[i], params, on_text=on_text)
        rec["end"] = time.perf_counter()
        rec["ids"] = out["token_ids"]
        rec["finish_reason"] = out.get("finish_reason")

    return closed_loop(len(prompts), conc, run_one), [summarize(r) for r in recs]


def run_openai(base_url: str, prompts: list[str], params: SamplingParams, conc: int) -> tuple[float, list[dict]]:
    """Closed loop over the OpenAI frontend: `conc` threads, each streaming /v1/completions (SSE)."""
    import httpx

    recs = [{"ids": [], "text_t": None, "ids_t": None} for _ in prompts]

    def run_one(i: int, http) -> None:
        rec = recs[i]
        body = {"model": "peagle", "prompt": prompts[i], "max_tokens": params.max_tokens, "temperature": 0,
                "ignore_eos": params.ignore_eos, "stream": True, "return_token_ids": True}
        rec["start"] = time.perf_counter()
        with http.stream("POST", "/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choice = (json.loads(line[6:])["choices"] or [{}])[0]
                if choice.get("text") and rec["text_t"] is None:
                    rec["text_t"] = time.perf_counter()
                rec["ids"] += choice.get("token_ids", [])
                rec["finish_reason"] = choice.get("finish_reason") or rec.get("finish_reason")
        rec["end"] = time.perf_counter()

    wall = closed_loop(len(prompts), conc, run_one, lambda: httpx.Client(base_url=base_url, timeout=600))
    return wall, [summarize(r) for r in recs]


@contextlib.contextmanager
def openai_frontend(repo: Path, grpc_url: str):
    """The frontend in its own process (as in `peagle-trt serve`); yields its base URL."""
    import subprocess

    port = free_port()
    code = ("import sys; from pathlib import Path; from peagle_trt.openai_frontend import FrontendOptions, "
            f"OpenAIFrontend; fe = OpenAIFrontend(FrontendOptions(Path({str(repo)!r}), {grpc_url!r}, '127.0.0.1', "
            f"{port})).start(); print('ready', flush=True); sys.stdin.read(); fe.stop()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the OpenAI frontend did not start")
        yield f"http://127.0.0.1:{port}/v1", proc.pid
    finally:
        proc.stdin.close()
        proc.wait(30)


def summarize(rec: dict) -> dict:
    start = rec["start"]
    return {"ids": rec["ids"], "tokens": len(rec["ids"]), "finish_reason": rec.get("finish_reason"),
            "ttft_s": (rec["text_t"] - start) if rec["text_t"] is not None else None,
            "ttft_ids_s": (rec["ids_t"] - start) if rec["ids_t"] is not None else None,
            "latency_s": rec["end"] - start}


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def cpu_sample() -> tuple[float, float] | None:
    """(seconds of all CPUs, their busy seconds) from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return sum(ticks) / hz, (sum(ticks) - ticks[3] - ticks[4]) / hz


def descendants(root: int) -> list[int]:
    parent = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, p in parent.items() if p == pid]
    return out


def server_threads_env(root: int) -> dict[str, str | None]:
    """OMP_NUM_THREADS as seen by each process of the server tree (checks that it was inherited)."""
    out = {}
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        value = env.get(b"OMP_NUM_THREADS")
        out[name] = value.decode() if value is not None else None
    return out


def tree_cpu(root: int) -> float:
    """CPU seconds (user + system) of process `root` and its live descendants, from /proc."""
    hz = os.sysconf("SC_CLK_TCK")
    parent, used = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parent[int(entry)] = int(rest[1])
        used[int(entry)] = (int(rest[11]) + int(rest[12])) / hz
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += used.get(pid, 0.0)
        todo += [c for c, p in parent.items() if p == pid]
    return total


class CpuMeter:
    """CPU seconds used during a run by this process, by the server's process tree, and the share
    of all CPU capacity used by anything else (noise: should stay near 0)."""

    def __init__(self, server_pid: int, frontend_pid: int | None = None):
        self.pids = [server_pid] + ([frontend_pid] if frontend_pid else [])  # the frontend counts as server

    def __enter__(self) -> CpuMeter:
        t = os.times()
        self.a, self.own, self.srv = cpu_sample(), t.user + t.system, sum(tree_cpu(p) for p in self.pids)
        return self

    def __exit__(self, *exc) -> None:
        t = os.times()
        b = cpu_sample()
        self.own_s = t.user + t.system - self.own
        self.server_s = sum(tree_cpu(p) for p in self.pids) - self.srv
        if self.a is None or b is None or b[0] <= self.a[0]:
            self.other_share = None
        else:
            other = (b[1] - self.a[1]) - self.own_s - self.server_s
            self.other_share = max(0.0, other) / (b[0] - self.a[0])


def background_cpu(seconds: float = 2.0) -> float | None:
    """Share of all CPU capacity busy while this process sleeps (load from other processes)."""
    a = cpu_sample()
    time.sleep(seconds)
    b = cpu_sample()
    if a is None or b is None or b[0] <= a[0]:
        return None
    return round((b[1] - a[1]) / (b[0] - a[0]), 3)


def fmt(v: float | None, scale: float = 1.0, spec: str = ".1f") -> str:
    return "-" if v is None else format(v * scale, spec)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per path and concurrency")
    ap.add_argument("--openai", action="store_true", help="also the OpenAI frontend path (/v1/completions)")
    ap.add_argument("--max-batch", type=int, default=8, help="KV slots of the served model (default 8)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep models/repository here (default: temp)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads on BOTH paths (OMP_NUM_THREADS for the server); "
                         "0 keeps torch's default (one per core)")


def run(args: argparse.Namespace) -> dict:
    if args.smoke:  # a few short requests, one round
        args.prompts, args.max_tokens, args.concurrency, args.repeats = 4, 8, "1,2", 1
    if args.torch_threads > 0:  # before the server starts: its Python-backend stub inherits it
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
        torch.set_num_threads(args.torch_threads)
    concs = [int(c) for c in args.concurrency.split(",")]
    bg = background_cpu(0.5 if args.smoke else 2.0)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return bench(args, concs, bg, work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def bench(args, concs: list[int], bg: float | None, work: Path) -> dict:
    t_setup = time.perf_counter()
    repo_root = work / "repo"
    with stdout_to_stderr():  # keep stdout for the table + JSON (the tokenizer trainer writes to fd 1)
        tiny = make_all(work / "tiny")
        if repo_root.exists():
            shutil.rmtree(repo_root)
        build_repository(tiny["llama"], tiny["aws"], repo_root,
                         RepositoryOptions(SpecConfig("peagle", 3), max_batch=args.max_batch, max_seq_len=512))
    prompts = make_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    engine = TextGenerator.load(*read_options(repo_root))
    engine.start()
    spec = ServeOptions(repo_root, "127.0.0.1", free_port(), free_port(), free_port(),
                     ready_timeout_s=180, log_path=work / "tritonserver.log")
    results: dict[tuple[str, int], list[tuple[float, list[dict]]]] = {}
    paths = ("inproc", "triton", "openai") if args.openai else ("inproc", "triton")
    try:
        with TritonServer(spec) as server, (openai_frontend(repo_root, server.grpc_url) if args.openai
                                            else contextlib.nullcontext((None, None))) as (openai_url, fe_pid):
            setup_s = time.perf_counter() - t_setup
            progress(f"  server ready after {setup_s:.1f} s of setup")
            server_env = server_threads_env(server.proc.pid)
            # warm-up (untimed): first forwards, first gRPC connection, lazy imports
            run_inprocess(engine, prompts[:2], params, 2, "warmup")
            run_triton(server.grpc_url, prompts[:2], params, 2)
            if openai_url:
                run_openai(openai_url, prompts[:2], params, 2)
            for rnd in range(args.repeats):
                for conc in concs:
                    shift = (rnd + conc) % len(paths)  # rotate which path goes first
                    for path in paths[shift:] + paths[:shift]:
                        with CpuMeter(server.proc.pid, fe_pid if path == "openai" else None) as cpu:
                            if path == "inproc":
                                wall, recs = run_inprocess(engine, prompts, params, conc, f"r{rnd}c{conc}")
                            elif path == "triton":
                                wall, recs = run_triton(server.grpc_url, prompts, params, conc)
                            else:
                                wall, recs = run_openai(openai_url, prompts, params, conc)
                        results.setdefault((path, conc), []).append((wall, recs, cpu))
                        progress(f"  round {rnd} C={conc} {path}: {wall:.2f} s, CPU own {cpu.own_s:.2f} s "
                                 f"server {cpu.server_s:.2f} s, other {cpu.other_share or 0:.0%}")
    finally:
        engine.stop()

    # -- figures -------------------------------------------------------------------------------
    rows, reference, identical = [], None, True
    mismatches = []
    for conc in concs:
        per_path = {}
        for path in paths:
            runs = results[(path, conc)]
            reqs = [r for _, rs, _ in runs for r in rs]
            wall = statistics.median(w for w, _, _ in runs)
            tokens = statistics.median(sum(r["tokens"] for r in rs) for _, rs, _ in runs)
            others = [c.other_share for _, _, c in runs if c.other_share is not None]
            per_path[path] = {
                "path": path, "concurrency": conc, "requests": len(prompts), "rounds": len(runs),
                "wall_s": round(wall, 4), "walls_s": [round(w, 4) for w, _, _ in runs],
                "cpu_s_this_process": round(statistics.median(c.own_s for _, _, c in runs), 3),
                "cpu_s_server": round(statistics.median(c.server_s for _, _, c in runs), 3),
                "other_cpu_share_max": round(max(others), 3) if others else None,
                "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
                "mean_ttft_ms": round(mean(r["ttft_s"] for r in reqs) * 1e3, 2),
                "mean_ttft_ids_ms": (round(mean(r["ttft_ids_s"] for r in reqs) * 1e3, 2)
                                     if path == "inproc" else None),
                "mean_latency_ms": round(mean(r["latency_s"] for r in reqs) * 1e3, 2),
                "finish_reasons": sorted({r["finish_reason"] for r in reqs})}
            # token ids: every round of every path must match the first in-process round
            for rnd, (_, rs, _) in enumerate(runs):
                ids = [r["ids"] for r in rs]
                if reference is None:
                    reference = ids
                for i, (a, b) in enumerate(zip(reference, ids)):
                    if a != b:
                        identical = False
                        mismatches.append({"path": path, "concurrency": conc, "round": rnd, "prompt": i})
        ratio = per_path["triton"]["wall_s"] / per_path["inproc"]["wall_s"]
        per_path["triton"]["wall_ratio_vs_inproc"] = round(ratio, 3)
        paired = [t[0] / i[0] for t, i in zip(results[("triton", conc)], results[("inproc", conc)])]
        per_path["triton"]["paired_wall_ratios"] = [round(x, 3) for x in paired]  # same round
        per_path["triton"]["median_paired_wall_ratio"] = round(statistics.median(paired), 3)
        per_path["triton"]["ttft_ratio_vs_inproc"] = round(
            per_path["triton"]["mean_ttft_ms"] / per_path["inproc"]["mean_ttft_ms"], 3)
        per_path["triton"]["target_met"] = ratio <= TARGET_RATIO
        if args.openai:  # the frontend's cost over the gRPC path it forwards to
            o = per_path["openai"]
            o["wall_ratio_vs_triton"] = round(o["wall_s"] / per_path["triton"]["wall_s"], 3)
            o["paired_wall_ratios_vs_triton"] = [
                round(a[0] / b[0], 3) for a, b in zip(results[("openai", conc)], results[("triton", conc)])]
            o["wall_ratio_vs_inproc"] = round(o["wall_s"] / per_path["inproc"]["wall_s"], 3)
            o["ttft_ratio_vs_inproc"] = round(o["mean_ttft_ms"] / per_path["inproc"]["mean_ttft_ms"], 3)
            o["target_met"] = o["wall_ratio_vs_triton"] <= TARGET_RATIO
        rows += [per_path[p] for p in paths]

    text = [(f"## Streaming: Triton (gRPC, bundled tritonserver) vs in-process TextGenerator; "
             f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, peagle K=3, tiny llama on CPU, "
             f"torch threads {torch.get_num_threads()}; median wall of {args.repeats} rounds"), "",
            markdown_table(["path", "conc", "wall s", "tok/s", "TTFT ms", "latency ms", "wall ratio", "TTFT ratio",
                            "CPU s proc", "CPU s srv", "other CPU"],
                           [[r["path"], r["concurrency"], f"{r['wall_s']:.2f}", f"{r['tokens_per_s']:.1f}",
                             f"{r['mean_ttft_ms']:.1f}", f"{r['mean_latency_ms']:.1f}",
                             fmt(r.get("wall_ratio_vs_inproc"), spec=".3f"),
                             fmt(r.get("ttft_ratio_vs_inproc"), spec=".3f"), f"{r['cpu_s_this_process']:.2f}",
                             f"{r['cpu_s_server']:.2f}", fmt(r["other_cpu_share_max"], 100, ".0f") + "%"]
                            for r in rows]), ""]
    for r in rows:
        if r["path"] == "inproc":
            text.append(f"- in-process C={r['concurrency']}: mean time to first token ids "
                        f"{r['mean_ttft_ids_ms']:.1f} ms (first non-empty text {r['mean_ttft_ms']:.1f} ms)")
    for r in rows:
        if r["path"] == "openai":
            text.append(f"- target OpenAI wall <= {TARGET_RATIO:.2f}x Triton gRPC at C={r['concurrency']}: "
                        f"{'MET' if r['target_met'] else 'NOT MET'} ({r['wall_ratio_vs_triton']:.3f}x; "
                        f"per-round ratios {r['paired_wall_ratios_vs_triton']})")
    all_met = all(r["target_met"] for r in rows if r["path"] == "triton")
    for r in rows:
        if r["path"] == "triton":
            text.append(f"- target Triton wall <= {TARGET_RATIO:.2f}x in-process at C={r['concurrency']}: "
                        f"{'MET' if r['target_met'] else 'NOT MET'} ({r['wall_ratio_vs_inproc']:.3f}x; per-round "
                        f"ratios {r['paired_wall_ratios']}, median {r['median_paired_wall_ratio']:.3f}x)")
    text.append(f"- token ids identical across paths, concurrency levels and rounds: "
                f"{'YES' if identical else 'NO (' + str(len(mismatches)) + ' mismatching request(s))'}")
    emit(args, "\n".join(text))

    env = {"benchmark": "serving_triton_vs_inprocess",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "cpu": cpu_model(),
           "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
           "server_omp_num_threads": server_env,
           "background_cpu_share_before": bg, "prompts": len(prompts), "max_tokens": args.max_tokens,
           "spec": {"mode": "peagle", "k": 3}, "max_batch": args.max_batch, "max_seq_len": 512,
           "repeats": args.repeats, "target_wall_ratio": TARGET_RATIO, "target_met": all_met,
           "token_ids_identical": identical, "mismatches": mismatches[:20],
           "setup_s": round(setup_s, 1), "smoke": args.smoke}
    return dict(**env, rows=rows)
