"""The serving engine of a built model directory: tokenizer + executor + in-flight scheduler,
stepped by a background thread, with text streaming and stop strings per request.

The Triton model (`triton_model.py`) is a thin adapter over this class; `peagle-trt generate
--repo` runs the same class in-process, so both paths produce the same tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from peagle_trt.checkpoint import load_pair
from peagle_trt.checkpoint.target import load_target_config
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.manifest import verify_manifest
from peagle_trt.offline import DTYPES
from peagle_trt.runtime.executor import TorchExecutor
from peagle_trt.runtime.scheduler import Request, RequestOutput, Scheduler
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.tokenizer import TextCodec

log = logging.getLogger(__name__)


@dataclass
class Event:
    """What a client receives: the NEW text and ids since the previous event."""
    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    stats: dict | None = None  # on the final event


def make_executor(params: dict, version: Path, spec: SpecConfig, num_slots: int, max_len: int):
    """The executor a model directory's `backend` parameter asks for."""
    backend = params.get("backend", "torch")
    if backend == "torch":
        drafter = version / params["drafter_path"] if params.get("drafter_path") else None
        pair = load_pair(version / params["target_path"], drafter, spec)
        target, drafter_model = pair.build(params.get("device", "cpu"), DTYPES[params.get("dtype", "float32")])
        max_rows = max(int(params.get("prefill_chunk", 256)), spec.k + 1)  # windowed layers keep only W + this - 1
        return TorchExecutor(target, drafter_model, num_slots=num_slots, max_len=max_len, max_rows=max_rows)
    if backend == "onnxruntime":
        from peagle_trt.runtime.ort_executor import OrtExecutor

        executor = OrtExecutor(version / params["onnx_path"], verify=False)  # the repo manifest covers it
        if (executor.num_slots, executor.max_len) != (num_slots, max_len):
            raise ConfigError(f"{version}: the ONNX export was made for {executor.num_slots} slots x "
                              f"{executor.max_len} positions, config.pbtxt asks {num_slots} x {max_len}; rebuild")
        return executor
    if backend == "tensorrt":
        import numpy as np
        import torch

        from peagle_trt.runtime.trt_executor import TensorRTExecutor

        d2t_path = version / params["onnx_path"] / "d2t.npy"
        d2t = torch.from_numpy(np.load(d2t_path, allow_pickle=False)) if d2t_path.is_file() else None
        return TensorRTExecutor(version / params["engine_path"], arch=params.get("gpu_arch") or None, d2t=d2t,
                                verify=False)
    raise ConfigError(f"backend {backend!r} is not supported (torch | onnxruntime | tensorrt)")


class ServingEngine:
    def __init__(self, codec: TextCodec, scheduler: Scheduler, params: dict):
        self.codec, self.scheduler, self.params = codec, scheduler, params
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
        version = model_dir / "1"
        spec = SpecConfig(params["spec_mode"], int(params["num_spec_tokens"]))
        max_batch, max_seq_len = int(params["max_batch"]), int(params["max_seq_len"])
        executor = make_executor(params, version, spec, max_batch, max_seq_len + spec.k + 1)
        codec = TextCodec(version / params["target_path"])
        eos = tuple(sorted(set(codec.eos_ids) | set(load_target_config(version / params["target_path"]).eos_token_ids)))
        decoder = SpecDecoder(executor, spec, eos)
        scheduler = Scheduler(decoder, max_batch, int(params.get("prefill_chunk", 256)))
        return cls(codec, scheduler, params)

    # -- requests ------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt: str, params: SamplingParams, on_event: Callable[[Event], None],
               is_cancelled: Callable[[], bool] | None = None, chat_template: bool = False,
               echo_prompt: bool = False) -> None:
        """Queue a request; raises ConfigError for bad input (nothing queued)."""
        if not prompt:
            raise ConfigError("text_input is empty; send a non-empty prompt")
        ids = self.codec.encode_prompt(prompt, chat_template)
        stream = self.codec.stream(params.stop)
        prefix = [prompt if echo_prompt else "", ids if echo_prompt else []]

        def on_output(out: RequestOutput) -> bool:
            text = stream.push(out.new_token_ids)
            if out.finished:
                text += stream.finish()
            head_text, head_ids = prefix
            prefix[:] = ["", []]
            stats = dict(out.stats.to_dict(), prompt_tokens=len(ids)) if out.finished else None
            on_event(Event(request_id, head_text + text, head_ids + out.new_token_ids, out.finished,
                           out.finish_reason, stats))
            return stream.stopped

        self.scheduler.add(Request(request_id, ids, params, on_output, is_cancelled))

    def cancel(self, request_id: str) -> None:
        self.scheduler.cancel(request_id)

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
                except Exception as exc:  # keep serving: fail the running requests, not the server
                    log.exception("scheduler step failed; aborting the running requests")
                    self.step_error = exc
                    for r in list(sched.running):
                        sched.cancel(r.request_id)
            if self.on_step is not None:  # after steps and while idle (metrics stay fresh)
                self.on_step()

    def run_one(self, prompt: str, params: SamplingParams, on_event: Callable[[Event], None],
                chat_template: bool = True) -> None:
        """Serve one request on the calling thread (for `generate --repo`)."""
        done = threading.Event()

        def relay(event: Event) -> None:
            on_event(event)
            if event.finished:
                done.set()

        self.submit(f"local-{time.monotonic_ns()}", prompt, params, relay, chat_template=chat_template)
        while not done.is_set():
            self.scheduler.step()
