"""The wire contract of the `peagle` Triton model, shared by the model, the clients and the CLI:
its inputs and their size limits (`structured_output`: one JSON string, vLLM's
`structured_outputs` object, e.g. {"json": SCHEMA}, {"regex": "..."}, {"choice": [...]},
{"grammar": "..."} or {"json_object": true}; config.py `StructuredOutput`), the statistics its
final response carries, and the one JSON shape of a generated request (`generate --target`, `--repo`
and `--url` print the same keys in the same order). Light on purpose: clients import it without
torch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from peagle_trt.config import MAX_STOP_BYTES, PROMPT_BYTES_PER_TOKEN
from peagle_trt.errors import ConfigError, RequestError

INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "stop", "end_id",
          "ignore_eos", "exclude_input_in_output", "apply_chat_template", "structured_output")

# the final response's statistics: output name -> (key of the generator's final stats, numpy dtype)
FINAL_OUTPUTS = {"prompt_tokens": ("prompt_tokens", np.int32), "spec_mode": ("spec_mode", np.object_),
                 "num_spec_tokens": ("num_spec_tokens", np.int32),
                 "acceptance_length": ("acceptance_length", np.float32),
                 "draft_accept_rate": ("draft_accept_rate", np.float32),
                 "accept_rate_per_pos": ("accept_rate_per_pos", np.float32),
                 "num_draft_steps": ("steps", np.int32), "target_forwards": ("target_forwards", np.int32),
                 "drafter_forwards": ("drafter_forwards", np.int32),
                 "num_draft_tokens": ("drafted", np.int32),
                 "acceptance_histogram": ("acceptance_histogram", np.int32),
                 "per_step_drafted": ("per_step_drafted", np.int32),
                 "per_step_accepted": ("per_step_accepted", np.int32)}



@dataclass(frozen=True)
class InputLimits:
    """Byte limits checked before any tokenization, so an oversized input costs its sender an
    error and nobody else any time. Per repository: config.pbtxt parameters `max_prompt_bytes`
    (default 16 x max_seq_len) and `max_stop_bytes` (all stop strings together, default 1024),
    written by `peagle-trt build --max-prompt-bytes / --max-stop-bytes`."""
    prompt_bytes: int
    stop_bytes: int = MAX_STOP_BYTES

    @classmethod
    def resolve(cls, max_seq_len: int, max_prompt_bytes: int | None = None,
                max_stop_bytes: int | None = None) -> InputLimits:
        """The limits of a model with these settings (None: the defaults above)."""
        limits = cls(PROMPT_BYTES_PER_TOKEN * max_seq_len if max_prompt_bytes is None else max_prompt_bytes,
                     MAX_STOP_BYTES if max_stop_bytes is None else max_stop_bytes)
        if limits.prompt_bytes <= 0 or limits.stop_bytes < 0:
            raise ConfigError(f"max_prompt_bytes must be > 0 and max_stop_bytes >= 0, got {limits}")
        return limits

    def check_prompt(self, prompt: str | bytes) -> None:
        size = _utf8_size(prompt, self.prompt_bytes)
        if size > self.prompt_bytes:
            raise RequestError(f"text_input is {size} bytes or more; this model accepts at most "
                              f"{self.prompt_bytes} bytes (max_prompt_bytes); shorten the prompt")

    def check_stop(self, stop: list[str | bytes] | tuple[str | bytes, ...]) -> None:
        size = sum(_utf8_size(s, self.stop_bytes + 1) for s in stop)
        if size > self.stop_bytes:
            raise RequestError(f"the stop strings are {size} bytes or more together; this model accepts "
                              f"at most {self.stop_bytes} bytes (max_stop_bytes); send shorter or fewer "
                              "stop strings")


def _utf8_size(text: str | bytes, limit: int) -> int:
    """UTF-8 size of `text`, or a lower bound above `limit` (no encoding of a huge string)."""
    if isinstance(text, bytes) or len(text) > limit:  # a character is at least one byte
        return len(text)
    return len(text.encode("utf-8"))


RESULT_KEYS = ("text", "token_ids", "finish_reason", "prompt_tokens", "spec_mode", "num_spec_tokens",
               "acceptance_length", "draft_accept_rate", "accept_rate_per_pos", "steps", "target_forwards",
               "drafter_forwards")


def generate_result(text: str, token_ids: list[int], finish_reason: str | None, stats: dict) -> dict:
    """The one JSON shape of a generated request (`generate --target / --repo / --url` alike):
    RESULT_KEYS in that order, from the final event's statistics."""
    values = {"text": text, "token_ids": token_ids, "finish_reason": finish_reason, **stats}
    missing = [k for k in RESULT_KEYS if k not in values]
    if missing:
        raise ConfigError(f"the final response lacks {missing}; is the server running an older peagle-trt?")
    return {k: values[k] for k in RESULT_KEYS}
