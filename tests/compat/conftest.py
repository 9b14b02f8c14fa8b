"""Heads written by the real `speculators` library, with its own forward outputs as the oracle.

The library needs numpy>=2 (our venv pins numpy<2 for nvidia-pytriton), so it lives in its own
venv, `.venv-speculators` at the repository root, which `scripts/speculators_env.sh` creates on
first use (PyPI only; a few minutes once). Every library call of the session runs in ONE
subprocess of that venv (tests/compat/speculators_driver.py). If the venv cannot be made or the
driver fails, the tests FAIL with the reason: they never skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peagle_trt.make_tiny import MASK_TOKEN
from tests.compat.cases import library_cases
from tests.compat.venv import ensure_venv, progress

ROOT = Path(__file__).resolve().parents[2]
VENV = Path(os.environ.get("PEAGLE_SPECULATORS_VENV", ROOT / ".venv-speculators"))


@pytest.fixture(scope="session")
def library(tiny, tmp_path_factory) -> dict:
    """{'cases': {name: case}, 'results': driver results.json, 'heads': dir, 'oracle': dir, 'targets'}."""
    python = ensure_venv(VENV, sys.executable)
    out = tmp_path_factory.mktemp("speculators")
    targets = {"llama": tiny["llama"], "qwen3": tiny["qwen3"]}
    cases = library_cases()
    for c in cases:
        tokens = json.loads((targets[c["family"]] / "tokenizer.json").read_text())["added_tokens"]
        c["verifier"] = str(targets[c["family"]])
        c["mask_token_id"] = next(t["id"] for t in tokens if t["content"] == MASK_TOKEN)
    (out / "cases.json").write_text(json.dumps(cases, indent=1))
    progress(f"writing {len(cases)} heads with the speculators library ...")
    t0 = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(python), str(Path(__file__).with_name("speculators_driver.py")),
                           str(out / "cases.json"), str(out)], capture_output=True, text=True, env=env,
                          timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"the speculators driver failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                    f"{proc.stderr[-4000:]}", pytrace=False)
    progress(f"library heads and oracle outputs written in {time.perf_counter() - t0:.1f} s")
    results = json.loads((out / "results.json").read_text())
    return {"cases": {c["name"]: c for c in cases}, "results": results["cases"], "heads": out / "heads",
            "oracle": out / "oracle", "targets": targets}
