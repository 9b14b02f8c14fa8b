"""Fault injection: `--force` never destroys anything that is not a previous peagle-trt output.

Every stage that writes an output directory (build, quantize, export, engine) is pointed at an
input folder, a folder holding the inputs, a folder inside an input, a foreign folder and a
regular file: each is refused with a BuildError and left byte for byte as it was. A previous
output is replaced, with nothing left beside it. Inputs are private copies of the tiny
checkpoints, so a regression cannot damage the session's fixtures.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from peagle_trt.atomic import publish
from peagle_trt.cli import main
from peagle_trt.errors import BuildError

pytestmark = pytest.mark.faults


def snapshot(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root (or of root itself when it is a file)."""
    if root.is_file():
        return {".": hashlib.sha256(root.read_bytes()).hexdigest()}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def pair(tiny, tmp_path) -> tuple[Path, Path]:
    """Private copies of the llama target and its P-EAGLE drafter under tmp_path/models."""
    models = tmp_path / "models"
    return (Path(shutil.copytree(tiny["llama"], models / "target")),
            Path(shutil.copytree(tiny["aws"], models / "drafter")))


def run_build(capsys, target: Path, drafter: Path, output: Path, *extra: str) -> tuple[int, dict]:
    """`peagle-trt build --force` (torch backend: a plain copy, fast); (exit code, JSON last line)."""
    code = main(["build", "--target", str(target), "--drafter", str(drafter), "--output", str(output),
                 "--num-spec-tokens", "3", "--backend", "torch", "--force", *extra])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_force_over_an_input_folder_is_refused(pair, capsys):
    target, drafter = pair
    before = snapshot(target)
    code, result = run_build(capsys, target, drafter, target)
    assert code == 2 and result["error_type"] == "BuildError"
    assert "is the input" in result["error"] and str(target) in result["error"]
    assert snapshot(target) == before
    assert sorted(p.name for p in target.parent.iterdir()) == ["drafter", "target"]  # no stray


def test_force_over_a_folder_holding_the_inputs_is_refused(pair, capsys):
    target, drafter = pair
    models = target.parent
    before = snapshot(models)
    code, result = run_build(capsys, target, drafter, models)
    assert code == 2 and "contains the input" in result["error"]
    assert snapshot(models) == before
    assert sorted(p.name for p in models.parent.iterdir()) == ["models"]


def test_force_over_a_folder_inside_an_input_is_refused(pair, capsys):
    target, drafter = pair
    inner = target / "original"  # e.g. the original-format weights some hubs ship beside the HF ones
    inner.mkdir()
    (inner / "consolidated.safetensors").write_bytes(b"precious")
    before = snapshot(target)
    code, result = run_build(capsys, target, drafter, inner)
    assert code == 2 and "lies inside the input" in result["error"]
    assert snapshot(target) == before


def test_force_over_a_foreign_folder_is_refused(pair, tmp_path, capsys):
    target, drafter = pair
    mine = tmp_path / "notes"
    (mine / "sub").mkdir(parents=True)
    (mine / "todo.txt").write_text("keep me")
    (mine / "sub" / "manifest.json").write_text('{"name": "another tool\'s manifest"}')
    before = snapshot(mine)
    code, result = run_build(capsys, target, drafter, mine)
    assert code == 2 and "not a peagle-trt output" in result["error"] and "manifest.json" in result["error"]
    assert snapshot(mine) == before


def test_force_replaces_a_previous_output_and_only_that(pair, tmp_path, capsys):
    target, drafter = pair
    repo = tmp_path / "repo"
    assert run_build(capsys, target, drafter, repo)[0] == 0
    (repo / "peagle" / "1" / "__pycache__").mkdir()  # what Triton leaves when it imports model.py
    (repo / "peagle" / "1" / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    code, result = run_build(capsys, target, drafter, repo, "--spec-mode", "eagle3")
    assert code == 0 and result["spec_mode"] == "eagle3"
    assert json.loads((repo / "peagle" / "manifest.json").read_text())["repo"]["spec_mode"] == "eagle3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "repo"]  # nothing left beside it
    # a file the user added to the repository makes it no longer ours to delete
    (repo / "README.txt").write_text("my notes")
    before = snapshot(repo)
    code, result = run_build(capsys, target, drafter, repo)
    assert code == 2 and "README.txt is not listed" in result["error"]
    assert snapshot(repo) == before


def test_force_replaces_an_onnxruntime_repository(pair, tmp_path, capsys):
    """An onnxruntime model keeps its export's own manifest.json inside it: the build's file, listed,
    so a second build replaces the repository (the demo's second run once stopped here)."""
    target, drafter = pair
    repo = tmp_path / "repo"
    for _ in range(2):
        code, result = run_build(capsys, target, drafter, repo, "--backend", "onnxruntime")
        assert code == 0, result
    assert (repo / "peagle" / "1" / "artifacts" / "onnx" / "manifest.json").is_file()


@pytest.mark.parametrize("kind", ["file", "symlink"])
def test_force_over_a_regular_file_or_link_is_refused_and_leaves_no_stray(pair, tmp_path, capsys, kind):
    target, drafter = pair
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("a file the user owns")
    else:
        assert run_build(capsys, target, drafter, tmp_path / "real")[0] == 0
        out.symlink_to(tmp_path / "real")
    before = snapshot(out)
    code, result = run_build(capsys, target, drafter, out)
    assert code == 2 and ("is a file" in result["error"] or "symbolic link" in result["error"])
    assert snapshot(out) == before and out.is_symlink() == (kind == "symlink")
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no .out.old-* / .tmp-*


def test_publish_over_a_file_leaves_no_stray(tmp_path):
    """The swap itself removes what it replaced, file or folder, and keeps nothing beside it."""
    (tmp_path / "new").mkdir()
    (tmp_path / "new" / "x").write_text("new")
    (tmp_path / "out").write_text("old")
    publish(tmp_path / "new", tmp_path / "out")
    assert (tmp_path / "out" / "x").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_quantize_and_export_refuse_to_replace_their_inputs(pair, tmp_path, capsys):
    pytest.importorskip("modelopt")
    target, drafter = pair
    models = target.parent
    before = snapshot(models)
    # quantize --force over the folder holding its target: refused before calibration
    code = main(["quantize", "--target", str(target), "--output", str(models), "--num-calib", "1", "--force"])
    assert code == 2 and "contains the input" in json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    # export --force over the drafter
    code = main(["export", "--target", str(target), "--drafter", str(drafter), "--output", str(drafter),
                 "--num-spec-tokens", "3", "--force"])
    assert code == 2 and "is the input" in json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
    assert snapshot(models) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]


def test_engine_refuses_an_output_over_its_export(tmp_path):
    """The engine stage updates a previous engine directory in place; never its export directory.
    Checked before TensorRT is imported, so this holds on machines without TensorRT too."""
    from peagle_trt.engine import EngineOptions, build_engines

    export = tmp_path / "export"
    (export / "trt").mkdir(parents=True)
    (export / "trt" / "target.onnx").write_bytes(b"graph")
    before = snapshot(export)
    for out in (export, export / "trt", tmp_path):
        with pytest.raises(BuildError, match="the input"):
            build_engines(export, out, EngineOptions("sm_90", timing_cache=tmp_path / "cache"))
    assert snapshot(export) == before
