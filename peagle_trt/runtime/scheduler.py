"""In-flight batched speculate-verify: many requests stepped together, joining and leaving
between steps.

One `step()`:
  1. drop cancelled requests (waiting or running), freeing their KV slots;
  2. admit waiting requests while a KV slot is free and the batch has room (FIFO);
  3. prefill: the next chunk (`prefill_chunk` tokens) of every request still in prefill, in one
     target forward (and one drafter forward);
  4. decode: ONE speculate-verify step for every decoding request (one target forward with K+1
     rows per request, one drafter forward in peagle mode);
  5. report new tokens through each request's `on_output`; finished requests free their slot.
Capacity: each running request holds one KV slot of `max_seq_len` positions; a request that
cannot fit (prompt + max_tokens > max_seq_len) is refused at `add`, never truncated; when every
slot is taken new requests wait in the queue.

`add` and `cancel` are thread-safe; `step` runs on one thread (the server's loop).
`generate(decoder, prompt, params)` runs one request through a scheduler on the calling thread:
tests and benchmarks use it, so they exercise the code that serves.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from peagle_trt.config import SamplingParams
from peagle_trt.errors import ConfigError
from peagle_trt.speculative.decoder import Sequence, SpecDecoder
from peagle_trt.speculative.stats import SpecStats

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stats: SpecStats | None = None  # on the final output


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    # called on the scheduler thread with each step's new tokens; returns True to end the request
    # (e.g. a stop string appeared in the text)
    on_output: Callable[[RequestOutput], bool | None]
    is_cancelled: Callable[[], bool] | None = None
    arrival: float = field(default_factory=time.monotonic)
    seq: Sequence | None = None
    sent: int = 0  # output tokens already reported


class Scheduler:
    def __init__(self, decoder: SpecDecoder, max_batch: int | None = None, prefill_chunk: int = 256,
                 max_queue: int = 1024):
        self.decoder = decoder
        self.max_batch = max_batch or decoder.ex.num_slots
        self.prefill_chunk, self.max_queue = prefill_chunk, max_queue
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self.wakeup = threading.Condition(self._lock)
        self.stats = SpecStats(decoder.k)  # all finished requests
        self.finished_requests = 0
        self.generated_tokens = 0

    # -- called from any thread ----------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request; raises ConfigError (nothing queued) when it can never run."""
        limit = self.decoder.max_seq_len
        if not request.prompt:
            raise ConfigError("the prompt is empty; send at least one token")
        if len(request.prompt) + request.params.max_tokens > limit:
            raise ConfigError(f"prompt ({len(request.prompt)} tokens) + max_tokens "
                              f"({request.params.max_tokens}) exceeds the maximum sequence length "
                              f"{limit}; shorten the prompt or lower max_tokens")
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise ConfigError(f"the request queue is full ({self.max_queue}); retry later")
            self.waiting.append(request)
            self.wakeup.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
            self.wakeup.notify()

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def kv_slots_used(self) -> int:
        return len(self.running)

    # -- the scheduler thread ------------------------------------------------------------------
    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        prefilling, decoding = [], []
        for r in self.running:  # split before prefilling: a prompt finishing now decodes next step
            (decoding if r.seq.num_computed == len(r.seq.prompt) else prefilling).append(r.seq)
        if prefilling:
            self.decoder.prefill(prefilling, self.prefill_chunk)
        if decoding:
            self.decoder.step(decoding)
        self._report()

    def _admit(self) -> None:
        ex = self.decoder.ex
        while self.waiting and len(self.running) < self.max_batch and ex.free_slots:
            with self._lock:
                request = self.waiting.popleft()
            request.seq = self.decoder.new_sequence(request.prompt, request.params, ex.alloc_slot())
            self.running.append(request)

    def _drop_cancelled(self) -> None:
        with self._lock:
            for r in self.waiting:
                if r.is_cancelled and r.is_cancelled():
                    self._cancelled.add(r.request_id)
            for r in self.running:
                if r.is_cancelled and r.is_cancelled():
                    self._cancelled.add(r.request_id)
            gone = self._cancelled
            self._cancelled = set()
            queued = [r for r in self.waiting if r.request_id in gone]
            self.waiting = collections.deque(r for r in self.waiting if r.request_id not in gone)
        for r in queued:
            self._finish(r, "abort")
        for r in [r for r in self.running if r.request_id in gone]:
            r.seq.finish_reason = "abort"
            self._finish(r, "abort")

    def _report(self) -> None:
        for r in list(self.running):
            seq = r.seq
            if len(seq.output) == r.sent and seq.finish_reason is None:
                continue
            new = seq.output[r.sent:]
            r.sent = len(seq.output)
            if new and seq.finish_reason is None:
                if self._emit(r, RequestOutput(r.request_id, new)):
                    seq.finish_reason = "stop"
                    self._finish(r, "stop", already_sent=True)
                continue
            if seq.finished:
                self._finish(r, seq.finish_reason, new)

    def _emit(self, r: Request, out: RequestOutput) -> bool:
        try:
            return bool(r.on_output(out))
        except Exception:  # a broken client callback must not stop the other requests
            log.exception("output callback of request %s failed; cancelling it", r.request_id)
            return True

    def _finish(self, r: Request, reason: str, new: list[int] | None = None,
                already_sent: bool = False) -> None:
        if r in self.running:
            self.running.remove(r)
            self.decoder.ex.free_slot(r.seq.slot)
        stats = r.seq.stats if r.seq is not None else SpecStats(self.decoder.k)
        self.stats.merge(stats)
        self.finished_requests += 1
        self.generated_tokens += len(r.seq.output) if r.seq is not None else 0
        final = RequestOutput(r.request_id, [] if already_sent else list(new or []), True, reason, stats)
        self._emit(r, final)

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()


def generate(decoder: SpecDecoder, prompt: list[int], params: SamplingParams,
             on_tokens: Callable[[list[int]], bool | None] | None = None, prefill_chunk: int = 256) -> Sequence:
    """One request through the in-flight scheduler, stepped to completion on the calling thread.
    `on_tokens` gets each step's new ids and returns True to end the request there (a stop
    string was seen). Raises ConfigError when the request can never fit (nothing runs)."""
    def on_output(out: RequestOutput) -> bool:
        return bool(on_tokens(out.new_token_ids)) if on_tokens and out.new_token_ids else False

    request = Request("local", list(prompt), params, on_output)
    scheduler = Scheduler(decoder, max_batch=1, prefill_chunk=prefill_chunk)
    scheduler.add(request)
    scheduler.run_until_idle()
    return request.seq
