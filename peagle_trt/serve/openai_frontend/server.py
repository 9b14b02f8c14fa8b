"""Run the OpenAI frontend with uvicorn on a background thread of the `peagle-trt serve` process.

The socket is bound in the constructor (a busy port fails before tritonserver starts, with a
ServeError naming the flag); `start()` waits until uvicorn accepts connections; `stop()` asks it
to finish (graceful, bounded) and joins the thread. Requests that arrive while Triton still loads
get 503. Tested in tests/serve/test_openai.py.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from peagle_trt.errors import ServeError


@dataclass(frozen=True)
class FrontendOptions:
    repo: Path  # the model repository tritonserver serves (chat templates, model names)
    grpc_url: str  # HOST:PORT of tritonserver's gRPC endpoint
    host: str = "127.0.0.1"
    port: int = 9000
    start_timeout_s: float = 20.0
    spec_metrics: str = "summary"  # vLLM's --per-request-spec-decode-metrics: none | summary | detailed
    served_names: tuple[tuple[str, str], ...] = ()  # (served name, Triton model): vLLM's --served-model-name


class OpenAIFrontend:
    def __init__(self, options: FrontendOptions):
        import uvicorn

        from peagle_trt.serve.openai_frontend.app import create_app
        from peagle_trt.serve.openai_frontend.backend import TritonBackend

        self.options = options
        family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((options.host, options.port))
        except OSError as exc:
            self._sock.close()
            raise ServeError(f"cannot bind the OpenAI frontend to {options.host}:{options.port} ({exc.strerror}); "
                             "pick a free port with --openai-port") from exc
        self.backend = TritonBackend(options.grpc_url, options.repo, dict(options.served_names))
        app = create_app(self.backend, options.spec_metrics)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=5, timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="peagle-openai", daemon=True)

    @property
    def url(self) -> str:
        """Base URL for OpenAI clients (`openai.OpenAI(base_url=...)`)."""
        host = f"[{self.options.host}]" if ":" in self.options.host else self.options.host
        return f"http://{host}:{self.options.port}/v1"

    def start(self) -> OpenAIFrontend:
        threading.Thread(target=self.backend.warm_up, name="peagle-openai-warmup", daemon=True).start()
        self._thread.start()
        deadline = time.monotonic() + self.options.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ServeError(f"the OpenAI frontend did not start on {self.url} within "
                                 f"{self.options.start_timeout_s:.0f} s")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():  # open streams outlived the graceful period
                self._server.force_exit = True
                self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> OpenAIFrontend:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
