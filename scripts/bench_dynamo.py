"""What Dynamo's frontend and router add per token: the code pair served by tritonserver directly
(gRPC stream) vs through Dynamo's frontend (HTTP SSE, KV router) with one and with two
peagle-trt workers (docs/BENCHMARKS.md, "Dynamo routing overhead").

Run it inside a private network namespace (Dynamo's event-plane publishers bind every interface;
peagle_trt/dynamo/options.py), from the repository root, after scripts/dynamo_env.sh:

    unshare -n sh -c 'ip link set lo up; PYTHONPATH=. .venv/bin/python scripts/bench_dynamo.py'

Requests: 8 code prompts x 64 greedy tokens (EOS ignored), one at a time (C=1: latency), then 8 in
flight (C=8: throughput), two rounds; every process runs with one torch thread. Reported per path:
median TTFT (submit -> first text), median TPOT ((last - first text) / (tokens - 1)), output
tokens/s at C=8. On this 2-core machine two workers share the cores one worker already uses: the
C=8 figures show that bound, not the scale-out (docs/DEPLOY.md has the estimate for GPUs).
The last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.demo import code_pair
from peagle_trt.repository import RepositoryOptions, build_repository
from peagle_trt.serving.client import stream_generate
from peagle_trt.serving.server import ServeOptions, TritonServer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def fibonacci(n):", "import os\n\ndef list_files(path):", "class Stack:\n    def __init__(self):",
           "def parse_args(argv):", "def read_json(path):", "for i in range(10):", "def merge(a, b):",
           "with open(path) as f:"]
MAX_TOKENS, ROUNDS = 64, 2


def timed(fn) -> dict:
    """fn(on_text) -> token count; returns ttft_s, tpot_s, tokens."""
    t0, marks = time.perf_counter(), []
    tokens = fn(lambda _text: marks.append(time.perf_counter()))
    ttft = marks[0] - t0
    return {"ttft_s": ttft, "tpot_s": (marks[-1] - marks[0]) / max(tokens - 1, 1), "tokens": tokens}


def triton_request(url: str):
    def run(prompt: str) -> dict:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        return timed(lambda on_text: len(stream_generate(url, prompt, params, on_text=on_text)["token_ids"]))
    return run


def dynamo_request(base: str):
    def run(prompt: str) -> dict:
        body = {"model": "peagle", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

        def go(on_text) -> int:
            tokens = 0
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        if any(c.get("text") for c in event.get("choices", [])):
                            on_text(None)
                        tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
            return tokens
        return timed(go)
    return run


def measure(request) -> dict:
    request(PROMPTS[0])  # warm-up
    latency, tps = [], []
    for _ in range(ROUNDS):
        latency += [request(p) for p in PROMPTS]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            done = list(pool.map(request, PROMPTS))
        tps.append(sum(d["tokens"] for d in done) / (time.perf_counter() - t0))
    return {"ttft_ms": round(1000 * statistics.median(d["ttft_s"] for d in latency), 2),
            "tpot_ms": round(1000 * statistics.median(d["tpot_s"] for d in latency), 2),
            "tokens_per_s_c8": round(statistics.median(tps), 1)}


def dynamo(repo: Path, workers: int, tmp: Path) -> dict:
    python = ROOT / ".venv-dynamo" / "bin" / "python"
    disc, procs = tmp / f"disc-{workers}", []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DYN_LOG": "warn"}
    base = [str(python), "-m", "peagle_trt.cli", "dynamo"]
    try:
        procs.append(subprocess.Popen([*base, "frontend", "--http-port", "8000", "--discovery-dir", str(disc)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for i in range(workers):
            procs.append(subprocess.Popen([*base, "worker", "--repo", str(repo), "--host", f"127.0.0.{2 + i}",
                                           "--discovery-dir", str(disc)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 120
        folder = disc / "v1" / "instances"
        while time.monotonic() < deadline:
            n = sum(1 for f in (os.listdir(folder) if folder.is_dir() else []) if "generate" in f)
            if n >= workers:
                try:
                    dynamo_request("http://127.0.0.1:8000")(PROMPTS[0])
                    break
                except (httpx.HTTPError, IndexError):
                    pass
            time.sleep(0.5)
        return measure(dynamo_request("http://127.0.0.1:8000"))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)


def main() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    tmp = Path(tempfile.mkdtemp(prefix="bench-dynamo-"))
    pair = code_pair()
    repo = tmp / "repo"
    build_repository(pair, pair / "drafter-peagle", repo,
                     RepositoryOptions(SpecConfig("peagle", 3), model_name="peagle", max_batch=8, max_seq_len=512))
    results = {}
    with TritonServer(ServeOptions(repo, "127.0.0.1", 18000, 18001, 18002, ready_timeout_s=120)) as server:
        results["triton_grpc"] = measure(triton_request(server.grpc_url))
    results["dynamo_1_worker"] = dynamo(repo, 1, tmp)
    results["dynamo_2_workers"] = dynamo(repo, 2, tmp)
    for name, r in results.items():
        print(f"{name:18s} TTFT {r['ttft_ms']:7.2f} ms  TPOT {r['tpot_ms']:6.2f} ms  "
              f"C=8 {r['tokens_per_s_c8']:7.1f} tok/s")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    print(json.dumps({"suite": "dynamo-overhead", "git": sha.strip(), "cpus": os.cpu_count(),
                      "machine": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
                      "prompts": len(PROMPTS), "max_tokens": MAX_TOKENS, "rounds": ROUNDS, **results}))


if __name__ == "__main__":
    sys.exit(main())
