"""In-flight batched speculate-verify: many requests stepped together, joining and leaving
between steps.

One `step()`:
  1. drop cancelled requests (waiting or running), freeing their KV blocks;
  2. admit waiting requests in order (FIFO; a preempted request first) while the batch has room
     and the head of the queue fits: its cached prefix is reused, and free blocks must hold the
     rest of its prompt plus one step's lookahead (peagle_trt/runtime/blocks.py). A request with structured
     output waits, out of the queue's order, until its grammar has compiled on the grammar thread
     (peagle_trt/speculative/grammar.py `Grammars`; the others run meanwhile), and is refused with the
     library's reason when it does not compile, or not within the limit;
  3. reserve, oldest request first, the blocks this step writes; when the pool runs dry the
     NEWEST running request is preempted: its blocks go back, it returns to the head of the
     queue and later recomputes its KV from its tokens (prefix reuse usually finds most of it);
     its output so far is kept and nothing it sent changes. Never truncated, never wrong;
  4. prefill: the next chunk (`prefill_chunk` tokens) of every request still in prefill, in one
     target forward (and one drafter forward);
  5. decode: ONE speculate-verify step for every decoding request (one target forward with K+1
     rows per request, one drafter forward in peagle mode);
  6. full blocks whose KV became final enter the prefix cache; new tokens are reported through
     each request's `on_output`; finished requests give their blocks back.
Capacity: requests hold the blocks their tokens need, not `max_seq_len` each; a request that can
never fit (prompt + max_tokens > max_seq_len) is refused at `add`.

Isolation: one request never hurts another. Requests are known by a `uid` the scheduler assigns
at `add` (the client's `request_id` is only echoed and logged, two clients may send the same one),
and `cancel(uid)` reaches that request alone. An exception while stepping a batch (a forward, a
verify, a sampler) restores the batch's sequences to their state before the step and retries them
one at a time: the request(s) that fail alone end with finish_reason "error" and the message, the
others go on with exactly the tokens they would have had (KV is written by absolute position, so
re-running a step rewrites the same entries). The same holds for admission and client callbacks.
Tested by tests/runtime/test_scheduler.py and tests/faults/test_requests.py.

`add` and `cancel` are thread-safe; `step` runs on one thread (the server's loop).
`generate(decoder, prompt, params)` runs one request through a scheduler on the calling thread:
tests and benchmarks use it, so they exercise the code that serves.
"""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from peagle_trt.config import SamplingParams
from peagle_trt.errors import ConfigError, RequestError, RuntimeInvariantError
from peagle_trt.runtime.blocks import BlockManager
from peagle_trt.speculative.decoder import Sequence, SpecDecoder
from peagle_trt.speculative.grammar import Grammars
from peagle_trt.speculative.stats import SpecStats

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str  # the client's id, echoed
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stats: SpecStats | None = None  # on the final output
    uid: int = -1  # the scheduler's id of the request
    error: str | None = None  # with finish_reason "error": what went wrong


@dataclass(eq=False)
class Request:
    request_id: str  # chosen by the client: echoed and logged, never used to find the request
    prompt: list[int]
    params: SamplingParams
    # called on the scheduler thread with each step's new tokens; returns True to end the request
    # (e.g. a stop string appeared in the text)
    on_output: Callable[[RequestOutput], bool | None]
    is_cancelled: Callable[[], bool] | None = None
    arrival: float = field(default_factory=time.monotonic)
    seq: Sequence | None = None
    sent: int = 0  # output tokens already reported
    uid: int = -1  # assigned by Scheduler.add, unique per scheduler
    grammar: Future | None = None  # structured output: the compiled grammar, when done (Scheduler.add)


_STAT_COUNTERS = ("steps", "drafted", "target_forwards", "drafter_forwards", "tokens")


def _save(seq: Sequence) -> tuple:
    """What a step may change in a sequence, to undo a failed batch step. Runs before every step
    (the hot path): plain values and one small dict copy, no object rebuilt."""
    st = seq.stats
    counters = (st.steps, st.drafted, st.target_forwards, st.drafter_forwards, st.tokens, dict(st.histogram),
                list(st.tries))
    rng = seq.generator.get_state() if seq.generator is not None else None
    return (len(seq.output), (seq.drafts, seq.parents), seq.undrafted, counters, seq.finish_reason, seq.num_computed,
            seq.cur, rng)


