"""CLI flags: `--num-spec-tokens 0` is an error (it silently ran K = 7), and `generate`
has an option to raise the maximum sequence length its error message asks for."""

from __future__ import annotations

import json

import pytest

from peagle_trt.cli import main

pytestmark = pytest.mark.faults


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("k", ["0", "-1"])
def test_num_spec_tokens_below_one_is_an_error_not_k7(tiny, capsys, k):
    code = main(["generate", "--target", str(tiny["llama"]), "--drafter", str(tiny["aws"]), "--prompt", "x",
                 "--max-tokens", "2", "--num-spec-tokens", k])
    result = last_json(capsys)
    assert code == 2 and result["error_type"] == "ConfigError"
    assert "--num-spec-tokens must be >= 1" in result["error"] and "--spec-mode none" in result["error"]


def test_spec_mode_none_with_zero_spec_tokens_runs_the_target_alone(tiny, capsys):
    assert main(["generate", "--target", str(tiny["llama"]), "--drafter", str(tiny["aws"]), "--prompt", "x",
                 "--max-tokens", "3", "--ignore-eos", "--spec-mode", "none", "--num-spec-tokens", "0"]) == 0
    result = last_json(capsys)
    assert result["spec_mode"] == "none" and result["drafter_forwards"] == 0 and len(result["token_ids"]) == 3


def test_generate_max_seq_len_raises_the_limit_its_error_names(tiny, capsys):
    base = ["generate", "--target", str(tiny["llama"]), "--prompt", "word " * 40, "--no-chat-template",
            "--spec-mode", "none", "--max-tokens", "8", "--ignore-eos"]
    assert main(base + ["--max-seq-len", "32"]) == 2
    refused = last_json(capsys)
    assert refused["error_type"] == "RequestError" and "--max-seq-len" in refused["error"]
    assert main(base + ["--max-seq-len", "256"]) == 0
    assert len(last_json(capsys)["token_ids"]) == 8
