"""The OpenAI-compatible frontend (peagle_trt/serve/openai_frontend/) in front of a real tritonserver,
driven by real clients: the `openai` package (streaming and not) and plain HTTP (httpx). Its tokens
must equal the gRPC path's (`peagle_trt.serve.client.stream_generate`) for the same request; bad
parameters get OpenAI-shaped 400s, unknown models 404, a server still loading 503; a client that
leaves mid-stream frees its KV slot; `peagle-trt serve --openai-port` starts and stops it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.config import SamplingParams, SpecConfig
from tests.serve.conftest import free_port
from tests.serve.test_triton import metric

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.triton
PROMPTS = ["Hello there", "def fibonacci(n):\n    return"]


@pytest.fixture(scope="module")
def frontend(server, repo):
    from peagle_trt.serve.openai_frontend import FrontendOptions, OpenAIFrontend

    with OpenAIFrontend(FrontendOptions(repo, server.grpc_url, "127.0.0.1", free_port())) as fe:
        yield fe


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend.url, api_key="unused", max_retries=0, timeout=60)


def grpc(server, prompt: str, chat: bool = False, model: str = "peagle", **kw) -> dict:
    from peagle_trt.serve.client import stream_generate

    params = SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **kw})
    return stream_generate(server.grpc_url, prompt, params, model=model, chat_template=chat)


def sse(response) -> list:
    """The JSON events of an SSE response, and "[DONE]" as itself."""
    out = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in out]


@pytest.mark.parametrize("model", ["peagle", "peagle_none"])
def test_openai_client_completions_equal_the_grpc_path(server, client, model):
    extra = {"ignore_eos": True, "return_token_ids": True}
    for prompt in PROMPTS:
        ref = grpc(server, prompt, model=model)
        whole = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body=extra)
        choice = whole.choices[0]
        assert choice.model_extra["token_ids"] == ref["token_ids"] and choice.text == ref["text"]
        assert choice.finish_reason == "length"
        assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (ref["prompt_tokens"], 24)
        spec = whole.model_extra["speculative"]
        assert spec["acceptance_length"] == pytest.approx(ref["acceptance_length"], abs=1e-3)
        assert len(spec["accept_rate_per_pos"]) == (0 if model == "peagle_none" else 3)
        vllm = whole.model_extra["metrics"]["speculative_decoding"]  # vLLM's per-request shape (AIPerf reads it)
        if model == "peagle_none":  # vLLM: null without speculation
            assert vllm is None
            continue
        assert vllm["num_spec_tokens"] == 3 and len(vllm["acceptance_histogram"]) == 4
        assert vllm["num_spec_steps"] == ref["steps"] == sum(vllm["acceptance_histogram"])
        assert vllm["num_draft_tokens"] == 3 * ref["steps"]
        assert "per_step_drafted" not in vllm  # the summary level
        assert vllm["mean_acceptance_length"] == pytest.approx(ref["acceptance_length"], abs=1e-3)
        assert vllm["num_accepted_draft_tokens"] == sum(j * n for j, n in enumerate(vllm["acceptance_histogram"]))
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body=extra))
        ids = [i for c in chunks if c.choices for i in c.choices[0].model_extra.get("token_ids", [])]
        assert ids == ref["token_ids"] and "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
        assert chunks[-1].usage.completion_tokens == 24 and chunks[-1].choices == []
        assert chunks[-1].model_extra["metrics"]["speculative_decoding"] == vllm  # streaming: on the usage chunk
        assert sum("metrics" in c.model_extra for c in chunks) == 1  # once, as vLLM (AIPerf drops it twice)


def test_openai_client_chat_uses_the_chat_template_and_equals_the_grpc_path(server, client):
    messages = [{"role": "user", "content": "Write a poem about the sea"}]
    ref = grpc(server, messages[0]["content"], chat=True)  # the Triton model's own chat template
    whole = client.chat.completions.create(model="peagle", messages=messages, max_completion_tokens=24,
                                           temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert whole.choices[0].model_extra["token_ids"] == ref["token_ids"]
    assert whole.choices[0].message.content == ref["text"] and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == ref["prompt_tokens"] > len(messages[0]["content"]) // 4
    stream = client.chat.completions.create(model="peagle", messages=messages, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.prompt_tokens == ref["prompt_tokens"] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].model_extra["speculative"]["draft_steps"] == ref["steps"]


def test_sampling_seed_and_stop_are_forwarded(server, client):
    sampled = dict(temperature=0.8, top_p=0.9, seed=7)
    ref = grpc(server, PROMPTS[0], top_k=20, **sampled)
    got = client.completions.create(model="peagle", prompt=PROMPTS[0], max_tokens=24, **sampled,
                                    extra_body={"top_k": 20, "ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == ref["token_ids"]
    greedy = grpc(server, PROMPTS[1], max_tokens=40)
    stop = greedy["text"][len(greedy["text"]) // 2:][:3]
    ref = grpc(server, PROMPTS[1], max_tokens=40, stop=(stop,))
    got = client.completions.create(model="peagle", prompt=PROMPTS[1], max_tokens=40, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == ref["text"] and stop not in got.choices[0].text
    assert got.choices[0].finish_reason == "stop" == ref["finish_reason"]


def test_plain_http_stream_models_and_errors(frontend):
    with httpx.Client(base_url=frontend.url, timeout=60) as http:
        models = http.get("/models").json()
        assert {m["id"] for m in models["data"]} >= {"peagle", "peagle_none"} and models["object"] == "list"
        body = {"model": "peagle", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        with http.stream("POST", "/chat/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events = sse(r)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8
        assert len(events[-2]["speculative"]["accept_rate_per_pos"]) == 3

        def refused(path: str, payload, status: int = 400, what: str = "") -> dict:
            r = http.post(path, json=payload) if not isinstance(payload, bytes) else http.post(path, content=payload)
            err = r.json()["error"]
            assert r.status_code == status and set(err) == {"message", "type", "param", "code"}, (payload, r.text)
            assert what in err["message"], err
            return err

        chat = {"model": "peagle", "messages": [{"role": "user", "content": "hi"}]}
        refused("/chat/completions", {**chat, "n": 2}, what="n=2 is not supported")
        refused("/chat/completions", {**chat, "temperature": -1}, what="temperature")
        refused("/chat/completions", {**chat, "top_p": 0}, what="top_p")
        refused("/chat/completions", {**chat, "max_tokens": 0}, what="max_tokens")
        refused("/chat/completions", {**chat, "logprobs": True}, what="logprobs")
        refused("/chat/completions", {**chat, "no_such": 1}, what="no_such: unknown parameter")
        refused("/chat/completions", {"model": "peagle"}, what="messages")
        refused("/chat/completions", b"{not json", what="not valid JSON")
        refused("/completions", {"model": "peagle", "prompt": "x " * 300}, what="exceeds the maximum sequence")
        err = refused("/chat/completions", {**chat, "model": "nope"}, 404, "does not exist")
        assert err["code"] == "model_not_found"
        refused("/no/such/route", {}, 404)


def test_openai_client_raises_its_typed_errors(client):
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported"):
        client.chat.completions.create(model="peagle", messages=[{"role": "user", "content": "x"}], n=3)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")


WEATHER = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}, "days": {"enum": [1, 2, 3]}},
           "required": ["unit", "days"], "additionalProperties": False}


def test_response_format_json_schema_equals_constrained_target_only(server, client):
    """Structured output through the OpenAI SDK (P-EAGLE) equals the constrained target alone
    (`peagle_none`, the same target) and the gRPC path's `structured_output`, and validates."""
    import jsonschema

    from peagle_trt.config import StructuredOutput

    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    messages = [{"role": "user", "content": "The weather in Paris, as JSON"}]
    out = {model: client.chat.completions.create(model=model, messages=messages, max_tokens=40, temperature=0,
                                                 response_format=fmt, extra_body={"return_token_ids": True})
           for model in ("peagle", "peagle_none")}
    spec, plain = (out[m].choices[0] for m in ("peagle", "peagle_none"))
    assert spec.model_extra["token_ids"] == plain.model_extra["token_ids"]
    assert spec.finish_reason == "stop"  # ended by the grammar
    jsonschema.validate(json.loads(spec.message.content), WEATHER)
    ref = grpc(server, messages[0]["content"], chat=True, max_tokens=40, ignore_eos=False,
               structured=StructuredOutput.from_dict({"json": WEATHER}))
    assert ref["token_ids"] == spec.model_extra["token_ids"]
    choice = client.completions.create(model="peagle", prompt="Pick one:", max_tokens=10, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert choice.choices[0].text in ("red", "green", "blue")


def test_structured_output_bad_input_is_a_400_with_the_reason(frontend, client):
    chat = {"model": "peagle", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    bad = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}}
    with pytest.raises(openai.BadRequestError, match="invalid JSON schema: Unsupported type"):
        client.chat.completions.create(**chat, extra_body=bad)
    with httpx.Client(base_url=frontend.url, timeout=60) as http:
        for extra, what in [({"guided_json": WEATHER}, "guided_json was removed"),
                            ({"structured_outputs": {"choice": ["", ""]}}, "non-empty strings"),
                            ({"structured_outputs": {"regex": "[a-"}}, "invalid regex: Regex parsing error"),
                            ({"structured_outputs": {"json": {"$ref": "#"}}}, "no finite JSON value"),
                            ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos")]:
            r = http.post("/chat/completions", json={**chat, **extra})
            assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
            assert what in r.json()["error"]["message"], r.text
    good = client.chat.completions.create(**chat, temperature=0, response_format={"type": "json_object"})
    assert good.choices[0].finish_reason in ("stop", "length")  # the server goes on


def test_disconnect_mid_stream_cancels_the_triton_request(server, frontend):
    def settle(name: str) -> float:
        deadline = time.time() + 20
        while metric(server, "peagle_kv_blocks_used") != 0 and time.time() < deadline:
            time.sleep(0.2)
        time.sleep(1.1)  # the model refreshes its metrics twice a second
        return metric(server, name)

    before = settle("peagle_generated_tokens_total")
    body = {"model": "peagle", "prompt": "a victim that leaves early", "max_tokens": 220, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=frontend.url, timeout=60) as http:
        with http.stream("POST", "/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # the stream is running
    generated = settle("peagle_generated_tokens_total") - before
    assert metric(server, "peagle_kv_blocks_used") == 0
    assert generated < 220, generated  # stopped early: the request was cancelled, not finished


def test_a_server_still_loading_answers_503(repo):
    from peagle_trt.serve.openai_frontend import FrontendOptions, OpenAIFrontend

    with OpenAIFrontend(FrontendOptions(repo, f"127.0.0.1:{free_port()}", "127.0.0.1", free_port())) as fe:
        with httpx.Client(base_url=fe.url, timeout=30) as http:
            r = http.post("/completions", json={"model": "peagle", "prompt": "x"})
            assert r.status_code == 503 and "not up yet" in r.json()["error"]["message"]
            assert http.get("/models").status_code == 503


def test_serve_with_openai_port_streams_and_stops_on_sigterm(tiny, tmp_path):
    pytest.importorskip("pytriton")
    repo = tmp_path / "repo"
    build_repository(tiny["llama"], tiny["aws"], repo,
                     RepositoryOptions(SpecConfig("peagle", 2), max_batch=2, max_seq_len=64))
    port = free_port()
    cmd = [sys.executable, "-m", "peagle_trt.cli", "serve", str(repo), "--http-port", str(free_port()),
           "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--openai-port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["openai"] == f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=ready["openai"], api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model="peagle", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, stream=True)
        assert sum(1 for c in stream if c.choices and c.choices[0].delta.content) >= 1
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        with pytest.raises(httpx.ConnectError):  # the frontend went down with the server
            httpx.get(f"{ready['openai']}/models", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
