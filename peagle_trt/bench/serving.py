"""Suite `serving` (docs/BENCHMARKS.md, "serving"): the same greedy requests streamed through a real
tritonserver (bundled in nvidia-pytriton, loopback) over gRPC (`stream_generate`), and in-process
through `TextGenerator.submit` on the same built repository (tiny llama + AWS-layout P-EAGLE drafter,
peagle K=3, float32, CPU); with --openai also through the OpenAI frontend (/v1/completions, SSE) in
front of the same server. Each path is a closed loop at each concurrency; the paths alternate within
rounds. Reported: median wall, tokens/s, mean TTFT (first non-empty text) and latency, the ratios
(targets: Triton <= 1.10x in-process; OpenAI <= 1.10x Triton), and whether every path and round gave
the same token ids. Both paths run --torch-threads intra-op threads (the server inherits
OMP_NUM_THREADS). Tiny models: the ratios are an upper bound of the serving overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from peagle_trt.bench.harness import (
    Figure,
    alternate,
    closed_loop,
    finish,
    free_port,
    progress,
    reported,
    stdout_to_stderr,
    table,
)
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


def streamed(prompts: list[str], conc: int, send: Callable, session=contextlib.nullcontext) -> tuple[float, list]:
    """Closed loop of `conc` client threads; `send(i, ctx, first_text)` streams request i (calling
    `first_text()` on every non-empty text piece) and returns (token ids, finish reason).
    Returns (wall seconds, per request: ids, tokens, finish_reason, ttft_s (first text), latency_s)."""
    recs: list = [None] * len(prompts)

    def run_one(i: int, ctx) -> None:
        first: list[float] = []
        start = time.perf_counter()
        ids, reason = send(i, ctx, lambda: first or first.append(time.perf_counter()))
        recs[i] = {"ids": ids, "tokens": len(ids), "finish_reason": reason,
                   "ttft_s": first[0] - start if first else None, "latency_s": time.perf_counter() - start}

    return closed_loop(len(prompts), conc, run_one, session), recs


def send_inprocess(engine: TextGenerator, prompts: list[str], params: SamplingParams, tag: str) -> Callable:
    def send(i: int, _, first_text) -> tuple[list[int], str]:
        ids, done, reason = [], threading.Event(), []

        def on_event(ev) -> None:
            if ev.text:
                first_text()
            ids.extend(ev.token_ids)
            if ev.finished:
                reason.append(ev.finish_reason)
                done.set()

        engine.submit(f"{tag}-{i}", prompts[i], params, on_event)
        if not done.wait(600):
            raise TimeoutError(f"request {tag}-{i} did not finish in 600 s")
        return ids, reason[0]
    return send


def send_triton(url: str, prompts: list[str], params: SamplingParams) -> Callable:
    def send(i: int, _, first_text) -> tuple[list[int], str]:
        out = stream_generate(url, prompts[i], params, on_text=lambda piece: first_text())
        return out["token_ids"], out.get("finish_reason")
    return send


def send_openai(prompts: list[str], params: SamplingParams) -> Callable:
    """/v1/completions streamed (SSE) with the thread's httpx client (its session)."""
    def send(i: int, http, first_text) -> tuple[list[int], str]:
        body = {"model": "peagle", "prompt": prompts[i], "max_tokens": params.max_tokens, "temperature": 0,
                "ignore_eos": params.ignore_eos, "stream": True, "return_token_ids": True}
        ids, reason = [], None
        with http.stream("POST", "/completions", json=body) as r:
            r.raise_for_status()
            for line in (x for x in r.iter_lines() if x.startswith("data: {")):
                choice = (json.loads(line[6:])["choices"] or [{}])[0]
                if choice.get("text"):
                    first_text()
                ids += choice.get("token_ids", [])
                reason = choice.get("finish_reason") or reason
        return ids, reason
    return send


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
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.stdin.close()
        proc.wait(30)


def mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


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
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-serving-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return bench(args, [int(c) for c in args.concurrency.split(",")], work)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


def bench(args, concs: list[int], work: Path) -> dict:
    repo_root = work / "repo"
    with stdout_to_stderr():  # keep stdout for the table + JSON (the tokenizer trainer writes to fd 1)
        tiny = make_all(work / "tiny")
        shutil.rmtree(repo_root, ignore_errors=True)
        build_repository(tiny["llama"], tiny["aws"], repo_root,
                         RepositoryOptions(SpecConfig("peagle", 3), max_batch=args.max_batch, max_seq_len=512))
    prompts = make_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    engine = TextGenerator.load(*read_options(repo_root))
    engine.start()
    spec = ServeOptions(repo_root, "127.0.0.1", free_port(), free_port(), free_port(),
                        ready_timeout_s=180, log_path=work / "tritonserver.log")
    runs: dict[tuple[str, int], list] = {}  # (path, C) -> [(wall, recs) per round]
    try:
        with TritonServer(spec) as server, (openai_frontend(repo_root, server.grpc_url) if args.openai
                                            else contextlib.nullcontext()) as openai_url:
            paths = {"inproc": lambda c, tag: streamed(prompts, c, send_inprocess(engine, prompts, params, tag)),
                     "triton": lambda c, tag: streamed(prompts, c, send_triton(server.grpc_url, prompts, params))}
            if openai_url:
                import httpx

                paths["openai"] = lambda c, tag: streamed(prompts, c, send_openai(prompts, params),
                                                          lambda: httpx.Client(base_url=openai_url, timeout=600))
            for name, fn in paths.items():  # warm-up: first forwards, first connections, lazy imports
                fn(2, f"warmup-{name}")
            for conc in concs:
                def timed_path(name, conc=conc):
                    def go() -> float:
                        rounds = runs.setdefault((name, conc), [])
                        rounds.append(paths[name](conc, f"{name}-{conc}-{len(rounds)}"))
                        progress(f"  C={conc} {name}: {rounds[-1][0]:.2f} s")
                        return rounds[-1][0]
                    return go

                alternate({name: timed_path(name) for name in paths}, args.repeats, warmup=0, clock=reported)
    finally:
        engine.stop()
    return report(args, prompts, concs, list(paths), runs)


