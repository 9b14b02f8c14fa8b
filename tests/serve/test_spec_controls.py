"""Speculation controls through a real tritonserver + the OpenAI frontend: a serve-time K schedule
(`serve --speculative-config`, K = 0 at batch >= 2) keeps outputs identical to target-only, the
detailed per-request metrics list each step's k, and Prometheus counts steps by k (a draft tree's: by its
nodes, under an adaptive budget)."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.runtime.scheduler import generate
from peagle_trt.tokenizer import TextCodec
from tests.helpers import make_decoder
from tests.serve.conftest import free_port

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.triton
SCHEDULE = {"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 8, 0]]}
PROMPTS = ["Hello there", "def fibonacci(n):\n    return", "The sea is"]


@pytest.fixture(scope="module")
def served(tiny, tmp_path_factory):
    pytest.importorskip("pytriton")
    from peagle_trt.serve.openai_frontend import FrontendOptions, OpenAIFrontend
    from peagle_trt.serve.server import ServeOptions, TritonServer

    repo = tmp_path_factory.mktemp("controls") / "repo"
    build_repository(tiny["llama"], tiny["aws"], repo, RepositoryOptions(SpecConfig("peagle", 3), max_batch=4,
                                                                         max_seq_len=256, prefill_chunk=32,
                                                                         deterministic=True))
    options = ServeOptions(repo, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=120,
                           speculative_config=json.dumps(SCHEDULE))
    with TritonServer(options) as server, \
            OpenAIFrontend(FrontendOptions(repo, server.grpc_url, "127.0.0.1", free_port(),
                                           spec_metrics="detailed")) as fe:
        yield server, openai.OpenAI(base_url=fe.url, api_key="unused", max_retries=0, timeout=120)


def test_served_k_schedule_is_lossless_and_reported_per_step(tiny, served):
    server, client = served
    plain, codec = make_decoder(tiny, "llama", None, "none", 1, max_len=256), TextCodec(tiny["llama"])
    refs = [generate(plain, codec.encode_prompt(p, False), SamplingParams(max_tokens=40, ignore_eos=True)).output
            for p in PROMPTS]

    def ask(prompt):
        return client.completions.create(model="peagle", prompt=prompt, max_tokens=40, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True})
    alone = ask(PROMPTS[0])  # batch 1: k = 2 every step
    spec = alone.model_extra["metrics"]["speculative_decoding"]
    assert alone.choices[0].model_extra["token_ids"] == refs[0]
    assert set(spec["per_step_drafted"]) == {2} and len(spec["per_step_drafted"]) == spec["num_spec_steps"]
    assert sum(spec["per_step_accepted"]) == spec["num_accepted_draft_tokens"]
    assert spec["num_draft_tokens"] == sum(spec["per_step_drafted"]) and spec["num_spec_tokens"] == 3
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # together: plain steps (k = 0) while batched
        together = list(pool.map(ask, PROMPTS))
    assert [r.choices[0].model_extra["token_ids"] for r in together] == refs
    ours = [r.model_extra["speculative"] for r in together]  # verify forwards: spec steps + plain (k = 0) steps
    assert any(s["target_forwards"] - 1 > s["draft_steps"] for s in ours)
    url = f"http://127.0.0.1:{server.options.metrics_port}/metrics"
    for _ in range(20):  # Triton's metrics endpoint itself refreshes on its own interval
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        zero = [line for line in text.splitlines() if line.startswith("peagle_num_spec_tokens_per_step_bucket")
                and 'le="0"' in line]
        if zero and float(zero[0].rsplit(" ", 1)[1]) > 0:
            break
        time.sleep(0.5)
    assert zero and float(zero[0].rsplit(" ", 1)[1]) > 0  # plain steps were counted under k = 0


def test_served_adaptive_tree_is_lossless_and_counts_tree_steps(tiny, tmp_path):
    """A build with an adaptive tree budget (up to 8 nodes, K = 3): served outputs stay the target's,
    and Prometheus counts the tree steps under their nodes (the rule runs the largest budget at
    least once: it measures every smaller one)."""
    from peagle_trt.serve.openai_frontend import FrontendOptions, OpenAIFrontend
    from peagle_trt.serve.server import ServeOptions, TritonServer

    repo = tmp_path / "repo"
    spec = SpecConfig("peagle", 3, tree_budget=8, adaptive_tree=True)
    build_repository(tiny["llama"], tiny["aws"], repo, RepositoryOptions(spec, max_batch=2, max_seq_len=256,
                                                                         prefill_chunk=32, deterministic=True))
    plain, codec = make_decoder(tiny, "llama", None, "none", 1, max_len=256), TextCodec(tiny["llama"])
    ref = generate(plain, codec.encode_prompt(PROMPTS[1], False), SamplingParams(max_tokens=30, ignore_eos=True)).output
    options = ServeOptions(repo, "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=120)
    with TritonServer(options) as server, \
            OpenAIFrontend(FrontendOptions(repo, server.grpc_url, "127.0.0.1", free_port())) as fe:
        client = openai.OpenAI(base_url=fe.url, api_key="unused", max_retries=0, timeout=120)
        out = client.completions.create(model="peagle", prompt=PROMPTS[1], max_tokens=30, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == ref
        url = f"http://127.0.0.1:{server.options.metrics_port}/metrics"
        for _ in range(20):
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            counts = {line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                      if line.startswith("peagle_num_spec_tokens_per_step_bucket")}
            if counts.get("8", 0) > counts.get("7", 0):
                break
            time.sleep(0.5)
        assert counts["8"] > counts["7"], counts  # steps of 8 nodes: the cap, counted in a bucket of their own
