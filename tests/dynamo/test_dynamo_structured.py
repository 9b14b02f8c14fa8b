"""Structured output through NVIDIA Dynamo's own frontend: a client sends OpenAI's
`response_format` with a JSON schema; Dynamo's preprocessor turns it into
`sampling_options.guided_decoding` for the worker (peagle_trt/dynamo/engine.py), whose P-EAGLE
output is token-identical to the constrained target alone (the same repository's target, no
speculation, in process: same backend, deterministic mode) and validates against the schema. A bad
schema is refused by the worker as Dynamo's InvalidArgument, which the frontend answers with a 400
carrying the reason; the worker goes on serving.
One worker (the tiny pair of tests/dynamo/conftest.py), file discovery, a private network namespace.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.dynamo.cluster import Deployment

pytestmark = [pytest.mark.dynamo, pytest.mark.timeout(600)]
SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "structured" / "schemas.json").read_text())
WEATHER = SCHEMAS["tool_get_weather"]
EXTRA = {"nvext": {"extra_fields": ["completion_token_ids"]}}
MESSAGES = [{"role": "user", "content": "The weather in Paris, as JSON"}]


@pytest.fixture(scope="module")
def deployment(dynamo_python, dyn_repo, tmp_path_factory):
    dep = Deployment(tmp_path_factory.mktemp("dynamo_structured"), dynamo_python, dyn_repo)
    dep.start_frontend()
    dep.start_worker("127.0.0.2")
    try:
        dep.wait_ready(1)
        yield dep
    finally:
        dep.stop()


@pytest.fixture(scope="module")
def target_alone(dyn_repo):
    """The repository's target without its drafter, in process (the worker's code, no Dynamo)."""
    from peagle_trt.config import SpecConfig
    from peagle_trt.serve.generator import TextGenerator
    from peagle_trt.serve.options import read_options

    model_dir, options, paths = read_options(dyn_repo, "peagle")
    assert options.deterministic
    return TextGenerator.load(model_dir, dataclasses.replace(options, speculation=SpecConfig("none", 0)), paths)


def test_response_format_json_schema_equals_the_constrained_target_alone(deployment, target_alone):
    import jsonschema

    from peagle_trt.config import SamplingParams, StructuredOutput

    fmt = {"type": "json_schema", "json_schema": {"name": "get_weather", "schema": WEATHER, "strict": True}}
    body = {"model": "peagle", "messages": MESSAGES, "max_tokens": 64, "temperature": 0, "response_format": fmt,
            **EXTRA}
    with deployment.client() as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice, ids = r.json()["choices"][0], r.json()["nvext"]["completion_token_ids"]
    ref = target_alone.generate(MESSAGES[0]["content"], SamplingParams(
        max_tokens=64, temperature=0.0, structured=StructuredOutput.from_dict({"json": WEATHER})))
    assert ref["finish_reason"] == "stop", ref  # the reference ended by the grammar, within max_tokens
    assert ids == ref["token_ids"]  # the end token (EOS) included
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), WEATHER)


def test_a_bad_schema_is_a_400_with_the_reason_and_the_worker_goes_on(deployment):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
    body = {"model": "peagle", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    with deployment.client() as c:
        r = c.post("/v1/chat/completions", json={**body, "response_format": bad})
        assert r.status_code == 400, r.text
        assert "invalid JSON schema" in r.text and "objekt" in r.text, r.text
        # Dynamo's frontend refuses vLLM's structured_outputs itself (docs/SERVING.md)
        refused = c.post("/v1/chat/completions", json={**body, "structured_outputs": {"regex": "[0-9]+"}})
        assert refused.status_code == 400 and "structured_outputs" in refused.text, refused.text
        ok = c.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["message"]["content"].startswith("{")  # forwarded: an object
