"""The FastAPI application: /v1/models, /v1/completions, /v1/chat/completions (streamed as SSE or
whole), OpenAI-shaped errors (400 bad parameters, 404 unknown model or route, 503 while the model
loads), and the speculative statistics as the extension field `speculative` of the final chunk /
response. Tested in tests/serve/test_openai.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from peagle_trt.errors import ConfigError, RemoteError, RequestError, ServeError
from peagle_trt.serve.client import Chunk
from peagle_trt.serve.openai_frontend.backend import ModelNotFound, ModelUnavailable, TritonBackend
from peagle_trt.serve.openai_frontend.protocol import (
    ChatRequest,
    CompletionRequest,
    ValidationError,
    error_body,
    new_id,
    now,
    refuse_removed_keys,
    validation_message,
)

FINISH = {"stop": "stop", "length": "length"}  # "abort" (cancelled / failed step) becomes an error


def _error(status: int, message: str, kind: str, param: str | None = None, code: str | None = None):
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


def _remote_error(exc: RemoteError) -> JSONResponse:
    """Triton's refusal of one request: its own message; bad input -> 400, not loaded -> 503."""
    if exc.status.endswith("UNAVAILABLE"):
        return _error(503, str(exc), "service_unavailable", code="model_not_ready")
    if str(exc).startswith("internal error"):
        return _error(500, str(exc), "internal_error")
    return _error(400, str(exc), "invalid_request_error")


def speculative(final: dict) -> dict:
    return {"acceptance_length": round(final["acceptance_length"], 4),
            "accept_rate_per_pos": final["accept_rate_per_pos"], "draft_steps": final["steps"],
            "target_forwards": final["target_forwards"], "drafter_forwards": final["drafter_forwards"]}


SPEC_METRICS = ("none", "summary", "detailed")  # vLLM's --per-request-spec-decode-metrics levels


def spec_decode_metrics(final: dict, level: str = "summary") -> dict | None:
    """vLLM's per-request `metrics` object (`--per-request-spec-decode-metrics`; the shape AIPerf
    0.13's vLLM adapter reads from the body, or from the last chunks when streaming):
    mean_acceptance_length = 1 + accepted / steps, draft_acceptance_rate = accepted / drafted,
    acceptance_histogram dense of length K + 1 (peagle_trt/speculative/stats.py); `detailed` adds the
    per-step lists. {"speculative_decoding": null} without speculation; None at level "none"."""
    if level == "none":
        return None
    if final.get("spec_mode") == "none" or not final.get("num_spec_tokens"):
        return {"speculative_decoding": None}
    hist, steps, drafted = final["acceptance_histogram"], final["steps"], final["drafted"]
    accepted = sum(j * n for j, n in enumerate(hist))
    out = {"mean_acceptance_length": round(1.0 + accepted / steps, 4) if steps else 1.0,
           "draft_acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
           "acceptance_histogram": hist, "num_spec_steps": steps, "num_accepted_draft_tokens": accepted,
           "num_draft_tokens": drafted, "num_spec_tokens": final["num_spec_tokens"]}
    if level == "detailed":
        out.update(per_step_accepted=final.get("per_step_accepted", []),
                   per_step_drafted=final.get("per_step_drafted", []))
    return {"speculative_decoding": out}


def stats_fields(level: str):
    """The statistics of a final response as top-level fields: ours (`speculative`) and vLLM's
    (`metrics`, unless the level is "none" or `metrics` is False). A stream carries `metrics` on
    ONE chunk, as vLLM: the usage chunk, or the finish chunk when usage was not asked for (AIPerf
    drops a request whose stream carries it twice, reading it as n > 1)."""
    def fields(final: dict, metrics: bool = True) -> dict:
        metrics = spec_decode_metrics(final, level) if metrics else None
        return {"speculative": speculative(final), **({"metrics": metrics} if metrics is not None else {})}
    return fields


