"""End to end through a real tritonserver: streamed and HTTP outputs equal the offline greedy
reference, concurrency, cancellation, and bad requests that fail alone."""

from __future__ import annotations

import json
import queue
import random
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from peagle_trt.config import SamplingParams
from peagle_trt.serve.client import build_inputs, stream_generate
from peagle_trt.serve.generator import TextGenerator
from peagle_trt.tokenizer import TextCodec
from tests.export.crossbackend import check_greedy_streams, torch_teacher_forced_logits
from tests.serve.conftest import MAX_SEQ_LEN, MODELS

pytestmark = pytest.mark.triton
PROMPTS = ["Hello there", "Write a poem about the sea", "x", "def fibonacci(n):\n    return"]
ORT_LOGIT_TOL = 1e-4  # torch against onnxruntime on the tiny pair, as tests/export/test_onnx.py


@pytest.fixture(scope="module")
def offline(tiny):
    engines = {name: TextGenerator.from_checkpoints(tiny["llama"], tiny["aws"], spec, max_seq_len=MAX_SEQ_LEN,
                                                  deterministic=True)
               for name, spec in MODELS.items()}

    def reference(prompt: str, max_tokens: int, model: str = "peagle") -> list[int]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return engines[model].generate(prompt, params, chat_template=False)["token_ids"]

    return reference


def http_post(server, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"{server.http_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric_lines(server) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.options.metrics_port}/metrics", timeout=10) as r:
        return [line for line in r.read().decode().splitlines() if line.startswith("peagle_")]


def metric(server, name: str, model: str = "peagle") -> float:
    """The value of our series `name` for `model` (each model's series carry its name as a label)."""
    for line in metric_lines(server):
        if line.startswith(name + "{") and f'model="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} of model {model} not exported")


def test_each_model_exports_its_own_metric_series(server):
    """Several models in one server: every peagle_* series is labelled with its model, so one
    model's slots or acceptance never overwrite another's."""
    lines = metric_lines(server)
    for model in MODELS:
        assert metric(server, "peagle_kv_blocks_total", model) > 0
        assert any(line.startswith("peagle_generated_tokens_total{") and f'model="{model}"' in line for line in lines)
    assert not [line for line in lines if not line.split(" ")[0].endswith("}")], "a series without labels"


@pytest.mark.parametrize("model", list(MODELS))
def test_grpc_stream_and_http_generate_equal_offline_greedy(server, offline, model):
    for prompt in PROMPTS:
        ref = offline(prompt, 20, model)
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        got = stream_generate(server.grpc_url, prompt, params, model=model)
        assert got["token_ids"] == ref and got["finish_reason"] == "length"
        assert got["acceptance_length"] >= 1.0
        assert len(got["accept_rate_per_pos"]) == (0 if model == "peagle_none" else 3)
        status, body = http_post(server, f"/v2/models/{model}/generate",
                                 {"text_input": prompt, "max_tokens": 20, "ignore_eos": True})
        assert status == 200, body
        out = json.loads(body)
        assert np.atleast_1d(out["output_ids"]).tolist() == ref and out["text_output"] == got["text"]
        status, body = http_post(server, f"/v2/models/{model}/generate_stream",
                                 {"text_input": prompt, "max_tokens": 20, "ignore_eos": True, "stream": True})
        events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
        ids = [i for e in events for i in np.atleast_1d(e["output_ids"]).tolist()]
        assert status == 200 and ids == ref and "".join(e["text_output"] for e in events) == got["text"]
        assert "acceptance_length" in events[-1] and "acceptance_length" not in events[0] or len(events) == 1


