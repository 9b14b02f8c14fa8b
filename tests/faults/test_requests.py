"""Fault injection: one request never hurts another.

  temperatures that overflow float32 (1e-38, the float32 subnormal 1e-45, 5e-324) sample greedily,
      in a batch with greedy requests that stay token-identical to running alone;
  an exception raised while stepping a batch (injected into the executor for one request, in
      prefill, in verify, in drafting) fails that request with an error, the others go on exactly;
  an oversized prompt or stop string is refused from its byte count, before tokenization, while
      a stream runs on untouched;
  two gRPC clients with one request id: one cancels, the other completes exactly (real tritonserver).
Kept fast: tiny seeded models, one small repository.
"""

from __future__ import annotations

import queue
import random
import shutil
import sys
import time

import numpy as np
import pytest
import torch

from peagle_trt.config import TEMPERATURE_FLOOR, SamplingParams, SpecConfig
from peagle_trt.errors import RequestError
from peagle_trt.runtime.scheduler import Request, Scheduler, generate
from peagle_trt.serve.generator import TextGenerator
from peagle_trt.speculative.sampling import probabilities
from peagle_trt.speculative.verify import verify, verify_greedy
from tests.helpers import collect, greedy, make_decoder

pytestmark = pytest.mark.faults
NAN_PRONE = [1e-38, float(np.float32(1e-45)), 5e-324]  # 1e-45 as it arrives over gRPC (FP32)
MAX_SEQ_LEN = 512


def workload(n: int, seed: int):
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def references(tiny):
    single = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256)
    return [generate(single, p, greedy(24)).output for p in workload(6, 11)]


# -- sampling ------------------------------------------------------------------------------------
def test_every_accepted_temperature_gives_finite_probabilities_or_greedy_tokens():
    logits = torch.randn(4, 512) * 30  # [K+1, V], a wide range of logits
    drafts = logits[:3].argmax(-1).tolist()
    for t in [TEMPERATURE_FLOOR, 2e-5, 1e-3, 1.0, 1e30, 1e300, sys.float_info.max]:
        for extra in ({}, {"top_k": 5, "top_p": 0.9}):
            p = probabilities(logits, SamplingParams(temperature=t, **extra))
            assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(4)), t
    for t in NAN_PRONE:
        params = SamplingParams(temperature=t, top_p=0.5, seed=1)
        assert params.greedy
        assert verify(drafts, logits, params, None) == verify_greedy(drafts, logits)


def test_nan_prone_temperatures_in_a_mixed_batch_keep_every_greedy_request_exact(tiny, references):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256, slots=6)
    sched = Scheduler(decoder, prefill_chunk=16)
    outputs: dict = {}
    temperatures = NAN_PRONE + [0.0, 0.0, 0.8]
    for i, (prompt, t) in enumerate(zip(workload(6, 11), temperatures)):
        params = SamplingParams(max_tokens=24, temperature=t, seed=i, ignore_eos=True)
        sched.add(Request(str(i), prompt, params, collect(outputs)))
    sched.run_until_idle()
    for i, t in enumerate(temperatures):
        assert outputs[str(i)]["reason"] == "length" and outputs[str(i)]["final"] == 1, (t, outputs[str(i)])
        if t < TEMPERATURE_FLOOR:  # NaN-prone and greedy requests alike: the greedy tokens
            assert outputs[str(i)]["ids"] == references[i], t
    assert sched.blocks.used_blocks == 0


# -- step failures ---------------------------------------------------------------------------------
class FaultyExecutor:
    """Wraps an executor; `method` (a name, or several) raises from its `at`-th call that involves
    the victim's first KV block on, every time (a persistent fault of that request)."""

    def __init__(self, inner, method: str | tuple[str, ...], at: int, victim_block):
        self.inner, self.method, self.at, self.victim_block = inner, method, at, victim_block
        self.calls = 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name not in (self.method if isinstance(self.method, tuple) else (self.method,)):
            return attr

        def faulty(*args, **kwargs):
            tables = args[2] if name == "target" else args[4]  # target(tokens, pos, tables, ..), draft_parallel(_top)
            if self.victim_block() in tables[0, :, 0].tolist():
                self.calls += 1
                if self.calls >= self.at:
                    raise RuntimeError("injected fault")
            return attr(*args, **kwargs)
        return faulty


@pytest.mark.parametrize("method,at", [("target", 1), ("target", 3), ("draft_parallel", 3)],
                         ids=["prefill", "verify", "drafting"])
