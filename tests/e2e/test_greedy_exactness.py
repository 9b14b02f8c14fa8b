"""Greedy speculative output against transformers' greedy `generate`, for every spec mode, K in
{1, 3, 7}, several prompts and lengths, both target families: two implementations, so near-equality
with top-2 margins (tests/export/crossbackend.py): identical, or parting first at a near-tie of
transformers' own logits after MIN_AGREED identical tokens. (Speculative == target-only on one backend
is exact: tests/speculative.)"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from peagle_trt.config import SamplingParams
from peagle_trt.runtime.scheduler import generate
from tests.export.crossbackend import check_greedy_streams, hf_teacher_forced_logits
from tests.helpers import PAIRS, greedy, make_decoder

PROMPT_LENGTHS_AND_MAX_TOKENS = [(1, 9), (5, 30), (17, 41), (40, 64)]
NEAR_TIE = 1e-3  # logits: fp32 against fp32, different kernels (measured errors ~1e-5)
MIN_AGREED = 8


def prompts(family: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(len(family))
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n, _ in PROMPT_LENGTHS_AND_MAX_TOKENS]


@pytest.fixture(scope="module")
def hf_reference(tiny):
    """(family, prompt, n) -> transformers' greedy continuation (n <= 64 new tokens) and its
    teacher-forced logits [n, V]."""
    cache, models = {}, {}

    def ref(family: str, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
        key = (family, tuple(prompt))
        if key not in cache:
            if family not in models:
                models[family] = AutoModelForCausalLM.from_pretrained(tiny[family]).eval()
            with torch.no_grad():
                out = models[family].generate(torch.tensor([prompt]), max_new_tokens=64,
                                              do_sample=False, pad_token_id=0, min_new_tokens=64)
            tokens = out[0, len(prompt):].tolist()
            cache[key] = (tokens, hf_teacher_forced_logits(models[family], prompt, tokens))
        tokens, logits = cache[key]
        return tokens[:n], logits[:n]

    return ref


def check_against_transformers(hf_reference, family: str, prompt: list[int], out: list[int]) -> None:
    ref, logits = hf_reference(family, prompt, len(out))
    check_greedy_streams(logits, ref, out, NEAR_TIE, MIN_AGREED)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("mode,k", [("none", 0), ("eagle3", 1), ("eagle3", 3), ("eagle3", 7),
                                    ("peagle", 1), ("peagle", 3), ("peagle", 7)])
def test_greedy_near_equals_transformers_generate(tiny, hf_reference, family, mode, k):
    decoder = make_decoder(tiny, family, PAIRS[family], mode, max(k, 1))
    for prompt, (_, max_tokens) in zip(prompts(family), PROMPT_LENGTHS_AND_MAX_TOKENS):
        out = generate(decoder, prompt, greedy(max_tokens)).output
        assert len(out) == max_tokens, (mode, k, len(prompt))
        check_against_transformers(hf_reference, family, prompt, out)


def test_plain_eagle3_head_greedy_near_equals_transformers(tiny, hf_reference):
    decoder = make_decoder(tiny, "llama", "eagle3", "eagle3", 3)
    prompt = list(range(3, 15))
    check_against_transformers(hf_reference, "llama", prompt, generate(decoder, prompt, greedy(30)).output)


def test_eos_stops_generation(tiny):
    """With EOS set to a token the target emits, output stops right after it (the reference: the same
    backend's target-only greedy, deterministic mode: exact on any CPU)."""
    prompt = list(range(20, 31))
    ref = generate(make_decoder(tiny, "llama", None, "none", 1), prompt, greedy(40)).output
    eos = ref[12]
    decoder = make_decoder(tiny, "llama", "aws", "peagle", 7)
    decoder.eos_ids = (eos,)
    seq = generate(decoder, prompt, SamplingParams(max_tokens=40))
    assert seq.output == ref[:ref.index(eos) + 1] and seq.finish_reason == "stop"
