"""`peagle-trt build`: a ready repository with a manifest checked at load; failed builds leave
nothing behind; the config.pbtxt parses as a Triton ModelConfig text proto."""

from __future__ import annotations

import dataclasses
import json
import os
import stat

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.config import SpecConfig
from peagle_trt.errors import BuildError, ConfigError, ManifestError, PairingError, RequestError, ServeError
from peagle_trt.serve.generator import TextGenerator
from peagle_trt.serve.options import read_options, read_parameters

PEAGLE3 = SpecConfig("peagle", 3)


def build(tiny, out, drafter="aws", spec=PEAGLE3, **kw):
    options = RepositoryOptions(spec, max_batch=2, max_seq_len=128)
    return build_repository(tiny["llama"], tiny[drafter], out, options, **kw)


def test_repository_layout_and_config_parse(tiny, tmp_path):
    manifest = build(tiny, tmp_path / "repo")
    model = tmp_path / "repo" / "peagle"
    assert (model / "1" / "model.py").is_file() and (model / "manifest.json").is_file()
    assert "1/artifacts/target/model.safetensors" in manifest["files"]
    assert "1/artifacts/drafter/model.safetensors" in manifest["files"]
    _, params = read_parameters(tmp_path / "repo")
    assert params["spec_mode"] == "peagle" and params["num_spec_tokens"] == "3" and params["max_batch"] == "2"
    text_format = pytest.importorskip("google.protobuf.text_format")
    model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    config = text_format.Parse((model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.model_transaction_policy.decoupled and config.backend == "python"
    names = {i.name for i in config.input}
    assert {"text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "stop", "end_id",
            "ignore_eos", "exclude_input_in_output"} <= names
    assert {o.name for o in config.output} >= {"text_output", "output_ids", "acceptance_length"}


def test_built_repository_runs_in_process(tiny, tmp_path):
    from peagle_trt.config import SamplingParams

    build(tiny, tmp_path / "repo")
    engine = TextGenerator.load(*read_options(tmp_path / "repo"))
    events = []
    engine.generate("hello", SamplingParams(max_tokens=6, ignore_eos=True), events.append, chat_template=False)
    assert sum(len(e.token_ids) for e in events) == 6 and events[-1].finished
    assert events[-1].stats["drafter_forwards"] == events[-1].stats["steps"]


def test_manifest_mismatch_refuses_to_load(tiny, tmp_path):
    build(tiny, tmp_path / "repo")
    weights = tmp_path / "repo" / "peagle" / "1" / "artifacts" / "drafter" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="does not match its hash"):
        TextGenerator.load(*read_options(tmp_path / "repo"))
    weights.unlink()
    with pytest.raises(ManifestError, match="missing"):
        TextGenerator.load(*read_options(tmp_path / "repo"))


def test_bad_drafter_leaves_no_repository(tiny, tmp_path):
    with pytest.raises(PairingError, match="mask_hidden"):
        build(tiny, tmp_path / "repo", drafter="eagle3")
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_kept_without_force(tiny, tmp_path):
    build(tiny, tmp_path / "repo")
    with pytest.raises(BuildError, match="already exists"):
        build(tiny, tmp_path / "repo")
    build(tiny, tmp_path / "repo", spec=SpecConfig("eagle3", 2), force=True)
    assert read_parameters(tmp_path / "repo")[1]["spec_mode"] == "eagle3"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # no temporary leftovers


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only directories")
def test_unwritable_output_leaves_nothing(tiny, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(BuildError, match="not writable"):
            build(tiny, locked / "repo")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(stat.S_IRWXU)


def test_failure_midway_removes_the_temporary_directory(tiny, tmp_path, monkeypatch):
    """Any failure while writing (disk full, interrupted copy) removes the partial output."""
    import peagle_trt.build.repository as package

    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(package, "write_manifest", boom)
    with pytest.raises(BuildError, match="No space left on device"):
        build(tiny, tmp_path / "repo")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_parent_path_is_reported(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(BuildError, match="cannot create"):
        build(tiny, blocker / "sub" / "repo")


def test_serve_refuses_a_directory_that_is_not_a_repository(tmp_path):
    from peagle_trt.serve.server import ServeOptions, TritonServer

    with pytest.raises(ServeError, match="not a model repository"):
        TritonServer(ServeOptions(tmp_path))


def test_repo_without_the_model(tmp_path):
    with pytest.raises(ConfigError, match="no model 'peagle'"):
        read_parameters(tmp_path)


def test_cli_build_json(tiny, tmp_path, capsys):
    from peagle_trt.cli import main

    code = main(["build", "--target", str(tiny["llama"]), "--drafter", str(tiny["aws"]), "--output",
                 str(tmp_path / "r"), "--num-spec-tokens", "4"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["spec_mode"] == "peagle" and result["num_spec_tokens"] == 4


def test_build_with_fp8_quantization_serves_the_fp8_target(tiny, tmp_path, capsys):
    pytest.importorskip("modelopt")
    from peagle_trt.cli import main
    from peagle_trt.config import SamplingParams

    code = main(["build", "--target", str(tiny["llama"]), "--drafter", str(tiny["aws"]), "--output",
                 str(tmp_path / "r"), "--num-spec-tokens", "3", "--max-batch", "2", "--max-seq-len", "96",
                 "--backend", "onnxruntime", "--quantization", "fp8"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and result["quantization"] == "fp8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]  # the temporary FP8 checkpoint is gone
    engine = TextGenerator.load(*read_options(tmp_path / "r"))
    events = []
    engine.generate("hi", SamplingParams(max_tokens=5, ignore_eos=True), events.append, chat_template=False)
    assert sum(len(e.token_ids) for e in events) == 5


def test_kv_cache_dtype_fp8_goes_from_build_to_the_served_executor(tiny, tmp_path, capsys):
    """build --kv-cache-dtype fp8 (onnxruntime): config.pbtxt and the manifest say so, the KV memory
    is a quarter of float32's, and the repository's executor stores E4M3 codes (uint8 caches) and
    decodes what the same pair does from checkpoints with FP8 caches (target-only, greedy, exact)."""
    from peagle_trt.cli import main
    from peagle_trt.config import SamplingParams

    code = main(["build", "--target", str(tiny["llama"]), "--output",
                 str(tmp_path / "r"), "--spec-mode", "none", "--max-batch", "1", "--max-seq-len", "64",
                 "--backend", "onnxruntime", "--kv-cache-dtype", "fp8", "--deterministic"])
    assert code == 0 and "(1-byte FP8 E4M3 elements)" in capsys.readouterr().err
    model_dir, options, paths = read_options(tmp_path / "r")
    manifest = json.loads((model_dir / "manifest.json").read_text())
    assert options.kv_cache_dtype == "fp8" and manifest["repo"]["kv_cache_dtype"] == "fp8"
    memory = manifest["kv_memory"]
    auto = build_kv_memory(tiny, dataclasses.replace(options, kv_cache_dtype="auto"))
    assert memory["element_bytes"] == 1 and memory["total_bytes"] * 4 == auto.total_bytes
    engine = TextGenerator.load(model_dir, options, paths)
    kv = engine.scheduler.decoder.ex.g_target.kv
    assert {a.dtype.name for a in kv.values()} == {"uint8"}
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    served = engine.generate("hello there", params, chat_template=False)["token_ids"]
    alone = TextGenerator.from_checkpoints(tiny["llama"], None, SpecConfig("none", 1), max_seq_len=64,
                                           backend="onnxruntime", deterministic=True, kv_cache_dtype="fp8")
    assert served == alone.generate("hello there", params, chat_template=False)["token_ids"]
    assert kv["past_key_0"].any()  # the served request wrote its codes there
    capsys.readouterr()
    assert main(["generate", "--repo", str(tmp_path / "r"), "--prompt", "hi", "--kv-cache-dtype", "fp8"]) == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert "a repository's KV cache dtype is its build's" in error  # refused by name, never ignored


def build_kv_memory(tiny, options):
    from peagle_trt.build import kv_memory_of
    from peagle_trt.checkpoint import load_pair

    return kv_memory_of(load_pair(tiny["llama"], None, options.speculation), options)


def test_build_writes_the_input_byte_limits_the_model_enforces(tiny, tmp_path):
    from peagle_trt.config import SamplingParams

    build_repository(tiny["llama"], tiny["aws"], tmp_path / "repo",
                     RepositoryOptions(SpecConfig("none", 1), max_batch=1, max_seq_len=64, max_prompt_bytes=100,
                              max_stop_bytes=8))
    _, params = read_parameters(tmp_path / "repo")
    assert (params["max_prompt_bytes"], params["max_stop_bytes"]) == ("100", "8")
    engine = TextGenerator.load(*read_options(tmp_path / "repo"))
    with pytest.raises(RequestError, match="max_prompt_bytes"):
        engine.submit("x", "y" * 101, SamplingParams(max_tokens=2), lambda event: None)
    with pytest.raises(RequestError, match="max_stop_bytes"):
        engine.submit("x", "hi", SamplingParams(max_tokens=2, stop=("123456789",)), lambda event: None)
    build(tiny, tmp_path / "default")
    _, default = read_parameters(tmp_path / "default")
    assert (default["max_prompt_bytes"], default["max_stop_bytes"]) == (str(16 * 128), "1024")
