"""A Dynamo deployment for the tests: Dynamo's frontend (KV router) and peagle-trt workers in a
private network namespace (loopback only; workers on 127.0.0.2, 127.0.0.3, ... as separate hosts
would be), file discovery in a temporary directory, HTTP reached through a Unix socket relay
(tests/dynamo/relay.py). Processes are started with `nsenter -t <relay> -n`, so they are this
process's children: a test can kill -9 one and check that nothing is left behind.
The Dynamo venv is made on first use by scripts/dynamo_env.sh (`ensure_dynamo_venv`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "scripts" / "dynamo-requirements.txt"
PORT = 8000  # the frontend's port inside the namespace


def progress(msg: str) -> None:
    print(f"[dynamo] {msg}", file=sys.__stderr__, flush=True)


def ensure_dynamo_venv() -> Path:
    """.venv-dynamo's interpreter, made (about 80 MB, under a minute) when missing or stale;
    fails the calling test with the script's log when it cannot be made."""
    venv = ROOT / ".venv-dynamo"
    python, stamp = venv / "bin" / "python", venv / "peagle-requirements.txt"
    if python.exists() and stamp.is_file() and stamp.read_text() == REQUIREMENTS.read_text():
        return python
    progress("creating .venv-dynamo with scripts/dynamo_env.sh (once) ...")
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "dynamo_env.sh"), str(venv)],
                          env={**os.environ, "PROJECT_PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not python.exists():
        pytest.fail(f"could not create .venv-dynamo (scripts/dynamo_env.sh exit {proc.returncode}):\n"
                    f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}", pytrace=False)
    progress("ready: .venv-dynamo")
    return python


class Deployment:
    def __init__(self, tmp: Path, python: Path, repo: Path, router_mode: str = "kv", migration_limit: int = 0):
        self.tmp, self.python, self.repo, self.router_mode = tmp, python, repo, router_mode
        self.migration_limit = migration_limit
        self.discovery = tmp / "discovery"
        self.socket = str(tmp / "frontend.sock")
        # no grace period before a worker's cleanup: the drain tested is the engine's own (engine.py)
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "0"}
        # root: a network namespace alone; others: inside a user namespace of their own (joined with -U)
        root = os.geteuid() == 0
        self.join = ["nsenter", "-t"], ["-n"] if root else ["-U", "-n", "--preserve-credentials"]
        relay = [sys.executable, str(ROOT / "tests/dynamo/relay.py"), self.socket, str(PORT)]
        self.relay = subprocess.Popen(["unshare", "-n" if root else "-rn", "--", *relay], stdout=subprocess.PIPE,
                                      text=True)
        assert self.relay.stdout.readline().strip() == "ready", "the namespace relay did not start"
        self.frontend: subprocess.Popen | None = None
        self.workers: dict[str, subprocess.Popen] = {}
        self.shm_seen: set[str] = set()  # /dev/shm files our processes had open or mapped
        self.codes: dict | None = None

    def enter(self) -> list[str]:
        """The command prefix that runs a program inside the deployment's network namespace."""
        return [*self.join[0], str(self.relay.pid), *self.join[1], "--"]

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        cmd = [*self.enter(), str(self.python), "-m", "peagle_trt.cli",
               "dynamo", *args, "--discovery-dir", str(self.discovery)]
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **(env or {})}, cwd=ROOT)

    def start_frontend(self) -> None:
        self.frontend = self._spawn("frontend", ["frontend", "--host", "127.0.0.1", "--http-port", str(PORT),
                                                 "--router-mode", self.router_mode,
                                                 "--migration-limit", str(self.migration_limit)])

    def start_worker(self, host: str, kv_events: bool = True, env: dict | None = None,
                     repo: Path | None = None, model: str = "peagle") -> subprocess.Popen:
        extra = [] if kv_events else ["--no-kv-events"]
        args = ["worker", "--repo", str(repo or self.repo), "--model", model, "--host", host, *extra]
        proc = self._spawn(f"worker-{host}", args, env)
        self.workers[host] = proc
        return proc

    def scan_shm(self) -> set[str]:
        """Record the /dev/shm files the deployment's live processes hold (fds and mappings)."""
        for proc in [self.frontend, *self.workers.values()]:
            if proc is None or proc.poll() is not None:
                continue
            try:
                maps = Path(f"/proc/{proc.pid}/maps").read_text()
                fds = [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
            except OSError:
                continue
            self.shm_seen |= {w for w in maps.split() + fds if w.startswith("/dev/shm/")}
        return self.shm_seen

    def instances(self) -> set[int]:
        """Worker ids registered in discovery (the ids the router reports in nvext.worker_id)."""
        folder = self.discovery / "v1" / "instances"
        names = [unquote(n).split("/") for n in (os.listdir(folder) if folder.is_dir() else [])]
        return {int(n[3], 16) for n in names if len(n) == 4 and n[0] == "peagle" and n[2] == "generate"}

    def wait_ready(self, workers: int, timeout: float = 120.0) -> None:
        """Until `workers` workers are registered and the frontend serves a request."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, proc in [("frontend", self.frontend), *self.workers.items()]:
                if proc is not None and proc.poll() is not None and (name == "frontend" or proc.returncode != -9):
                    pytest.fail(f"{name} exited with {proc.returncode}: {self.log(name)[-3000:]}")
            if len(self.instances()) >= workers:
                try:
                    with self.client() as c:
                        if c.get("/v1/models").json().get("data"):
                            self.scan_shm()
                            return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        pytest.fail(f"the deployment was not ready in {timeout:.0f} s: {self.instances()} registered")

    def worker_id(self, host: str) -> int:
        """The id the worker on `host` registered with (from its log: peagle_trt/dynamo/engine.py)."""
        found = re.findall(r"peagle-trt worker (\d+) ready", self.log(host))
        assert found, f"the worker on {host} has not logged its id: {self.log(host)[-2000:]}"
        return int(found[-1])

    def wait_gone(self, worker_id: int, timeout: float = 60.0) -> float:
        """Seconds until `worker_id` left discovery (a killed worker's lease expires)."""
        t0 = time.monotonic()
        while worker_id in self.instances():
            if time.monotonic() - t0 > timeout:
                pytest.fail(f"the dead worker {worker_id} was still registered after {timeout:.0f} s")
            time.sleep(0.25)
        return time.monotonic() - t0

    def wait_worker_id(self, host: str, other_than: int, timeout: float = 120.0) -> int:
        """The id of a worker restarted on `host` once it is ready (its log is appended to)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.findall(r"peagle-trt worker (\d+) ready", self.log(host))
            if found and int(found[-1]) != other_than:
                return int(found[-1])
            if self.workers[host].poll() is not None:
                pytest.fail(f"the worker on {host} exited: {self.log(host)[-3000:]}")
            time.sleep(0.5)
        pytest.fail(f"the worker restarted on {host} was not ready in {timeout:.0f} s")

    def log(self, name: str) -> str:
        path = self.tmp / ("frontend.log" if name == "frontend" else f"worker-{name}.log")
        return path.read_text(errors="replace") if path.exists() else ""

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), base_url="http://dynamo", timeout=timeout)

    def async_client(self, timeout: float = 120.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=self.socket), base_url="http://dynamo",
                                 timeout=timeout)

    def listeners(self) -> list[str]:
        """Local addresses of every listening TCP socket in the namespace (ss inside it)."""
        out = subprocess.run([*self.enter(), "ss", "-Hltn"],
                             capture_output=True, text=True, check=True).stdout
        return [line.split()[3] for line in out.splitlines() if line.strip()]

    def stop(self, timeout: float = 30.0) -> dict[str, int]:
        """SIGTERM every process, wait; returns the exit codes (a process still alive after
        `timeout` is killed and reported as None). A second call returns the first's codes."""
        if self.codes is not None:
            return self.codes
        procs = {"frontend": self.frontend, **{f"worker-{h}": p for h, p in self.workers.items()}}
        for p in procs.values():
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        codes = {}
        for name, p in procs.items():
            if p is None:
                continue
            try:
                codes[name] = p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                codes[name] = None
        self.relay.terminate()
        self.relay.wait(10)
        self.codes = codes
        return codes


def sse(lines) -> tuple[list[dict], list[str]]:
    """(JSON events, error lines) of an SSE stream's lines."""
    events, errors = [], []
    for line in lines:
        if line.startswith("data: ") and line[6:].strip() != "[DONE]":
            obj = json.loads(line[6:])
            (errors.append(json.dumps(obj)) if "error" in obj else events.append(obj))
        elif line.startswith("event: error") or line.startswith(":") and "error" in line:
            errors.append(line)
    return events, errors
