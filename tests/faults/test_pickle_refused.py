"""Fault injection: pickled weights are refused by every stage before anything opens them.

The target's only weights are a valid `pytorch_model.bin` (the tiny llama's own tensors, which
transformers would load happily). An audit hook (PEP 578) records every Python-level open() of a
pickle file: torch.load and transformers open checkpoints that way, so "nothing read" is observed,
not assumed. Each stage must fail with a CheckpointError that says why and how to convert, write
nothing and leave no temporary folder behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from peagle_trt.checkpoint.safetensors_io import load_tensors
from peagle_trt.cli import main
from peagle_trt.errors import CheckpointError

pytestmark = pytest.mark.faults
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
_opened: list[str] | None = None  # recording when a list; the hook stays installed (hooks cannot be removed)


def _audit(event: str, args: tuple) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.endswith(PICKLE_SUFFIXES):
            _opened.append(path)


sys.addaudithook(_audit)


@pytest.fixture
def opened():
    """The pickle files opened (by Python code) while the test runs."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


@pytest.fixture
def pickled_target(tiny, tmp_path) -> Path:
    """A llama target whose only weights are a pickled pytorch_model.bin."""
    target = tmp_path / "inputs" / "target"
    shutil.copytree(tiny["llama"], target, ignore=shutil.ignore_patterns("*.safetensors*"))
    torch.save(load_file(tiny["llama"] / "model.safetensors"), target / "pytorch_model.bin")
    return target


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_audit_hook_sees_torch_load(pickled_target, opened):
    """The oracle works: torch.load of the checkpoint is recorded."""
    torch.load(pickled_target / "pytorch_model.bin", weights_only=True)
    assert opened == [str(pickled_target / "pytorch_model.bin")]


@pytest.mark.parametrize("stage", ["build --quantization fp8", "quantize", "export", "build"])
def test_pickle_only_target_refused_before_it_is_read(stage, pickled_target, tiny, tmp_path, capsys, opened):
    """The quantize paths loaded the pickle before the fix (ModelOpt calibrates a transformers model);
    export and the plain build already refused it through our loader and must keep doing so."""
    if "fp8" in stage or stage == "quantize":
        pytest.importorskip("modelopt")
    out = tmp_path / "out"
    common = ["--target", str(pickled_target), "--output", str(out)]
    argv = {"build --quantization fp8": ["build", *common, "--drafter", str(tiny["aws"]), "--num-spec-tokens", "3",
                                         "--backend", "onnxruntime", "--quantization", "fp8"],
            "quantize": ["quantize", *common, "--num-calib", "1"],
            "export": ["export", *common, "--drafter", str(tiny["aws"]), "--num-spec-tokens", "3"],
            "build": ["build", *common, "--drafter", str(tiny["aws"]), "--num-spec-tokens", "3",
                      "--backend", "torch"]}[stage]
    code = main(argv)
    result = last_json(capsys)
    assert code == 2 and result["error_type"] == "CheckpointError", result
    assert "pytorch_model.bin" in result["error"] and "never unpickles" in result["error"]
    assert "safe_serialization=True" in result["error"]  # the fix
    assert opened == []  # nothing opened the pickle
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs"]  # nothing written, no temporary left


def test_index_naming_a_pickle_shard_is_refused_by_name(pickled_target, opened):
    """A safetensors index that maps tensors to a .bin shard: refused from the index, unopened."""
    (pickled_target / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "pytorch_model.bin"}}))
    with pytest.raises(CheckpointError, match=r"not safetensors files.*never unpickles"):
        load_tensors(pickled_target)
    assert opened == []
