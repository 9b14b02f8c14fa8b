"""`peagle-trt generate`: streams text, last stdout line is JSON with the promised keys, and the
spec-config flags resolve as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from peagle_trt.cli import build_parser, main
from peagle_trt.config import SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.flags import resolve_spec

KEYS = {"token_ids", "text", "acceptance_length", "accept_rate_per_pos", "target_forwards",
        "drafter_forwards"}


def run_cli(capsys, *argv) -> tuple[int, str, dict]:
    code = main(list(argv))
    out = capsys.readouterr().out
    return code, out, json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["none", "eagle3", "peagle"])
def test_generate_json_last_line_and_greedy_equality(tiny, capsys, mode):
    base = ["generate", "--target", str(tiny["llama"]), "--drafter", str(tiny["aws"]),
            "--prompt", "Write a poem", "--max-tokens", "12", "--ignore-eos", "--deterministic"]
    code, out, result = run_cli(capsys, *base, "--spec-mode", mode, "--num-spec-tokens", "3")
    assert code == 0 and KEYS <= set(result)
    assert len(result["token_ids"]) == 12
    _, _, plain = run_cli(capsys, *base, "--spec-mode", "none")
    assert result["token_ids"] == plain["token_ids"] and result["text"] == plain["text"]
    expected_drafter = {"none": 0, "peagle": result["steps"], "eagle3": 3 * result["steps"]}[mode]
    assert result["drafter_forwards"] == expected_drafter
    assert out.startswith(result["text"].rstrip("\ufffd")[:5])  # the text was streamed first


def test_chat_template_applied_unless_disabled(tiny, capsys):
    base = ["generate", "--target", str(tiny["llama"]), "--prompt", "hi", "--max-tokens", "2",
            "--spec-mode", "none"]
    _, _, templated = run_cli(capsys, *base)
    _, _, raw = run_cli(capsys, *base, "--no-chat-template")
    assert templated["prompt_tokens"] > raw["prompt_tokens"]


def test_speculative_config_json(tiny):
    parser = build_parser()
    args = parser.parse_args(["generate", "--target", "t", "--prompt", "p", "--speculative-config",
                              '{"method":"eagle3","num_speculative_tokens":5,"parallel_drafting":true}'])
    assert resolve_spec(args) == SpecConfig("peagle", 5)
    args = parser.parse_args(["generate", "--target", "t", "--prompt", "p", "--speculative-config",
                              '{"method":"eagle3","num_speculative_tokens":4}'])
    assert resolve_spec(args) == SpecConfig("eagle3", 4)
    args = parser.parse_args(["generate", "--target", "t", "--prompt", "p", "--spec-mode", "none",
                              "--speculative-config", '{"method":"eagle3","parallel_drafting":true}'])
    with pytest.raises(ConfigError, match="contradicts"):
        resolve_spec(args)


def test_the_config_model_key_names_the_drafter(tiny, capsys):
    """The README's way: no --drafter, the drafter named by the speculative config's "model"."""
    config = json.dumps({"method": "eagle3", "parallel_drafting": True, "num_speculative_tokens": 3,
                         "model": str(tiny["aws"])})
    code, _, result = run_cli(capsys, "generate", "--target", str(tiny["llama"]), "--prompt", "Write a poem",
                              "--max-tokens", "6", "--ignore-eos", "--speculative-config", config)
    assert code == 0 and result["spec_mode"] == "peagle" and result["drafter_forwards"] > 0


@pytest.mark.parametrize("tree", [{"draft_tree_budget": 6}, {"speculative_token_tree": "[(0,), (1,), (0, 0)]"}])
def test_generate_with_a_draft_tree(tiny, capsys, tree):
    config = json.dumps({"method": "eagle3", "parallel_drafting": True, "model": str(tiny["aws"]), **tree})
    base = ["generate", "--target", str(tiny["llama"]), "--prompt", "Write a poem", "--max-tokens", "10",
            "--ignore-eos"]
    code, _, result = run_cli(capsys, *base, "--speculative-config", config)
    _, _, plain = run_cli(capsys, *base, "--spec-mode", "none")
    assert code == 0 and result["token_ids"] == plain["token_ids"] and result["drafter_forwards"] > 0


def test_default_spec_mode_follows_the_drafter(tiny):
    parser = build_parser()
    for drafter, mode in (("aws", "peagle"), ("eagle3", "eagle3")):
        args = parser.parse_args(["generate", "--target", str(tiny["llama"]), "--drafter",
                                  str(tiny[drafter]), "--prompt", "p"])
        assert resolve_spec(args).mode == mode
    args = parser.parse_args(["generate", "--target", str(tiny["llama"]), "--prompt", "p"])
    assert resolve_spec(args).mode == "none"


def test_stop_string_cuts_the_text(tiny, capsys):
    base = ["generate", "--target", str(tiny["llama"]), "--prompt", "Write", "--max-tokens", "30",
            "--spec-mode", "none", "--ignore-eos"]
    _, _, full = run_cli(capsys, *base)
    stop = full["text"][6:9]
    _, out, cut = run_cli(capsys, *base, "--stop", stop)
    assert cut["finish_reason"] == "stop" and stop not in cut["text"]
    assert full["text"].startswith(cut["text"]) and len(cut["text"]) <= full["text"].find(stop)


def test_bad_input_exits_nonzero_with_json_error(tiny, capsys):
    code, _, result = run_cli(capsys, "generate", "--target", str(tiny["llama"]), "--drafter",
                              str(tiny["eagle3"]), "--prompt", "x", "--spec-mode", "peagle")
    assert code == 2 and result["error_type"] == "PairingError" and "mask_hidden" in result["error"]


def test_console_script_runs_as_a_module(tiny):
    proc = subprocess.run([sys.executable, "-m", "peagle_trt.cli", "generate", "--target", str(tiny["qwen3"]),
                           "--drafter", str(tiny["speculators"]), "--prompt", "hello", "--max-tokens", "5",
                           "--temperature", "0.8", "--seed", "3", "--top-k", "20", "--top-p", "0.9"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["spec_mode"] == "peagle" and len(result["token_ids"]) <= 5


def test_third_party_progress_bars_only_with_verbose(tmp_path):
    """transformers' "Writing model shards" / "Loading weights" bars are silenced unless --verbose."""
    # in-process main() calls of other tests set these for this process: start children without them
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_VERBOSITY")}

    def stderr_of(*flags):
        out = str(tmp_path / str(len(flags)))
        proc = subprocess.run([sys.executable, "-m", "peagle_trt.cli", *flags, "make-tiny", out],
                              capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert "model shards" not in stderr_of()
    assert "model shards" in stderr_of("--verbose")


def test_missing_checkpoint_directory_is_a_clear_error(tmp_path, capsys):
    code, _, result = run_cli(capsys, "generate", "--target", str(tmp_path / "nope"), "--drafter",
                              str(tmp_path / "nope2"), "--prompt", "x")
    assert code == 2 and result["error_type"] == "CheckpointError" and "no such checkpoint directory" in result["error"]


def test_generate_structured_output_flags(tiny, capsys, tmp_path):
    """--json-schema / --regex / --choice: P-EAGLE equals target-only, and the output follows."""
    import re

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                                  "additionalProperties": False}))
    base = ["generate", "--target", str(tiny["llama"]), "--drafter", str(tiny["aws"]), "--prompt", "Answer",
            "--max-tokens", "16", "--backend", "torch"]
    for flags, check in [(["--json-schema", str(schema)], lambda t: json.loads(t)["ok"] in (True, False)),
                         (["--regex", "[0-9]{2}-[a-z]{2}"], lambda t: re.fullmatch("[0-9]{2}-[a-z]{2}", t)),
                         (["--choice", "yes", "no way"], lambda t: t in ("yes", "no way"))]:
        _, _, spec = run_cli(capsys, *base, *flags, "--spec-mode", "peagle", "--num-spec-tokens", "3")
        _, _, plain = run_cli(capsys, *base, *flags, "--spec-mode", "none")
        assert spec["token_ids"] == plain["token_ids"] and spec["finish_reason"] == "stop", flags
        assert check(spec["text"]), (flags, spec["text"])
    assert main([*base, "--regex", "a", "--choice", "a"]) != 0
    assert "at most one of --json-schema" in capsys.readouterr().err