def report(args, prompts: list[str], concs: list[int], paths: list[str], runs: dict) -> dict:
    rows, mismatches, reference = [], [], None
    for conc in concs:
        per = {}
        for path in paths:
            rr = runs[(path, conc)]
            reqs = [r for _, rs in rr for r in rs]
            wall = statistics.median(w for w, _ in rr)
            tokens = statistics.median(sum(r["tokens"] for r in rs) for _, rs in rr)
            per[path] = {"path": path, "concurrency": conc, "requests": len(prompts), "rounds": len(rr),
                         "wall_s": round(wall, 4), "walls_s": [round(w, 4) for w, _ in rr],
                         "output_tokens": tokens, "tokens_per_s": round(tokens / wall, 2),
                         "mean_ttft_ms": round(mean(r["ttft_s"] for r in reqs) * 1e3, 2),
                         "mean_latency_ms": round(mean(r["latency_s"] for r in reqs) * 1e3, 2)}
            for rnd, (_, rs) in enumerate(rr):  # every round of every path: the first one's token ids
                reference = reference or [r["ids"] for r in rs]
                mismatches += [{"path": path, "concurrency": conc, "round": rnd, "prompt": i}
                               for i, (a, r) in enumerate(zip(reference, rs)) if a != r["ids"]]
        for path, base in (("triton", "inproc"), ("openai", "triton")):
            if path in per:
                r = per[path]
                paired = [a[0] / b[0] for a, b in zip(runs[(path, conc)], runs[(base, conc)])]
                r.update({f"wall_ratio_vs_{base}": round(r["wall_s"] / per[base]["wall_s"], 3),
                          f"paired_wall_ratios_vs_{base}": [round(x, 3) for x in paired],
                          "ttft_ratio_vs_inproc": round(r["mean_ttft_ms"] / per["inproc"]["mean_ttft_ms"], 3)})
                r["target_met"] = r[f"wall_ratio_vs_{base}"] <= TARGET_RATIO
        rows += [per[p] for p in paths]

    def f(v, spec=".3f"):
        return "-" if v is None else format(v, spec)

    body = [[r["path"], r["concurrency"], f"{r['wall_s']:.2f}", f"{r['tokens_per_s']:.1f}", f"{r['mean_ttft_ms']:.1f}",
             f"{r['mean_latency_ms']:.1f}", f(r.get("wall_ratio_vs_inproc") or r.get("wall_ratio_vs_triton")),
             f(r.get("ttft_ratio_vs_inproc"))] for r in rows]
    lines = [f"- {r['path']} wall <= {TARGET_RATIO:.2f}x {'in-process' if r['path'] == 'triton' else 'Triton'} at "
             f"C={r['concurrency']}: {'MET' if r['target_met'] else 'NOT MET'} (per-round ratios "
             f"{r.get('paired_wall_ratios_vs_inproc') or r.get('paired_wall_ratios_vs_triton')})"
             for r in rows if r["path"] != "inproc"]
    lines.append(f"- token ids identical across paths, concurrency levels and rounds: "
                 f"{'YES' if not mismatches else f'NO ({len(mismatches)} mismatching request(s))'}")
    figures = [Figure(f"served stream, {r['path']} wall over {'in-process' if r['path'] == 'triton' else 'Triton'}, "
                      f"C={r['concurrency']}", r.get("wall_ratio_vs_inproc") or r["wall_ratio_vs_triton"], "x",
                      f"<= {TARGET_RATIO:.2f}x") for r in rows if r["path"] != "inproc"]
    sections = [f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, peagle K=3, tiny llama on CPU, torch "
                f"threads {torch.get_num_threads()}; median wall of {args.repeats} rounds (paths alternated); "
                "ratio: triton over in-process, openai over triton",
                table(["path", "conc", "wall s", "tok/s", "TTFT ms", "latency ms", "wall ratio", "TTFT ratio"], body),
                "\n".join(lines)]
    return finish(args, "Streaming: Triton gRPC and OpenAI vs in-process", sections,
                  {"prompts": len(prompts), "max_tokens": args.max_tokens, "spec": {"mode": "peagle", "k": 3},
                   "max_batch": args.max_batch, "repeats": args.repeats, "target_wall_ratio": TARGET_RATIO,
                   "target_met": all(r["target_met"] for r in rows if r["path"] != "inproc"),
                   "token_ids_identical": not mismatches, "mismatches": mismatches[:20], "rows": rows}, figures)
