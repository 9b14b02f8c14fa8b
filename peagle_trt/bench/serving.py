"""Suite `serving` (docs/BENCHMARKS.md, "serving"): the same greedy requests streamed in process
(`TextGenerator.submit`), through `peagle-trt serve`'s tritonserver over gRPC and, with --openai, its
OpenAI frontend (/v1/completions, SSE), on one repository (tiny llama + AWS-layout P-EAGLE, K = 3, CPU):
closed loops per concurrency, paths alternated within rounds: median wall, tok/s, mean TTFT and
latency, the ratios (targets: Triton <= 1.10x in-process, OpenAI <= 1.10x Triton), token ids compared.
Tiny models: the ratios are an upper bound of the serving overhead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from peagle_trt.bench.harness import (
    Figure,
    alternate,
    closed_loop,
    finish,
    int_list,
    options,
    progress,
    records,
    reported,
    serve_child,
    stdout_to_stderr,
)
from peagle_trt.config import SamplingParams, SpecConfig

TARGET_RATIO = 1.10
BASE = {"triton": "inproc", "openai": "triton"}  # a path -> the one its ratios are over


def senders(engine, grpc_url: str, params: SamplingParams) -> dict:
    """Per path, send(prompt, tag, http, first_text) -> (token ids, finish reason): streams one request,
    calling first_text() on every non-empty text piece."""
    from peagle_trt.serve.client import stream_generate

    def inproc(prompt, tag, _, first_text):
        ids, done, reason = [], threading.Event(), []

        def on_event(ev) -> None:
            if ev.text:
                first_text()
            ids.extend(ev.token_ids)
            if ev.finished:
                reason.append(ev.finish_reason)
                done.set()

        engine.submit(tag, prompt, params, on_event)
        if not done.wait(600):
            raise TimeoutError(f"request {tag} did not finish in 600 s")
        return ids, reason[0]

    def triton(prompt, tag, _, first_text):
        out = stream_generate(grpc_url, prompt, params, on_text=lambda piece: first_text())
        return out["token_ids"], out.get("finish_reason")

    def openai(prompt, tag, http, first_text):
        body = {"model": "peagle", "prompt": prompt, "max_tokens": params.max_tokens, "temperature": 0,
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
    return {"inproc": inproc, "triton": triton, "openai": openai}


def streamed(prompts: list[str], conc: int, send, tag: str, session=contextlib.nullcontext) -> tuple[float, list]:
    """A closed loop of `conc` client threads (each with its `session()`); (wall s, per request: ids,
    tokens, ttft_s (first text), latency_s)."""
    recs: list = [None] * len(prompts)

    def one(i: int, ctx) -> None:
        first: list[float] = []
        start = time.perf_counter()
        ids, _ = send(prompts[i], f"{tag}-{i}", ctx, lambda: first or first.append(time.perf_counter()))
        recs[i] = {"ids": ids, "tokens": len(ids), "ttft_s": first[0] - start if first else None,
                   "latency_s": time.perf_counter() - start}

    return closed_loop(len(prompts), conc, one, session), recs


SMOKE = dict(prompts=4, max_tokens=8, concurrency="1,2", repeats=1)


def add_arguments(p: argparse.ArgumentParser) -> None:
    options(p, prompts=16, max_tokens=64, concurrency="1,8", repeats=3)
    p.add_argument("--openai", action="store_true", help="also the OpenAI frontend path (/v1/completions)")
    p.add_argument("--max-batch", type=int, default=8, help="KV slots of the served model")
    p.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads on BOTH paths "
                   "(OMP_NUM_THREADS for the server); 0 keeps torch's default (one per core)")


def run(args: argparse.Namespace) -> dict:
    from peagle_trt.build import RepositoryOptions, build_repository
    from peagle_trt.make_tiny import CORPUS, make_all
    from peagle_trt.serve.generator import TextGenerator
    from peagle_trt.serve.options import read_options

    if args.torch_threads > 0:  # before the server starts: its Python-backend stub inherits it
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
        torch.set_num_threads(args.torch_threads)
    work = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    repo = work / "repo"
    with stdout_to_stderr():  # the tokenizer trainer writes to fd 1
        tiny = make_all(work / "tiny")
        build_repository(tiny["llama"], tiny["aws"], repo,
                         RepositoryOptions(SpecConfig("peagle", 3), max_batch=args.max_batch, max_seq_len=512))
    prompts = [f"{CORPUS[i % len(CORPUS)]} Request {i}: continue." for i in range(args.prompts)]
    concs = int_list(args.concurrency)
    engine = TextGenerator.load(*read_options(repo))
    engine.start()
    runs: dict[tuple[str, int], list] = {}  # (path, C) -> [(wall, recs) per round]
    paths = ["inproc", "triton"] + (["openai"] if args.openai else [])
    try:
        with serve_child(repo, work) as ready:  # tritonserver and the OpenAI frontend, as `peagle-trt serve`
            import httpx

            send = senders(engine, ready["grpc"], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
            sessions = {name: contextlib.nullcontext for name in paths}
            sessions["openai"] = lambda: httpx.Client(base_url=ready["openai"], timeout=600)
            for name in paths:  # warm-up: first forwards, first connections, lazy imports
                streamed(prompts, 2, send[name], f"warmup-{name}", sessions[name])

            def timed(name: str, conc: int):
                def go() -> float:
                    rounds = runs.setdefault((name, conc), [])
                    rounds.append(streamed(prompts, conc, send[name], f"{name}-{conc}-{len(rounds)}", sessions[name]))
                    progress(f"  C={conc} {name}: {rounds[-1][0]:.2f} s")
                    return rounds[-1][0]
                return go

            for conc in concs:
                alternate({name: timed(name, conc) for name in paths}, args.repeats, warmup=0, clock=reported)
    finally:
        engine.stop()
        shutil.rmtree(work, ignore_errors=True)
    return report(args, prompts, concs, paths, runs)


def report(args, prompts: list[str], concs: list[int], paths: list[str], runs: dict) -> dict:
    """Per (path, concurrency): medians over rounds, the ratio over its BASE path; token ids compared."""
    rows, mismatches = [], 0
    reference = [r["ids"] for r in runs[(paths[0], concs[0])][0][1]]
    for conc in concs:
        per = {}
        for path in paths:
            rounds = runs[(path, conc)]
            reqs = [r for _, rs in rounds for r in rs]
            wall = statistics.median(w for w, _ in rounds)
            tokens = statistics.median(sum(r["tokens"] for r in rs) for _, rs in rounds)
            per[path] = {"path": path, "concurrency": conc, "rounds": len(rounds), "wall_s": round(wall, 4),
                         "tokens_per_s": round(tokens / wall, 2),
                         "mean_ttft_ms": round(statistics.fmean(r["ttft_s"] for r in reqs if r["ttft_s"]) * 1e3, 2),
                         "mean_latency_ms": round(statistics.fmean(r["latency_s"] for r in reqs) * 1e3, 2)}
            mismatches += sum(a != r["ids"] for _, rs in rounds for a, r in zip(reference, rs))
            if path in BASE:
                per[path]["wall_ratio"] = round(per[path]["wall_s"] / per[BASE[path]]["wall_s"], 3)
                per[path]["target_met"] = per[path]["wall_ratio"] <= TARGET_RATIO
        rows += per.values()
    over = {"triton": "in-process", "openai": "Triton"}
    figures = [Figure(f"served stream, {r['path']} wall over {over[r['path']]}, C={r['concurrency']}", r["wall_ratio"],
                      "x", f"<= {TARGET_RATIO:.2f}x") for r in rows if r["path"] in BASE]
    return finish(args, "Streaming: Triton gRPC and OpenAI vs in-process", [
        f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, peagle K=3, tiny llama on CPU, torch threads "
        f"{torch.get_num_threads()}; median wall of {args.repeats} rounds (paths alternated); wall_ratio: triton "
        f"over inproc, openai over triton (target <= {TARGET_RATIO:.2f}x)",
        records(rows, ["path", "concurrency", "wall_s", "tokens_per_s", "mean_ttft_ms", "mean_latency_ms", "wall_ratio",
                       "target_met"]),
        f"token ids identical across paths, concurrency levels and rounds: "
        f"{'YES' if not mismatches else f'NO ({mismatches} mismatching request(s))'}"],
        {"prompts": len(prompts), "spec": {"mode": "peagle", "k": 3}, "target_wall_ratio": TARGET_RATIO,
         "target_met": all(r["target_met"] for r in rows if r["path"] in BASE),
         "token_ids_identical": not mismatches, "mismatches": mismatches, "rows": rows}, figures)
