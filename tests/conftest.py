"""Shared fixtures: small seeded checkpoints in the real layouts (written once per session)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from peagle_trt.tiny import make_all


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
    from peagle_trt.tiny import make_families

    return make_families(tmp_path_factory.mktemp("tiny_moe"))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
