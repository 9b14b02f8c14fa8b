"""Run one peagle-trt worker, or Dynamo's frontend, with every plane confined (options.py).

    run_worker(WorkerOptions)       this process becomes a Dynamo worker serving one model of a
                                    built repository (engine.py) until SIGTERM / SIGINT; Dynamo's
                                    runtime then unregisters it (the router stops sending), lets
                                    in-flight requests finish within its grace period (drain),
                                    and calls the engine's cleanup; a failed scheduler
                                    ends it the same way, then ServeError (exit code 2)
    frontend_command(...)           the `python -m dynamo.frontend` command line and environment:
                                    OpenAI HTTP, the preprocessor (tokenizer, chat template) and
                                    the router (`kv`: KV-aware, from the workers' block events)

Both need Dynamo, which lives in its own venv (scripts/dynamo_env.sh makes .venv-dynamo, layered
on the project venv); `require_dynamo` says so when it is missing.
Tested by tests/dynamo/test_dynamo.py.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass

from peagle_trt.dynamo.options import Planes, WorkerOptions, check_host
from peagle_trt.errors import ConfigError, ServeError

ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded")


def require_dynamo() -> None:
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.llm") is None:
        raise ConfigError(f"NVIDIA Dynamo is not installed for {sys.executable}; make its venv with "
                          "scripts/dynamo_env.sh and run `.venv-dynamo/bin/python -m peagle_trt.cli dynamo ...`")


def run_worker(options: WorkerOptions) -> None:
    require_dynamo()
    os.environ.update(options.planes.env())  # before the runtime starts: it reads them once
    import uvloop
    from dynamo.common.backend.worker import Worker, WorkerConfig

    from peagle_trt.dynamo.engine import PeagleEngine

    # the model path Dynamo registers: the target's directory (tokenizer, chat template, config)
    config = WorkerConfig(namespace=options.planes.namespace, component=options.component, endpoint="generate",
                          model_name=str(options.target_dir), served_model_name=options.served_name,
                          discovery_backend=options.planes.discovery_backend, request_plane="tcp",
                          event_plane="zmq", enable_kv_routing=options.kv_events)
    engine = PeagleEngine(options)
    uvloop.run(Worker(engine, config).run())
    if engine.failure is not None:
        raise ServeError(f"worker {options.served_name}: {engine.failure}; it unregistered and stopped: restart it")


@dataclass(frozen=True)
class FrontendOptions:
    planes: Planes
    http_port: int = 8000
    router_mode: str = "kv"
    http_host: str = ""  # default: planes.host
    # 0: a worker's death ends its in-flight streams with an error (clients retry); N: the frontend
    # replays them (and requests it routed to a worker found dead) on another worker, up to N times
    migration_limit: int = 0

    def __post_init__(self):
        if self.router_mode not in ROUTER_MODES:
            raise ConfigError(f"--router-mode must be one of {ROUTER_MODES}, got {self.router_mode!r}")
        if self.migration_limit < 0:
            raise ConfigError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        host = check_host(self.http_host or self.planes.host, self.planes.allow_all_interfaces, "--http-host")
        object.__setattr__(self, "http_host", host)


def frontend_command(options: FrontendOptions) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of Dynamo's frontend for these options."""
    require_dynamo()
    planes = options.planes
    argv = [sys.executable, "-m", "dynamo.frontend", "--http-host", options.http_host,
            "--http-port", str(options.http_port), "--discovery-backend", planes.discovery_backend,
            "--namespace", planes.namespace, "--router-mode", options.router_mode,
            "--request-plane", "tcp", "--event-plane", "zmq", "--migration-limit", str(options.migration_limit)]
    return argv, {**os.environ, **planes.env(), "DYN_HTTP_HOST": options.http_host}
