"""`peagle-trt demo --target DIR --drafter HEAD` with the real model: SmolLM2-135M-Instruct (the
session's converted copy) and a P-EAGLE head sized for it (random: it accepts little, so this
checks the path, not the speed): a coding request through the chat template, served by a real
tritonserver with the onnxruntime executor, the streamed answer identical to the target alone.
Marked slow (about two minutes on 2 cores: two ONNX exports, a server start, two generations)."""

from __future__ import annotations

import json

import pytest

from peagle_trt.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.triton]


def test_demo_serves_the_real_model(tmp_path, capsys, smollm2):
    pytest.importorskip("pytriton")
    assert main(["demo", "--target", str(smollm2["target"]), "--drafter", str(smollm2["head"]),
                 "--workdir", str(tmp_path), "--max-tokens", "48"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["identical_to_target"] is True and result["backend"] == "onnxruntime"
    assert result["target"] == str(smollm2["target"]) and result["drafter"] == str(smollm2["head"])
    assert 0 < result["tokens"] <= 48 and "def " in result["text"]  # the coding request gets code
