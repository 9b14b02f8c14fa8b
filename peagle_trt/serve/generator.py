"""The text generator: tokenizer + executor + in-flight scheduler, with text streaming and stop
strings per request. Every generate path runs it, so they all run the code that serves:

    Triton model (`triton_model.py`)     TextGenerator.load(REPO/peagle, options, paths) + start()
                                         (background thread)
    peagle-trt generate --repo REPO     TextGenerator.load(*read_options(REPO)).generate(...)
                                         (calling thread)
    peagle-trt generate --target DIR    TextGenerator.from_checkpoints(...).generate(...)

`from_checkpoints` describes the checkpoints with the same typed settings a built repository's
config.pbtxt carries (`RepositoryOptions` + `ArtifactPaths` of peagle_trt/serve/options.py,
torch backend), so both constructors are one (`from_options`).
Requests are refused before any tokenization when their prompt or stop strings exceed the byte
limits (`InputLimits`); structured output (`SamplingParams.structured`) compiles on the grammar
thread of the scheduler's `Grammars` (the model's tokenizer and vocabulary, the repository's
max_grammar_bytes / grammar_timeout_s); text work per streamed piece is bounded (`TextStream`). `submit` returns
the scheduler's uid of the request: the only handle `cancel` accepts (client ids may collide).
A request whose step fails gets a final event with finish_reason "error"; the others continue.
`serve --seed N` gives requests without a seed one derived from N and their arrival order
(`seeded`). Tested by tests/serve/ (through tritonserver), tests/e2e/test_cli.py (in-process) and
tests/faults/test_requests.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.checkpoint.target import load_target_config
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import BuildError, ConfigError, RequestError, RuntimeInvariantError
from peagle_trt.executors.torch import TorchExecutor
from peagle_trt.manifest import verify_manifest
from peagle_trt.runtime.scheduler import Request, RequestOutput, Scheduler
from peagle_trt.serve.options import ArtifactPaths, RepositoryOptions, serve_seed, with_deterministic
from peagle_trt.serve.protocol import InputLimits, generate_result
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.speculative.grammar import Grammars
from peagle_trt.tokenizer import TextCodec

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Event:
    """What a client receives: the NEW text and ids since the previous event."""
    request_id: str  # the client's id, echoed
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stats: dict | None = None  # on the final event
    uid: int = -1  # the generator's id of the request (`TextGenerator.cancel`)
    error: str | None = None  # with finish_reason "error"


def make_executor(options: RepositoryOptions, paths: ArtifactPaths, version: Path):
    """The executor the options' backend asks for, its KV cache laid out by `options.kv_layout`;
    paths are relative to `version` (or absolute)."""
    spec, kv = options.speculation, options.kv_layout
    if options.backend == "torch":
        if options.kernels == "cuda":  # before any weight is read
            from peagle_trt.ops import kernels as cuda_kernels

            cuda_kernels.require(torch.device(options.device))
        pair = load_pair(version / paths.target, version / paths.drafter if paths.drafter else None, spec)
        target, drafter_model = pair.build(options.device, DTYPES[options.dtype])
        return TorchExecutor(target, drafter_model, kv, kernels=options.kernels, deterministic=options.deterministic,
                             cuda_graphs=None if options.cuda_graphs else False)  # None: on where CUDA allows
    if options.backend == "onnxruntime" and not paths.onnx:  # in-process from checkpoints, graphs in memory
        from peagle_trt.executors.onnxruntime import OrtExecutor

        pair = load_pair(version / paths.target, version / paths.drafter if paths.drafter else None, spec)
        target, drafter_model = pair.build("cpu", torch.float32)
        return OrtExecutor.from_models(target, drafter_model, spec, kv, options.threads,
                                       deterministic=options.deterministic)
    if options.backend == "onnxruntime":
        from peagle_trt.executors.onnxruntime import OrtExecutor

        # verify=False: the repo manifest covers it
        executor = OrtExecutor(version / paths.onnx, verify=False, deterministic=options.deterministic)
        if executor.kv != kv:
            raise ConfigError(f"{version}: the ONNX export was made for the KV layout {executor.kv}, config.pbtxt "
                              f"asks {kv}; rebuild")
        return executor
    import numpy as np

    from peagle_trt.executors.tensorrt import TensorRTExecutor

    d2t_path = version / paths.onnx / "d2t.npy"
    d2t = torch.from_numpy(np.load(d2t_path, allow_pickle=False)) if d2t_path.is_file() else None
    return TensorRTExecutor(version / paths.engine, arch=options.gpu_arch or None, d2t=d2t, verify=False,
                            deterministic=options.deterministic)


class TextGenerator:
    def __init__(self, codec: TextCodec, scheduler: Scheduler, options: RepositoryOptions):
        self.codec, self.scheduler, self.options = codec, scheduler, options
        self.limits = InputLimits.resolve(options.max_seq_len, options.max_prompt_bytes,
                                          options.max_stop_bytes)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # `serve --seed N` (vLLM's flag): requests without a seed get one from N and their arrival
        # order, so a run's sampled outputs repeat when the same requests arrive in the same order
        self.default_seed: int | None = None
        self._arrivals = itertools.count()
        self.on_step: Callable[[], None] | None = None  # e.g. metrics refresh (throttled by the callee)
        self.step_error: Exception | None = None

    @classmethod
    def load(cls, model_dir: str | Path, options: RepositoryOptions, paths: ArtifactPaths,
             verify: bool = True) -> TextGenerator:
        """Build from a rendered model directory (`REPO/peagle`) and its config.pbtxt settings."""
        model_dir = Path(model_dir)
        if verify:
            verify_manifest(model_dir)
        return cls.from_options(model_dir / "1", options, paths)

    @classmethod
    def from_checkpoints(cls, target_dir: str | Path, drafter_dir: str | Path | None, spec: SpecConfig,
                         device: str = "cpu", dtype: str = "float32", max_seq_len: int = 4096,
                         max_batch: int = 1, prefill_chunk: int = 256, backend: str = "torch",
                         threads: int | None = None, deterministic: bool = False,
                         kv_cache_dtype: str = "auto") -> TextGenerator:
        """Serve checkpoint directories in-process (`generate --target`): `backend` "torch", or
        "onnxruntime" (float32 CPU: the graphs `export` writes, made in memory;
        peagle_trt/executors/onnxruntime.py; `threads`: its intra-op threads, None = onnxruntime's default);
        `deterministic`: row- and batch-invariant forwards (peagle_trt/serve/options.py); `kv_cache_dtype`:
        auto (the model's dtype) or fp8 (E4M3 KV caches)."""
        try:
            options = RepositoryOptions(spec, backend=backend, max_batch=max_batch, max_seq_len=max_seq_len,
                                        prefill_chunk=prefill_chunk, device=device, dtype=dtype,
                                        threads=threads, deterministic=deterministic, kv_cache_dtype=kv_cache_dtype)
        except BuildError as exc:
            raise ConfigError(str(exc)) from exc
        paths = ArtifactPaths(str(Path(target_dir).absolute()),
                              str(Path(drafter_dir).absolute()) if drafter_dir else "")
        return cls.from_options(Path("."), options, paths)

    @classmethod
    def from_options(cls, version: Path, options: RepositoryOptions, paths: ArtifactPaths) -> TextGenerator:
        """The one constructor: model paths are relative to `version` (or absolute); VLLM_BATCH_INVARIANT=1
        in the environment turns deterministic mode on (peagle_trt/serve/options.py, `with_deterministic`)."""
        options = with_deterministic(options)
        spec = options.speculation
        executor = make_executor(options, paths, version)
        target_dir = version / paths.target
        codec = TextCodec(target_dir)
        config = load_target_config(target_dir)
        eos = tuple(sorted(set(codec.eos_ids) | set(config.eos_token_ids)))
        decoder = SpecDecoder(executor, spec, eos)
        grammars = Grammars(codec.tok, config.vocab_size, options.max_grammar_bytes, options.grammar_timeout_s)
        scheduler = Scheduler(decoder, options.max_batch, options.prefill_chunk, prefix_caching=options.prefix_caching,
                              grammars=grammars)
        generator = cls(codec, scheduler, options)
        generator.default_seed = serve_seed()
        return generator

    def seeded(self, params: SamplingParams) -> SamplingParams:
        """`params` with a seed derived from `default_seed` and the arrival count when it has none."""
        if params.seed is not None or self.default_seed is None:
            return params
        digest = hashlib.blake2b(f"{self.default_seed}:{next(self._arrivals)}".encode(), digest_size=8).digest()
        return dataclasses.replace(params, seed=int.from_bytes(digest, "little") >> 1)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str, params: SamplingParams, on_event: Callable[[Event], None],
               is_cancelled: Callable[[], bool] | None = None, chat_template: bool = False,
               echo_prompt: bool = False) -> int:
        """Queue a request and return its uid (for `cancel`); raises RequestError for bad input
        (nothing queued). `request_id` is the client's, only echoed in events and logs."""
        if not prompt:
            raise RequestError("text_input is empty; send a non-empty prompt")
        self.limits.check_prompt(prompt)  # before any tokenization
        self.limits.check_stop(params.stop)
        params = self.seeded(params)
        ids = self.codec.encode_prompt(prompt, chat_template)
        stream = self.codec.stream(params.stop)
        prefix = [prompt if echo_prompt else "", ids if echo_prompt else []]

        def on_output(out: RequestOutput) -> bool:
            text = stream.push(out.new_token_ids)
            if out.finished and out.error is None:
                text += stream.finish()
            head_text, head_ids = prefix
            prefix[:] = ["", []]
            stats = dict(out.stats.to_dict(), prompt_tokens=len(ids), spec_mode=self.options.speculation.mode) \
                if out.finished else None
            on_event(Event(request_id, head_text + text, head_ids + out.new_token_ids, out.finished,
                           out.finish_reason, stats, out.uid, out.error))
            return stream.stopped

        return self.scheduler.add(Request(request_id, ids, params, on_output, is_cancelled))

    def cancel(self, uid: int) -> None:
        """Cancel the request `submit` returned `uid` for, and no other."""
        self.scheduler.cancel(uid)

    # -- the stepping thread ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="peagle-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self.scheduler.wakeup:
            self.scheduler.wakeup.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        sched = self.scheduler
        while not self._stop.is_set():
            with sched.wakeup:
                if not sched.has_work:
                    sched.wakeup.wait(0.05)  # also wakes up to poll client cancellations
            if sched.has_work:
                try:
                    sched.step()
                except Exception as exc:  # a scheduler bug (request failures are isolated inside)
                    log.exception("scheduler step failed; ending every request with an error")
                    self.step_error = exc
                    sched.fail_all(exc)
            if self.on_step is not None:  # after steps and while idle (metrics stay fresh)
                self.on_step()

    def generate(self, prompt: str, params: SamplingParams, on_event: Callable[[Event], None] | None = None,
                 chat_template: bool = True) -> dict:
        """Serve one request on the calling thread (no background thread running); returns its
        result in the JSON shape of `generate_result` (timings are the caller's)."""
        events: list[Event] = []

        def relay(event: Event) -> None:
            events.append(event)
            if on_event is not None:
                on_event(event)

        self.submit(f"local-{time.monotonic_ns()}", prompt, params, relay, chat_template=chat_template)
        while not (events and events[-1].finished):
            self.scheduler.step()
        final = events[-1]
        if final.error is not None:
            raise RuntimeInvariantError(f"generation failed: {final.error}")
        return generate_result("".join(e.text for e in events), [t for e in events for t in e.token_ids],
                               final.finish_reason, final.stats or {})
