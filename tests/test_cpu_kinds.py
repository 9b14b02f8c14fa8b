"""The exactness-sensitive tests (`-m exact`, listed in tests/cpu_kinds.py) under every CPU kind's
kernel selection this machine can run, each in a fresh pytest process (the libraries read their
selection when loaded): an AMD EPYC's CI sees the Intel kernels' results where the CPU has AVX-512,
and an Intel Xeon's sees the AMD ones. A kind whose instructions this CPU lacks is skipped, saying so.
Reproduce one: `pytest tests/test_cpu_kinds.py -k avx2` (or the README's "CPU kinds")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cpu_kinds import EXACT, KINDS, cpu_flags, is_exact, runnable

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_exact_tests_hold_under_the_kind(name, tmp_path):
    if not runnable(name):
        pytest.skip(f"this CPU lacks {KINDS[name].needs} for the {name} kernels ({KINDS[name].machine})")
    env = {**os.environ, **KINDS[name].env}  # threads as this worker has them (one under -n 2)
    env.pop("PYTEST_XDIST_WORKER", None)
    files = sorted({prefix.split("::")[0] for prefix in EXACT})
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                          "-m", "exact and not slow and not gpu", f"--basetemp={tmp_path / 'run'}", *files],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-30:])
    assert run.returncode == 0, f"{name} kernels ({KINDS[name].env}):\n{tail}"
    assert " passed" in tail and " deselected" in tail, tail  # the mark selected a part, and it ran


def test_every_exact_prefix_names_a_file():
    for prefix in EXACT:
        assert (ROOT / prefix.split("::")[0]).is_file(), prefix
    assert is_exact("tests/executors/test_deterministic.py::test_x") and not is_exact("tests/test_style.py::t")


def test_kinds_run_by_cpu_flags():
    assert runnable("avx", {"avx"}) and not runnable("avx2", {"avx", "avx2"})
    assert runnable("avx512", {"avx512f", "avx512bw", "avx512dq", "avx512vl"})
    assert cpu_flags() or not Path("/proc/cpuinfo").exists()
