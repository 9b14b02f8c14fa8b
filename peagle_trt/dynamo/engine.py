"""The peagle-trt engine behind Dynamo's worker runtime: one built repository, its in-flight
scheduler on a background thread, token streams in and out.

Dynamo's frontend tokenizes (with the target tokenizer and chat template registered here), routes
and detokenizes; this engine sees token ids only (`dynamo.common.backend.LLMEngine`):
  start()     load the repository's generator (any backend: torch, onnxruntime, TensorRT), start
              its stepping thread, return the registration (the target directory as the model
              path, KV block size and count, batch size)
  generate()  one request: its tokens as the scheduler reports them (one chunk per step), and a
              final chunk with finish_reason, usage and our per-request speculation metrics in
              vLLM's shape (`engine_data.metrics.speculative_decoding`)
  abort()     the frontend's cancellation (client gone, stop string seen): the request leaves
              the batch at the next step and frees its blocks
  cleanup()   drain: on SIGTERM Dynamo unregisters the worker, waits its grace period (5 s), then
              calls cleanup, which lets the requests still running finish (up to
              `WorkerOptions.drain_timeout_s`) before it stops the stepping thread
  kv_event_sources()  the paged cache's prefix events, published as Dynamo KV events (events.py)
Bad input (RequestError: a bad grammar, a limit) is raised as Dynamo's InvalidArgument before
the stream starts: the frontend answers a 400 with its reason (any other exception: a 500 without
it). A request that fails alone later ends with finish_reason "error: ..." (the others go on). A scheduler
that fails as a whole ends every request so, and the worker leaves at once: it signals itself
SIGTERM (Dynamo unregisters it: the router stops sending) and `peagle-trt dynamo worker` then
exits with code 2 and the reason; never registered-but-broken.
Tested by tests/dynamo/ (a real frontend and workers).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import AsyncGenerator
from typing import Any

from dynamo.common.backend.engine import EngineConfig, LLMEngine, LlmRegistration
from dynamo.common.backend.publisher import PushSource
from dynamo.llm.exceptions import InvalidArgument

from peagle_trt.config import SamplingParams, StructuredOutput
from peagle_trt.dynamo.events import KvEventRelay
from peagle_trt.dynamo.options import WorkerOptions
from peagle_trt.errors import ConfigError, RequestError, ServeError
from peagle_trt.runtime.scheduler import Request, RequestOutput
from peagle_trt.serve.generator import TextGenerator
from peagle_trt.serve.openai_frontend.app import spec_decode_metrics
from peagle_trt.serve.options import read_options, with_deterministic

log = logging.getLogger(__name__)
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


def sampling(request: dict, default_max_tokens: int) -> SamplingParams:
    """Dynamo's `sampling_options` / `stop_conditions` -> our SamplingParams (stop strings are the
    frontend's job: it detokenizes, and cancels the request when one appears; its
    `guided_decoding`, from response_format / structured outputs, is our StructuredOutput)."""
    so, sc = request.get("sampling_options") or {}, request.get("stop_conditions") or {}
    temperature = so.get("temperature")
    guided = {k: v for k, v in (so.get("guided_decoding") or {}).items() if v is not None}
    extra = sorted(set(guided) - {"json", "regex", "choice", "grammar"})
    if extra:
        raise RequestError(f"guided decoding {extra} is not supported by peagle-trt; send one of json, regex, "
                           "choice, grammar")
    return SamplingParams(max_tokens=sc.get("max_tokens") or default_max_tokens,
                          temperature=1.0 if temperature is None else float(temperature),
                          top_p=float(so.get("top_p") or 1.0), top_k=max(int(so.get("top_k") or 0), 0),
                          seed=so.get("seed"), ignore_eos=bool(sc.get("ignore_eos")),
                          # the frontend's hidden stop ids are the model's EOS ids: they end a request
                          # only when EOS counts
                          end_ids=() if sc.get("ignore_eos") else tuple(sc.get("stop_token_ids_hidden") or ()),
                          structured=StructuredOutput.from_dict(guided) if guided else None)


def _compiled(grammars, structured: StructuredOutput) -> None:
    """Wait for the grammar's compile (cached: the scheduler then finds it done); RequestError when
    it does not compile, or not within the limit."""
    from concurrent.futures import TimeoutError as CompileTimeout

    if grammars is None:
        raise RequestError("this worker has no grammar compiler; send the request without structured output")
    try:
        grammars.compile(structured).result(grammars.timeout_s)
    except CompileTimeout:
        raise RequestError(f"the grammar did not compile within {grammars.timeout_s:g} s (the server's "
                           "grammar_timeout_s); simplify it") from None


class PeagleEngine(LLMEngine):
    def __init__(self, options: WorkerOptions):
        self.options = options
        self.generator: TextGenerator | None = None
        self.relay: KvEventRelay | None = None
        self._uids: dict[str, int] = {}
        self.failure: str | None = None  # why the scheduler failed (the worker then leaves)

    @classmethod
    async def from_args(cls, argv=None):  # the worker is made by peagle_trt/dynamo/worker.py
        raise NotImplementedError("start a peagle-trt worker with `peagle-trt dynamo worker`")

    async def start(self, worker_id: int) -> EngineConfig:
        model_dir, options, paths = read_options(self.options.repo, self.options.model)
        options = with_deterministic(options, self.options.deterministic)
        generator = await asyncio.to_thread(TextGenerator.load, model_dir, options, paths)
        self.generator = generator
        blocks = generator.scheduler.blocks
        self.relay = KvEventRelay(blocks.kv.block_size)
        if self.options.kv_events:
            blocks.listeners.append(self.relay.push)
        generator.on_step = self._check_scheduler
        generator.start()
        log.info("peagle-trt worker %d ready: model %s (%s backend), %d KV blocks of %d positions", worker_id,
                 self.options.served_name, options.backend, blocks.num_blocks, blocks.kv.block_size)
        return EngineConfig(
            model=str(model_dir / "1" / paths.target), served_model_name=self.options.served_name,
            llm=LlmRegistration(context_length=options.max_seq_len, kv_cache_block_size=blocks.kv.block_size,
                                total_kv_blocks=blocks.num_blocks, max_num_seqs=generator.scheduler.max_batch,
                                max_num_batched_tokens=options.prefill_chunk * generator.scheduler.max_batch))

    def _check_scheduler(self) -> None:
        """After every step (the stepping thread): a failed scheduler takes the worker down."""
        gen = self.generator
        if gen is not None and gen.step_error is not None and self.failure is None:
            self.failure = f"the scheduler failed: {type(gen.step_error).__name__}: {gen.step_error}"
            log.error("%s; leaving (SIGTERM to this worker)", self.failure)
            os.kill(os.getpid(), signal.SIGTERM)

    async def kv_event_sources(self):
        return [PushSource(on_ready=self.relay.attach, dp_rank=0)] if self.options.kv_events else []

    async def generate(self, request: dict, context) -> AsyncGenerator[dict, None]:
        gen = self.generator
        if gen is None or gen.step_error is not None:
            raise ServeError(f"this peagle-trt worker cannot serve: its scheduler failed ({gen and gen.step_error})")
        prompt = list(request["token_ids"])
        try:
            uid, queue = await self._admit(gen, request, prompt, context)
        except RequestError as exc:  # the frontend answers Dynamo's InvalidArgument with a 400 and its text
            raise InvalidArgument(str(exc)) from None
        self._uids[context.id()] = uid
        sent, finished = 0, False
        try:
            while not finished:
                out: RequestOutput = await queue.get()
                sent, finished = sent + len(out.new_token_ids), out.finished
                chunk: dict[str, Any] = {"token_ids": out.new_token_ids, "index": 0}
                if finished:
                    chunk.update(self._final(out, len(prompt), sent))
                    if out.finish_reason == "abort":  # the frontend's cancellation reached the scheduler
                        log.info("request %s cancelled after %d tokens", context.id(), sent)
                yield chunk
        finally:
            self._uids.pop(context.id(), None)
            if not finished:  # the caller left (or the frontend stopped it): free its blocks now
                gen.cancel(uid)
                log.info("request %s cancelled after %d tokens", context.id(), sent)

    async def _admit(self, gen: TextGenerator, request: dict, prompt: list[int], context) -> tuple[int, asyncio.Queue]:
        """Queue one request: its uid and the queue its outputs arrive on; RequestError for bad input."""
        try:
            params = sampling(request, max(gen.options.max_seq_len - len(prompt), 1))
        except ConfigError as exc:  # a bad sampling value: the client's mistake, said as such
            raise RequestError(str(exc)) from exc
        if params.structured is not None:  # a bad grammar is refused before the stream starts
            await asyncio.to_thread(_compiled, gen.scheduler.grammars, params.structured)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def on_output(out: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, out)

        return gen.scheduler.add(Request(context.id(), prompt, params, on_output, context.is_stopped)), queue

    def _final(self, out: RequestOutput, prompt_tokens: int, completion_tokens: int) -> dict:
        reason = FINISH.get(out.finish_reason, "error")
        if out.finish_reason == "error":
            reason = f"error: {out.error}"
        final: dict[str, Any] = {"finish_reason": reason, "completion_usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}}
        if out.stats is not None:
            final["engine_data"] = {"metrics": spec_decode_metrics(out.stats.to_dict())}
        return final

    async def abort(self, context) -> None:
        uid = self._uids.get(context.id())
        if uid is not None and self.generator is not None:
            self.generator.cancel(uid)

    async def cleanup(self) -> None:
        deadline = time.monotonic() + self.options.drain_timeout_s
        if self._uids:
            log.info("drain: waiting for %d running request(s)", len(self._uids))
        while self._uids and self.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # unregistered: no new request arrives; running ones finish
        if self._uids:
            log.warning("drain: %d request(s) still running after %.0f s; stopping them", len(self._uids),
                        self.options.drain_timeout_s)
        if self.generator is not None:
            self.generator.stop()
            self.generator = None
        if self.relay is not None:
            self.relay.close()
            self.relay = None
