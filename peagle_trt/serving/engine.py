"""The serving engine: tokenizer + executor + in-flight scheduler, with text streaming and stop
strings per request. Every generate path runs it, so they all run the code that serves:

    Triton model (`triton_model.py`)     ServingEngine.load(REPO/peagle, params) + start() (background thread)
    peagle-trt generate --repo REPO     ServingEngine.load(...).generate(...)   (calling thread)
    peagle-trt generate --target DIR    ServingEngine.from_checkpoints(...).generate(...)

`from_checkpoints` describes the checkpoints with the same parameters a built repository's
config.pbtxt carries (torch backend), so both constructors are one (`from_params`).
Requests are refused before any tokenization when their prompt or stop strings exceed the byte
limits (`InputLimits`); text work per streamed piece is bounded (`TextStream`). `submit` returns
the scheduler's uid of the request: the only handle `cancel` accepts (client ids may collide).
A request whose step fails gets a final event with finish_reason "error"; the others continue.
Tested by tests/serving/ (through tritonserver), tests/e2e/test_cli.py (in-process) and
tests/faults/test_requests.py.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.checkpoint.target import load_target_config
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError, RuntimeInvariantError
from peagle_trt.manifest import verify_manifest
from peagle_trt.runtime.executor import TorchExecutor
from peagle_trt.runtime.scheduler import Request, RequestOutput, Scheduler
from peagle_trt.serving.protocol import InputLimits, generate_result
from peagle_trt.speculative.decoder import SpecDecoder
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
    uid: int = -1  # the engine's id of the request (`ServingEngine.cancel`)
    error: str | None = None  # with finish_reason "error"


def make_executor(params: dict, version: Path, spec: SpecConfig, num_slots: int, max_len: int):
    """The executor a model directory's `backend` parameter asks for."""
    backend = params.get("backend", "torch")
    if backend == "torch":
        drafter = version / params["drafter_path"] if params.get("drafter_path") else None
        pair = load_pair(version / params["target_path"], drafter, spec)
        target, drafter_model = pair.build(params.get("device", "cpu"), DTYPES[params.get("dtype", "float32")])
        max_rows = max(int(params.get("prefill_chunk", 256)), spec.k + 1)  # windowed layers keep only W + this - 1
        return TorchExecutor(target, drafter_model, num_slots=num_slots, max_len=max_len,
                             kernels=params.get("kernels", "reference"), max_rows=max_rows)
    if backend == "onnxruntime" and not params.get("onnx_path"):  # in-process from checkpoints
        from peagle_trt.runtime.ort_executor import OrtExecutor

        drafter = version / params["drafter_path"] if params.get("drafter_path") else None
        pair = load_pair(version / params["target_path"], drafter, spec)
        target, drafter_model = pair.build("cpu", torch.float32)
        threads = int(params["threads"]) if params.get("threads") else None
        return OrtExecutor.from_models(target, drafter_model, spec, num_slots, max_len, threads)
    if backend == "onnxruntime":
        from peagle_trt.runtime.ort_executor import OrtExecutor

        executor = OrtExecutor(version / params["onnx_path"], verify=False)  # the repo manifest covers it
        if (executor.num_slots, executor.max_len) != (num_slots, max_len):
            raise ConfigError(f"{version}: the ONNX export was made for {executor.num_slots} slots x "
                              f"{executor.max_len} positions, config.pbtxt asks {num_slots} x {max_len}; rebuild")
        return executor
    if backend == "tensorrt":
        import numpy as np

        from peagle_trt.runtime.trt_executor import TensorRTExecutor

        d2t_path = version / params["onnx_path"] / "d2t.npy"
        d2t = torch.from_numpy(np.load(d2t_path, allow_pickle=False)) if d2t_path.is_file() else None
        return TensorRTExecutor(version / params["engine_path"], arch=params.get("gpu_arch") or None, d2t=d2t,
                                verify=False)
    raise ConfigError(f"backend {backend!r} is not supported (torch | onnxruntime | tensorrt)")


