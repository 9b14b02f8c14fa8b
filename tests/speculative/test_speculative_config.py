"""vLLM's speculative config: every key implemented, warned or refused; the K schedule's
semantics (vLLM's: gaps and the tail keep the previous K); synthetic rates; the env variable;
the config.pbtxt round trip of the run-time keys; serve-time overrides of a built repository."""

from __future__ import annotations

import argparse
import json
import logging

import pytest

from peagle_trt.cli import build_parser
from peagle_trt.config import SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.flags import resolve_spec
from peagle_trt.serve.options import ArtifactPaths, RepositoryOptions, from_parameters, to_parameters
from peagle_trt.speculative_config import ENV, IGNORED, IMPLEMENTED, REFUSED, for_built, parse, resolve, to_vllm

# vLLM's SpeculativeConfig fields (vllm/config/speculative.py, read 2026-11-24)
VLLM_KEYS = {"enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size",
             "tensor_parallel_size", "quantization", "moe_backend", "attention_backend", "kv_cache_dtype",
             "max_model_len", "revision", "code_revision", "index_share_for_mtp_iteration",
             "disable_padded_drafter_batch", "disable_eagle_block_drop", "use_local_argmax_reduction",
             "use_heterogeneous_vocab", "prompt_lookup_max", "prompt_lookup_min", "parallel_drafting",
             "target_model_config", "target_parallel_config", "num_speculative_tokens_per_batch_size",
             "draft_model_config", "draft_parallel_config", "suffix_decoding_max_tree_depth",
             "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
             "suffix_decoding_min_token_prob", "draft_load_config", "rejection_sample_method",
             "synthetic_acceptance_rates", "synthetic_acceptance_length", "enable_adaptive_verification",
             "draft_sample_method", "dspark_draft_topk"}


def test_every_vllm_key_has_a_rule():
    ours = set(IGNORED) | set(REFUSED) | set(IMPLEMENTED)
    assert VLLM_KEYS <= ours
    # our own keys, and speculative_token_tree (vLLM's tree attention took it, PR #20401; since removed)
    assert ours - VLLM_KEYS == {"adaptive_num_speculative_tokens", "draft_tree_budget", "adaptive_draft_tree_budget",
                                "draft_tree_budget_per_batch_size", "speculative_token_tree"}


def test_bad_json_and_method():
    with pytest.raises(ConfigError, match=r"--speculative-config is not valid JSON"):
        parse('{"method": "eagle3", ')
    with pytest.raises(ConfigError, match=r"speculative method 'medusa' is not supported; use 'eagle3'"):
        parse('{"method": "medusa", "num_speculative_tokens": 5}')


def test_parallel_drafting_is_peagle():
    text = '{"method":"eagle3","num_speculative_tokens":5,"parallel_drafting":true}'
    assert parse(text).spec == SpecConfig("peagle", 5)
    assert parse('{"method":"eagle","num_speculative_tokens":3}').spec == SpecConfig("eagle3", 3)


def test_unknown_key_refused_ignored_key_warned(caplog):
    with pytest.raises(ConfigError, match=r"unknown key 'num_spec_tokens'"):
        parse('{"method":"eagle3","num_spec_tokens":5}')
    with pytest.raises(ConfigError, match=r"'tensor_parallel_size' is refused"):
        parse('{"method":"eagle3","tensor_parallel_size":2}')
    with caplog.at_level(logging.WARNING):
        parse('{"method":"eagle3","draft_tensor_parallel_size":1,"disable_padded_drafter_batch":false}')
    assert "draft_tensor_parallel_size=1 is ignored" in caplog.text
    assert "disable_padded_drafter_batch" not in caplog.text  # vLLM's default: nothing to say


@pytest.mark.parametrize("key,value,match", [
    ("rejection_sample_method", "block", "not implemented"),
    ("draft_sample_method", "probabilistic", "not implemented"),
    ("use_heterogeneous_vocab", True, "another vocabulary"),
    ("enable_adaptive_verification", True, "adaptive_num_speculative_tokens"),
])
def test_output_changing_keys_refused(key, value, match):
    with pytest.raises(ConfigError, match=match):
        parse(json.dumps({"method": "eagle3", "num_speculative_tokens": 4, key: value}))


def test_schedule_semantics_match_vllm():
    spec = parse('{"method":"eagle3","num_speculative_tokens":7,"parallel_drafting":true,'
                 '"num_speculative_tokens_per_batch_size":[[1,1,7],[2,4,5],[8,16,0]]}').spec
    assert [spec.k_for_batch(b) for b in (1, 2, 4, 5, 7, 8, 16, 17, 100)] == [7, 5, 5, 5, 5, 0, 0, 0, 0]
    assert SpecConfig("peagle", 7).k_for_batch(64) == 7


@pytest.mark.parametrize("schedule,match", [
    ([[2, 4, 5]], "start at 1"),
    ([[1, 4, 5], [3, 8, 2]], "without overlap"),
    ([[1, 4, 9]], r"0 <= K <= num_speculative_tokens \(7\)"),
    ([[1, 4]], "must be"),
    ([[1, 4, 1, 100, 3]], "context-bucketed"),
])
def test_bad_schedules(schedule, match):
    with pytest.raises(ConfigError, match=match):
        parse(json.dumps({"method": "eagle3", "num_speculative_tokens": 7,
                          "num_speculative_tokens_per_batch_size": schedule}))


