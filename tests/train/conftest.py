"""Fixtures shared by the training tests (tests/train/test_gpu_run.py, test_train_curve.py)."""

from __future__ import annotations

import pytest

from peagle_trt.train.distill import distill


@pytest.fixture(scope="module")
def answers(tiny, tmp_path_factory):
    """8 answers the tiny llama distilled (answers.jsonl), made once per test module."""
    data = tmp_path_factory.mktemp("answers") / "answers.jsonl"
    rows = [{"id": f"r{i}", "kind": "write", "prompt": f"def f{i}(x):\n    return x + {i}", "max_tokens": 10}
            for i in range(8)]
    distill(tiny["llama"], rows, data, backend="torch", batch=4, max_len=256)
    return data
