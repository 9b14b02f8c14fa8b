"""Shared bits of the benchmark scripts (run from the repository root as scripts/bench_*.py)."""

from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name (for the JSON env block of every benchmark)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
