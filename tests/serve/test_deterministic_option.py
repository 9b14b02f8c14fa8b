"""`deterministic` as one setting: RepositoryOptions (config.pbtxt round trip), `--deterministic` on
build, generate, serve and `dynamo worker`, vLLM's VLLM_BATCH_INVARIANT=1, and the typed refusal on
the tensorrt backend (peagle_trt/serve/options.py; docs/SERVING.md, "Deterministic mode")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from peagle_trt.cli import main
from peagle_trt.config import SpecConfig
from peagle_trt.errors import BuildError, ConfigError
from peagle_trt.serve.options import (
    DETERMINISTIC_ENV,
    ArtifactPaths,
    RepositoryOptions,
    from_parameters,
    read_options,
    to_parameters,
    with_deterministic,
)

SPEC = SpecConfig("peagle", 3)


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_option_round_trips_and_defaults_off():
    on = RepositoryOptions(SPEC, backend="onnxruntime", deterministic=True, max_prompt_bytes=99, max_stop_bytes=9)
    params = to_parameters(on, ArtifactPaths("t", onnx="o"))
    assert params["deterministic"] == "True" and from_parameters(params)[0] == on
    old = {k: v for k, v in to_parameters(RepositoryOptions(SPEC), ArtifactPaths("t")).items() if k != "deterministic"}
    assert from_parameters(old)[0].deterministic is False  # a repository built before the option


def test_tensorrt_and_the_triton_kernels_are_refused_with_what_it_would_take():
    with pytest.raises(BuildError, match="fixed tactic per layer") as exc:
        RepositoryOptions(SPEC, backend="tensorrt", deterministic=True)
    assert "--backend onnxruntime or torch" in str(exc.value)
    with pytest.raises(BuildError, match="kernels='reference'"):
        RepositoryOptions(SPEC, device="cuda", kernels="cuda", deterministic=True)


def test_tensorrt_executor_refuses_before_loading_anything(tmp_path):
    from peagle_trt.executors.tensorrt import TensorRTExecutor

    with pytest.raises(ConfigError, match="not available on the tensorrt backend"):
        TensorRTExecutor(tmp_path / "no-engines", deterministic=True)


def test_vllm_batch_invariant_turns_it_on_and_never_off(monkeypatch):
    off, on = RepositoryOptions(SPEC), RepositoryOptions(SPEC, deterministic=True)
    monkeypatch.delenv(DETERMINISTIC_ENV, raising=False)
    assert with_deterministic(off) == off and with_deterministic(off, True) == on
    monkeypatch.setenv(DETERMINISTIC_ENV, "1")
    assert with_deterministic(off) == on
    with pytest.raises(ConfigError, match="not available on the tensorrt backend"):
        with_deterministic(RepositoryOptions(SPEC, backend="tensorrt"))
    monkeypatch.setenv(DETERMINISTIC_ENV, "0")
    assert with_deterministic(off) == off and with_deterministic(on) == on
    monkeypatch.setenv(DETERMINISTIC_ENV, "yes please")
    with pytest.raises(ConfigError, match="expected 1"):
        with_deterministic(off)


def test_build_writes_it_and_generate_runs_it(tiny, tmp_path, capsys, monkeypatch):
    from peagle_trt.serve.generator import TextGenerator

    monkeypatch.delenv(DETERMINISTIC_ENV, raising=False)
    repo = tmp_path / "repo"
    assert main(["build", "--target", str(tiny["llama"]), "--drafter", str(tiny["aws"]), "--output", str(repo),
                 "--backend", "torch", "--max-seq-len", "64", "--max-batch", "2", "--deterministic"]) == 0
    model_dir, options, paths = read_options(repo)
    assert options.deterministic
    assert TextGenerator.load(model_dir, options, paths).scheduler.decoder.ex.deterministic
    base = ["generate", "--prompt", "hi", "--max-tokens", "6", "--ignore-eos"]
    assert main([*base, "--repo", str(repo)]) == 0
    spec = last_json(capsys)["token_ids"]
    assert main([*base, "--target", str(tiny["llama"]), "--spec-mode", "none", "--backend", "torch",
                 "--deterministic"]) == 0
    assert last_json(capsys)["token_ids"] == spec
    assert main([*base, "--url", "127.0.0.1:1", "--deterministic"]) == 2
    assert "serve --deterministic" in last_json(capsys)["error"]
    assert main(["build", "--target", str(tiny["llama"]), "--output", str(tmp_path / "trt"), "--backend", "tensorrt",
                 "--spec-mode", "none", "--deterministic"]) == 2
    assert "fixed tactic" in last_json(capsys)["error"] and not (tmp_path / "trt").exists()


def test_serve_and_the_dynamo_worker_pass_it_on(tiny, tmp_path):
    from peagle_trt.build import build_repository
    from peagle_trt.dynamo.options import Planes, WorkerOptions
    from peagle_trt.serve.server import ServeOptions, command_and_env

    repo = tmp_path / "repo"
    build_repository(tiny["llama"], None, repo, RepositoryOptions(SpecConfig("none", 1), max_seq_len=64))
    _, env = command_and_env(ServeOptions(repo, deterministic=True), "x")
    assert env[DETERMINISTIC_ENV] == "1"
    worker = WorkerOptions(repo, Planes(discovery_dir=str(tmp_path / "d")), deterministic=True)
    assert worker.deterministic and Path(worker.repo) == repo