def _restore(seq: Sequence, saved: tuple) -> None:
    n, (seq.drafts, seq.parents), seq.undrafted, counters, seq.finish_reason, seq.num_computed, seq.cur, rng = saved
    del seq.output[n:]
    if seq.grammar is not None:
        seq.grammar.sync(seq.output)
    for name, value in zip(_STAT_COUNTERS, counters):
        setattr(seq.stats, name, value)
    seq.stats.histogram, seq.stats.tries = counters[5], counters[6]
    del seq.stats.per_step_drafted[seq.stats.steps:], seq.stats.per_step_accepted[seq.stats.steps:]
    if rng is not None:
        seq.generator.set_state(rng)


class Scheduler:
    def __init__(self, decoder: SpecDecoder, max_batch: int | None = None, prefill_chunk: int = 256,
                 max_queue: int = 1024, prefix_caching: bool = True, grammars: Grammars | None = None):
        self.decoder, self.grammars = decoder, grammars  # grammars: structured output (None: refused)
        kv = decoder.ex.kv
        self.max_batch = max_batch or kv.max_batch
        if self.max_batch > kv.max_batch:
            raise ConfigError(f"max_batch {self.max_batch} exceeds the {kv.max_batch} requests the KV cache was "
                              "laid out for (windowed layers hold blocks per request); rebuild with a larger batch")
        self.prefill_chunk, self.max_queue = prefill_chunk, max_queue
        k = decoder.num_spec_tokens
        if len(decoder.ex.windows) > 1 and max(prefill_chunk, k + 1) > kv.max_rows:
            raise ConfigError(f"prefill chunk {prefill_chunk} / K + 1 = {k + 1} exceed the {kv.max_rows} rows per "
                              "forward the windowed layers' KV blocks were sized for; rebuild with this chunk")
        # a step writes verify rows cur .. cur + max_draft_rows (K, or a draft tree's most nodes), then
        # the drafter's K - 1 mask rows past the accepted ones (depth <= K)
        self.blocks = BlockManager(kv, decoder.ex.windows, decoder.max_draft_rows + k if k else 1, drafter=bool(k),
                                   prefix_caching=prefix_caching)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._cancelled: set[int] = set()
        self._uids = itertools.count()
        self._lock = threading.Lock()
        self.wakeup = threading.Condition(self._lock)
        self.stats = SpecStats(decoder.num_spec_tokens, keep_steps=False)  # all finished requests
        self.finished_requests = 0
        self.generated_tokens = 0

    # -- called from any thread ----------------------------------------------------------------
    def add(self, request: Request) -> int:
        """Queue a request and return its uid (for `cancel`); raises RequestError (nothing
        queued) when it can never run."""
        limit = self.decoder.max_seq_len
        if not request.prompt:
            raise RequestError("the prompt is empty; send at least one token")
        if len(request.prompt) + request.params.max_tokens > limit:
            raise RequestError(f"prompt ({len(request.prompt)} tokens) + max_tokens "
                              f"({request.params.max_tokens}) exceeds the maximum sequence length "
                              f"{limit}; shorten the prompt, lower max_tokens or raise the maximum "
                              "(--max-seq-len of generate or build)")
        structured = request.params.structured
        if structured is not None:
            if self.grammars is None:
                raise RequestError("this server has no grammar compiler (structured output needs the model's "
                                   "tokenizer); send the request without structured output")
            request.grammar = self.grammars.compile(structured)  # RequestError: over the size limit
            request.grammar.add_done_callback(self._wake)
        with self._lock:
            if len(self.waiting) >= self.max_queue:
                raise RequestError(f"the request queue is full ({self.max_queue}); retry later")
            request.uid = next(self._uids)
            self.waiting.append(request)
            self.wakeup.notify()
        return request.uid

    def _wake(self, _=None) -> None:
        with self._lock:
            self.wakeup.notify()

    def cancel(self, uid: int) -> None:
        """Cancel the request `add` returned `uid` for (and no other)."""
        with self._lock:
            self._cancelled.add(uid)
            self.wakeup.notify()

    def fail_all(self, exc: BaseException) -> None:
        """Last resort of a server loop whose `step` itself broke (a scheduler bug): every
        request ends with an error rather than hanging."""
        with self._lock:
            queued, self.waiting = list(self.waiting), collections.deque()
        for r in queued + list(self.running):
            self._finish(r, "error", error=_describe(exc))

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def metrics(self) -> dict:
        """KV capacity and prefix reuse (peagle_trt/runtime/blocks.py), plus the queue."""
        return {**self.blocks.metrics(), "requests_running": len(self.running), "requests_waiting": len(self.waiting)}

    # -- the scheduler thread ------------------------------------------------------------------
    def step(self) -> None:
        self._drop_cancelled()
        self._admit()
        if not self.running:  # nothing to step: the waiting requests' grammars are compiling
            with self.wakeup:
                if self.waiting:
                    self.wakeup.wait(0.005)  # woken when a compile ends
            return
        self._reserve()
        self.decoder.batch = len(self.running)  # the K schedule's batch size
        prefilling, decoding = [], []
        for r in self.running:  # split before prefilling: a prompt finishing now decodes next step
            (decoding if r.seq.prefilled else prefilling).append(r.seq)
        if prefilling:
            self._isolated(lambda seqs: self.decoder.prefill(seqs, self.prefill_chunk), prefilling)
        if decoding:
            self._isolated(self.decoder.step, decoding)
        for r in self.running:
            self.blocks.commit(r.seq)
        self._report()

    def _reserve(self) -> None:
        """Blocks for what this step writes, oldest request first; preempt the newest when short."""
        k = self.decoder.num_spec_tokens
        for r in sorted(self.running, key=_uid):
            seq = r.seq
            if r not in self.running:
                continue  # preempted for an older one
            if seq.prefilled:  # verify rows cur .. cur + max_draft_rows, then the drafter's mask rows
                low, rows, upto = seq.cur, seq.cur + self.decoder.max_draft_rows + 1, seq.cur + self.blocks.lookahead
            else:  # this chunk, then (last chunk) K - 1 mask rows
                low = seq.num_computed
                rows = min(low + self.prefill_chunk, seq.prefill_len)
                upto = rows + k
            while not self.blocks.reserve(seq, low, rows, upto):
                victim = max(self.running, key=lambda x: x.uid)
                self._preempt(victim)
                if victim is r:
                    break

    def _preempt(self, r: Request) -> None:
        log.info("KV cache full: preempting request %s (uid %d, %d tokens); it resumes when blocks free up",
                 r.request_id, r.uid, len(r.seq.prompt) + len(r.seq.output))
        self.running.remove(r)
        self.blocks.release(r.seq)
        r.seq.preempt()
        self.blocks.stats.preemptions += 1
        with self._lock:
            self.waiting.appendleft(r)

    def _isolated(self, run: Callable[[list[Sequence]], None], seqs: list[Sequence]) -> None:
        """run(seqs); if it raises, undo it and run each sequence alone: those that still fail
        end with an error, the others continue as if nothing happened."""
        saved = [_save(s) for s in seqs]
        try:
            run(seqs)
            return
        except Exception as exc:
            batch_error = exc
        for s, state in zip(seqs, saved):
            _restore(s, state)
        if len(seqs) > 1:
            log.warning("a step of %d requests failed (%s); retrying them one by one", len(seqs),
                        _describe(batch_error))
        owner = {id(r.seq): r for r in self.running}
        for s, state in zip(seqs, saved):
            try:
                if len(seqs) == 1:
                    raise batch_error
                run([s])
            except Exception as exc:
                _restore(s, state)
                r = owner[id(s)]
                log.error("request %s (uid %d) failed and ends: %s", r.request_id, r.uid, _describe(exc),
                          exc_info=exc)
                self._finish(r, "error", error=_describe(exc))

    def _admit(self) -> None:
        while len(self.running) < self.max_batch:
            request = self._next_waiting()
            if request is None:
                return
            try:
                if request.seq is None:  # its grammar (if any) has compiled: result() does not wait
                    compiled = request.grammar.result() if request.grammar is not None else None
                    request.seq = self.decoder.new_sequence(request.prompt, request.params, compiled)
                admitted = self.blocks.admit(request.seq)
            except Exception as exc:  # only this request cannot start
                with self._lock:
                    self.waiting.remove(request)
                self._finish(request, "error", error=_describe(exc))
                continue
            if not admitted:
                return  # the head of the queue waits for blocks (FIFO: no overtaking)
            with self._lock:
                self.waiting.remove(request)
            self.running.append(request)

    def _next_waiting(self) -> Request | None:
        """The first waiting request that can start: its grammar compiled (or none). One whose
        grammar is still compiling past the limit is refused (its compile goes on, cached)."""
        with self._lock:
            queued = list(self.waiting)
        for r in queued:
            if r.grammar is None or r.grammar.done() or r.seq is not None:
                return r
            limit = self.grammars.timeout_s
            if time.monotonic() - r.arrival > limit:
                with self._lock:
                    self.waiting.remove(r)
                self._finish(r, "error", error=f"RequestError: the grammar did not compile within {limit:g} s "
                                               "(the server's grammar_timeout_s); simplify it")
        return None

    def _drop_cancelled(self) -> None:
        with self._lock:
            for r in itertools.chain(self.waiting, self.running):
                if _asks_to_cancel(r):
                    self._cancelled.add(r.uid)
            gone = self._cancelled
            self._cancelled = set()
            queued = [r for r in self.waiting if r.uid in gone]
            self.waiting = collections.deque(r for r in self.waiting if r.uid not in gone)
        for r in queued:
            self._finish(r, "abort")
        for r in [r for r in self.running if r.uid in gone]:
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
                if self._emit(r, RequestOutput(r.request_id, new, uid=r.uid)):
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
                already_sent: bool = False, error: str | None = None) -> None:
        if r in self.running:
            self.running.remove(r)
        if r.seq is not None and r.seq.blocks:
            self.blocks.release(r.seq)
        stats = r.seq.stats if r.seq is not None else SpecStats(self.decoder.num_spec_tokens)
        self.stats.merge(stats)
        self.finished_requests += 1
        self.generated_tokens += len(r.seq.output) if r.seq is not None else 0
        final = RequestOutput(r.request_id, [] if already_sent else list(new or []), True, reason, stats,
                              r.uid, error)
        self._emit(r, final)

    def run_until_idle(self) -> None:
        while self.has_work:
            self.step()