class ServingEngine:
    def __init__(self, codec: TextCodec, scheduler: Scheduler, params: dict):
        self.codec, self.scheduler, self.params = codec, scheduler, params
        self.limits = InputLimits.from_params(params)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.on_step: Callable[[], None] | None = None  # e.g. metrics refresh (throttled by the callee)
        self.step_error: Exception | None = None

    @classmethod
    def load(cls, model_dir: str | Path, params: dict[str, str], verify: bool = True) -> "ServingEngine":
        """Build from a rendered model directory (`REPO/peagle`) and its config.pbtxt parameters."""
        model_dir = Path(model_dir)
        if verify:
            verify_manifest(model_dir)
        return cls.from_params(model_dir / "1", params)

    @classmethod
    def from_checkpoints(cls, target_dir: str | Path, drafter_dir: str | Path | None, spec: SpecConfig,
                         device: str = "cpu", dtype: str = "float32", max_seq_len: int = 4096,
                         max_batch: int = 1, prefill_chunk: int = 256, backend: str = "torch",
                         threads: int | None = None) -> "ServingEngine":
        """Serve checkpoint directories in-process (`generate --target`): `backend` "torch", or
        "onnxruntime" (float32 CPU: the graphs `export` writes, made in memory; runtime/ort_executor.py;
        `threads`: its intra-op threads, None = onnxruntime's default, the physical cores)."""
        params = {"backend": backend, "spec_mode": spec.mode, "num_spec_tokens": str(spec.num_spec_tokens),
                  "max_batch": str(max_batch), "max_seq_len": str(max_seq_len),
                  "prefill_chunk": str(prefill_chunk), "device": device, "dtype": dtype,
                  "target_path": str(Path(target_dir).absolute()),
                  "drafter_path": str(Path(drafter_dir).absolute()) if drafter_dir else "",
                  "threads": str(threads or "")}
        return cls.from_params(Path("."), params)

    @classmethod
    def from_params(cls, version: Path, params: dict[str, str]) -> "ServingEngine":
        """The one constructor: model paths in `params` are relative to `version` (or absolute)."""
        spec = SpecConfig(params["spec_mode"], int(params["num_spec_tokens"]))
        max_batch, max_seq_len = int(params["max_batch"]), int(params["max_seq_len"])
        executor = make_executor(params, version, spec, max_batch, max_seq_len + spec.k + 1)
        target_dir = version / params["target_path"]
        codec = TextCodec(target_dir)
        eos = tuple(sorted(set(codec.eos_ids) | set(load_target_config(target_dir).eos_token_ids)))
        decoder = SpecDecoder(executor, spec, eos)
        scheduler = Scheduler(decoder, max_batch, int(params.get("prefill_chunk", 256)))
        return cls(codec, scheduler, params)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str, params: SamplingParams, on_event: Callable[[Event], None],
               is_cancelled: Callable[[], bool] | None = None, chat_template: bool = False,
               echo_prompt: bool = False) -> int:
        """Queue a request and return its uid (for `cancel`); raises ConfigError for bad input
        (nothing queued). `request_id` is the client's, only echoed in events and logs."""
        if not prompt:
            raise ConfigError("text_input is empty; send a non-empty prompt")
        self.limits.check_prompt(prompt)  # before any tokenization
        self.limits.check_stop(params.stop)
        ids = self.codec.encode_prompt(prompt, chat_template)
        stream = self.codec.stream(params.stop)
        prefix = [prompt if echo_prompt else "", ids if echo_prompt else []]

        def on_output(out: RequestOutput) -> bool:
            text = stream.push(out.new_token_ids)
            if out.finished and out.error is None:
                text += stream.finish()
            head_text, head_ids = prefix
            prefix[:] = ["", []]
            stats = dict(out.stats.to_dict(), prompt_tokens=len(ids), spec_mode=self.params["spec_mode"]) \
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
