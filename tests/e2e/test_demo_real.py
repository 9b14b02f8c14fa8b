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


def test_demo_smollm2_names_the_packaged_model_and_its_shipped_head(tmp_path, capsys, smollm2, monkeypatch):
    """`--target smollm2`: the cached conversion of the packaged model (here the session's, linked
    into a fresh cache), the head of the source tree (tests/data/smollm2-heads/peagle) and its K,
    the answer identical to the target alone."""
    pytest.importorskip("pytriton")
    from peagle_trt.convert.packaged import KNOWN, cached_target
    from peagle_trt.demo import SMOLLM2_K, smollm2_head

    monkeypatch.setenv("PEAGLE_TRT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / KNOWN["smollm2"].cache_name).symlink_to(smollm2["target"], target_is_directory=True)
    assert main(["demo", "--target", "smollm2", "--workdir", str(tmp_path), "--max-tokens", "32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["target"] == str(cached_target("smollm2")) and result["drafter"] == str(smollm2_head())
    assert result["num_spec_tokens"] == SMOLLM2_K and result["identical_to_target"] is True
    assert result["acceptance_length"] >= 1.0 and 0 < result["tokens"] <= 32