_uid = operator.attrgetter("uid")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _asks_to_cancel(r: Request) -> bool:
    try:
        return bool(r.is_cancelled and r.is_cancelled())
    except Exception:  # a broken client handle: that client is gone
        log.exception("cancellation check of request %s failed; cancelling it", r.request_id)
        return True


def generate(decoder: SpecDecoder, prompt: list[int], params: SamplingParams,
             on_tokens: Callable[[list[int]], bool | None] | None = None, prefill_chunk: int = 256,
             grammars: Grammars | None = None) -> Sequence:
    """One request through the in-flight scheduler, stepped to completion on the calling thread.
    `on_tokens` gets each step's new ids and returns True to end the request there (a stop
    string was seen). Raises RequestError when the request can never fit (nothing runs) and
    RuntimeInvariantError when stepping it failed."""
    errors: list[str] = []

    def on_output(out: RequestOutput) -> bool:
        if out.error:
            errors.append(out.error)
        return bool(on_tokens(out.new_token_ids)) if on_tokens and out.new_token_ids else False

    request = Request("local", list(prompt), params, on_output)
    scheduler = Scheduler(decoder, max_batch=1, prefill_chunk=prefill_chunk, grammars=grammars)
    scheduler.add(request)
    scheduler.run_until_idle()
    if errors:
        raise RuntimeInvariantError(f"generation failed: {errors[0]}")
    return request.seq
