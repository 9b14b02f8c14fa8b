"""Shared helpers of the benchmark suites (peagle_trt/bench/*.py): the CPU's name, a closed-loop load,
CPU-time counters that tell when other processes competed, a free port, and a context that sends
stdout to stderr (so only the report and the JSON reach stdout). The prompt sets: bench/prompts.py."""

from __future__ import annotations

import contextlib
import os
import platform
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable


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


def cpu_counters() -> tuple[float, float, float] | None:
    """(all CPUs' total seconds, their non-idle seconds, this process's CPU seconds), or None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    own = os.times()
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is within user)
    return total / tick, (total - fields[3] - fields[4]) / tick, own.user + own.system


def other_cpu_share(before, after, min_wall_s: float = 1.0) -> float | None:
    """Share of all CPU time between two cpu_counters() samples used by OTHER processes (or steal);
    None when unknown or when the interval is too short for the 10 ms /proc/stat ticks."""
    if before is None or after is None:
        return None
    if (after[0] - before[0]) / (os.cpu_count() or 1) < min_wall_s:
        return None
    other = (after[1] - before[1]) - (after[2] - before[2])
    return max(other, 0.0) / (after[0] - before[0])


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stdout_to_stderr():
    """Send this process's stdout (fd 1 too: native libraries, child processes) to stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def progress(message: str) -> None:
    """One progress line on stderr."""
    print(message, file=sys.stderr, flush=True)
