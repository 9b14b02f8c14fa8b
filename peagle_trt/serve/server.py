"""Start a tritonserver on a model repository: the one on PATH (NGC containers) or else the one
bundled in the `nvidia-pytriton` wheel; loopback by default; wait for readiness with a timeout and
say why when it fails; shut down cleanly on Ctrl-C / SIGTERM.

    peagle-trt serve REPO [--host 127.0.0.1] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]

What a run guarantees (tests/faults/test_serve_faults.py proves each):
- the ports are checked before anything starts (PortInUseError, "port P is in use"), and readiness
  is confirmed against the server this run started: its own process alive, its own log saying it
  listens on the three ports, then `/v2/health/ready`;
- SIGTERM / Ctrl-C drain: tritonserver stops taking requests, lets running streams finish (up to
  `drain_timeout_s`, its exit timeout) and exits once its models have unloaded;
- a model process (Python-backend stub) that dies, busy or idle, stops the whole server at once
  (SIGTERM: readiness goes off and tritonserver unloads and exits cleanly, SIGKILL only if it has
  not within `_DEAD_STUB_GRACE_S`), so in-flight clients get an error instead of hanging and no
  one sees a ready-but-broken server; `serve` exits with that reason (code 2);
- tritonserver dies with the process that started it (parent-death signal);
- on every exit path the run's stub processes and `/dev/shm` regions (named by a prefix unique to
  the run, `shm_prefix`) are removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.errors import ConfigError, PortInUseError, ServeError
from peagle_trt.serve.options import DETERMINISTIC_ENV, SEED_ENV
from peagle_trt.serve.procs import alive, check_ports, die_with_parent, pids_with_arg, sweep
from peagle_trt.speculative_config import SERVE_ENV as SPEC_ENV

# Error lines every CPU-only tritonserver prints: never the reason a start failed.
_HARMLESS = ("CudaDriverHelper has not been initialized", "pinned memory", "CUDA driver")
_STARTUP_GRACE_S = 5.0  # before it is ready nothing runs that could drain: SIGKILL after this
_IDLE_GRACE_S = 3.0  # draining: models idle this long -> nothing left to finish
_DEAD_STUB_GRACE_S = 5.0  # a model process died: tritonserver's time to unload and exit by itself
_PORT_TAKEN = re.compile(r"Socket '([^']*):(\d+)' already in use")


@dataclass(frozen=True)
class ServeOptions:
    repo: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    ready_timeout_s: float = 180.0
    log_path: Path | None = None  # None: a temporary log, removed after a clean stop, kept after a failure
    drain_timeout_s: float = 30.0  # SIGTERM: longest wait for running streams (tritonserver's exit timeout)
    speculative_config: str | None = None  # run-time keys over the built config (vLLM JSON; triton_model.py)
    deterministic: bool = False  # every model in deterministic mode (VLLM_BATCH_INVARIANT=1 for the models)
    seed: int | None = None  # `serve --seed`: the models' default request seed (PEAGLE_SERVE_SEED)

    def __post_init__(self):
        for role, port in self.ports.items():
            if not 0 < port < 65536:
                raise ConfigError(f"--{role}-port must be in 1..65535, got {port}")
        for name, value in (("--ready-timeout", self.ready_timeout_s), ("--drain-timeout", self.drain_timeout_s)):
            if not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value}")

    @property
    def ports(self) -> dict[str, int]:
        return {"http": self.http_port, "grpc": self.grpc_port, "metrics": self.metrics_port}


def _bundled() -> tuple[Path, Path]:
    """(tritonserver binary, backend directory prepared for this Python) from nvidia-pytriton."""
    try:
        import pytriton
    except ImportError as exc:
        raise ServeError("no `tritonserver` on PATH and nvidia-pytriton is not installed; run inside an "
                         "NGC Triton container or `pip install -e '.[serving]'`") from exc
    dist = Path(pytriton.__file__).parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServeError(f"nvidia-pytriton ships no Python-backend stub for Python {version}")
    work = Path(tempfile.gettempdir()) / f"peagle-trt-triton-{os.getuid()}-{version}"
    ready = work / "backends" / "python" / "triton_python_backend_stub"
    if not ready.is_file():
        # Made whole beside `work`, then renamed in: a server starting at the same time either finds
        # it whole or makes its own copy, and never removes one another server already runs from.
        tmp = Path(tempfile.mkdtemp(dir=work.parent))
        shutil.copytree(dist / "backends", tmp / "backends")
        shutil.copy2(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
        shutil.copytree(dist / "caches", tmp / "caches")
        if work.exists() and not ready.is_file():  # incomplete (files deleted under it): set it aside
            aside = Path(tempfile.mkdtemp(dir=work.parent))
            with contextlib.suppress(FileNotFoundError):  # another start set it aside first
                work.rename(aside / "old")
            shutil.rmtree(aside, ignore_errors=True)
        try:
            tmp.rename(work)  # atomic; refused when another start renamed its copy in first
        except OSError:
            if not ready.is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # theirs is in place: drop ours
    return dist / "bin" / "tritonserver", work


def command_and_env(options: ServeOptions, shm_prefix: str) -> tuple[list[str], dict]:
    env = dict(os.environ)
    env.pop(SPEC_ENV, None)
    if options.speculative_config:
        env[SPEC_ENV] = options.speculative_config
    if options.deterministic:  # read by TextGenerator.from_options (peagle_trt/serve/options.py, with_deterministic)
        env[DETERMINISTIC_ENV] = "1"
    if options.seed is not None:  # read by TextGenerator.from_options (serve_seed)
        env[SEED_ENV] = str(options.seed)
    on_path = shutil.which("tritonserver")
    args = [f"--model-repository={options.repo.absolute()}",
            f"--http-address={options.host}", f"--http-port={options.http_port}",
            f"--grpc-address={options.host}", f"--grpc-port={options.grpc_port}",
            f"--metrics-address={options.host}", f"--metrics-port={options.metrics_port}",
            f"--exit-timeout-secs={max(1, round(options.drain_timeout_s))}",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
            "--allow-gpu-metrics=false", "--log-info=true"]
    if on_path:
        return [on_path, *args], env
    binary, work = _bundled()
    import pytriton

    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    libpython = sysconfig.get_config_var("LIBDIR") or ""
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libpython, str(libs), env.get("LD_LIBRARY_PATH", "")) if p)
    # The stub runs Python in isolated mode and finds its prefix through `python3` on PATH.
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    return [str(binary), *args, f"--backend-directory={work / 'backends'}",
            f"--cache-directory={work / 'caches'}"], env


class TritonServer:
    """A running tritonserver; use as a context manager or call `stop()`. Its log goes to
    `options.log_path`, or else to a temporary file that a clean stop removes (a failure keeps it
    and names it).

    Create it on a thread that outlives it (the parent-death signal fires when that thread ends)."""

    def __init__(self, options: ServeOptions):
        if not (options.repo / "peagle" / "config.pbtxt").is_file() and not any(options.repo.glob("*/config.pbtxt")):
            raise ServeError(f"{options.repo}: not a model repository (no */config.pbtxt); build one with "
                             "`peagle-trt build`")
        check_ports(options.host, options.ports)
        self.options = options
        self.shm_prefix = f"peagle_{os.getpid()}_{secrets.token_hex(4)}_"
        cmd, env = command_and_env(options, self.shm_prefix)
        self.log_path = options.log_path or Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")
        except OSError as e:
            raise ServeError(f"cannot write tritonserver's log to {self.log_path}: {e}; choose another "
                             "--log") from e
        self.keep_log = options.log_path is not None  # set where a server that may exit cleanly failed
        self.stubs: list[int] = []  # the model processes, known once ready
        self.swept: list[str] = []  # what the last cleanup had to remove (empty after a clean exit)
        self.drained = False  # stopped with nothing left running (set by stop)
        self._closed = False
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent(os.getpid()))

    @property
    def http_url(self) -> str:
        return f"http://{self.options.host}:{self.options.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.options.host}:{self.options.grpc_port}"

    # -- the server's log --------------------------------------------------------------------------
    def _log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def log_tail(self, lines: int = 20) -> str:
        """The server's error lines (E... in Triton's log format) or else the end of its log."""
        text = self._log_lines()
        errors = [line[:2000] for line in text if (line.startswith("E") or line.startswith("error"))
                  and not any(h in line for h in _HARMLESS)]
        prose = [line[:2000] for line in text if line.strip() and not line.startswith(("|", "+"))]
        return "\n".join(errors[-5:] if errors else prose[-lines:])

    def _listening(self) -> bool:
        """The log of THIS server says it listens on all three ports (a port another server holds
        never gets this far: tritonserver exits with "already in use")."""
        text = "\n".join(self._log_lines())
        return all(re.search(rf"Started {service} at \S*:{port}\b", text) for service, port in (
            ("HTTPService", self.options.http_port), ("GRPCInferenceService", self.options.grpc_port),
            ("Metrics Service", self.options.metrics_port)))

    # -- health --------------------------------------------------------------------------------------
    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def health(self) -> str | None:
        """None while the server and every model process run, else why not."""
        exited = self.proc.poll() is not None  # first: a stub outlives its server by < 1 s
        dead = [pid for pid in self.stubs if not alive(pid)]
        reasons = [self._exit_reason()] if exited else []
        if dead:
            reasons.append(f"a model process (Python-backend stub, pid {', '.join(map(str, dead))}) died while "
                           "serving; its requests cannot complete")
        return "; ".join(reasons) or None

    def _exit_reason(self) -> str:
        text = "\n".join(self._log_lines())
        taken = _PORT_TAKEN.search(text)
        if taken:
            return f"port {taken.group(2)} is in use on {taken.group(1)} by another process"
        code = self.proc.returncode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"tritonserver {how}; its log ({self.log_path}) ends with:\n{self.log_tail(5)}"

    def wait_ready(self, should_stop: Callable[[], bool] | None = None) -> bool:
        """Block until this server is ready (True) or `should_stop()` says stop (False, server
        stopped); raise ServeError (server stopped, nothing left behind) if it cannot start."""
        deadline = time.monotonic() + self.options.ready_timeout_s
        while time.monotonic() < deadline:
            if should_stop is not None and should_stop():
                self.stop(_STARTUP_GRACE_S)
                return False
            if self.proc.poll() is not None:
                reason = self._exit_reason()
                self.stop(_STARTUP_GRACE_S)  # it had exited: not drained, so its log is kept
                error = PortInUseError if reason.startswith("port ") else ServeError
                raise error(f"tritonserver could not start: {reason}")
            if self._listening() and self.ready():
                self.stubs = pids_with_arg(self.shm_prefix)
                if self.proc.poll() is None:
                    return True
            time.sleep(0.25)
        tail = self.log_tail()
        self.keep_log = True
        self.stop(_STARTUP_GRACE_S)
        raise ServeError(f"tritonserver was not ready after {self.options.ready_timeout_s:.0f} s (a model "
                         f"that cannot load keeps the server not-ready); its log ({self.log_path}) ends "
                         f"with:\n{tail}")

    # -- shutdown ------------------------------------------------------------------------------------
    def _models_busy(self) -> bool | None:
        """Whether a peagle model still runs or queues a request (its metrics), None if unknown."""
        url = f"http://{self.options.host}:{self.options.metrics_port}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                text = r.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            return None
        values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith(("peagle_kv_blocks_used", "peagle_requests_waiting"))]
        return any(v > 0 for v in values) if values else None

    def stop(self, grace_s: float | None = None, abort: Callable[[], bool] | None = None) -> int:
        """Drain, then exit: SIGTERM makes tritonserver refuse new requests and wait for running
        streams (up to its exit timeout), unload the models and exit. It also waits for clients
        that keep a finished gRPC stream open, so once the models have run idle for
        `_IDLE_GRACE_S` the server is stopped at once. SIGKILL if it overruns `grace_s` (default:
        the drain timeout + 15 s) or `abort()` says so. Then remove whatever the run left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + (self.options.drain_timeout_s + 15 if grace_s is None else grace_s)
            idle_since = None
            while self.proc.poll() is None and time.monotonic() < deadline and not (abort and abort()):
                if self._models_busy() is False:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > _IDLE_GRACE_S:
                        break
                else:
                    idle_since = None
                time.sleep(0.25)
            if self.proc.poll() is None:
                self.drained = idle_since is not None
                self.kill()
            else:
                self.drained = self.proc.returncode == 0
        self._cleanup()
        return self.proc.returncode

    def kill(self) -> int:
        """Stop at once (a model process died: nothing can drain), then clean up."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the server and the stubs it forked
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._cleanup()
        return self.proc.returncode

    def _cleanup(self) -> None:
        if self._closed:
            return
        self.swept = sweep(self.shm_prefix)
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in pids_with_arg(self.shm_prefix)) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._log.close()
        self._closed = True
        if self.drained and not self.keep_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> TritonServer:
        if not self.wait_ready():
            raise ServeError("tritonserver was stopped before it was ready")
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(options: ServeOptions, on_ready=None) -> dict:
    """Run until Ctrl-C / SIGTERM, then drain and shut the server down. Returns tritonserver's
    exit code and whether every stream had finished; raises ServeError (everything stopped and
    cleaned up) when it cannot start or stops serving."""
    stop: dict = {"signal": None, "count": 0}

    def handle(signum, frame):  # the first drains; a second stops at once
        stop["signal"] = signum
        stop["count"] += 1

    old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    server = None
    try:
        server = TritonServer(options)
        if not server.wait_ready(should_stop=lambda: stop["signal"] is not None):
            return {"exit_code": server.proc.returncode, "drained": True}
        if on_ready:
            on_ready(server)
        while stop["signal"] is None:
            reason = server.health()
            if reason is not None:
                server.keep_log = True
                code = server.stop(_DEAD_STUB_GRACE_S)  # nothing can drain; a clean exit when it can
                how = "it exited cleanly" if code == 0 else f"it ended with code {code}"
                raise ServeError(f"{reason}; stopped the server ({how}; in-flight requests failed) and removed "
                                 f"its processes and shared memory (its log: {server.log_path}); start "
                                 "`peagle-trt serve` again")
            time.sleep(0.2)
        code = server.stop(abort=lambda: stop["count"] > 1)
        return {"exit_code": code, "drained": server.drained}
    finally:
        if server is not None:
            server.stop()
        for s, h in old.items():
            signal.signal(s, h)
