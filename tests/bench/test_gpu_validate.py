"""scripts/gpu_validate.sh (the GPU check) rehearsed on the CPU (GPU_VALIDATE_REHEARSE=1: tiny shapes,
--smoke): a failing stage is recorded and the next still runs, the peers stage reports a peer that
cannot run with its error, a missing `bench seeds` suite is "missing" (not a failure), a spent budget
skips stages, and whatever ran comes back as at most three files a GPU lease can return (the summary
JSON and markdown, and a tar of every stage's files, large logs cut to their tail). The whole check
rehearsed, every default stage (the kernels under Triton's interpreter): `-m slow`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LEASE_FILES, LEASE_BYTES = 8, 16 << 20  # what one device call returns from $OUT (the tool's limits)


def _check(tmp_path: Path, timeout: int = 600, **env) -> tuple[subprocess.CompletedProcess, Path, Path]:
    out, work = tmp_path / "out", tmp_path / "work"
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PEAGLE_PYTHON": sys.executable,
            "GPU_VALIDATE_REHEARSE": "1", "GPU_VALIDATE_WORK": str(work), "OMP_NUM_THREADS": "1",
            "PEAGLE_COMMIT": "0123456789abcdef", **env}
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_validate.sh"), str(out)], cwd=REPO, env=full,
                          capture_output=True, text=True, timeout=timeout)
    return done, out, work


def _returnable(out: Path) -> dict:
    """OUT as a GPU lease returns it: <= 8 plain files, each <= 16 MiB, plain names; the summary."""
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= LEASE_FILES and all(p.stat().st_size <= LEASE_BYTES for p in files), files
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in files)
    assert {p.name for p in files} == {"gpu_validate.json", "gpu_validate.md", "gpu_validate.tar.gz"}
    return json.loads((out / "gpu_validate.json").read_text())


def test_a_failing_stage_does_not_lose_the_others_and_peers_report_their_errors(tmp_path):
    done, out, work = _check(tmp_path, GPU_VALIDATE_STAGES="env,step,peers,seeds",
                             GPU_VALIDATE_STEP_ARGS="--sections no-such-section",  # fails at once
                             GPU_VALIDATE_GPT_FAST=str(tmp_path / "no-checkout"),
                             GPU_VALIDATE_SEEDS_SUITE="no-such-suite")
    assert done.returncode == 1, done.stderr[-2000:]  # a stage failed
    last = json.loads(done.stdout.strip().splitlines()[-1])
    summary = _returnable(out)
    assert last == summary
    states = {k: v["state"] for k, v in summary["stages"].items()}
    assert states == {"env": "ok", "step": "failed", "peers": "ok", "seeds": "missing"}
    assert summary["commit"] == "0123456789abcdef" and "no-such-section" in summary["bench"]["step"]["error"]
    peers = {p["contender"]: p for p in summary["bench"]["peers"]["peers"]}
    assert set(peers) == {"peagle-trt", "gpt-fast", "transformers"}
    assert "ConfigError" in peers["gpt-fast"]["error"] and "no such folder" in peers["gpt-fast"]["error"]
    assert peers["transformers"]["error"] is None or "no longer than" in peers["transformers"]["error"]
    assert peers["peagle-trt"]["step_ms"] > 0
    with tarfile.open(out / "gpu_validate.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"env.txt", "stages.tsv", "step/bench_gpu.log", "peers/bench_gpu.json", "peers/bench_gpu.md"} <= names
    md = (out / "gpu_validate.md").read_text()
    assert "| seeds | missing |" in md and "peer gpt-fast" in md and "ERROR ConfigError" in md


def test_a_spent_budget_skips_stages_and_still_packs_what_is_there(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "big.log").write_bytes(b"x" * (5 << 20) + b"THE END")  # a long log: its tail travels
    done, out, _ = _check(tmp_path, GPU_VALIDATE_STAGES="env,longctx", GPU_VALIDATE_BUDGET_S="25", timeout=120)
    summary = _returnable(out)
    assert {k: v["state"] for k, v in summary["stages"].items()} == {"env": "skipped", "longctx": "skipped"}
    assert done.returncode == 1 and summary["ok"] is False
    with tarfile.open(out / "gpu_validate.tar.gz") as tar:
        data = tar.extractfile("big.log").read()
    assert data.endswith(b"THE END") and data.startswith(b"[gpu_validate_summary: the first") and len(data) < 5 << 20


@pytest.mark.slow
def test_the_whole_check_rehearsed_on_the_cpu(tmp_path):
    """Every default stage at smoke sizes (bench kernels under Triton's interpreter)."""
    done, out, _ = _check(tmp_path, GPU_VALIDATE_SEEDS_SUITE="no-such-suite", timeout=1800)
    summary = _returnable(out)
    assert done.returncode == 0, (summary["stages"], done.stderr[-3000:])
    assert {k: v["state"] for k, v in summary["stages"].items()} == {
        "env": "ok", "step": "ok", "longctx": "ok", "timing": "ok", "peers": "ok", "seeds": "missing"}
    assert summary["bench"]["step"]["errors"] == {} and summary["bench"]["longctx"]["long_context"]