def test_a_step_exception_fails_only_its_request(tiny, references, method, at):
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 3, max_len=256, slots=6)
    sched = Scheduler(decoder, prefill_chunk=16)
    outputs: dict = {}
    victim = Request("victim", [7, 8, 9, 10], greedy(40), collect(outputs))
    faulty = FaultyExecutor(decoder.ex, method, at,  # the victim's first block while it holds it
                            lambda: victim.seq.blocks[0][0] if victim in sched.running else None)
    decoder.ex = decoder.proposer.ex = faulty
    load = workload(6, 11)
    for i in (0, 1, 2):
        sched.add(Request(str(i), load[i], greedy(24), collect(outputs)))
    sched.add(victim)
    for i in (3, 4, 5):
        sched.add(Request(str(i), load[i], greedy(24), collect(outputs)))
    sched.run_until_idle()
    assert outputs["victim"]["reason"] == "error" and "injected fault" in outputs["victim"]["error"]
    assert outputs["victim"]["final"] == 1 and faulty.calls >= at
    for i in range(6):
        assert outputs[str(i)]["ids"] == references[i] and outputs[str(i)]["reason"] == "length", i
    assert sched.blocks.used_blocks == 0 and sched.finished_requests == 7


@pytest.fixture(scope="module")
def engine(tiny):
    return TextGenerator.from_checkpoints(tiny["llama"], tiny["aws"], SpecConfig("peagle", 3),
                                          max_seq_len=MAX_SEQ_LEN, max_batch=6, prefill_chunk=32, deterministic=True)


PROMPTS = ["Hello there", "Write a poem about the sea", "the quick brown fox", "def f(x):"]


@pytest.fixture(scope="module")
def refs(engine):
    """Greedy tokens of each prompt alone, computed before any test starts the engine's thread."""
    jobs = [*[(p, 30) for p in PROMPTS], *[(p, 120) for p in PROMPTS[:2]],
            ("a long running stream", 300), ("the second client", 450)]
    params = {n: SamplingParams(max_tokens=n, ignore_eos=True) for _, n in jobs}
    return {(p, n): engine.generate(p, params[n], chat_template=False)["token_ids"] for p, n in jobs}


@pytest.fixture
def started(engine):
    """Starts the engine's stepping thread when called; stops it after the test."""
    def start():
        engine._stop.clear()
        engine.start()
        return engine

    yield start
    engine.stop()


def submit(engine, name: str, prompt: str, params: SamplingParams, done: dict) -> int:
    events: list = []

    def on_event(event):
        events.append(event)
        if event.finished:
            done[name] = events

    return engine.submit(name, prompt, params, on_event)


