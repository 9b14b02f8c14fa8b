"""In-process generation from model directories: tokenizer + checkpoint pair + torch executor
+ `SpecDecoder`, one request at a time. This is what `peagle-trt generate` runs.

    engine = OfflineEngine.load(target_dir, drafter_dir, SpecConfig("peagle", 7))
    result = engine.generate("Hello", SamplingParams(max_tokens=32), on_text=print)
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from peagle_trt.checkpoint import load_pair
from peagle_trt.config import SamplingParams, SpecConfig
from peagle_trt.runtime.executor import TorchExecutor
from peagle_trt.speculative.decoder import SpecDecoder
from peagle_trt.speculative.generate import generate
from peagle_trt.tokenizer import TextCodec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class OfflineEngine:
    def __init__(self, codec: TextCodec, decoder: SpecDecoder):
        self.codec, self.decoder = codec, decoder

    @classmethod
    def load(cls, target_dir: str | Path, drafter_dir: str | Path | None, spec: SpecConfig,
             device: str = "cpu", dtype: str = "float32", max_len: int = 4096) -> "OfflineEngine":
        pair = load_pair(target_dir, drafter_dir, spec)
        target, drafter = pair.build(device, DTYPES[dtype])
        codec = TextCodec(target_dir)
        eos = tuple(sorted(set(codec.eos_ids) | set(pair.target.config.eos_token_ids)))
        decoder = SpecDecoder(TorchExecutor(target, drafter, num_slots=1, max_len=max_len), spec, eos)
        return cls(codec, decoder)

    def generate(self, prompt: str, params: SamplingParams, chat_template: bool = True,
                 on_text: Callable[[str], None] | None = None) -> dict:
        ids = self.codec.encode_prompt(prompt, chat_template)
        return self.generate_ids(ids, params, on_text)

    def generate_ids(self, ids: list[int], params: SamplingParams,
                     on_text: Callable[[str], None] | None = None) -> dict:
        stream = self.codec.stream(params.stop)

        def on_tokens(new: list[int]) -> bool:
            piece = stream.push(new)
            if on_text and piece:
                on_text(piece)
            return stream.stopped

        seq = generate(self.decoder, ids, params, on_tokens)
        rest = stream.finish()
        if on_text and rest:
            on_text(rest)
        return {"token_ids": seq.output, "text": stream.text, "finish_reason": seq.finish_reason,
                "prompt_tokens": len(ids), "spec_mode": self.decoder.spec.mode,
                "num_spec_tokens": self.decoder.k, **seq.stats.to_dict()}
