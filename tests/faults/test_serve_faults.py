"""Fault injection against a real `peagle-trt serve`: a port already in use (before and after the
check), kill -9 of the model's stub process with streams in flight, SIGTERM during 8 streams,
SIGKILL of `serve`, a model that never loads. Each ends with nothing left behind: no tritonserver
or stub process of the run, none of its /dev/shm regions.

Other servers may run on this machine at the same time, so everything is identified through this
test's own repository path (in tritonserver's and the stubs' command lines) and the region names
the stubs of this run carry.
"""

from __future__ import annotations

import http.server
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from peagle_trt.build import RepositoryOptions, build_repository
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import PortInUseError, ServeError
from peagle_trt.serve.client import build_inputs, stream_generate
from tests.serve.conftest import free_port

pytestmark = [pytest.mark.faults, pytest.mark.triton]
SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def repo(tiny, tmp_path_factory):
    pytest.importorskip("pytriton")
    pytest.importorskip("tritonclient.grpc")
    path = tmp_path_factory.mktemp("faults") / "repo"
    build_repository(tiny["llama"], tiny["aws"], path,
                     RepositoryOptions(SpecConfig("peagle", 2), max_batch=8, max_seq_len=256, prefill_chunk=32,
                                       deterministic=True))
    return path


# -- this run's processes and shared memory ---------------------------------------------------------
def _cmdline(pid: int) -> list[str]:
    try:
        return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def processes_of(repo: Path) -> dict[int, list[str]]:
    """tritonserver (--model-repository=REPO) and its stubs (REPO/<model>/1/model.py), alive."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            args = _cmdline(int(entry.name))
            if any(str(repo) in a for a in args[:3]) and _alive(int(entry.name)):
                found[int(entry.name)] = args
    return found


def stubs_of(repo: Path) -> dict[int, str]:
    """{stub pid: its shm region name}."""
    return {pid: args[2] for pid, args in processes_of(repo).items()
            if args[0].endswith("triton_python_backend_stub") and len(args) > 2}


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return found


class RegionWatch:
    """Records the shm regions of this repository's stubs while a server starts or runs."""

    def __init__(self, repo: Path):
        self.repo, self.regions, self._stop = repo, set(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.regions |= set(stubs_of(self.repo).values())
            time.sleep(0.05)

    def stop(self) -> set[str]:
        self._stop.set()
        self._thread.join()
        return self.regions


def assert_nothing_left(repo: Path, regions: set[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (processes_of(repo) or any((SHM / r).exists() for r in regions)):
        time.sleep(0.1)
    assert not processes_of(repo), f"left running: {processes_of(repo)}"
    assert not [r for r in regions if (SHM / r).exists()], "shared-memory regions left in /dev/shm"


# -- serve ---------------------------------------------------------------------------------------------
_started: list[tuple[subprocess.Popen, Path]] = []


@pytest.fixture(autouse=True)
def _reap():
    """After the assertions: never leave a failing test's processes running on a shared machine."""
    yield
    while _started:
        proc, repo = _started.pop()
        proc.kill()
        proc.wait()
        for pid, args in processes_of(repo).items():
            os.kill(pid, signal.SIGKILL)
            if args[0].endswith("triton_python_backend_stub") and len(args) > 2:
                (SHM / args[2]).unlink(missing_ok=True)


class Serve:
    def __init__(self, repo: Path, *extra: str, http_port: int | None = None, ready_timeout: float = 120):
        self.ports = [http_port or free_port(), free_port(), free_port()]
        cmd = [sys.executable, "-m", "peagle_trt.cli", "serve", str(repo), "--http-port", str(self.ports[0]),
               "--grpc-port", str(self.ports[1]), "--metrics-port", str(self.ports[2]),
               "--ready-timeout", str(ready_timeout), *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        _started.append((self.proc, repo))
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [self.lines.put(line) for line in self.proc.stdout] + [self.lines.put(None)],
                         daemon=True).start()

    def first_line(self, timeout: float = 150) -> dict | None:
        line = self.lines.get(timeout=timeout)
        return json.loads(line) if line else None

    def last_line(self, timeout: float) -> tuple[int, dict]:
        code = self.proc.wait(timeout)
        lines = []
        while (line := self.lines.get(timeout=5)) is not None:
            lines.append(line)
        return code, json.loads(lines[-1])


class Stream:
    """One gRPC stream: collects tokens until its final response or an error."""

    def __init__(self, url: str, prompt: str, max_tokens: int):
        import tritonclient.grpc as grpcclient

        self.tokens: list[int] = []
        self.error: str | None = None
        self.final = threading.Event()
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on)
        self.client.async_stream_infer("peagle", build_inputs(prompt, SamplingParams(max_tokens=max_tokens,
                                                                                      ignore_eos=True)),
                                       enable_empty_final_response=True)

    def _on(self, result, error):
        if self.final.is_set():  # e.g. the server closing a finished stream's connection
            return
        if error is not None:
            self.error = error.message()
        else:
            ids = result.as_numpy("output_ids")
            self.tokens += [] if ids is None else ids.tolist()
            self.first.set()
            if not result.get_response().parameters["triton_final_response"].bool_param:
                return
        self.ended_at = time.monotonic()
        self.final.set()

    def close(self):
        self.client.stop_stream(cancel_requests=True)  # never waits on a stream the server forgot
        self.client.close()


class ReadyImpostor(http.server.ThreadingHTTPServer):
    """Another server on the HTTP port that answers every readiness probe with 200."""

    def __init__(self, port: int):
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", port), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


# -- the faults --------------------------------------------------------------------------------------
def test_a_port_in_use_is_refused_before_anything_starts(repo):
    port = free_port()
    impostor = ReadyImpostor(port)
    try:
        serve = Serve(repo, http_port=port)
        code, result = serve.last_line(timeout=60)
    finally:
        impostor.shutdown()
        impostor.server_close()
    assert code != 0 and result["error_type"] == "PortInUseError", result
    assert f"port {port} (--http-port) is in use" in result["error"]
    assert_nothing_left(repo, set())


def test_a_port_taken_after_the_check_is_named_and_nothing_leaks(repo, monkeypatch):
    """The port is free at the check and taken before tritonserver binds it: readiness must come
    from our server (the impostor answers 200), the error must name the port, the stub that had
    already loaded the model must not survive."""
    from peagle_trt.serve import server as server_mod

    monkeypatch.setattr(server_mod, "check_ports", lambda host, ports: None, raising=False)
    port = free_port()
    impostor = ReadyImpostor(port)
    watch = RegionWatch(repo)
    try:
        spec = server_mod.ServeOptions(repo, "127.0.0.1", port, free_port(), free_port(), ready_timeout_s=120)
        srv = server_mod.TritonServer(spec)
        with pytest.raises(PortInUseError, match=f"port {port} is in use"):
            srv.wait_ready()
        srv.stop()
    finally:
        impostor.shutdown()
        impostor.server_close()
        regions = watch.stop()
    assert regions, "the stub never started: the test did not exercise a loaded model"
    assert_nothing_left(repo, regions)


def test_kill_9_of_the_model_process_fails_streams_promptly_and_serve_exits_clean(repo):
    serve = Serve(repo)
    ready = serve.first_line()
    assert ready and ready["ready"]
    watch = RegionWatch(repo)
    streams = [Stream(ready["grpc"], f"victim {i}", 240) for i in range(4)]
    try:
        for s in streams:
            assert s.first.wait(60)
        (triton,) = children(serve.proc.pid)
        (stub,) = [pid for pid in children(triton) if pid in stubs_of(repo)]
        killed_at = time.monotonic()
        os.kill(stub, signal.SIGKILL)
        for s in streams:
            assert s.final.wait(20), "an in-flight client got no response after the model died"
            assert s.error is not None and len(s.tokens) < 240
            assert s.ended_at - killed_at < 15
        code, result = serve.last_line(timeout=30)
    finally:
        for s in streams:
            s.close()
        regions = watch.stop()
    assert code != 0 and result["error_type"] == "ServeError"
    assert "model process" in result["error"] and "died" in result["error"]
    assert_nothing_left(repo, regions)


def test_kill_9_of_an_idle_model_process_turns_readiness_off_at_once(repo):
    """The health contract a router relies on: a bare tritonserver whose stub died
    while idle keeps answering ready (health 200, model ready 200) and fails every request; under
    `serve` the stub's death ends readiness within a second (the server is stopped) and `serve`
    exits with code 2 and the reason, so a supervisor restarts it."""
    import urllib.error
    import urllib.request

    serve = Serve(repo)
    ready = serve.first_line()
    assert ready and ready["ready"]
    url = f"http://127.0.0.1:{serve.ports[0]}/v2/health/ready"

    def is_ready() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    regions = set(stubs_of(repo).values())
    assert is_ready()
    (triton,) = children(serve.proc.pid)
    (stub,) = [pid for pid in children(triton) if pid in stubs_of(repo)]
    os.kill(stub, signal.SIGKILL)
    killed_at = time.monotonic()
    while is_ready() and time.monotonic() - killed_at < 10:
        time.sleep(0.05)
    not_ready_after = time.monotonic() - killed_at
    code, result = serve.last_line(timeout=30)
    assert not_ready_after < 1.5, f"still ready {not_ready_after:.1f} s after the model process died"
    assert code == 2 and result["error_type"] == "ServeError" and "model process" in result["error"], result
    assert "it exited cleanly" in result["error"], result  # tritonserver exit 0 after SIGTERM, not SIGKILL
    assert f"its log: {ready['log']}" in result["error"] and Path(ready["log"]).is_file()  # a failure keeps it
    Path(ready["log"]).unlink()
    assert_nothing_left(repo, regions)


def test_sigterm_during_8_streams_finishes_them_exactly_then_exits_promptly(repo):
    serve = Serve(repo)
    ready = serve.first_line()
    watch = RegionWatch(repo)
    prompts = [f"stream number {i} of eight" for i in range(8)]
    try:
        params = SamplingParams(max_tokens=60, ignore_eos=True)
        reference = [stream_generate(ready["grpc"], p, params)["token_ids"] for p in prompts[:2]]
        streams = [Stream(ready["grpc"], p, 60) for p in prompts]
        for s in streams:
            assert s.first.wait(60)
        serve.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(ServeError):  # draining: new requests are refused
            stream_generate(ready["grpc"], "too late", SamplingParams(max_tokens=4), timeout_s=30)
        for s in streams:
            assert s.final.wait(120)
        done = max(s.ended_at for s in streams)
        code, result = serve.last_line(timeout=60)
        exit_after = time.monotonic() - done
    finally:
        for s in streams:
            s.close()
        regions = watch.stop()
    assert [s.error for s in streams] == [None] * 8
    assert [len(s.tokens) for s in streams] == [60] * 8
    assert [s.tokens for s in streams[:2]] == reference  # exact, not merely complete
    assert exit_after < 10, f"serve took {exit_after:.1f} s to exit after the last stream ended"
    assert_nothing_left(repo, regions)
    assert code == 0 and result["stopped"] and result["drained"], result
    assert not Path(ready["log"]).exists()  # the temporary log of a clean stop is removed


def test_sigkill_of_serve_takes_the_server_down(repo):
    serve = Serve(repo)
    ready = serve.first_line()
    assert ready and ready["ready"]
    regions = set(stubs_of(repo).values())
    assert regions and processes_of(repo)
    serve.proc.kill()
    serve.proc.wait(10)
    assert_nothing_left(repo, regions, timeout=30)


def test_a_failed_start_leaks_nothing(repo, tmp_path):
    """One model loads (its stub runs), another fails in initialize: tritonserver gives up."""
    bad = tmp_path / "repo"
    shutil.copytree(repo / "peagle", bad / "peagle")
    (bad / "broken" / "1").mkdir(parents=True)
    (bad / "broken" / "config.pbtxt").write_text(
        'name: "broken"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_CPU } ]\n')
    (bad / "broken" / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def initialize(self, args):\n        raise RuntimeError('broken on purpose')\n")
    watch = RegionWatch(bad)
    try:
        serve = Serve(bad, ready_timeout=120)
        code, result = serve.last_line(timeout=150)
    finally:
        regions = watch.stop()
    assert code != 0 and result["error_type"] == "ServeError" and "broken on purpose" in result["error"]
    assert "CudaDriverHelper" not in result["error"]  # the reason, not the noise every CPU-only start logs
    assert regions, "no stub ever started"
    assert_nothing_left(bad, regions)
