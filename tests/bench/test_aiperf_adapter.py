"""AIPerf itself reads our per-request speculation metrics: the `aiperf` suite at smoke size runs the
real `aiperf` (0.13.0, in its own venv, .venv-bench, made by this test on first use)
against `peagle-trt serve --openai-port`; AIPerf's vLLM adapter must accept every response's
metrics.speculative_decoding (a malformed payload is dropped by it with a warning, which would leave
the metric out) and report an acceptance length within 1 .. K + 1. Slow: the venv takes minutes to
make, once."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from peagle_trt.bench.cli import run_suite

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.triton]


def aiperf_executable() -> str:
    exe = ROOT / ".venv-bench" / "bin" / "aiperf"
    if not exe.exists():
        subprocess.run(["bash", "-c", "set -e; python3 -m venv .venv-bench; "
                        ".venv-bench/bin/python -m pip install -q aiperf==0.13.0"], cwd=ROOT, check=True)
    return str(exe)


def test_aiperf_reads_our_spec_decode_metrics(tmp_path):
    pytest.importorskip("pytriton")
    result = run_suite("aiperf", ["--smoke", "--aiperf", aiperf_executable(), "--workdir", str(tmp_path / "work"),
                                  "--output-dir", str(tmp_path)])
    rows = result["rows"]
    assert rows and all(r["errors"] == 0 for r in rows)
    for r in rows:  # K = 3: AIPerf read every response's acceptance
        assert r["acceptance_length"] is not None, r
        assert 1.0 <= r["acceptance_length"] <= 4.0
