"""peagle-trt workers behind NVIDIA Dynamo's own frontend and KV router, on this machine:
a private network namespace (loopback only), file discovery, workers on 127.0.0.2 / 127.0.0.3.

  - 32 concurrent streams through the frontend are token-identical to one in-process engine, and
    carry our per-request speculation metrics (nvext.engine_data, vLLM's shape);
  - chat uses the registered tokenizer and template; a client that leaves cancels its request; an
    onnxruntime-built worker serves its own model beside the torch ones;
  - every listening socket is on a named loopback address or (Dynamo's ZMQ publishers) on the
    wildcard of a namespace that holds loopback only;
  - KV-aware routing: a prompt sharing a long prefix with an earlier one goes to the worker that
    holds it (the router's choice, its KV hit rate, a lower time to first token);
  - kill -9 of one worker: its in-flight streams end with an error, the others finish, new
    requests go to the survivor, nothing hangs or is left behind; a restarted worker rejoins;
    with `--migration-limit 1` its streams are replayed on the survivor and end exactly;
  - SIGTERM ends frontend and workers cleanly (exit 0).
Marked `dynamo` (in the default suite); the Dynamo venv is made on first use.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import time

import pytest

from tests.dynamo.cluster import Deployment, sse
from tests.export.crossbackend import check_greedy_streams, torch_teacher_forced_logits

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(600)]
WORKERS = ("127.0.0.2", "127.0.0.3")
EXTRA = {"nvext": {"extra_fields": ["worker_id", "timing", "engine_data", "completion_token_ids"]}}


@pytest.fixture(scope="module")
def deployment(dynamo_python, dyn_repo, tmp_path_factory):
    dep = Deployment(tmp_path_factory.mktemp("dynamo"), dynamo_python, dyn_repo)
    dep.start_frontend()
    for host in WORKERS:
        dep.start_worker(host)
    try:
        dep.wait_ready(len(WORKERS))
        yield dep
    finally:
        dep.stop()


def completion(dep: Deployment, prompt: list[int], max_tokens: int, pin: int | None = None) -> dict:
    """One request, non-streamed; `pin`: the worker id it must go to (nvext.backend_instance_id)."""
    nvext = {**EXTRA["nvext"], **({"backend_instance_id": pin} if pin is not None else {})}
    body = {"model": "peagle", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "nvext": nvext}
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


def test_chat_uses_the_registered_tokenizer_and_chat_template(deployment, reference):
    """/v1/chat/completions: Dynamo's frontend renders the target's chat template and tokenizes with
    its tokenizer (both registered by the worker): the tokens equal in-process chat generation."""
    for text in ("Hello there", "def fibonacci(n):"):
        body = {"model": "peagle", "messages": [{"role": "user", "content": text}], "max_tokens": 12,
                "temperature": 0, "ignore_eos": True, **EXTRA}
        with deployment.client() as c:
            r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["nvext"]["completion_token_ids"] == reference.chat(text, 12), text
        assert out["choices"][0]["message"]["content"]
        assert out["nvext"]["engine_data"]["metrics"]["speculative_decoding"]["num_spec_tokens"] == 3


def test_a_client_that_leaves_cancels_its_request_on_the_worker(deployment):
    """Closing a stream mid-way: the frontend cancels it, the worker's generate ends early and
    frees the request's blocks (engine.py logs it), long before its 480 tokens were made."""
    before = sum(deployment.log(h).count("cancelled after") for h in WORKERS)
    body = {"model": "peagle", "prompt": prompts(1, 24, seed=11)[0], "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with deployment.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # one chunk, then leave
    deadline = time.monotonic() + 10
    while sum(deployment.log(h).count("cancelled after") for h in WORKERS) == before:
        assert time.monotonic() < deadline, "the worker did not see the cancellation"
        time.sleep(0.1)


def test_an_onnxruntime_worker_serves_its_own_model_beside_them(deployment, ort_repo, reference, tiny):
    """Any backend: a worker for a repository built for onnxruntime joins as model `peagle_ort`;
    its greedy tokens near-equal the torch in-process engine's on this pair (identical, or parting
    at a near-tie of the torch logits: tests/export/crossbackend.py)."""
    proc = deployment.start_worker("127.0.0.5", repo=ort_repo, model="peagle_ort")
    deployment.wait_worker_id("127.0.0.5", other_than=-1)
    batch = prompts(4, 24, seed=12)
    try:
        for p, ref in zip(batch, reference(batch, 16)):
            body = {"model": "peagle_ort", "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                    **EXTRA}
            for _ in range(40):  # the frontend learns the new model from discovery
                with deployment.client() as c:
                    r = c.post("/v1/completions", json=body)
                if r.status_code != 404:
                    break
                time.sleep(0.25)
            assert r.status_code == 200, r.text
            logits = torch_teacher_forced_logits(tiny["llama"], p, ref)
            check_greedy_streams(logits, ref, r.json()["nvext"]["completion_token_ids"], 2e-4, min_agreed=8)
    finally:
        proc.terminate()
        assert proc.wait(60) == 0
        del deployment.workers["127.0.0.5"]


def test_every_plane_is_confined(deployment):
    listeners = deployment.listeners()
    assert listeners
    for addr in listeners:
        host = addr.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", *WORKERS, "0.0.0.0"), f"a socket listens on {addr}"
    # the wildcard ones (Dynamo's ZMQ publishers) reach loopback only: the namespace has nothing else
    out = json.loads(subprocess.run([*deployment.enter(), "ip", "-j", "-4", "addr"], capture_output=True,
                                    text=True, check=True).stdout)
    assert {a["local"] for i in out for a in i["addr_info"]} == {"127.0.0.1"}
    assert not any(addr.startswith("0.0.0.0:") for addr in listeners if addr.endswith(f":{8000}"))


def test_kv_aware_routing_follows_our_block_events(deployment):
    """Each first prompt is pinned to a worker, alternately; its follow-up shares 6 full blocks (192
    tokens) with it and is routed freely: the router sends it to the worker that published those
    blocks, which prefills only the rest (a faster first token)."""
    block, ids = 32, sorted(deployment.instances())
    cold, warm = [], []
    for i, base in enumerate(prompts(6, 6 * block + 8, seed=100)):
        first = completion(deployment, base, 4, pin=ids[i % 2])["nvext"]
        assert first["worker_id"]["decode_worker_id"] == ids[i % 2]
        time.sleep(0.5)  # the stored events travel over the event plane to the router
        follow = base[:6 * block] + prompts(1, 8, seed=200 + i)[0]
        again = completion(deployment, follow, 4)["nvext"]
        holder, chosen = first["worker_id"]["decode_worker_id"], again["worker_id"]["decode_worker_id"]
        assert chosen == holder, f"prefix {i}: routed to {chosen}, the blocks are on {holder}"
        assert again["timing"]["kv_hit_rate"] > 0.8, again["timing"]
        cold.append(first["timing"]["ttft_ms"])
        warm.append(again["timing"]["ttft_ms"])
    assert statistics.median(warm) < statistics.median(cold), f"TTFT ms with the prefix {warm}, without {cold}"
    print(f"TTFT median: cold {statistics.median(cold):.1f} ms, prefix hit {statistics.median(warm):.1f} ms")


def kill_mid_stream(dep: Deployment, victim_host: str, batch: list[list[int]], max_tokens: int) -> list[dict]:
    """Stream `batch`, SIGKILL the worker on `victim_host` once tokens flow; every stream must end
    (within 90 s: nothing hangs)."""
    proc = dep.workers[victim_host]
    dep.scan_shm()

    async def run():
        async with dep.async_client() as client:
            tasks = [asyncio.create_task(stream_completion(client, p, max_tokens)) for p in batch]
            await asyncio.sleep(1.0)
            dep.scan_shm()
            proc.kill()
            return await asyncio.wait_for(asyncio.gather(*tasks), 90)

    results = asyncio.run(run())
    assert proc.wait(10) == -9
    return results


def test_kill9_of_a_worker_costs_only_its_in_flight_requests_and_it_rejoins(deployment, reference):
    """Without migration (the default): the killed worker's streams end with an error, the others
    finish exactly. Until Dynamo drops the dead worker (its discovery lease, ~10 s), a request the
    router still sends there fails at once (503, retryable); then every request goes to the
    survivor. A worker restarted on the same host rejoins."""
    victim_host, survivor_host = WORKERS
    victim, survivor = deployment.worker_id(victim_host), deployment.worker_id(survivor_host)
    batch = prompts(12, 24, seed=3)
    results = kill_mid_stream(deployment, victim_host, batch, 240)
    failed = [r for r in results if r["finish"] != "length"]
    assert failed, "no stream was in flight on the killed worker"
    for r in failed:  # cut short, and the client is told
        assert r["errors"] and len(r["ids"]) < 240, r
    print(f"{len(failed)} streams on the killed worker ended with: {failed[0]['errors'][0][:300]}")
    done = [(p, r) for p, r in zip(batch, results) if r["finish"] == "length"]
    assert done, "no stream survived: the other worker's requests were lost too"
    for (_, r), ref in zip(done, reference([p for p, _ in done], 240)):
        assert r["ids"] == ref and r["nvext"]["worker_id"]["decode_worker_id"] in (victim, survivor)
    gone_after = deployment.wait_gone(victim)
    print(f"the dead worker left discovery after {gone_after:.1f} s more")
    for p in prompts(6, 24, seed=4):
        assert completion(deployment, p, 8)["nvext"]["worker_id"]["decode_worker_id"] == survivor
    deployment.start_worker(victim_host)
    rejoined = deployment.wait_worker_id(victim_host, other_than=victim)

    async def spread():
        async with deployment.async_client() as client:
            return await asyncio.gather(*(stream_completion(client, p, 32) for p in prompts(16, 24, seed=5)))

    seen: set = set()
    for _ in range(5):
        seen |= {r["nvext"]["worker_id"]["decode_worker_id"] for r in asyncio.run(spread()) if r["finish"] == "length"}
        if rejoined in seen:
            break
        time.sleep(1.0)
    assert {rejoined, survivor} <= seen, f"requests went to {seen}; the restarted worker is {rejoined}"


def test_with_migration_a_dead_workers_streams_finish_on_the_survivor(dynamo_python, dyn_repo, reference,
                                                                      tmp_path):
    """`dynamo frontend --migration-limit 1`: the killed worker's streams are replayed on the
    survivor (its tokens so far as the prompt) and end exactly as in-process; requests sent right
    after the kill all succeed."""
    dep = Deployment(tmp_path, dynamo_python, dyn_repo, migration_limit=1)
    try:
        dep.start_frontend()
        for host in WORKERS:
            dep.start_worker(host)
        dep.wait_ready(len(WORKERS))
        batch = prompts(8, 24, seed=6)
        results = kill_mid_stream(dep, WORKERS[0], batch, 200)
        for i, (r, ref) in enumerate(zip(results, reference(batch, 200))):
            assert not r["errors"] and r["finish"] == "length", (i, r["errors"])
            assert r["ids"] == ref, f"stream {i} differs from in-process after migration"
        assert "recreating stream" in dep.log("frontend"), "no stream was migrated: none was on the killed worker"
        for p in prompts(6, 24, seed=7):
            completion(dep, p, 8)  # asserts 200
    finally:
        codes = dep.stop()
    assert codes["frontend"] == 0 and codes[f"worker-{WORKERS[1]}"] == 0, codes


FAIL_SCHEDULER = """
import os
from peagle_trt.runtime import scheduler

_step = scheduler.Scheduler.step


def step(self):
    if os.path.exists(os.environ["PEAGLE_TEST_FAIL_FLAG"]):
        raise RuntimeError("injected scheduler failure")
    return _step(self)


scheduler.Scheduler.step = step
"""


def test_a_worker_whose_scheduler_fails_leaves_at_once_never_ready_but_broken(deployment, tmp_path):
    """Fault injection (a sitecustomize in the worker only): once its scheduler fails, the worker
    ends its requests with an error, unregisters (the router stops sending to it) and exits 2."""
    (tmp_path / "sitecustomize.py").write_text(FAIL_SCHEDULER)
    flag = tmp_path / "fail-now"
    host = "127.0.0.4"
    proc = deployment.start_worker(host, env={"PYTHONPATH": f"{tmp_path}:{deployment.env['PYTHONPATH']}",
                                              "PEAGLE_TEST_FAIL_FLAG": str(flag)})
    broken = deployment.wait_worker_id(host, other_than=-1)
    deadline = time.monotonic() + 30
    while broken not in deployment.instances() and time.monotonic() < deadline:
        time.sleep(0.25)
    flag.touch()
    body = {"model": "peagle", "prompt": prompts(1, 24, seed=8)[0], "max_tokens": 8, "temperature": 0,
            "nvext": {"backend_instance_id": broken}}
    with deployment.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code != 200 or r.json()["choices"][0]["finish_reason"].startswith("error"), r.text
    t0 = time.monotonic()
    assert proc.wait(30) == 2, deployment.log(host)[-2000:]
    assert "the scheduler failed" in deployment.log(host) and '"error_type": "ServeError"' in deployment.log(host)
    deployment.wait_gone(broken, timeout=15)
    print(f"the failed worker unregistered and exited {time.monotonic() - t0:.1f} s after the failure")
    del deployment.workers[host]
    for p in prompts(4, 24, seed=9):
        assert completion(deployment, p, 4)["nvext"]["worker_id"]["decode_worker_id"] != broken


def test_sigterm_drains_a_worker_then_ends_every_process_cleanly_and_nothing_is_left(deployment, reference):
    """SIGTERM of a worker with streams in flight: it stops taking requests, its streams finish
    exactly, it exits 0. Then SIGTERM ends the frontend and the other worker with exit 0."""
    host = WORKERS[1]
    proc = deployment.workers[host]
    batch = prompts(8, 24, seed=10)

    async def run():
        async with deployment.async_client() as client:
            tasks = [asyncio.create_task(stream_completion(client, p, 240)) for p in batch]
            await asyncio.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    results = asyncio.run(run())
    for i, (r, ref) in enumerate(zip(results, reference(batch, 240))):
        assert not r["errors"] and r["ids"] == ref, (i, r["errors"])
    assert proc.wait(60) == 0, deployment.log(host)[-2000:]
    log = deployment.log(host)
    assert "drain: waiting for" in log and "stopping them" not in log, log[-3000:]  # drained, not cut
    codes = deployment.stop()
    assert codes and all(code == 0 for code in codes.values()), codes
    assert not [f for f in deployment.shm_seen if os.path.exists(f)], "shared memory left in /dev/shm"
    for proc in (deployment.frontend, *deployment.workers.values()):
        assert not os.path.exists(f"/proc/{proc.pid}")
