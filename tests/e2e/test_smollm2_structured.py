"""Structured output on the real model (SmolLM2-135M-Instruct): for schemas shipped as fixtures
(tests/data/structured/schemas.json), speculative constrained output equals constrained
target-only output token for token (the random P-EAGLE head on one schema: it accepts ~nothing; a
scripted drafter right 70% of the time, which gets drafts accepted under the masks), and every
output that ends by the grammar parses and validates against its schema (jsonschema)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from peagle_trt.config import SamplingParams, StructuredOutput
from peagle_trt.runtime.scheduler import generate
from peagle_trt.speculative.grammar import Grammars
from peagle_trt.tokenizer import TextCodec
from tests.helpers import ScriptedDrafter, make_decoder

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "structured" / "schemas.json").read_text())
CASES = {"tool_get_weather": "What is the weather in Paris? Answer with the arguments of get_weather as JSON.",
         "enum_sentiment": "Classify the sentiment of: 'I love this phone, it is great.' Answer in JSON.",
         "nested_person": "Describe Ada Lovelace (name, address with city and zip) as JSON."}
N = 48


@pytest.fixture(scope="module")
def setup(smollm2):
    from peagle_trt.checkpoint.target import load_target_config

    codec = TextCodec(smollm2["target"])
    grammars = Grammars(codec.tok, load_target_config(smollm2["target"]).vocab_size)
    yield codec, grammars
    grammars.close()


def test_constrained_speculation_equals_target_only_and_validates(smollm2, setup):
    codec, grammars = setup
    eos = tuple(codec.eos_ids)
    none = make_decoder(smollm2, "target", None, "none", 1, max_len=256)
    peagle = make_decoder(smollm2, "target", "head", "peagle", 3, max_len=256)
    refs: dict = {}
    scripted = make_decoder(smollm2, "target", "head", "peagle", 5, max_len=256, proposer=ScriptedDrafter(
        refs, grammars.vocab_size, lambda i, rng: bool(torch.rand((), generator=rng) < 0.7)))
    for d in (none, peagle, scripted):
        d.eos_ids = eos
    ended_by_grammar = 0
    for name, text in CASES.items():
        prompt = codec.encode_prompt(text)
        params = SamplingParams(max_tokens=N, structured=StructuredOutput.from_dict({"json": SCHEMAS[name]}))
        plain = generate(none, prompt, params, grammars=grammars)
        refs[tuple(prompt)] = plain.output
        if name == "tool_get_weather":  # the real head's path (one case: it accepts ~nothing, so it is slow)
            assert generate(peagle, prompt, params, grammars=grammars).output == plain.output, name
        fast = generate(scripted, prompt, params, grammars=grammars)
        assert fast.output == plain.output, name
        assert fast.stats.acceptance_length > 1.5, name  # drafts were accepted under the masks
        if plain.finish_reason == "stop":
            ended_by_grammar += 1
            jsonschema.validate(json.loads(codec.decode(plain.output)), SCHEMAS[name])
    assert ended_by_grammar >= 2  # short answers: the grammar ends most of them within N tokens