def usage(final: dict, completion_tokens: int) -> dict:
    prompt = final.get("prompt_tokens") or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def create_app(backend: TritonBackend, spec_metrics: str = "summary") -> FastAPI:
    if spec_metrics not in SPEC_METRICS:
        raise ConfigError(f"per-request spec-decode metrics {spec_metrics!r}: expected one of {SPEC_METRICS}")
    fields = stats_fields(spec_metrics)
    app = FastAPI(title="peagle-trt OpenAI-compatible frontend", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # a bug: say so in OpenAI's shape
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error")

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        try:
            index = await asyncio.to_thread(backend.index)
        except ModelUnavailable as exc:
            return _error(503, str(exc), "service_unavailable", code="server_not_ready")
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0,
                                            "owned_by": "peagle-trt", "ready": m.get("state") == "READY"}
                                           for m in index for name in backend.served_names(m["name"])]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _generate(request, ChatRequest)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _generate(request, CompletionRequest)

    async def _generate(request: Request, kind):
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, f"the request body must be a JSON object, got {type(body).__name__}",
                          "invalid_request_error")
        try:
            refuse_removed_keys(body)
            req = kind.model_validate(body)
            req.check_unsupported()
        except ValidationError as exc:
            message, param = validation_message(exc)
            return _error(400, message, "invalid_request_error", param)
        except (ConfigError, RequestError) as exc:
            return _error(400, str(exc), "invalid_request_error")
        try:
            await asyncio.to_thread(backend.check_ready, req.model)
            chat = isinstance(req, ChatRequest)
            if chat:
                prompt = await asyncio.to_thread(backend.chat_prompt, req.model,
                                                 [m.as_template_dict() for m in req.messages])
            else:
                prompt = req.text
            max_tokens = req.requested_max_tokens or await asyncio.to_thread(backend.room, req.model, prompt)
            params = req.sampling(max_tokens)
        except ModelNotFound as exc:
            return _error(404, str(exc), "not_found_error", "model", "model_not_found")
        except ModelUnavailable as exc:
            return _error(503, str(exc), "service_unavailable", "model", "model_not_ready")
        except (ConfigError, RequestError) as exc:
            return _error(400, str(exc), "invalid_request_error")
        chunks = backend.stream(req.model, prompt, params, request.is_disconnected)
        try:  # the first chunk decides between an error status and a 200 stream
            first = await chunks.__anext__()
        except RemoteError as exc:
            return _remote_error(exc)
        except ServeError as exc:  # Triton went away between the readiness check and the request
            backend.forget(req.model)
            return _error(503, str(exc), "service_unavailable", code="server_not_ready")
        except StopAsyncIteration:  # the client left before the first token
            return _error(499, "the client closed the request", "invalid_request_error")
        rid, created = new_id("chatcmpl" if chat else "cmpl"), now()
        if req.stream:
            events = _chat_events if chat else _completion_events
            return StreamingResponse(events(req, rid, created, first, chunks, fields), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(req, chat, rid, created, first, chunks, fields)

    return app


async def _all(first: Chunk, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    yield first
    async for chunk in chunks:
        yield chunk


async def _whole(req, chat: bool, rid: str, created: int, first: Chunk, chunks, fields) -> JSONResponse:
    text, ids, final = [], [], None
    try:
        async for chunk in _all(first, chunks):
            text.append(chunk.text)
            ids += chunk.token_ids
            final = chunk.final or final
    except RemoteError as exc:
        return _remote_error(exc)
    if final is None or final["finish_reason"] not in FINISH:
        return _error(500, f"the generation was aborted ({(final or {}).get('finish_reason')}); see the "
                      "server log", "internal_error")
    content = "".join(text)
    choice = ({"index": 0, "message": {"role": "assistant", "content": content}, "logprobs": None,
               "finish_reason": FINISH[final["finish_reason"]]} if chat else
              {"index": 0, "text": content, "logprobs": None, "finish_reason": FINISH[final["finish_reason"]]})
    if req.return_token_ids:
        choice["token_ids"] = ids
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": created, "model": req.model, "choices": [choice],
                         "usage": usage(final, len(ids)), **fields(final)})


async def _chat_events(req: ChatRequest, rid: str, created: int, first: Chunk, chunks, fields
                       ) -> AsyncIterator[str]:
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model}

    def event(delta: dict, finish: str | None = None, **extra) -> str:
        return _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}], **extra})

    def content(text: str, ids: list[int]) -> str:
        return _sse({**head, "choices": [{"index": 0, "delta": {"content": text}, "logprobs": None,
                                          "finish_reason": None, **({"token_ids": ids} if ids else {})}]})

    yield event({"role": "assistant", "content": ""})
    async for piece in _stream_body(req, head, first, chunks, content,
                                    lambda finish, final: event({}, finish, **fields(final, not req.include_usage)),
                                    fields):
        yield piece


async def _completion_events(req: CompletionRequest, rid: str, created: int, first: Chunk,
                             chunks, fields) -> AsyncIterator[str]:
    head = {"id": rid, "object": "text_completion", "created": created, "model": req.model}

    def event(text: str, finish: str | None = None, ids: list[int] | None = None, **extra) -> str:
        return _sse({**head, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                          **({"token_ids": ids} if ids else {})}], **extra})

    async for piece in _stream_body(req, head, first, chunks, lambda text, ids: event(text, None, ids),
                                    lambda finish, final: event("", finish, **fields(final, not req.include_usage)),
                                    fields):
        yield piece


async def _stream_body(req, head: dict, first: Chunk, chunks, text_event, finish_event, fields
                       ) -> AsyncIterator[str]:
    """Content events, the finish event with the statistics, the usage event, [DONE]. The
    generator's `finally` (also on a client disconnect) closes `chunks`, which cancels the request."""
    ids, final = 0, None
    try:
        async for chunk in _all(first, chunks):
            ids += len(chunk.token_ids)
            if chunk.text or (chunk.token_ids and req.return_token_ids):
                yield text_event(chunk.text, chunk.token_ids if req.return_token_ids else None)
            if chunk.final is not None:
                final = chunk.final
                if final["finish_reason"] not in FINISH:
                    yield _sse(error_body(f"the generation was aborted ({final['finish_reason']}); see the "
                                          "server log", "internal_error"))
                    break
                yield finish_event(FINISH[final["finish_reason"]], final)
        if final is not None and final["finish_reason"] in FINISH and req.include_usage:
            yield _sse({**head, "choices": [], "usage": usage(final, ids), **fields(final)})
    except RemoteError as exc:
        yield _sse(error_body(str(exc), "internal_error"))
    finally:
        await chunks.aclose()
    yield "data: [DONE]\n\n"
