"""Qwen3-MoE, GPT-OSS and Gemma-4 through a real tritonserver: a streamed greedy request (P-EAGLE,
K=3) equals target-only greedy decoding of the same checkpoint in process (torch, deterministic)
exactly on the torch backend (Qwen3-MoE), and near-equals it (identical, or parting at a near-tie
of the torch logits: tests/export/crossbackend.py) on the onnxruntime backend (GPT-OSS: dense MoE
graph, sinks, sliding windows; Gemma-4: per-layer head sizes, KV-shared layers, per-layer inputs,
windows; Gemma-4 with the MoE block on the torch backend).
Marked slow: its own server with four more Python models (the shared one already holds four)."""

from __future__ import annotations

import shutil

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.runtime.scheduler import generate
from peagle_trt.serve.client import stream_generate
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.tokenizer import TextCodec
from tests.export.crossbackend import check_greedy_streams, teacher_forced_logits
from tests.serve.conftest import free_port

pytestmark = [pytest.mark.triton, pytest.mark.slow]
MODELS = {"qwen3_moe_torch": ("qwen3_moe", "torch"), "gpt_oss_ort": ("gpt_oss", "onnxruntime"),
          "gemma4_ort": ("gemma4", "onnxruntime"), "gemma4_moe_torch": ("gemma4_moe", "torch")}
LOGIT_TOL = 1e-4  # torch against onnxruntime, as tests/e2e/test_families_e2e.py
MIN_AGREED = 8
PROMPTS = ["Hello there", "Explain how a transformer attends to earlier tokens"]  # the 2nd: > window


@pytest.fixture(scope="module")
def family_server(tiny_moe, tmp_path_factory):
    pytest.importorskip("tritonclient.grpc")
    pytest.importorskip("pytriton")
    from peagle_trt.serve.server import ServeOptions, TritonServer

    root = tmp_path_factory.mktemp("family_repo")
    (root / "models").mkdir()
    for name, (family, backend) in MODELS.items():
        build_repository(tiny_moe[family], tiny_moe[f"drafter-{family}"], root / name,
                         RepositoryOptions(SpecConfig("peagle", 3), model_name=name, backend=backend, max_batch=4,
                                  max_seq_len=128, prefill_chunk=16, deterministic=True))
        shutil.move(str(root / name / name), str(root / "models" / name))
    spec = ServeOptions(root / "models", "127.0.0.1", free_port(), free_port(), free_port(), ready_timeout_s=300)
    with TritonServer(spec) as srv:
        yield srv


@pytest.mark.parametrize("model", list(MODELS))
def test_stream_equals_target_only_greedy(family_server, tiny_moe, model):
    family, backend = MODELS[model]
    target, _ = load_pair(tiny_moe[family], None, SpecConfig("none", 1)).build()
    codec = TextCodec(tiny_moe[family])
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS:
        ids = codec.encode_prompt(prompt, chat_template=False)
        decoder = SpecDecoder(TorchExecutor(target, None, 1, 128, deterministic=True), SpecConfig("none", 1))
        ref = generate(decoder, ids, params).output
        got = stream_generate(family_server.grpc_url, prompt, params, model=model)
        assert got["finish_reason"] == "length"
        if backend == "torch":  # one backend, deterministic on both sides: exact
            assert got["token_ids"] == ref
        else:
            logits = teacher_forced_logits(TorchExecutor(target, None, 1, 128, deterministic=True), ids, ref)
            check_greedy_streams(logits, ref, got["token_ids"], 2 * LOGIT_TOL, MIN_AGREED)
        assert len(got["accept_rate_per_pos"]) == 3
