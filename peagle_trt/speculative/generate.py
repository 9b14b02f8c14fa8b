"""Generate for one request with any `SpecDecoder`: prefill, then speculate-verify until done."""

from __future__ import annotations

from typing import Callable

from peagle_trt.config import SamplingParams
from peagle_trt.errors import RuntimeInvariantError
from peagle_trt.speculative.decoder import Sequence, SpecDecoder


def generate(decoder: SpecDecoder, prompt: list[int], params: SamplingParams,
             on_tokens: Callable[[list[int]], bool] | None = None) -> Sequence:
    """Run one request to completion. `on_tokens` gets each step's new ids as they come and
    returns True to end the request there (a stop string was seen)."""
    slot = decoder.ex.alloc_slot()
    if slot is None:
        raise RuntimeInvariantError("no free KV slot for a single request")
    try:
        seq = decoder.new_sequence(prompt, params, slot)
        decoder.prefill([seq])
        seen = 0
        while True:
            if on_tokens and len(seq.output) > seen:
                if on_tokens(seq.output[seen:]) and not seq.finished:
                    seq.finish_reason = "stop"
                seen = len(seq.output)
            if seq.finished:
                return seq
            decoder.step([seq])
    finally:
        decoder.ex.free_slot(slot)