def test_synthetic_rates():
    assert parse('{"num_speculative_tokens":4,"rejection_sample_method":"synthetic",'
                 '"synthetic_acceptance_length":2.5}').spec.synthetic_rates == (1.0, 0.5, 0.0, 0.0)
    rates = parse('{"num_speculative_tokens":3,"rejection_sample_method":"synthetic",'
                  '"synthetic_acceptance_rates":[0.9,0.5,0.2]}').spec.synthetic_rates
    assert rates == (0.9, 0.5, 0.2)
    with pytest.raises(ConfigError, match="non-increasing"):
        parse('{"num_speculative_tokens":2,"rejection_sample_method":"synthetic","synthetic_acceptance_rates":[0.5,0.9]}')
    with pytest.raises(ConfigError, match="need rejection_sample_method='synthetic'"):
        parse('{"num_speculative_tokens":2,"synthetic_acceptance_length":2}')
    with pytest.raises(ConfigError, match=r"must be in \[1, 3\]"):
        parse('{"num_speculative_tokens":2,"rejection_sample_method":"synthetic","synthetic_acceptance_length":4}')


def test_to_vllm_round_trip():
    spec = SpecConfig("peagle", 6, ((1, 2, 6), (3, 64, 2)), True, ())
    assert parse(json.dumps(to_vllm(spec))).spec == spec
    synth = SpecConfig("eagle3", 2, synthetic_rates=(0.75, 0.25))
    assert parse(json.dumps(to_vllm(synth))).spec == synth


def test_env_variable_and_flag_precedence(monkeypatch, caplog):
    monkeypatch.setenv(ENV, '{"method":"eagle3","num_speculative_tokens":3,"parallel_drafting":true}')
    with caplog.at_level(logging.INFO):
        assert resolve(None, "build").spec == SpecConfig("peagle", 3)
    assert f"speculative config from {ENV}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert resolve('{"num_speculative_tokens":5}', "build").spec == SpecConfig("eagle3", 5)
    assert f"{ENV} is set and ignored" in caplog.text
    monkeypatch.delenv(ENV)
    assert resolve(None, "build") is None


def test_cli_env_model_key_and_synthetic_refusal(monkeypatch, tmp_path):
    parser = build_parser()
    monkeypatch.setenv(ENV, json.dumps({"method": "eagle3", "num_speculative_tokens": 4, "model": str(tmp_path)}))
    args = parser.parse_args(["build", "--target", "t", "--output", "o"])
    assert resolve_spec(args, "build") == SpecConfig("eagle3", 4)
    assert args.drafter == tmp_path  # "model" named the drafter
    monkeypatch.setenv(ENV, '{"num_speculative_tokens":2,"rejection_sample_method":"synthetic",'
                            '"synthetic_acceptance_length":2}')
    with pytest.raises(ConfigError, match="--allow-synthetic-acceptance"):
        resolve_spec(parser.parse_args(["build", "--target", "t", "--output", "o"]), "build")
    forced = parser.parse_args(["build", "--target", "t", "--output", "o", "--allow-synthetic-acceptance"])
    assert resolve_spec(forced, "build").synthetic_rates == (1.0, 0.0)
    assert isinstance(forced, argparse.Namespace)


def test_run_time_keys_round_trip_config_pbtxt():
    spec = SpecConfig("peagle", 5, ((1, 1, 5), (2, 8, 3)), True, (0.9, 0.8, 0.5, 0.5, 0.1))
    options = RepositoryOptions(spec)
    params = to_parameters(options, ArtifactPaths("t"))
    assert all('"' not in v for v in params.values())  # config.pbtxt strings stay quote-free
    assert from_parameters(params)[0].speculation == spec
    old = {k: v for k, v in params.items() if k not in ("k_schedule", "adaptive_k", "synthetic_rates")}
    assert from_parameters(old)[0].speculation == SpecConfig("peagle", 5)  # a repository built before them
    for tree in (SpecConfig("peagle", 4, tree_budget=12, tree_schedule=((1, 2, 12), (3, 64, 0))),
                 SpecConfig("eagle3", 3, static_tree=((0,), (1,), (0, 0), (0, 0, 0)))):  # draft trees
        params = to_parameters(RepositoryOptions(tree), ArtifactPaths("t"))
        assert from_parameters(params)[0].speculation == tree and all('"' not in v for v in params.values())
        assert RepositoryOptions(tree).kv_layout.max_len == 2048 + tree.max_nodes + 1  # the tree's verify rows


def test_serve_time_trees_of_a_built_repository():
    built = SpecConfig("peagle", 7, tree_budget=16)
    assert for_built(built, parse('{"parallel_drafting":true,"num_speculative_tokens":7}')) == built
    runtime = parse('{"parallel_drafting":true,"num_speculative_tokens":7,"draft_tree_budget":8}')
    assert for_built(built, runtime).tree_budget == 8
    with pytest.raises(ConfigError, match="built for 16"):
        for_built(built, parse('{"parallel_drafting":true,"num_speculative_tokens":7,"draft_tree_budget":32}'))


def test_serve_time_override_of_a_built_repository():
    built = SpecConfig("peagle", 7)
    runtime = parse('{"method":"eagle3","parallel_drafting":true,"num_speculative_tokens":7,'
                    '"num_speculative_tokens_per_batch_size":[[1,2,7],[3,8,3]]}')
    assert for_built(built, runtime).k_schedule == ((1, 2, 7), (3, 8, 3))
    with pytest.raises(ConfigError, match="built for peagle"):
        for_built(built, parse('{"num_speculative_tokens":7}'))
    with pytest.raises(ConfigError, match="lower K with num_speculative_tokens_per_batch_size"):
        for_built(built, parse('{"parallel_drafting":true,"num_speculative_tokens":3}'))
