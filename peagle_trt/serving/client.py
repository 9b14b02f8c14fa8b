"""gRPC streaming client for the `peagle` model (what `peagle-trt generate --url` runs)."""

from __future__ import annotations

import queue
import uuid
from typing import Callable

import numpy as np

from peagle_trt.config import SamplingParams
from peagle_trt.errors import PeagleError, ServeError
from peagle_trt.serving.protocol import FINAL_OUTPUTS, generate_result


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
    return inputs


def stream_generate(url: str, prompt: str, params: SamplingParams, model: str = "peagle",
                    on_text: Callable[[str], None] | None = None, chat_template: bool = False,
                    timeout_s: float = 600.0) -> dict:
    """Stream one request over gRPC; returns token_ids, text and the final response's statistics."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    try:
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer(model, build_inputs(prompt, params, True, chat_template),
                                  request_id=uuid.uuid4().hex, enable_empty_final_response=True)
        text, ids, final = [], [], {}
        while True:
            try:
                result, error = results.get(timeout=timeout_s)
            except queue.Empty as exc:
                raise ServeError(f"no response from {url} within {timeout_s:.0f} s") from exc
            if error is not None:
                raise ServeError(f"the server refused the request: {error.message()}")
            response = result.get_response()
            if result.as_numpy("text_output") is not None:
                piece = b"".join(result.as_numpy("text_output")).decode("utf-8")
                text.append(piece)
                ids += result.as_numpy("output_ids").tolist()
                if on_text and piece:
                    on_text(piece)
            if result.as_numpy("finish_reason") is not None:
                final = final_stats(result)
            if response.parameters["triton_final_response"].bool_param:
                break
    except InferenceServerException as exc:
        raise ServeError(f"cannot reach the server at {url}: {exc.message()}") from exc
    except PeagleError:
        raise
    finally:
        try:
            client.stop_stream()
        finally:
            client.close()
    if not final:
        raise ServeError(f"the stream from {url} ended without a final response")
    return generate_result("".join(text), ids, final.pop("finish_reason"), final)


def final_stats(result) -> dict:
    """The final response's statistics, keyed as the engine's (`generate_result`)."""
    stats = {"finish_reason": result.as_numpy("finish_reason")[0].decode()}
    for name, (key, _) in FINAL_OUTPUTS.items():
        value = result.as_numpy(name)
        if value is None:
            raise ServeError(f"the final response lacks {name!r}; rebuild the repository with this peagle-trt")
        if name == "accept_rate_per_pos":
            stats[key] = [round(float(x), 4) for x in value]
        elif name == "spec_mode":
            stats[key] = value[0].decode()
        else:
            stats[key] = round(float(value[0]), 4) if value.dtype.kind == "f" else int(value[0])
    return stats
