"""Make the `speculators` venv for tests/compat/ with scripts/speculators_env.sh, printing progress."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "scripts" / "speculators-requirements.txt"
STAMP = "peagle-requirements.txt"  # the script copies the requirements it installed here


def progress(msg: str) -> None:
    print(f"[compat] {msg}", file=sys.__stderr__, flush=True)


def ensure_venv(venv: Path, base_python: str) -> Path:
    """The venv's interpreter; (re)creates the venv when missing or made from other pins.
    Fails the calling test (never skips) when it cannot be made."""
    python, stamp = venv / "bin" / "python", venv / STAMP
    if python.exists() and stamp.is_file() and stamp.read_text() == REQUIREMENTS.read_text():
        return python
    progress(f"creating {venv} with scripts/speculators_env.sh (once; a few minutes) ...")
    log = venv.with_name(venv.name + ".log")
    env = {**os.environ, "PYTHON": base_python}
    with open(log, "w") as f:
        proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "speculators_env.sh"), str(venv)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:  # progress on the terminal, everything in the log
            f.write(line)
            if line.startswith("[speculators-env]"):
                progress(line.strip())
        code = proc.wait(timeout=1800)
    if code != 0 or not python.exists():
        tail = log.read_text()[-3000:]
        pytest.fail(f"could not create the speculators venv (scripts/speculators_env.sh exit {code}); "
                    f"log {log}:\n{tail}", pytrace=False)
    progress(f"ready: {venv}")
    return python
