"""`peagle-trt inspect`: describes a checkpoint directory and runs the pair checks `build` runs
(the same functions, so the same messages), with a JSON last line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from peagle_trt.checkpoint import load_pair
from peagle_trt.checkpoint.drafter import load_drafter
from peagle_trt.cli import main
from peagle_trt.config import SpecConfig
from peagle_trt.errors import ConfigError, PairingError


def run(capsys, *argv) -> tuple[int, str, dict]:
    code = main(["inspect", *map(str, argv)])
    out = capsys.readouterr().out
    return code, out, json.loads(out.strip().splitlines()[-1])


def edited(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **changes}))
    return dst


def test_drafter_description(tiny, capsys):
    code, out, result = run(capsys, tiny["speculators"])
    d = result["drafter"]
    assert code == 0 and set(result) == {"drafter"}
    assert d["layout"] == "speculators" and d["speculators_model_type"] == "peagle"
    assert d["spec_modes"] == ["none", "eagle3", "peagle"] and d["trained_k"] == 8
    assert d["flags"]["norm_before_fc"] is True and d["flags"]["norm_output"] is False
    assert d["draft_vocab_size"] == 384 and d["vocab_mapping"] == "d2t offsets"
    assert "layout: speculators" in out and "trained_k: 8" in out  # the human-readable part


def test_target_and_plain_eagle3_head(tiny, capsys):
    code, _, result = run(capsys, tiny["eagle3"], tiny["llama"])  # either order
    assert code == 0 and result["target"]["family"] == "llama" and result["target"]["layers"] == 8
    assert result["drafter"]["head"] == "EAGLE-3 (sequential)"
    assert "peagle" not in result["drafter"]["spec_modes"]
    assert result["pair"] == {"fits": True, "spec_mode": "eagle3", "num_spec_tokens": 7, "taps": [2, 4, 5],
                              "max_seq_len": 2048, "backend": "torch"}


def test_pair_misfit_reports_the_build_error(tiny, tmp_path, capsys):
    head = edited(tiny["aws"], tmp_path / "head", eagle_aux_hidden_state_layer_ids=[2, 4, 9])
    with pytest.raises(PairingError) as build_error:
        load_pair(tiny["llama"], head, SpecConfig("peagle", 7))
    code, out, result = run(capsys, tiny["llama"], head)
    assert code == 2 and result["error_type"] == "PairingError"
    assert result["error"] == str(build_error.value)
    assert "head: P-EAGLE (parallel)" in out  # the description came first


def test_refused_flags_are_explained(tiny, tmp_path, capsys):
    head = edited(tiny["speculators"], tmp_path / "head", fc_norm=True)
    code, _, result = run(capsys, head)
    assert code == 2 and "mutually exclusive" in result["error"]
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_drafter(head)


def test_sliding_window_limit_checked_for_tensorrt_only(tiny, tmp_path, capsys):
    """torch / onnxruntime compute drafter windows exactly (any length); the TensorRT plugins do
    not, so a tensorrt check refuses lengths past the window, with the way out."""
    cfg = json.loads((tiny["speculators"] / "config.json").read_text())
    layers = {**cfg["transformer_layer_config"], "layer_types": ["sliding_attention"] * 2,
              "sliding_window": 64}
    head = edited(tiny["speculators"], tmp_path / "head", transformer_layer_config=layers)
    trt = ("--num-spec-tokens", "3", "--backend", "tensorrt")
    code, _, result = run(capsys, tiny["qwen3"], head, *trt, "--max-seq-len", "60")
    assert code == 0 and result["drafter"]["sliding_window"]["window"] == 64
    assert result["drafter"]["sliding_window"]["layers"] == [0, 1]
    code, _, result = run(capsys, tiny["qwen3"], head, *trt, "--max-seq-len", "61")
    assert code == 2 and "sliding-window attention (window 64)" in result["error"]
    assert "does not implement windows" in result["error"] and "--backend torch / onnxruntime" in result["error"]
    for backend in ("torch", "onnxruntime"):
        code, _, result = run(capsys, tiny["qwen3"], head, "--num-spec-tokens", "3", "--max-seq-len", "4096",
                              "--backend", backend)
        assert code == 0 and result["pair"]["fits"] and result["pair"]["backend"] == backend


def test_two_targets_refused(tiny, capsys):
    code, _, result = run(capsys, tiny["llama"], tiny["qwen3"])
    assert code == 2 and "one target and one drafter" in result["error"]