def wait_for(done: dict, names, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(n in done for n in names) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(n in done for n in names), (sorted(done), names)


def ids_of(events) -> list[int]:
    return [t for e in events for t in e.token_ids]


def test_the_serving_loop_keeps_serving_beside_a_failing_request(engine, refs, started, monkeypatch):
    """Through the engine's own thread: NaN-prone temperatures and a request whose forward
    raises, beside greedy requests; the old loop aborted every running request."""
    victim_uid = []
    target = engine.scheduler.decoder.ex.target

    def faulty_target(tokens, positions, tables, *rest, **kwargs):
        victim = [r.seq.blocks[0][0] for r in engine.scheduler.running if r.uid in victim_uid and r.seq]
        if victim and victim[0] in tables[0, :, 0].tolist():
            raise RuntimeError("injected fault")
        return target(tokens, positions, tables, *rest, **kwargs)

    monkeypatch.setattr(engine.scheduler.decoder.ex, "target", faulty_target)
    done: dict = {}
    # queued before the loop starts: all are admitted together and share their steps
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    victim_uid.append(submit(engine, "victim", "a victim", params, done))
    for i, p in enumerate(PROMPTS):
        t = [0.0, *NAN_PRONE][i]
        submit(engine, str(i), p, SamplingParams(max_tokens=30, temperature=t, seed=i, ignore_eos=True), done)
    started()
    wait_for(done, ["victim", "0", "1", "2", "3"])
    assert done["victim"][-1].finish_reason == "error" and "injected fault" in done["victim"][-1].error
    for i, p in enumerate(PROMPTS):
        assert done[str(i)][-1].finish_reason == "length" and ids_of(done[str(i)]) == refs[(p, 30)], i
    assert engine.step_error is None


# -- oversized inputs ------------------------------------------------------------------------------
def test_oversized_prompt_and_stop_string_are_refused_before_tokenization(engine, refs, started, monkeypatch):
    started()
    encoded: list[int] = []
    encode = engine.codec.encode_prompt
    monkeypatch.setattr(engine.codec, "encode_prompt", lambda text, chat=True: encoded.append(len(text))
                        or encode(text, chat))
    done: dict = {}
    submit(engine, "stream", "a long running stream", SamplingParams(max_tokens=300, ignore_eos=True), done)
    prompt_limit, stop_limit = 16 * MAX_SEQ_LEN, 1024  # the defaults for max_seq_len 512
    started = time.monotonic()
    with pytest.raises(RequestError, match=rf"at most {prompt_limit} bytes \(max_prompt_bytes\)"):
        submit(engine, "huge", "x" * 10_000_000, SamplingParams(max_tokens=5), done)
    with pytest.raises(RequestError, match=r"max_prompt_bytes"):  # 4-byte characters count as bytes
        submit(engine, "wide", "😀" * (prompt_limit // 4 + 1), SamplingParams(max_tokens=5), done)
    with pytest.raises(RequestError, match=rf"at most {stop_limit} bytes \(max_stop_bytes\)"):
        submit(engine, "stop", "hi", SamplingParams(max_tokens=5, stop=("s" * 400_000,)), done)
    with pytest.raises(RequestError, match=r"max_stop_bytes"):
        submit(engine, "stops", "hi", SamplingParams(max_tokens=5, stop=("abc",) * 400), done)
    refused_s = time.monotonic() - started
    assert 10_000_000 not in encoded and not any(n > prompt_limit for n in encoded)
    assert refused_s < 5.0, refused_s  # generous: tokenizing 10 MB alone took seconds
    # within the byte limit but beyond max_seq_len tokens: tokenized, then refused by its length
    with pytest.raises(RequestError, match="exceeds the maximum sequence length"):
        submit(engine, "long", "y " * (prompt_limit // 2), SamplingParams(max_tokens=5), done)
    assert encoded[-1] == prompt_limit
    submit(engine, "small", "a small request", SamplingParams(max_tokens=20, ignore_eos=True), done)
    wait_for(done, ["stream", "small"])
    assert ids_of(done["stream"]) == refs[("a long running stream", 300)]
    assert len(ids_of(done["small"])) == 20 and sorted(done) == ["small", "stream"]


# -- through a real tritonserver -------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny, tmp_path_factory):
    pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("pytriton")
    from peagle_trt.build import RepositoryOptions, build_repository
    from peagle_trt.serve.server import ServeOptions, TritonServer
    from tests.serve.conftest import free_port

    repo = tmp_path_factory.mktemp("faults") / "repo"
    build_repository(tiny["llama"], tiny["aws"], repo, RepositoryOptions(SpecConfig("peagle", 3), max_batch=8,
                                                                max_seq_len=MAX_SEQ_LEN, prefill_chunk=32,
                                                                deterministic=True))
    spec = ServeOptions(repo, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=120)
    with TritonServer(spec) as srv:
        yield srv
    shutil.rmtree(repo, ignore_errors=True)


def open_stream(server, prompt: str, params: SamplingParams, request_id: str = ""):
    import tritonclient.grpc as grpcclient

    from peagle_trt.serve.client import build_inputs

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer("peagle", build_inputs(prompt, params), request_id=request_id,
                              enable_empty_final_response=True)
    return client, q


def drain(q: queue.Queue, timeout: float = 120.0) -> dict:
    """ids, finish_reason, error of one stream, up to its final response."""
    ids: list[int] = []
    while True:
        result, error = q.get(timeout=timeout)
        if error is not None:
            return {"ids": ids, "error": error.message(), "reason": None}
        if result.as_numpy("output_ids") is not None:
            ids += result.as_numpy("output_ids").tolist()
        if result.get_response().parameters["triton_final_response"].bool_param:
            reason = result.as_numpy("finish_reason")
            return {"ids": ids, "error": None, "reason": reason[0].decode() if reason is not None else None}


@pytest.mark.triton
def test_two_clients_with_one_request_id_cancel_only_their_own(server, refs):
    params = SamplingParams(max_tokens=450, ignore_eos=True)
    reference = refs[("the second client", 450)]
    a, qa = open_stream(server, "the first client", params, request_id="same-id")
    b, qb = open_stream(server, "the second client", params, request_id="same-id")
    first_b = qb.get(timeout=60)
    qa.get(timeout=60)
    a.stop_stream(cancel_requests=True)  # A leaves; B, with the same request id, must not
    a.close()
    assert not first_b[0].get_response().parameters["triton_final_response"].bool_param  # B was running
    rest = drain(qb)
    b.stop_stream()
    b.close()
    ids = first_b[0].as_numpy("output_ids").tolist() + rest["ids"]
    assert rest["error"] is None and rest["reason"] == "length", rest
    assert ids == reference


@pytest.mark.triton
def test_grpc_faults_next_to_running_streams(server, refs):
    """A subnormal FP32 temperature beside greedy streams; a 10 MB prompt and a 400 KB stop
    string refused by their sizes while a stream runs on exactly."""
    from peagle_trt.serve.client import stream_generate

    prompts = PROMPTS[:2]
    streams = [open_stream(server, prompts[0], SamplingParams(max_tokens=120, ignore_eos=True)),
               open_stream(server, prompts[1],
                           SamplingParams(max_tokens=120, temperature=1e-45, ignore_eos=True))]
    errors = {}
    for name, prompt, params in [("prompt", "x" * 10_000_000, SamplingParams(max_tokens=5)),
                                 ("stop", "hi", SamplingParams(max_tokens=5, stop=("s" * 400_000,)))]:
        with pytest.raises(Exception) as info:
            stream_generate(server.grpc_url, prompt, params, timeout_s=60)
        errors[name] = str(info.value)
    assert "max_prompt_bytes" in errors["prompt"] and "max_stop_bytes" in errors["stop"], errors
    for (client, q), prompt in zip(streams, prompts):
        got = drain(q)
        client.stop_stream()
        client.close()
        assert got["error"] is None and got["reason"] == "length" and got["ids"] == refs[(prompt, 120)]
    assert server.ready()
