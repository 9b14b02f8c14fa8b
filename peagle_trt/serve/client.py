"""gRPC streaming client for the `peagle` model: `peagle-trt generate --url` and the OpenAI frontend
(peagle_trt/serve/openai_frontend/) both stream through `GrpcStream`, so both get the same tokens.

`GrpcStream` starts one request on its own gRPC stream and hands every response, parsed into a
`Chunk`, to a callback on tritonclient's stream thread (a queue for the blocking `stream_generate`);
`AsyncGrpcStream` does the same on asyncio over one shared channel (the frontend, many requests at
once); `close(cancel=True)` cancels the request on the server. Both build the request with
`build_inputs` and read responses with `parse_result`.
Tested in tests/serve/test_triton.py and tests/serve/test_openai.py.
"""

from __future__ import annotations

import queue
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from peagle_trt.config import SamplingParams
from peagle_trt.errors import PeagleError, RemoteError, ServeError
from peagle_trt.serve.protocol import FINAL_OUTPUTS, generate_result


def build_inputs(prompt: str, params: SamplingParams, stream: bool = True, chat_template: bool = False):
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype, triton_type):
        t = grpcclient.InferInput(name, [len(value)], triton_type)
        t.set_data_from_numpy(np.array(value, dtype=dtype))
        return t

    inputs = [tensor("text_input", [prompt.encode("utf-8")], np.object_, "BYTES"),
              tensor("max_tokens", [params.max_tokens], np.int32, "INT32"),
              tensor("stream", [stream], bool, "BOOL"),
              tensor("temperature", [params.temperature], np.float32, "FP32"),
              tensor("top_p", [params.top_p], np.float32, "FP32"),
              tensor("top_k", [params.top_k], np.int32, "INT32"),
              tensor("ignore_eos", [params.ignore_eos], bool, "BOOL"),
              tensor("apply_chat_template", [chat_template], bool, "BOOL")]
    if params.seed is not None:
        inputs.append(tensor("seed", [params.seed], np.int64, "INT64"))
    if params.stop:
        inputs.append(tensor("stop", [s.encode() for s in params.stop], np.object_, "BYTES"))
    if params.structured is not None:
        inputs.append(tensor("structured_output", [params.structured.to_json().encode()], np.object_, "BYTES"))
    return inputs


@dataclass
class Chunk:
    """One streamed response: the NEW text and ids; `final` holds the statistics of the last one."""
    text: str
    token_ids: list[int]
    final: dict | None = None
    last: bool = False  # Triton's final response of the request (may be empty)


def parse_result(result) -> Chunk:
    text, ids, final = "", [], None
    if result.as_numpy("text_output") is not None:
        text = b"".join(result.as_numpy("text_output")).decode("utf-8")
        ids = result.as_numpy("output_ids").tolist()
    if result.as_numpy("finish_reason") is not None:
        final = final_stats(result)
    last = result.get_response().parameters["triton_final_response"].bool_param
    return Chunk(text, ids, final, last)


def final_stats(result) -> dict:
    """The final response's statistics, keyed as the generator's (`protocol.generate_result`, which
    names any that an older server did not send)."""
    stats = {"finish_reason": result.as_numpy("finish_reason")[0].decode()}
    for name, (key, _) in FINAL_OUTPUTS.items():
        value = result.as_numpy(name)
        if value is None:
            continue
        if name == "accept_rate_per_pos":
            stats[key] = [round(float(x), 4) for x in value]
        elif name in ("acceptance_histogram", "per_step_drafted", "per_step_accepted"):
            stats[key] = [int(x) for x in value]
        elif name == "spec_mode":
            stats[key] = value[0].decode()
        else:
            stats[key] = round(float(value[0]), 4) if value.dtype.kind == "f" else int(value[0])
    return stats


