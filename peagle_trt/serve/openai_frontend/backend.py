"""What the OpenAI frontend knows about the Triton side: which models exist and are ready (Triton's
repository index over gRPC), each model's chat template (the target's tokenizer inside the built
repository) and one async token stream per request over `peagle_trt.serve.client`
(`AsyncGrpcStream`: the request and response code of `peagle-trt generate --url`, on one shared
asyncio channel), cancelled on the server when the caller leaves.
Responses that queued up while the consumer was busy are merged into one chunk (fewer SSE events
under load; the same text and ids).
Tested in tests/serve/test_openai.py.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from peagle_trt.config import SamplingParams
from peagle_trt.errors import ConfigError, RemoteError, ServeError
from peagle_trt.serve.client import AsyncGrpcChannel, Chunk
from peagle_trt.serve.options import read_options


class ModelUnavailable(ServeError):
    """The model exists but is not ready (still loading, or failed to load): HTTP 503."""


class ModelNotFound(ServeError):
    """No model of that name in the repository: HTTP 404."""


class TritonBackend:
    POLL_S = 1.0  # how often a waiting stream checks whether its HTTP client is still there

    def __init__(self, grpc_url: str, repo: Path, aliases: dict[str, str] | None = None):
        self.grpc_url, self.repo = grpc_url, Path(repo)
        # served model names (vLLM's --served-model-name; by default the hub id `serve MODEL` was
        # given) -> the Triton model they name; a Triton model's own name works too
        self.aliases = dict(aliases or {})
        self._ready: set[str] = set()
        self._templates: dict[str, tuple] = {}
        self._lock = threading.Lock()
        self._channel: AsyncGrpcChannel | None = None  # made in the event loop on first use

    # -- models --------------------------------------------------------------------------------------
    def index(self) -> list[dict]:
        """Triton's repository index: [{"name", "state", "reason"}]; ServeError while unreachable."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        client = grpcclient.InferenceServerClient(self.grpc_url)
        try:
            return client.get_model_repository_index(as_json=True).get("models", [])
        except InferenceServerException as exc:
            raise ModelUnavailable(f"the Triton server at {self.grpc_url} is not up yet (models are "
                                   f"loading); retry shortly ({exc.message()})") from exc
        finally:
            client.close()

    def triton_name(self, name: str) -> str:
        """The Triton model a request's `model` names (an alias, or the model's own name)."""
        return self.aliases.get(name, name)

    def served_names(self, triton_name: str) -> list[str]:
        """The names /v1/models lists for a Triton model: its aliases, else its own name."""
        return [a for a, t in self.aliases.items() if t == triton_name] or [triton_name]

    def check_ready(self, name: str) -> None:
        """Raise ModelNotFound / ModelUnavailable unless `name` is a READY model."""
        name = self.triton_name(name)
        if name in self._ready:
            return
        if not (self.repo / name / "config.pbtxt").is_file():
            raise ModelNotFound(f"model {name!r} does not exist; GET /v1/models lists the served models")
        state = {m["name"]: m for m in self.index()}.get(name)
        if state is None or state.get("state") != "READY":
            why = f" ({state.get('state')}: {state.get('reason')})" if state and state.get("reason") else ""
            raise ModelUnavailable(f"model {name!r} is not ready yet{why}; retry shortly")
        self._ready.add(name)

    def warm_up(self) -> None:
        """Load every model's tokenizer now (seconds), not on its first chat request."""
        for config in sorted(self.repo.glob("*/config.pbtxt")):
            try:
                self._template(config.parent.name)
            except (ConfigError, KeyError):  # not one of our models: its requests will say why
                pass

    def forget(self, name: str) -> None:
        self._ready.discard(self.triton_name(name))

    # -- prompts ---------------------------------------------------------------------------------------
    def _template(self, name: str):
        """(codec, max_seq_len, strip_bos) of a model, loaded once."""
        name = self.triton_name(name)
        with self._lock:
            if name not in self._templates:
                from peagle_trt.tokenizer import TextCodec

                model_dir, options, paths = read_options(self.repo, name)
                codec = TextCodec(model_dir / "1" / paths.target)
                bos = codec.tok.bos_token
                first = codec.tok("a", add_special_tokens=True)["input_ids"][:1]
                # The template usually writes the BOS text itself; the model's raw-text encoding adds
                # BOS again when the tokenizer does so by default: drop the template's copy.
                strip = bos if bos and first == [codec.tok.bos_token_id] else ""
                self._templates[name] = (codec, options.max_seq_len, strip)
            return self._templates[name]

    def chat_prompt(self, name: str, messages: list[dict]) -> str:
        """The conversation rendered with the target's chat template, ready for the generation."""
        codec, _, strip = self._template(name)
        if not codec.has_chat_template:
            raise ConfigError(f"model {name!r}: its tokenizer has no chat template; use /v1/completions")
        text = codec.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text[len(strip):] if strip and text.startswith(strip) else text

    def room(self, name: str, prompt: str) -> int:
        """Tokens left after the prompt in the model's maximum sequence length (at least 1)."""
        codec, max_seq_len, _ = self._template(name)
        return max(1, max_seq_len - len(codec.encode_prompt(prompt, chat_template=False)))

    # -- generation --------------------------------------------------------------------------------
    async def stream(self, name: str, prompt: str, params: SamplingParams,
                     client_gone: Callable[[], Awaitable[bool]]) -> AsyncIterator[Chunk]:
        """The request's chunks; raises RemoteError when Triton refuses it. Leaving early (the
        consumer stops iterating, or `client_gone()` turns true) cancels it on the server."""
        if self._channel is None:
            self._channel = AsyncGrpcChannel(self.grpc_url)
        queue: asyncio.Queue = asyncio.Queue()
        stream = self._channel.open(self.triton_name(name), prompt, params, queue.put_nowait)
        finished, pending = False, None
        try:
            while True:
                try:
                    item = pending or await asyncio.wait_for(queue.get(), self.POLL_S)
                except asyncio.TimeoutError:
                    if await client_gone():
                        return
                    continue
                pending = None
                if isinstance(item, RemoteError):
                    finished = True
                    if item.status.endswith("UNAVAILABLE"):
                        self.forget(name)
                    raise item
                while not item.last and not queue.empty():  # coalesce what already arrived: one event
                    nxt = queue.get_nowait()
                    if isinstance(nxt, RemoteError):
                        pending = nxt
                        break
                    item = Chunk(item.text + nxt.text, item.token_ids + nxt.token_ids, nxt.final or item.final,
                                 nxt.last)
                yield item
                if item.last:
                    finished = True
                    return
        finally:
            stream.close(cancel=not finished)
