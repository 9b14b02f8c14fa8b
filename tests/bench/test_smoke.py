"""Every suite of `peagle-trt bench` runs at --smoke size on the shared harness: the report in
OUTPUT_DIR/bench_SUITE.md, the results (with the machine measured in the run and the headline
figures) in OUTPUT_DIR/bench_SUITE.json and as the returned dict. The suites with a test of their own
are listed in ELSEWHERE; a suite added without a smoke test fails test_every_suite_has_a_smoke_test."""

from __future__ import annotations

import json

import pytest

from peagle_trt.bench.cli import SUITES, run_suite
from peagle_trt.bench.harness import stem

ELSEWHERE = {  # suite -> the test that runs its --smoke (or, without a GPU, its refusal)
    "scheduler": "test_bench_cli.py", "gpu": "test_bench_gpu_smoke.py", "kernels": "test_bench_cli.py (no CUDA)",
    "aiperf": "test_aiperf_adapter.py (slow: AIPerf's own venv)",
    "paged": "test_paged.py", "speculation": "test_speculation.py", "draft-length": "test_draft_length_sim.py",
    "curves": "test_curves.py", "heads": "test_heads.py", "seeds": "test_seeds.py",
    "long-context": "test_long_context.py",
    "train-memory": "test_train_memory.py",
}
SMOKE = {  # suite -> extra options of its smoke run
    "drafter": [], "backends": [], "families": [], "moe": [], "step-cost": [], "verify-shapes": [], "structured": [],
    "deterministic": [], "trees": [],
    "serving": ["--openai"], "acceptance": ["--no-served"],  # served: test_heads.py
}
# --smoke on the tiny llama; slow: on SmolLM2 (tests/conftest.py)
TARGET_SUITES = ("decode", "fp8-quality", "kv-fp8", "context-decode")
NEEDS_TRITON = ("serving",)


def test_every_suite_has_a_smoke_test():
    assert set(SMOKE) | set(TARGET_SUITES) | set(ELSEWHERE) == set(SUITES)


def check(name: str, result: dict, out) -> None:
    assert result == json.loads((out / f"{stem(name)}.json").read_text())
    assert result["smoke"] is True and result["machine"]["bandwidth_gbs"] > 0 and result["machine"]["cpu"]
    assert all({"name", "value", "unit"} <= set(f) for f in result["figures"])
    report = (out / f"{stem(name)}.md").read_text()
    assert report.startswith("## ") and "machine: " in report and "|---" in report


@pytest.mark.parametrize("name", sorted(SMOKE))
def test_smoke(name, tmp_path):
    if name in NEEDS_TRITON:
        pytest.importorskip("pytriton")
    options = SMOKE[name] + (["--workdir", str(tmp_path / "work")] if name == "acceptance" else [])
    check(name, run_suite(name, ["--smoke", "--output-dir", str(tmp_path), *options]), tmp_path)


def check_target_suite(name: str, target, out) -> None:
    flag = "--fp32" if name == "fp8-quality" else "--target"
    result = run_suite(name, ["--smoke", "--output-dir", str(out), flag, str(target)])
    check(name, result, out)
    if name == "decode":
        assert {"transformers", "ours (torch)", "ours (onnxruntime)"} == set(result["decode"])
    elif name == "context-decode":
        assert result["contexts"] == [16, 64] and {r["backend"] for r in result["rows"]} == {"torch", "onnxruntime"}
        assert {r["forward"] for r in result["rows"]} == {"decode", "verify 4 rows", "drafter"}
        assert all(v > 0 for v in result["ms"].values()) and len(result["ms"]) == 12
    elif name == "kv-fp8":
        assert result["agreement"]["tokens"] == 16 and all(r["torch"] > 0 for r in result["ratios"])
        assert result["kv_bytes_per_position"]["auto"] == 4 * result["kv_bytes_per_position"]["fp8"]
    else:
        assert 0.0 <= result["top1_agreement"] <= 1.0 and result["positions"] == 64


@pytest.mark.parametrize("name", TARGET_SUITES)
def test_smoke_on_the_tiny_llama(name, tiny, tmp_path):
    check_target_suite(name, tiny["llama"], tmp_path)


@pytest.mark.slow  # minutes on 2 busy cores: the onnxruntime graphs of SmolLM2 are made in memory
@pytest.mark.parametrize("name", TARGET_SUITES)
def test_smoke_on_the_real_model(name, smollm2, tmp_path):
    check_target_suite(name, smollm2["target"], tmp_path)