class GrpcStream:
    """One request streamed over its own gRPC stream; `on_chunk` receives each `Chunk`, or one
    `RemoteError` when the server refuses or fails the request, on tritonclient's thread."""

    def __init__(self, url: str, model: str, prompt: str, params: SamplingParams,
                 on_chunk: Callable[[Chunk | RemoteError], None], chat_template: bool = False):
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        self.url, self.on_chunk, self.closed = url, on_chunk, False
        self.client = grpcclient.InferenceServerClient(url)
        try:
            self.client.start_stream(callback=self._callback)
            self.client.async_stream_infer(model, build_inputs(prompt, params, True, chat_template),
                                           request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        except InferenceServerException as exc:
            self.close()
            raise ServeError(f"cannot reach the server at {url}: {exc.message()}") from exc

    def _callback(self, result, error) -> None:
        if self.closed:
            return
        if error is not None:
            self.on_chunk(RemoteError(error.message(), str(error.status() or "")))
            return
        self.on_chunk(parse_result(result))

    def close(self, cancel: bool = False) -> None:
        """End the stream; `cancel=True` cancels the request on the server (the client left)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.client.stop_stream(cancel_requests=cancel)
        finally:
            self.client.close()


class AsyncGrpcChannel:
    """One asyncio gRPC channel for many concurrent streamed requests (the OpenAI frontend): each
    `open()` starts a request on its own bidirectional stream over the shared channel (no channel
    set-up or thread per request). Create it inside the running event loop."""

    def __init__(self, url: str):
        import tritonclient.grpc.aio as aio

        self.url = url
        self.client = aio.InferenceServerClient(url)

    def open(self, model: str, prompt: str, params: SamplingParams,
             on_chunk: Callable[[Chunk | RemoteError], None], chat_template: bool = False) -> AsyncGrpcStream:
        return AsyncGrpcStream(self, model, prompt, params, on_chunk, chat_template)

    async def close(self) -> None:
        await self.client.close()


class AsyncGrpcStream:
    """`GrpcStream` on an `AsyncGrpcChannel`: a task reads the responses and hands each `Chunk`
    (or one `RemoteError`) to `on_chunk` on the event loop; `close(cancel=True)` cancels the call."""

    def __init__(self, channel: AsyncGrpcChannel, model: str, prompt: str, params: SamplingParams,
                 on_chunk: Callable[[Chunk | RemoteError], None], chat_template: bool = False):
        import asyncio

        self.on_chunk, self.closed, self._done = on_chunk, False, asyncio.Event()
        request = {"model_name": model, "inputs": build_inputs(prompt, params, True, chat_template),
                   "request_id": uuid.uuid4().hex}

        async def requests():  # keep our half of the stream open until the request ends
            yield request
            await self._done.wait()

        self._call = channel.client.stream_infer(requests())
        self._task = asyncio.get_running_loop().create_task(self._read(channel.url))

    async def _read(self, url: str) -> None:
        import grpc
        from tritonclient.utils import InferenceServerException

        try:
            async for result, error in self._call:
                if error is not None:
                    self.on_chunk(RemoteError(error.message(), ""))
                    return
                chunk = parse_result(result)
                chunk.last = chunk.last or chunk.final is not None  # the response with the statistics ends it
                self.on_chunk(chunk)
                if chunk.last:
                    return
        except grpc.aio.AioRpcError as exc:
            if not self.closed:
                self.on_chunk(RemoteError(f"{url}: {exc.details()}", str(exc.code())))
        except InferenceServerException as exc:
            if not self.closed:
                self.on_chunk(RemoteError(f"{url}: {exc.message()}", str(exc.status() or "")))
        finally:
            self._done.set()

    def close(self, cancel: bool = False) -> None:
        """End the stream; `cancel=True` cancels the request on the server (the client left)."""
        if self.closed:
            return
        self.closed = True
        if cancel and not self._done.is_set():
            self._call.cancel()
        self._done.set()


def stream_generate(url: str, prompt: str, params: SamplingParams, model: str = "peagle",
                    on_text: Callable[[str], None] | None = None, chat_template: bool = False,
                    timeout_s: float = 600.0) -> dict:
    """Stream one request over gRPC; returns token_ids, text and the final response's statistics."""
    results: queue.Queue = queue.Queue()
    stream = GrpcStream(url, model, prompt, params, results.put, chat_template)
    text, ids, final = [], [], {}
    try:
        while True:
            try:
                chunk = results.get(timeout=timeout_s)
            except queue.Empty as exc:
                raise ServeError(f"no response from {url} within {timeout_s:.0f} s") from exc
            if isinstance(chunk, RemoteError):
                raise RemoteError(f"the server refused the request: {chunk}", chunk.status)
            text.append(chunk.text)
            ids += chunk.token_ids
            if on_text and chunk.text:
                on_text(chunk.text)
            final = chunk.final or final
            if chunk.last:
                break
    except PeagleError:
        stream.close(cancel=True)
        raise
    stream.close()
    if not final:
        raise ServeError(f"the stream from {url} ended without a final response")
    return generate_result("".join(text), ids, final.pop("finish_reason"), final)
