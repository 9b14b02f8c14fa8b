"""Process and shared-memory hygiene for the tritonserver that `serve` starts: free-port checks,
the parent-death signal, and finding / removing what a server run left (its Python-backend stub
processes and `/dev/shm` regions, both named by a prefix unique to the run).

Linux only (prctl, /proc, /dev/shm), like the Triton Python backend itself.
Tested through tests/faults/test_serve_faults.py (ports in use, killed processes, leaks).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
from pathlib import Path

from peagle_trt.errors import PortInUseError, ServeError

SHM_DIR = Path("/dev/shm")
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: preexec_fn must not import


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Raise PortInUseError for the first port another process listens on (or that cannot be
    bound on `host`), ServeError when two roles share one port."""
    seen: dict[int, str] = {}
    for role, port in ports.items():
        if port in seen:
            raise ServeError(f"--{role}-port and --{seen[port]}-port are both {port}; give each its own port")
        seen[port] = role
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            # SO_REUSEADDR: a port whose old connections linger in TIME_WAIT is free (tritonserver
            # binds it the same way); a listening socket still makes bind() fail.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUseError(
                        f"port {port} (--{role}-port) is in use on {host} by another process; stop it or "
                        f"pick a free port with --{role}-port") from exc
                raise ServeError(f"cannot bind {host}:{port} (--{role}-port): {exc.strerror}") from exc


def die_with_parent(parent_pid: int):
    """A Popen `preexec_fn`: the child gets SIGTERM when the thread that started it dies (SIGKILL
    of `serve` included), so tritonserver shuts down, unloads its models and frees their memory."""

    def setup() -> None:
        if _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            os._exit(127)
        if os.getppid() != parent_pid:  # the parent died before prctl: do not outlive it
            os.kill(os.getpid(), signal.SIGTERM)

    return setup


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def pids_with_arg(prefix: str) -> list[int]:
    """Processes with a command-line argument starting with `prefix` (a run's stubs carry their
    shm region name, which starts with the run's prefix)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            if any(arg.startswith(prefix) for arg in _cmdline(int(entry.name))):
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def shm_regions(prefix: str) -> list[Path]:
    return sorted(SHM_DIR.glob(prefix + "*")) if SHM_DIR.is_dir() else []


def sweep(prefix: str) -> list[str]:
    """SIGKILL the run's leftover stub processes and remove its shm regions; returns what it
    found (empty after a clean shutdown). Stubs ignore SIGTERM, hence SIGKILL."""
    left = []
    for pid in pids_with_arg(prefix):
        left.append(f"process {pid}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for region in shm_regions(prefix):
        left.append(str(region))
        region.unlink(missing_ok=True)
    return left
