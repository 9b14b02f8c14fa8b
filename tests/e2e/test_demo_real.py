"""`peagle-trt demo` with its defaults: SmolLM2-135M-Instruct (converted from the packaged GGUF and
cached in the user cache, as users run it) and the P-EAGLE head shipped for it, served by a real
tritonserver. Marked slow (about two minutes on 2 cores: two ONNX exports, a server start, two
generations)."""

from __future__ import annotations

import json

import pytest

from peagle_trt.cli import main
from peagle_trt.demo import smollm2_heads

pytestmark = [pytest.mark.slow, pytest.mark.triton]


def test_demo_serves_the_real_model_with_its_head(tmp_path, capsys):
    pytest.importorskip("pytriton")
    assert (smollm2_heads() / "drafter-peagle" / "config.json").is_file(), "the shipped head is missing"
    assert main(["demo", "--workdir", str(tmp_path), "--max-tokens", "96"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert result["identical_to_target"] is True
    assert result["drafter"] == str(smollm2_heads() / "drafter-peagle")
    assert result["target"].endswith("smollm2-135m-instruct") and result["tokens"] > 0
    assert result["acceptance_length"] > 1.5  # a trained head: drafts are accepted
    assert "def " in result["text"]  # the coding request is answered with code
