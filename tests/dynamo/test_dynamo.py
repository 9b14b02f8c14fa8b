"""peagle-trt workers behind NVIDIA Dynamo's own frontend and KV router (issue 25), on this machine:
a private network namespace (loopback only), file discovery, workers on 127.0.0.2 / 127.0.0.3.

  - 32 concurrent streams through the frontend are token-identical to one in-process engine, and
    carry our per-request speculation metrics (nvext.engine_data, vLLM's shape);
  - every listening socket is on a named loopback address or (Dynamo's ZMQ publishers) on the
    wildcard of a namespace that holds loopback only;
  - KV-aware routing: a prompt sharing a long prefix with an earlier one goes to the worker that
    holds it (the router's choice, its KV hit rate, a lower time to first token);
  - kill -9 of one worker: its in-flight streams end with an error, the others finish, new
    requests go to the survivor, nothing hangs or is left behind; a restarted worker rejoins;
  - SIGTERM ends frontend and workers cleanly (exit 0).
Marked `dynamo` (in the default suite); the Dynamo venv is made on first use.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time

import pytest

from tests.dynamo.cluster import Deployment, sse

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(600)]
WORKERS = ("127.0.0.2", "127.0.0.3")
EXTRA = {"nvext": {"extra_fields": ["worker_id", "timing", "engine_data", "completion_token_ids"]}}


@pytest.fixture(scope="module")
def deployment(dynamo_python, dyn_repo, tmp_path_factory):
    shm_before = set(os.listdir("/dev/shm"))
    dep = Deployment(tmp_path_factory.mktemp("dynamo"), dynamo_python, dyn_repo)
    dep.start_frontend()
    for host in WORKERS:
        dep.start_worker(host)
    try:
        dep.wait_ready(len(WORKERS))
        yield dep
    finally:
        codes = dep.stop()
        dep.shm_left = set(os.listdir("/dev/shm")) - shm_before
        dep.exit_codes = codes


def completion(dep: Deployment, prompt: list[int], max_tokens: int, stream: bool = False) -> dict:
    body = {"model": "peagle", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **EXTRA}
    with dep.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def stream_completion(client, prompt: list[int], max_tokens: int) -> dict:
    """One streamed request: its token ids, finish reason, nvext of the last chunk, errors."""
    body = {"model": "peagle", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, **EXTRA}
    lines = []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"status": r.status_code, "errors": [(await r.aread()).decode()], "ids": [], "finish": None}
            async for line in r.aiter_lines():
                lines.append(line)
    except Exception as exc:  # a stream cut by a dead worker: the error the client sees
        return {"status": 200, "errors": [f"{type(exc).__name__}: {exc}"], "ids": [], "finish": None,
                "lines": lines}
    events, errors = sse(lines)
    ids = [t for e in events for t in (e.get("nvext") or {}).get("completion_token_ids") or []]
    finish = next((c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")), None)
    nvext = {}
    for e in events:
        nvext.update(e.get("nvext") or {})
    return {"status": 200, "ids": ids, "finish": finish, "nvext": nvext, "errors": errors, "lines": lines}


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, 500) for _ in range(length)] for _ in range(n)]


def test_32_streams_are_token_identical_to_in_process_and_carry_our_metrics(deployment, reference):
    batch = prompts(32, 24, seed=1)
    expected = reference(batch, 16)

    async def run():
        async with deployment.async_client() as client:
            return await asyncio.gather(*(stream_completion(client, p, 16) for p in batch))

    results = asyncio.run(run())
    for i, (res, ref) in enumerate(zip(results, expected)):
        assert not res["errors"], (i, res["errors"])
        assert res["ids"] == ref, f"stream {i}: {res['ids']} != in-process {ref}"
        assert res["finish"] == "length"
        spec = res["nvext"]["engine_data"]["metrics"]["speculative_decoding"]
        assert spec["num_spec_tokens"] == 3 and sum(spec["acceptance_histogram"]) == spec["num_spec_steps"] > 0
        assert spec["mean_acceptance_length"] >= 1.0
    used = {r["nvext"]["worker_id"]["decode_worker_id"] for r in results}
    assert used == deployment.instances(), "both workers should have served some of the 32 streams"


def test_every_plane_is_confined(deployment):
    listeners = deployment.listeners()
    assert listeners
    for addr in listeners:
        host = addr.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", *WORKERS, "0.0.0.0"), f"a socket listens on {addr}"
    # the wildcard ones (Dynamo's ZMQ publishers) reach loopback only: the namespace has nothing else
    out = json.loads(os.popen(f"nsenter -t {deployment.relay.pid} -n -- ip -j -4 addr").read())
    assert {a["local"] for i in out for a in i["addr_info"]} == {"127.0.0.1"}
    assert not any(addr.startswith("0.0.0.0:") for addr in listeners if addr.endswith(f":{8000}"))
