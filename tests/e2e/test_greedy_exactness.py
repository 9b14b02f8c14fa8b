"""Hard gate: greedy speculative output equals transformers' greedy `generate` token for token,
for every spec mode, K in {1, 3, 7}, several prompts and lengths, both target families."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from peagle_trt.config import SamplingParams
from peagle_trt.runtime.scheduler import generate
from tests.helpers import PAIRS, greedy, make_decoder

PROMPT_LENGTHS_AND_MAX_TOKENS = [(1, 9), (5, 30), (17, 41), (40, 64)]


def prompts(family: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(len(family))
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n, _ in PROMPT_LENGTHS_AND_MAX_TOKENS]


@pytest.fixture(scope="module")
def hf_reference(tiny):
    """(family, prompt, n) -> transformers' greedy continuation, n <= 64 new tokens."""
    cache, models = {}, {}

    def ref(family: str, prompt: list[int], n: int) -> list[int]:
        key = (family, tuple(prompt))
        if key not in cache:
            if family not in models:
                models[family] = AutoModelForCausalLM.from_pretrained(tiny[family]).eval()
            with torch.no_grad():
                out = models[family].generate(torch.tensor([prompt]), max_new_tokens=64,
                                              do_sample=False, pad_token_id=0, min_new_tokens=64)
            cache[key] = out[0, len(prompt):].tolist()
        return cache[key][:n]

    return ref


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("mode,k", [("none", 0), ("eagle3", 1), ("eagle3", 3), ("eagle3", 7),
                                    ("peagle", 1), ("peagle", 3), ("peagle", 7)])
def test_greedy_equals_transformers_generate(tiny, hf_reference, family, mode, k):
    decoder = make_decoder(tiny, family, PAIRS[family], mode, max(k, 1))
    for prompt, (_, max_tokens) in zip(prompts(family), PROMPT_LENGTHS_AND_MAX_TOKENS):
        out = generate(decoder, prompt, greedy(max_tokens)).output
        assert out == hf_reference(family, prompt, max_tokens), (mode, k, len(prompt))


def test_plain_eagle3_head_greedy_exact(tiny, hf_reference):
    decoder = make_decoder(tiny, "llama", "eagle3", "eagle3", 3)
    prompt = list(range(3, 15))
    assert generate(decoder, prompt, greedy(30)).output == hf_reference("llama", prompt, 30)


def test_eos_stops_generation(tiny, hf_reference):
    """With EOS set to a token the target emits, output stops right after it."""
    prompt = list(range(20, 31))
    ref = hf_reference("llama", prompt, 40)
    eos = ref[12]
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 7)
    decoder.eos_ids = (eos,)
    seq = generate(decoder, prompt, SamplingParams(max_tokens=40))
    assert seq.output == ref[:ref.index(eos) + 1] and seq.finish_reason == "stop"
