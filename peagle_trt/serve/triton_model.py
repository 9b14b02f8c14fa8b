"""The `peagle` Triton Python model: decoupled, `execute` only enqueues; the text generator's
background thread (peagle_trt/serve/generator.py) steps the in-flight scheduler and streams through each
request's response sender. Its settings come typed from config.pbtxt (peagle_trt/serve/options.py).

Inputs follow the TensorRT-LLM / vLLM Triton backends (`text_input`, `max_tokens`, `stream`,
`temperature`, `top_p`, `top_k`, `seed`, `stop`, `end_id`, `ignore_eos`, `exclude_input_in_output`,
plus `apply_chat_template` and `structured_output`: peagle_trt/serve/protocol.py). Each response's
`text_output` / `output_ids` hold only the NEW text and tokens, so concatenating the responses gives
the whole output; the final response also carries `finish_reason`, `prompt_tokens` and the request's
acceptance statistics (peagle_trt/serve/protocol.py FINAL_OUTPUTS).
Bad requests get an error response of their own; other streams are not disturbed: oversized
prompts and stop strings are refused from their byte counts before decoding or tokenizing, a
request whose step fails ends with an error response, and a client cancels only its own request
(the generator's uid, not the client-chosen request id, identifies it).

Lifetime: Triton unloads the model (`finalize`) once its last stream has ended; `finalize` is
bounded. If tritonserver dies without unloading it (killed, crashed, a failed start), the stub
process would linger forever (it ignores SIGTERM and can deadlock in its own exit path), so a
watchdog thread frees the stub's shared-memory region and ends the process at once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np

from peagle_trt.config import SamplingParams, StructuredOutput
from peagle_trt.errors import PeagleError, RequestError
from peagle_trt.serve.generator import Event, TextGenerator
from peagle_trt.serve.options import from_parameters
from peagle_trt.serve.protocol import FINAL_OUTPUTS, INPUTS, InputLimits
from peagle_trt.speculative_config import SERVE_ENV, for_built, parse

log = logging.getLogger("peagle_trt.triton")


def _scalar(pb_utils, request, name: str, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)
    if value.size != 1:
        raise RequestError(f"input {name!r} must hold exactly one value, got {value.size}")
    return value[0].item() if hasattr(value[0], "item") else value[0]


def _text(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"input {name!r} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from exc
    return str(value)


def parse_request(pb_utils, request, limits: InputLimits) -> tuple[str, SamplingParams, dict]:
    """Triton request -> (prompt, sampling params, options); RequestError on bad input (sizes are
    checked on the raw bytes, before decoding)."""
    # HTTP /generate turns JSON keys that are not inputs into request parameters: refuse them
    # rather than silently ignoring a misspelled option.
    unknown = sorted(json.loads(request.parameters() or "{}"))
    if unknown:
        raise RequestError(f"unknown input(s) {unknown}; accepted inputs: {', '.join(INPUTS)}")
    raw_prompt = _scalar(pb_utils, request, "text_input", b"")
    limits.check_prompt(raw_prompt)
    prompt = _text(raw_prompt, "text_input")
    stop_tensor = pb_utils.get_input_tensor_by_name(request, "stop")
    raw_stop = list(stop_tensor.as_numpy().reshape(-1)) if stop_tensor is not None else []
    limits.check_stop(raw_stop)
    stop = tuple(_text(s, "stop") for s in raw_stop)
    end_id = _scalar(pb_utils, request, "end_id", None)
    structured = _scalar(pb_utils, request, "structured_output", None)
    params = SamplingParams(
        max_tokens=int(_scalar(pb_utils, request, "max_tokens", 64)),
        temperature=float(_scalar(pb_utils, request, "temperature", 0.0)),
        top_p=float(_scalar(pb_utils, request, "top_p", 1.0)),
        top_k=int(_scalar(pb_utils, request, "top_k", 0)),
        seed=_scalar(pb_utils, request, "seed", None),
        ignore_eos=bool(_scalar(pb_utils, request, "ignore_eos", False)),
        stop=stop, end_ids=(int(end_id),) if end_id is not None else (),
        structured=StructuredOutput.from_json(_text(structured, "structured_output")) if structured else None)
    options = {"stream": bool(_scalar(pb_utils, request, "stream", False)),
               "echo_prompt": not bool(_scalar(pb_utils, request, "exclude_input_in_output", True)),
               "chat_template": bool(_scalar(pb_utils, request, "apply_chat_template", False))}
    return prompt, params, options


def final_tensors(pb, finish_reason: str | None, stats: dict) -> list:
    tensors = [pb.Tensor("finish_reason", np.array([(finish_reason or "").encode()], dtype=np.object_))]
    for name, (key, dtype) in FINAL_OUTPUTS.items():
        value = stats[key]
        value = [v.encode() for v in [value]] if dtype is np.object_ else value
        tensors.append(pb.Tensor(name, np.array(value if isinstance(value, list) else [value], dtype=dtype)))
    return tensors


def _stub_identity() -> tuple[int, str] | None:
    """(tritonserver pid, this stub's shm region name) from the stub's command line:
    `triton_python_backend_stub MODEL_PATH SHM_REGION DEFAULT_SIZE GROWTH_SIZE PARENT_PID ...`;
    None outside a stub."""
    try:
        args = Path("/proc/self/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        args = []
    if len(args) > 5 and args[0].endswith("triton_python_backend_stub") and args[5].isdigit():
        return int(args[5]), args[2]
    return None


def _exit_when_orphaned(parent: int, shm_region: str, period_s: float = 0.25) -> None:
    while os.getppid() == parent:
        time.sleep(period_s)
    if "/" not in shm_region:  # the server is gone: nobody else will free it
        Path("/dev/shm", shm_region).unlink(missing_ok=True)
    os._exit(1)  # no interpreter teardown: the stub's own exit path can deadlock here


class TritonPythonModel:
    def initialize(self, args):
        import triton_python_backend_utils as pb_utils

        stub = _stub_identity()
        if stub is not None:
            threading.Thread(target=_exit_when_orphaned, args=stub, name="peagle-orphan-watch",
                             daemon=True).start()
        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        options, paths = from_parameters(params, args["model_name"])
        if os.environ.get(SERVE_ENV):  # `serve --speculative-config`: run-time keys over the built config
            spec = for_built(options.speculation, parse(os.environ[SERVE_ENV], "serve"))
            options = dataclasses.replace(options, speculation=spec)
            log.info("speculative config from serve: %s", os.environ[SERVE_ENV])
        model_dir = Path(args["model_repository"])
        if not (model_dir / "config.pbtxt").is_file():  # some Triton versions pass the repository root
            model_dir = model_dir / args["model_name"]
        self.generator = TextGenerator.load(model_dir, options, paths)
        spec = options.speculation
        self.num_spec_tokens, self.max_nodes = spec.num_spec_tokens, spec.max_nodes  # K, a tree's most nodes
        self._make_metrics({"model": args["model_name"], "version": str(args.get("model_version", "1"))})
        self.generator.on_step = self._update_metrics
        self._tokens_window: list[tuple[float, int]] = []
        self._next_metrics = 0.0
        # Responses go out from their own thread so the scheduler never waits on the transport.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender_thread = threading.Thread(target=self._send_loop, name="peagle-sender", daemon=True)
        self._sender_thread.start()
        self.generator.start()
        log.info("peagle model ready: %s", params)

    # -- requests ----------------------------------------------------------------------------------
    def execute(self, requests):
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                prompt, params, options = parse_request(pb, request, self.generator.limits)
                state = {"text": [], "ids": []}
                self.generator.submit(request.request_id() or f"req-{time.monotonic_ns()}", prompt, params,
                                   lambda event, s=sender, o=options, st=state: self._respond(s, o, st, event),
                                   is_cancelled=sender.is_cancelled, chat_template=options["chat_template"],
                                   echo_prompt=options["echo_prompt"])
            except PeagleError as exc:
                sender.send(pb.InferenceResponse(error=pb.TritonError(str(exc))),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # never let one request take the model down
                log.exception("unexpected error while queuing a request")
                sender.send(pb.InferenceResponse(error=pb.TritonError(f"internal error: {exc}")),
                            flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _respond(self, sender, options: dict, state: dict, event: Event) -> None:
        pb = self.pb
        if event.error is not None:  # this request's step failed: an error response ends it
            bad_input = event.error.removeprefix("RequestError: ")  # e.g. a grammar that does not compile
            message = bad_input if bad_input != event.error else f"the request failed: {event.error}"
            response = pb.InferenceResponse(error=pb.TritonError(message))
            self._outbox.put((sender, response, pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL, event))
            return
        if not options["stream"]:  # one response at the end (HTTP /generate)
            state["text"].append(event.text)
            state["ids"] += event.token_ids
            if not event.finished:
                return
            event = dataclasses.replace(event, text="".join(state["text"]), token_ids=state["ids"])
        tensors = [pb.Tensor("text_output", np.array([event.text.encode("utf-8")], dtype=np.object_)),
                   pb.Tensor("output_ids", np.array(event.token_ids, dtype=np.int32))]
        if event.finished:
            tensors += final_tensors(pb, event.finish_reason, event.stats or {})
        flags = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if event.finished else 0
        self._outbox.put((sender, pb.InferenceResponse(output_tensors=tensors), flags, event))

    def _send_loop(self) -> None:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            sender, response, flags, event = item
            try:
                sender.send(response, flags=flags)
            except Exception:  # the client is gone: stop generating for it
                log.info("client of %s (uid %d) disconnected; cancelling", event.request_id, event.uid)
                if not event.finished:
                    self.generator.cancel(event.uid)

    # -- metrics -------------------------------------------------------------------------------------
    def _make_metrics(self, labels: dict):
        """Our Prometheus series, labelled with this model's name and version (as Triton labels its
        own): several models in one server each keep their own series."""
        pb = self.pb

        self._families = []  # a MetricFamily must outlive its Metric objects

        def family(name, kind, doc):
            self._families.append(pb.MetricFamily(name=name, description=doc, kind=kind))
            return self._families[-1]

        gauge, counter = pb.MetricFamily.GAUGE, pb.MetricFamily.COUNTER
        self.m_al = family("peagle_acceptance_length", gauge,
                           "mean tokens per verify step incl. the bonus token (finished requests)"
                           ).Metric(labels=labels)
        pos = family("peagle_accept_rate_per_pos", gauge, "fraction of steps accepting >= i+1 drafts")
        self.m_pos = [pos.Metric(labels={**labels, "position": str(i)}) for i in range(self.num_spec_tokens)]
        self.m_tps = family("peagle_generated_tokens_per_second", gauge,
                            "generated tokens per second over the last 10 s").Metric(labels=labels)
        self.m_tokens = family("peagle_generated_tokens_total", counter, "generated tokens").Metric(labels=labels)
        # counters, so a benchmark gets the acceptance of its own window: 1 + d(accepted) / d(steps)
        self.m_steps = family("peagle_draft_steps_total", counter,
                              "verify steps of finished requests").Metric(labels=labels)
        self.m_accepted = family("peagle_accepted_drafts_total", counter,
                                 "accepted draft tokens of finished requests").Metric(labels=labels)
        self._last_steps = self._last_accepted = 0
        self.m_blocks = family("peagle_kv_blocks_used", gauge,
                               "KV-cache blocks held by running requests").Metric(labels=labels)
        self.m_blocks_total = family("peagle_kv_blocks_total", gauge, "KV-cache blocks").Metric(labels=labels)
        self.m_preempted = family("peagle_kv_preemptions_total", counter,
                                  "requests preempted when the KV cache ran dry").Metric(labels=labels)
        self.m_prefix_hits = family("peagle_prefix_cache_hit_tokens_total", counter,
                                    "prompt tokens whose KV came from the prefix cache").Metric(labels=labels)
        self.m_prefix_queries = family("peagle_prefix_cache_queried_tokens_total", counter,
                                       "prompt tokens looked up in the prefix cache").Metric(labels=labels)
        self.m_waiting = family("peagle_requests_waiting", gauge, "queued requests").Metric(labels=labels)
        self.m_k = family("peagle_num_spec_tokens_per_step", pb.MetricFamily.HISTOGRAM,
                          "drafts verified per step (K schedule / adaptive K; a draft tree's nodes, its budget; "
                          "0 = a plain decoding step)"
                          ).Metric(labels=labels, buckets=[float(k) for k in range(self.max_nodes + 1)])
        self._last_k: dict = {}
        self.m_blocks_total.set(self.generator.scheduler.blocks.num_blocks)
        self._last_blocks = {"kv_preemptions": 0, "prefix_hit_tokens": 0, "prefix_queried_tokens": 0}
        self._last_tokens = 0

    def _update_metrics(self):
        now = time.monotonic()
        if now < self._next_metrics:  # refresh at most twice a second: metric calls cross into C++
            return
        self._next_metrics = now + 0.5
        sched = self.generator.scheduler
        running = sum(len(r.seq.output) for r in sched.running if r.seq is not None)
        total = sched.generated_tokens + running
        self.m_tokens.increment(max(0, total - self._last_tokens))
        self._last_tokens = total
        self._tokens_window = [(t, n) for t, n in self._tokens_window if now - t < 10.0] + [(now, total)]
        (t0, n0), (t1, n1) = self._tokens_window[0], self._tokens_window[-1]
        self.m_tps.set((n1 - n0) / (t1 - t0) if t1 > t0 else 0.0)
        self.m_al.set(sched.stats.acceptance_length)
        self.m_steps.increment(sched.stats.steps - self._last_steps)
        self.m_accepted.increment(sched.stats.accepted - self._last_accepted)
        self._last_steps, self._last_accepted = sched.stats.steps, sched.stats.accepted
        for metric, rate in zip(self.m_pos, sched.stats.accept_rate_per_pos):
            metric.set(rate)
        kv = sched.blocks.metrics()
        self.m_blocks.set(kv["kv_blocks_used"])
        for key, metric in (("kv_preemptions", self.m_preempted), ("prefix_hit_tokens", self.m_prefix_hits),
                            ("prefix_queried_tokens", self.m_prefix_queries)):
            metric.increment(kv[key] - self._last_blocks[key])
            self._last_blocks[key] = kv[key]
        self.m_waiting.set(len(sched.waiting))
        for k, n in list(sched.decoder.draft_length.steps_at_k.items()):
            for _ in range(n - self._last_k.get(k, 0)):
                self.m_k.observe(float(k))
            self._last_k[k] = n

    def finalize(self):
        """Bounded: Triton calls it once every stream has ended (their senders are closed), and
        waits for it before the server can exit."""
        self.generator.stop(timeout=5.0)
        self._outbox.put(None)
        self._sender_thread.join(2.0)
        log.info("peagle model finalized")
