"""`bench kernels --rehearse` on the CPU (peagle_trt/bench/kernels.py under Triton's interpreter, toy sizes): every
case it times in a GPU window (attention unsplit / by shape / the tiling sweep, bf16 and FP8 caches, the FP8
linears, the fused MoE at the seeds' targets' expert layers and its tiling sweep, the draft sampler) runs and
reports, so a window is spent measuring, not debugging. Without a GPU
and without --rehearse the suite refuses with a ConfigError (tests/bench/test_bench_cli.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# find_spec, not importorskip: importing triton here, before tests/ops/conftest.py sets TRITON_INTERPRET,
# would fix its knobs for the process and decorate every kernel for a GPU (the interpreter tests then fail)
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="pip install -c constraints.txt 'peagle-trt[dev]' (triton==3.9.0)")

REPO = Path(__file__).resolve().parents[2]


def _bench(tmp_path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), CUDA_VISIBLE_DEVICES="")
    env.pop("TRITON_INTERPRET", None)  # --rehearse sets it in its own process
    return subprocess.run([sys.executable, "-m", "peagle_trt.cli", "bench", "kernels", "--smoke", "--rehearse",
                           "--output-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)


def test_bench_kernels_rehearses_every_case_on_the_cpu(tmp_path):
    proc = _bench(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rows = result["results"]
    attn = [r for r in rows if r["op"] == "kv_attention"]
    assert {r["mode"] for r in attn} == {"unsplit", "auto", "sweep"}
    assert any(r["mode"] == "auto" and r["splits"] > 1 for r in attn)  # the split path ran
    assert {r["fp8_cache"] for r in attn if r["mode"] == "auto"} == {False, True}
    assert all(r["ms"] and r["ms"] > 0 for r in attn), [r for r in attn if not r.get("ms")]
    paths = {r["path"] for r in rows if r["op"] == "linear"}
    assert {"bf16", "fp8-dequant", "fp8-triton", "fp8-triton:c1"} <= paths and all(r["ms"] for r in rows)
    assert any(r["op"] == "draft_sample" for r in rows)
    moe = [r for r in rows if r["op"] == "moe"]
    assert {(r["model"], r["rows"]) for r in moe if r["mode"] == "auto"} == {
        (m, t) for m in ("qwen3-30b-a3b", "gpt-oss-20b") for t in (1, 8, 64)}
    assert {r["weights"] for r in moe} == {"fp8-block", "bf16"} and any(r["mode"] == "sweep" for r in moe)
    assert all(r["ms"] and r["ms"] > 0 and r["experts_hit"] >= 1 for r in moe), moe
    assert {f["name"].split(",")[0] for f in result["figures"]} >= {"qkv linear at M = 1"}
