"""Fixtures of the Dynamo tests: the Dynamo venv, a built repository (the tiny pair, P-EAGLE K=3,
torch backend) and its in-process reference engine."""

from __future__ import annotations

import shutil

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.config import SpecConfig
from tests.dynamo.cluster import ensure_dynamo_venv

MAX_BATCH, MAX_SEQ_LEN = 8, 512


@pytest.fixture(scope="session")
def dynamo_python():
    if shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.fail("the Dynamo tests need util-linux's unshare and nsenter (network namespaces)", pytrace=False)
    return ensure_dynamo_venv()


@pytest.fixture(scope="session")
def dyn_repo(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("dynrepo")
    build_repository(tiny["llama"], tiny["aws"], root / "build",
                     RepositoryOptions(SpecConfig("peagle", 3), model_name="peagle", backend="torch",
                                       max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN, prefill_chunk=64,
                                       deterministic=True))
    return root / "build"


@pytest.fixture(scope="session")
def ort_repo(tiny, tmp_path_factory):
    """The same pair on the onnxruntime backend (ONNX graphs written at build), model `peagle_ort`."""
    root = tmp_path_factory.mktemp("dynrepo_ort")
    build_repository(tiny["llama"], tiny["aws"], root / "build",
                     RepositoryOptions(SpecConfig("peagle", 3), model_name="peagle_ort", backend="onnxruntime",
                                       max_batch=MAX_BATCH, max_seq_len=MAX_SEQ_LEN, prefill_chunk=64,
                                       deterministic=True))
    return root / "build"


@pytest.fixture(scope="session")
def reference(dyn_repo):
    """generate(prompt_ids, max_tokens) -> token ids, greedy, EOS ignored: one in-process engine
    built from the same repository (the code the worker runs, without Dynamo)."""
    from peagle_trt.config import SamplingParams
    from peagle_trt.runtime.scheduler import Request
    from peagle_trt.serve.generator import TextGenerator
    from peagle_trt.serve.options import read_options

    gen = TextGenerator.load(*read_options(dyn_repo, "peagle"))

    def one_thread(fn):
        def run(*args):
            import torch

            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # tiny ops: one thread is faster, and the workers share the cores
            try:
                return fn(*args)
            finally:
                torch.set_num_threads(threads)
        return run

    @one_thread
    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return _generate(prompts, max_tokens)

    def _generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            gen.scheduler.add(Request(str(i), prompt, params, lambda o, i=i: outs[i].extend(o.new_token_ids)))
        while gen.scheduler.has_work:
            gen.scheduler.step()
        return [outs[i] for i in range(len(prompts))]

    generate.chat = one_thread(lambda text, max_tokens: gen.generate(  # the chat template applied by our codec
        text, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))["token_ids"])
    return generate