def test_32_concurrent_streams_are_complete_and_exact(server, offline):
    rng = random.Random(5)
    jobs = [(" ".join(rng.choice(["alpha", "beta", "gamma", "sea", "fox"]) for _ in range(rng.randint(1, 40))),
             rng.randint(1, 48), rng.uniform(0, 1.0)) for _ in range(32)]
    results: dict[int, dict] = {}

    def client(i, prompt, max_tokens, delay):
        time.sleep(delay)
        results[i] = stream_generate(server.grpc_url, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    threads = [threading.Thread(target=client, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 32
    for i, (prompt, max_tokens, _) in enumerate(jobs):
        assert results[i]["token_ids"] == offline(prompt, max_tokens), i
        assert results[i]["finish_reason"] == "length"
    assert server.ready()


def _open_stream(server, prompt: str, max_tokens: int, model: str = "peagle"):
    import tritonclient.grpc as grpcclient

    q: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    client.async_stream_infer(model, build_inputs(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                              enable_empty_final_response=True)
    return client, q


def test_cancelled_stream_frees_its_kv_slot_and_others_continue(server, offline):
    victim, q = _open_stream(server, "a victim that leaves early", 200)
    q.get(timeout=30)  # the stream is running
    others: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: others.__setitem__(
        i, stream_generate(server.grpc_url, PROMPTS[i], SamplingParams(max_tokens=40, ignore_eos=True))))
        for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    victim.stop_stream(cancel_requests=True)  # the client disconnects mid-stream
    victim.close()
    for t in threads:
        t.join(60)
    deadline = time.time() + 20
    while metric(server, "peagle_kv_blocks_used") != 0 and time.time() < deadline:
        time.sleep(0.2)
    assert metric(server, "peagle_kv_blocks_used") == 0  # the victim's blocks came back
    for i in range(3):
        assert others[i]["token_ids"] == offline(PROMPTS[i], 40)


def test_same_output_alone_or_among_joining_and_leaving_requests(server, offline):
    prompt = "the same request twice"
    alone = stream_generate(server.grpc_url, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    noise = [_open_stream(server, f"noise {i}", 60) for i in range(4)]
    crowded: dict = {}
    t = threading.Thread(target=lambda: crowded.update(
        stream_generate(server.grpc_url, prompt, SamplingParams(max_tokens=40, ignore_eos=True))))
    t.start()
    for client, _ in noise[:2]:  # two leave mid-stream, two more join
        time.sleep(0.05)
        client.stop_stream(cancel_requests=True)
        client.close()
    noise += [_open_stream(server, f"late {i}", 10) for i in range(2)]
    t.join(60)
    assert crowded["token_ids"] == alone["token_ids"] == offline(prompt, 40)
    for client, _ in noise[2:]:
        client.stop_stream()
        client.close()


BAD = [
    ({"text_input": "", "max_tokens": 5}, "text_input is empty"),
    ({"text_input": "x " * (MAX_SEQ_LEN + 10), "max_tokens": 5}, "exceeds the maximum sequence length"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"text_input": "hi", "max_tokens": -3}, "max_tokens must be a positive integer"),
    ({"text_input": "hi", "max_tokens": 10 ** 9}, "exceeds the maximum sequence length"),
    ({"text_input": "hi", "temperature": -0.5}, "temperature must be >= 0"),
    ({"text_input": "hi", "top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"text_input": "hi", "top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ({"text_input": "hi", "no_such_input": 3}, r"unknown input\(s\) \['no_such_input'\]"),
]


def test_bad_requests_fail_alone(server, offline):
    import re

    background: dict = {}
    t = threading.Thread(target=lambda: background.update(
        stream_generate(server.grpc_url, PROMPTS[1], SamplingParams(max_tokens=120, ignore_eos=True))))
    t.start()
    for body, message in BAD:
        status, text = http_post(server, "/v2/models/peagle/generate", body)
        assert status >= 400 and re.search(message, text), (body, status, text)
    _tensor_api_errors(server)
    t.join(60)
    assert background["token_ids"] == offline(PROMPTS[1], 120)
    assert server.ready()


def _tensor_api_errors(server):
    """Wrong dtype, wrong shape and non-UTF-8 bytes on the gRPC tensor API."""
    import tritonclient.grpc as grpcclient

    def send(inputs) -> str:
        q: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: q.put(error))
        client.async_stream_infer("peagle", inputs, enable_empty_final_response=True)
        error = q.get(timeout=30)
        client.stop_stream()
        client.close()
        assert error is not None
        return error.message()

    def text(values, shape=None):
        t = grpcclient.InferInput("text_input", shape or [len(values)], "BYTES")
        t.set_data_from_numpy(np.array(values, dtype=np.object_).reshape(shape or [len(values)]))
        return t

    wrong_dtype = grpcclient.InferInput("max_tokens", [1], "FP32")
    wrong_dtype.set_data_from_numpy(np.array([4.0], dtype=np.float32))
    assert "data-type" in send([text([b"hi"]), wrong_dtype]) or "datatype" in send([text([b"hi"]), wrong_dtype])
    assert "shape" in send([text([b"a", b"b"])])
    extra = grpcclient.InferInput("no_such_input", [1], "INT32")
    extra.set_data_from_numpy(np.array([1], dtype=np.int32))
    assert "unexpected inference input 'no_such_input'" in send([text([b"hi"]), extra])
    assert "not valid UTF-8" in send([text([b"\xff\xfe bad"])])


def test_onnxruntime_backend_streams_the_torch_backends_tokens(server, offline, tiny):
    """build --backend onnxruntime -> serve -> a streamed request gives the torch backend's tokens:
    exactly from the served torch backend, near-equal (identical, or parting at a near-tie of the
    torch logits: tests/export/crossbackend.py) from the onnxruntime one."""
    codec = TextCodec(tiny["llama"])
    for prompt in PROMPTS:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        ort = stream_generate(server.grpc_url, prompt, params, model="peagle_ort")
        torch_backend = stream_generate(server.grpc_url, prompt, params, model="peagle")
        ref = offline(prompt, 24)
        assert torch_backend["token_ids"] == ref
        logits = torch_teacher_forced_logits(tiny["llama"], codec.encode_prompt(prompt, chat_template=False), ref)
        check_greedy_streams(logits, ref, ort["token_ids"], 2 * ORT_LOGIT_TOL, min_agreed=8)
        assert ort["drafter_forwards"] == ort["steps"]


def test_generate_prints_one_json_shape_for_target_repo_and_url(server, repo, tiny, capsys):
    """`generate --target`, `--repo` and `--url` run the same engine and print the same keys, in
    the same order, with the same tokens and statistics."""
    from peagle_trt.cli import main
    from peagle_trt.serve.protocol import RESULT_KEYS

    common = ["generate", "--prompt", "Write a poem", "--max-tokens", "12", "--ignore-eos", "--no-chat-template"]
    # the repository's model `peagle` runs the torch backend: --target is asked for the same one
    # (its CPU default is onnxruntime, peagle_trt/cli.py generate_backend)
    sources = {"target": ["--target", str(tiny["llama"]), "--drafter", str(tiny["aws"]), "--spec-mode", "peagle",
                          "--num-spec-tokens", "3", "--backend", "torch"],
               "repo": ["--repo", str(repo)],
               "url": ["--url", server.grpc_url]}
    results = {}
    for name, flags in sources.items():
        assert main(common + flags) == 0, name
        results[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for name, result in results.items():
        assert list(result)[:len(RESULT_KEYS)] == list(RESULT_KEYS), name
        assert list(result)[len(RESULT_KEYS):] == ["load_s", "generate_s", "tokens_per_s"], name
    same = {k: results["target"][k] for k in RESULT_KEYS}
    assert {k: results["repo"][k] for k in RESULT_KEYS} == same
    assert {k: results["url"][k] for k in RESULT_KEYS} == same
