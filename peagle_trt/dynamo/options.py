"""Settings of a peagle-trt Dynamo worker and frontend, and the confinement of Dynamo's planes.

Dynamo's processes open listening sockets on their own: a worker's request plane (TCP: the
frontend connects to it), its KV event plane (ZMQ: the router subscribes), its system/health
server; the frontend's HTTP port and the TCP server its workers stream responses back to. By
default several bind 0.0.0.0 or the host's address. Here every one of them binds `host`
(127.0.0.1 unless the user names another address) through Dynamo's own variables (`plane_env`),
and an address that means every interface (0.0.0.0, ::, empty) is refused unless the user passes
`--allow-all-interfaces`: serving a model to a whole network is a decision, not a default.
One gap Dynamo 1.6.1 leaves: a worker's ZMQ event-plane publishers (KV events, active sequences)
bind 0.0.0.0 whatever is set (only the address they advertise follows DYN_EVENT_PLANE_HOST). So a
worker starts only where "every interface" means no more than `host` and loopback: a network
namespace of its own (a container, a Kubernetes pod) holding just its address
(`check_wildcard_reach`), or with --allow-all-interfaces (then firewall those ports).
Discovery is Dynamo's file backend (`DYN_FILE_KV`: a directory every process of the deployment
reads and writes; a shared filesystem across machines) unless `--discovery-backend etcd` /
`kubernetes` is named, as in a cluster. Tested by tests/dynamo/test_dynamo_options.py.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.errors import ConfigError

ALL_INTERFACES = {"", "0.0.0.0", "::", "[::]", "*"}
DISCOVERY_BACKENDS = ("file", "etcd", "kubernetes")


def check_host(host: str, allow_all_interfaces: bool, what: str) -> str:
    """`host` itself when it names one interface (or all of them and that was asked for)."""
    if host.strip() in ALL_INTERFACES:
        if not allow_all_interfaces:
            raise ConfigError(f"{what} {host!r} binds every network interface; name one address (e.g. "
                              "127.0.0.1, or this machine's cluster address) or pass --allow-all-interfaces")
        return "0.0.0.0"
    try:
        ipaddress.ip_address(host)
    except ValueError as exc:
        raise ConfigError(f"{what} must be an IP address of this machine, got {host!r}") from exc
    return host


def local_addresses() -> set[str]:
    """The IPv4 addresses of this network namespace's interfaces (from /proc/net/fib_trie): the
    ones a ZMQ bind on tcp://0.0.0.0 (IPv4 only) listens on."""
    found, last = set(), ""
    for line in Path("/proc/net/fib_trie").read_text().splitlines():
        line = line.strip()
        if line.startswith(("|--", "+--")):
            last = line.split()[1]
        elif line == "/32 host LOCAL":
            found.add(last)
    return found


def check_wildcard_reach(planes: Planes) -> None:
    """Refuse a worker whose wildcard-bound publishers would be reachable on an address the user
    did not name (see the module docstring), unless --allow-all-interfaces."""
    if planes.allow_all_interfaces:
        return
    extra = sorted(a for a in local_addresses() if a != planes.host and not ipaddress.ip_address(a).is_loopback)
    if extra:
        raise ConfigError(f"Dynamo 1.6.1 binds a worker's event-plane publishers on every interface, and this "
                          f"network namespace also has {', '.join(extra)} besides --host {planes.host}: run the "
                          "worker where only its address exists (a container / pod / network namespace of its "
                          "own), or pass --allow-all-interfaces and firewall those ports")


@dataclass(frozen=True)
class Planes:
    """Where a Dynamo process listens, and how the processes find each other."""
    host: str = "127.0.0.1"
    discovery_backend: str = "file"
    discovery_dir: str = ""  # the file backend's directory (shared by the whole deployment)
    namespace: str = "peagle"
    allow_all_interfaces: bool = False

    def __post_init__(self):
        object.__setattr__(self, "host", check_host(self.host, self.allow_all_interfaces, "--host"))
        if self.discovery_backend not in DISCOVERY_BACKENDS:
            raise ConfigError(f"--discovery-backend must be one of {DISCOVERY_BACKENDS}, got "
                              f"{self.discovery_backend!r}")
        if self.discovery_backend == "file" and not self.discovery_dir:
            raise ConfigError("the file discovery backend needs --discovery-dir (a directory every process of "
                              "the deployment shares)")

    def env(self) -> dict[str, str]:
        """Dynamo's variables that put every plane of this process on `host`."""
        env = {"DYN_DISCOVERY_BACKEND": self.discovery_backend, "DYN_NAMESPACE": self.namespace,
               "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
               "DYN_TCP_RPC_HOST": self.host, "DYN_EVENT_PLANE_HOST": self.host,
               "DYN_TCP_RESPONSE_STREAM_HOST": self.host, "DYN_SYSTEM_HOST": self.host,
               "DYN_HTTP_HOST": self.host}
        if self.discovery_backend == "file":
            Path(self.discovery_dir).mkdir(parents=True, exist_ok=True)
            env["DYN_FILE_KV"] = str(Path(self.discovery_dir).absolute())
        return env


@dataclass(frozen=True)
class WorkerOptions:
    repo: Path  # a built model repository (`peagle-trt build`)
    planes: Planes
    model: str = "peagle"  # the model's directory inside the repository
    served_name: str = ""  # the name clients ask for; default: `model`
    kv_events: bool = True  # publish the prefix cache's events (KV-aware routing)
    drain_timeout_s: float = 60.0  # SIGTERM: longest wait for running requests (after Dynamo's 5 s grace)
    deterministic: bool = False  # serve the repository's model in deterministic mode (peagle_trt/serve/options.py)

    def __post_init__(self):
        if not (Path(self.repo) / self.model / "config.pbtxt").is_file():
            raise ConfigError(f"{self.repo}/{self.model}/config.pbtxt does not exist: --repo must be a repository "
                              f"built by `peagle-trt build` and --model one of its models")
        object.__setattr__(self, "repo", Path(self.repo))
        object.__setattr__(self, "served_name", self.served_name or self.model)
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout_s}")
        if self.deterministic:  # refused here, before Dynamo starts, where the backend cannot be (tensorrt)
            from peagle_trt.serve.options import read_options, with_deterministic

            with_deterministic(read_options(self.repo, self.model)[1], True)

    @property
    def component(self) -> str:
        """The Dynamo component the worker serves under: one per served model (Dynamo registers one
        model per endpoint; workers of the same model share it, and the router picks among them)."""
        return re.sub(r"[^A-Za-z0-9_-]", "-", self.served_name)

    @property
    def target_dir(self) -> Path:
        """The target checkpoint inside the repository: its tokenizer and chat template."""
        from peagle_trt.serve.options import read_options

        model_dir, _, paths = read_options(self.repo, self.model)
        return (model_dir / "1" / paths.target).absolute()
