"""The wire contract of the `peagle` Triton model, shared by the model, the clients and the CLI:
its inputs, the statistics its final response carries, and the one JSON shape of a generated
request (`generate --target`, `--repo` and `--url` print the same keys in the same order).
Light on purpose: clients import it without torch."""

from __future__ import annotations

import numpy as np

from peagle_trt.errors import ConfigError

INPUTS = ("text_input", "max_tokens", "stream", "temperature", "top_p", "top_k", "seed", "stop", "end_id",
          "ignore_eos", "exclude_input_in_output", "apply_chat_template")

# the final response's statistics: output name -> (key of the engine's final stats, numpy dtype)
FINAL_OUTPUTS = {"prompt_tokens": ("prompt_tokens", np.int32), "spec_mode": ("spec_mode", np.object_),
                 "num_spec_tokens": ("num_spec_tokens", np.int32),
                 "acceptance_length": ("acceptance_length", np.float32),
                 "draft_accept_rate": ("draft_accept_rate", np.float32),
                 "accept_rate_per_pos": ("accept_rate_per_pos", np.float32),
                 "num_draft_steps": ("steps", np.int32), "target_forwards": ("target_forwards", np.int32),
                 "drafter_forwards": ("drafter_forwards", np.int32)}


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
