"""Start a tritonserver on a model repository: the one on PATH (NGC containers) or else the one
bundled in the `nvidia-pytriton` wheel; loopback by default; wait for readiness with a timeout and
say why when it fails; shut down cleanly on Ctrl-C / SIGTERM.

    peagle-trt serve REPO [--host 127.0.0.1] [--http-port 8000] [--grpc-port 8001] [--metrics-port 8002]
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.errors import ServeError


@dataclass(frozen=True)
class ServeSpec:
    repo: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    ready_timeout_s: float = 180.0
    log_path: Path | None = None


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
    backend = work / "backends" / "python"
    if not (backend / "triton_python_backend_stub").is_file():
        tmp = Path(tempfile.mkdtemp(dir=work.parent if work.parent.exists() else None))
        shutil.copytree(dist / "backends", tmp / "backends")
        shutil.copy2(stub, tmp / "backends" / "python" / "triton_python_backend_stub")
        shutil.copytree(dist / "caches", tmp / "caches")
        shutil.rmtree(work, ignore_errors=True)
        tmp.rename(work)
    return dist / "bin" / "tritonserver", work


def command_and_env(spec: ServeSpec) -> tuple[list[str], dict]:
    env = dict(os.environ)
    on_path = shutil.which("tritonserver")
    args = [f"--model-repository={spec.repo.absolute()}",
            f"--http-address={spec.host}", f"--http-port={spec.http_port}",
            f"--grpc-address={spec.host}", f"--grpc-port={spec.grpc_port}",
            f"--metrics-address={spec.host}", f"--metrics-port={spec.metrics_port}",
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
    """A running tritonserver; use as a context manager or call `stop()`."""

    def __init__(self, spec: ServeSpec):
        if not (spec.repo / "peagle" / "config.pbtxt").is_file() and not any(spec.repo.glob("*/config.pbtxt")):
            raise ServeError(f"{spec.repo}: not a model repository (no */config.pbtxt); build one with "
                             "`peagle-trt build`")
        self.spec = spec
        cmd, env = command_and_env(spec)
        self.log_path = spec.log_path or Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    @property
    def http_url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.spec.host}:{self.spec.grpc_port}"

    def log_tail(self, lines: int = 20) -> str:
        """The server's error lines (E... in Triton's log format) or else the end of its log."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line[:2000] for line in text if line.startswith("E") or line.startswith("error")]
        return "\n".join(errors[-5:] if errors else text[-lines:])

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise ServeError(f"tritonserver exited with code {self.proc.returncode} before it was ready; "
                                 f"its log ({self.log_path}) ends with:\n{self.log_tail()}")
            if self.ready():
                return
            time.sleep(0.25)
        tail = self.log_tail()
        self.stop()
        raise ServeError(f"tritonserver was not ready after {self.spec.ready_timeout_s:.0f} s (a model "
                         f"that cannot load keeps the server not-ready); its log ({self.log_path}) ends "
                         f"with:\n{tail}")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # clean shutdown: unloads models, frees shm
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "TritonServer":
        self.wait_ready()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_forever(spec: ServeSpec, on_ready=None) -> int:
    """Run until Ctrl-C / SIGTERM, then shut the server down cleanly. Returns its exit code."""
    server = TritonServer(spec)
    stop = {"now": False}

    def handle(signum, frame):
        stop["now"] = True

    old = {s: signal.signal(s, handle) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.wait_ready()
        if on_ready:
            on_ready(server)
        while not stop["now"] and server.proc.poll() is None:
            time.sleep(0.2)
        if server.proc.poll() is not None and not stop["now"]:
            raise ServeError(f"tritonserver exited unexpectedly (code {server.proc.returncode}):\n"
                             f"{server.log_tail()}")
        return server.stop()
    finally:
        if server.proc.poll() is None:
            server.stop()
        for s, h in old.items():
            signal.signal(s, h)
