"""`peagle-trt serve`: ready line, clean SIGTERM shutdown, and a clear reason when a model cannot load."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.config import SpecConfig
from tests.serve.conftest import free_port

pytestmark = pytest.mark.triton


def _serve(repo, timeout: float = 120):
    pytest.importorskip("pytriton")
    cmd = [sys.executable, "-m", "peagle_trt.cli", "serve", str(repo), "--http-port", str(free_port()),
           "--grpc-port", str(free_port()), "--metrics-port", str(free_port()), "--ready-timeout", str(timeout)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serve_reports_ready_and_stops_cleanly_on_sigterm(tiny, tmp_path):
    repo = tmp_path / "repo"
    build_repository(tiny["llama"], tiny["aws"], repo,
                     RepositoryOptions(SpecConfig("peagle", 2), max_batch=2, max_seq_len=64))
    proc = _serve(repo)
    ready = json.loads(proc.stdout.readline())
    assert ready["ready"] and ready["grpc"].startswith("127.0.0.1:")  # loopback by default
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["stopped"] is True


def test_serve_says_why_a_model_cannot_load(tiny, tmp_path):
    repo = tmp_path / "repo"
    build_repository(tiny["llama"], tiny["aws"], repo,
                     RepositoryOptions(SpecConfig("peagle", 2), max_batch=2, max_seq_len=64))
    config = repo / "peagle" / "1" / "artifacts" / "target" / "config.json"
    config.write_text(config.read_text().replace('"hidden_size": 64', '"hidden_size": 65'))  # tampered
    proc = _serve(repo, timeout=60)
    start = time.time()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and time.time() - start < 100
    result = json.loads(out.strip().splitlines()[-1])
    assert result["error_type"] == "ServeError" and "does not match its hash" in result["error"]
    shutil.rmtree(repo)
