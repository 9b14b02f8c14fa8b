"""vLLM's speculative config (`--speculative-config` JSON, or SageMaker's SM_VLLM_SPECULATIVE_CONFIG)
-> SpecConfig: every key of vLLM's SpeculativeConfig is implemented, or named in a warning when it
cannot change the output, or refused when it would (or when we lack what it asks for); a key vLLM
does not have is refused too (a typo must not pass in silence).

    {"method": "eagle3", "num_speculative_tokens": 7, "parallel_drafting": true,
     "num_speculative_tokens_per_batch_size": [[1, 1, 7], [2, 4, 5], [5, 64, 3]],
     "adaptive_num_speculative_tokens": true}

    {"method": "eagle3", "num_speculative_tokens": 4, "parallel_drafting": true,
     "draft_tree_budget": 16, "adaptive_draft_tree_budget": true}

Implemented: method (eagle / eagle3), num_speculative_tokens, parallel_drafting (P-EAGLE), model
(the drafter: a directory or a hub id, peagle_trt/hub.py; when --drafter is not given), revision (its
hub revision), num_speculative_tokens_per_batch_size (3-item
entries), rejection_sample_method ("standard"; "synthetic" with synthetic_acceptance_rates or
_length, for benchmarks), draft_sample_method ("greedy"), speculative_token_tree (a static draft tree
of rank paths; num_speculative_tokens = its nodes, as in vLLM). Ours: adaptive_num_speculative_tokens,
draft_tree_budget (the B most probable prefixes of depth <= K per step) and
draft_tree_budget_per_batch_size (the budget by batch size, entries as the K schedule's; 0: the chain),
adaptive_draft_tree_budget (each step's budget, the chain or a tree of up to the budget or the
schedule's, by measured tokens per second; not with adaptive K).
The table of every key and what it does here: README.md, "Speculative config".
`resolve(flag_text, purpose)` picks the flag, else the environment variable, and logs which.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass

from peagle_trt.config import SpecConfig
from peagle_trt.errors import ConfigError
from peagle_trt.speculative.tree import parse_static

log = logging.getLogger(__name__)
ENV = "SM_VLLM_SPECULATIVE_CONFIG"  # what the AWS P-EAGLE launch documents for SageMaker
# `serve` -> the Triton model (peagle_trt/serve/triton_model.py): the run-time keys over the built config
SERVE_ENV = "PEAGLE_SERVE_SPECULATIVE_CONFIG"

# vLLM keys that cannot change our output, with their vLLM default: a different value is ignored
# with a warning saying why.
IGNORED = {
    "enforce_eager": (None, "graphs are fixed at build"),
    "draft_tensor_parallel_size": (None, "one device per model here"),
    "quantization": (None, "the drafter's precision follows the build (--quantization)"),
    "moe_backend": (None, "kernels are chosen at build"),
    "attention_backend": (None, "attention is the PEagleKVAttention op"),
    "kv_cache_dtype": (None, "the drafter's KV cache follows the target's (--kv-cache-dtype of build / serve)"),
    "max_model_len": (None, "the drafter shares the target's max_seq_len"),
    "code_revision": (None, "no repository code is ever run here (safetensors and config only)"),
    "index_share_for_mtp_iteration": (None, "MTP only"),
    "disable_padded_drafter_batch": (False, "drafter batches are padded"),
    "disable_eagle_block_drop": (False, "the prefix cache keys drafter blocks with the next token"),
    "use_local_argmax_reduction": (False, "no vocabulary parallelism here"),
    "prompt_lookup_max": (None, "n-gram only"),
    "prompt_lookup_min": (None, "n-gram only"),
    "suffix_decoding_max_tree_depth": (24, "suffix decoding only"),
    "suffix_decoding_max_cached_requests": (10000, "suffix decoding only"),
    "suffix_decoding_max_spec_factor": (1.0, "suffix decoding only"),
    "suffix_decoding_min_token_prob": (0.1, "suffix decoding only"),
    "draft_load_config": (None, "checkpoints are local safetensors"),
    "dspark_draft_topk": (None, "DSpark only"),
}
# vLLM keys we refuse whatever their value (besides the value checks below), and why.
REFUSED = {
    "tensor_parallel_size": "vLLM refuses it too: pass draft_tensor_parallel_size",
    "target_model_config": "an internal vLLM field, not an option",
    "target_parallel_config": "an internal vLLM field, not an option",
    "draft_model_config": "an internal vLLM field, not an option",
    "draft_parallel_config": "an internal vLLM field, not an option",
}
IMPLEMENTED = ("method", "num_speculative_tokens", "parallel_drafting", "model",
               "num_speculative_tokens_per_batch_size",
               "rejection_sample_method", "synthetic_acceptance_rates", "synthetic_acceptance_length",
               "draft_sample_method", "use_heterogeneous_vocab", "enable_adaptive_verification",
               "adaptive_num_speculative_tokens", "speculative_token_tree", "draft_tree_budget",
               "draft_tree_budget_per_batch_size", "adaptive_draft_tree_budget", "revision")


@dataclass(frozen=True)
class ParsedSpec:
    spec: SpecConfig
    model: str | None = None  # the drafter named by "model" (a directory or a hub id), if any
    source: str = "flag"  # "flag" | ENV
    revision: str | None = None  # "revision": the drafter's hub revision (branch, tag or commit)


def parse(text: str, source: str = "flag") -> ParsedSpec:
    """The SpecConfig of a vLLM speculative-config JSON text; ConfigError names the bad key."""
    where = "--speculative-config" if source == "flag" else ENV
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise ConfigError(f"{where} must be a JSON object")
    for key, value in obj.items():
        if key in REFUSED:
            raise ConfigError(f"{where}: {key!r} is refused ({REFUSED[key]})")
        if key in IGNORED:
            default, why = IGNORED[key]
            if value != default:
                log.warning("%s: %s=%r is ignored: %s (it cannot change the output)", where, key, value, why)
        elif key not in IMPLEMENTED:
            raise ConfigError(f"{where}: unknown key {key!r} (not one of vLLM's speculative-config keys); "
                              "see README.md, 'Speculative config'")
    method = obj.get("method", "eagle3")
    if method not in ("eagle3", "eagle"):
        raise ConfigError(f"{where}: speculative method {method!r} is not supported; use 'eagle3' "
                          "(with parallel_drafting=true for P-EAGLE)")
    k = obj.get("num_speculative_tokens", 7)
    if not _int(k) or not 1 <= k <= 64:
        raise ConfigError(f"{where}: num_speculative_tokens must be an integer in [1, 64], got {k!r}")
    paths = ()
    if obj.get("speculative_token_tree") is not None:
        text = obj["speculative_token_tree"]
        if not isinstance(text, str):
            raise ConfigError(f"{where}: speculative_token_tree must be a string like \"[(0,), (1,), (0, 0)]\"")
        paths = parse_static(text)
        if "num_speculative_tokens" in obj and k != len(paths):
            raise ConfigError(f"{where}: num_speculative_tokens={k} but speculative_token_tree has {len(paths)} "
                              "nodes; they must be equal (or leave num_speculative_tokens out)")
        k = max(len(p) for p in paths)  # the drafter's positions: the tree's depth
    budget = obj.get("draft_tree_budget", 0)
    if "draft_tree_budget" in obj and (not _int(budget) or not 1 <= budget <= 64):
        raise ConfigError(f"{where}: draft_tree_budget must be an integer in [1, 64] (nodes per step), got {budget!r}")
    for key, allowed in (("draft_sample_method", ("greedy",)), ("rejection_sample_method", ("standard", "synthetic"))):
        if obj.get(key, allowed[0]) not in allowed:
            raise ConfigError(f"{where}: {key}={obj[key]!r} is not implemented (only {', '.join(allowed)}): "
                              "it would change how outputs are sampled")
    if obj.get("use_heterogeneous_vocab"):
        raise ConfigError(f"{where}: use_heterogeneous_vocab needs a draft model of another vocabulary; "
                          "EAGLE heads share the target's (their draft vocabulary maps through d2t)")
    if obj.get("enable_adaptive_verification"):
        raise ConfigError(f"{where}: enable_adaptive_verification is DSpark's (vLLM refuses it for EAGLE too); "
                          "for per-request adaptive K use adaptive_num_speculative_tokens")
    adaptive = obj.get("adaptive_num_speculative_tokens", False)
    if not isinstance(adaptive, bool):
        raise ConfigError(f"{where}: adaptive_num_speculative_tokens must be true or false, got {adaptive!r}")
    adaptive_tree = obj.get("adaptive_draft_tree_budget", False)
    if not isinstance(adaptive_tree, bool):
        raise ConfigError(f"{where}: adaptive_draft_tree_budget must be true or false, got {adaptive_tree!r}")
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise ConfigError(f"{where}: model must be a drafter directory or hub id (org/name), got {model!r}")
    revision = obj.get("revision")
    if revision is not None and (not isinstance(revision, str) or model is None):
        raise ConfigError(f"{where}: revision must be a string naming the hub revision of \"model\" (a branch, tag "
                          f"or commit), given with \"model\"; got {revision!r}")
    tree_schedule = _schedule(obj.get("draft_tree_budget_per_batch_size"), where, "budget")
    spec = SpecConfig("peagle" if obj.get("parallel_drafting") else "eagle3", k,
                      _schedule(obj.get("num_speculative_tokens_per_batch_size"), where), adaptive,
                      _synthetic(obj, k, where), budget, tree_schedule, paths, adaptive_tree)
    return ParsedSpec(spec, model, source, revision)


def resolve(flag_text: str | None, purpose: str) -> ParsedSpec | None:
    """The flag's config, else SM_VLLM_SPECULATIVE_CONFIG's, else None; logs which was used."""
    env_text = os.environ.get(ENV)
    if flag_text:
        if env_text:
            log.info("%s: --speculative-config given; %s is set and ignored", purpose, ENV)
        return parse(flag_text)
    if env_text:
        log.info("%s: speculative config from %s: %s", purpose, ENV, env_text)
        return parse(env_text, ENV)
    return None


def to_vllm(spec: SpecConfig) -> dict:
    """The vLLM JSON of `spec` (what config.pbtxt and results record); parse(to_vllm(s)) == s."""
    if spec.mode == "none":
        return {}
    out = {"method": "eagle3", "num_speculative_tokens": spec.num_spec_tokens}
    if spec.mode == "peagle":
        out["parallel_drafting"] = True
    if spec.k_schedule:
        out["num_speculative_tokens_per_batch_size"] = [list(e) for e in spec.k_schedule]
    if spec.adaptive:
        out["adaptive_num_speculative_tokens"] = True
    if spec.synthetic_rates:
        out.update(rejection_sample_method="synthetic", synthetic_acceptance_rates=list(spec.synthetic_rates))
    if spec.static_tree:
        out.update(num_speculative_tokens=len(spec.static_tree), speculative_token_tree=str(list(spec.static_tree)))
    if spec.tree_budget:
        out["draft_tree_budget"] = spec.tree_budget
    if spec.tree_schedule:
        out["draft_tree_budget_per_batch_size"] = [list(e) for e in spec.tree_schedule]
    if spec.adaptive_tree:
        out["adaptive_draft_tree_budget"] = True
    return out


def synthetic_rates_for_length(length: float, k: int) -> tuple[float, ...]:
    """Unconditional per-position rates giving mean acceptance length `length` with the least
    variance (vLLM's rule): the first floor(length - 1) drafts always accepted, the next with the
    fractional part, the rest never."""
    if not 1 <= length <= k + 1:
        raise ConfigError(f"synthetic_acceptance_length must be in [1, {k + 1}], got {length}")
    full = int(length - 1)
    return tuple([1.0] * full + [round(length - 1 - full, 12)] + [0.0] * k)[:k]


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _schedule(value, where: str, what: str = "K") -> tuple[tuple[int, int, int], ...]:
    key = "num_speculative_tokens_per_batch_size" if what == "K" else "draft_tree_budget_per_batch_size"
    if value is None:
        return ()
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: {key} must be a non-empty list of "
                          f"[first batch size, last batch size, {what}]")
    entries = []
    for entry in value:
        if isinstance(entry, list) and len(entry) == 5:
            raise ConfigError(f"{where}: context-bucketed schedule entries (5 items) are not implemented; "
                              f"use [first batch size, last batch size, {what}]")
        if not isinstance(entry, list) or len(entry) != 3 or not all(_int(x) for x in entry):
            raise ConfigError(f"{where}: schedule entry {entry!r} must be [first batch size, last batch size, {what}]")
        entries.append(tuple(entry))
    return tuple(entries)


def _synthetic(obj: dict, k: int, where: str) -> tuple[float, ...]:
    rates, length = obj.get("synthetic_acceptance_rates"), obj.get("synthetic_acceptance_length")
    if obj.get("rejection_sample_method", "standard") != "synthetic":
        if rates is not None or length is not None:
            raise ConfigError(f"{where}: synthetic_acceptance_rates / _length need "
                              "rejection_sample_method='synthetic'")
        return ()
    if (rates is None) == (length is None):
        raise ConfigError(f"{where}: rejection_sample_method='synthetic' needs exactly one of "
                          "synthetic_acceptance_rates and synthetic_acceptance_length")
    if length is not None:
        if not isinstance(length, (int, float)) or isinstance(length, bool) or not math.isfinite(length):
            raise ConfigError(f"{where}: synthetic_acceptance_length must be a number, got {length!r}")
        return synthetic_rates_for_length(float(length), k)
    if not isinstance(rates, list) or not all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in rates):
        raise ConfigError(f"{where}: synthetic_acceptance_rates must be a list of numbers, got {rates!r}")
    return tuple(float(r) for r in rates)


def for_built(built: SpecConfig, parsed: ParsedSpec) -> SpecConfig:
    """`built` (a repository's) with the run-time keys of `parsed` (a serve-time config): the K
    schedule, adaptive K, synthetic acceptance. Method and K are fixed by the build: they must
    match (or K be left out); the drafter is the repository's."""
    spec = parsed.spec
    if spec.mode != built.mode:
        raise ConfigError(f"the speculative config asks for {spec.mode} but the repository was built for "
                          f"{built.mode}; rebuild, or leave method / parallel_drafting as built")
    if spec.num_spec_tokens != built.num_spec_tokens:
        raise ConfigError(f"num_speculative_tokens={spec.num_spec_tokens} differs from the {built.num_spec_tokens} "
                          "the repository was built for; lower K with num_speculative_tokens_per_batch_size or "
                          "adaptive_num_speculative_tokens, or rebuild")
    if parsed.model is not None or parsed.revision is not None:
        raise ConfigError("\"model\" (and its \"revision\") cannot change when a built repository is served: the "
                          "drafter is the repository's; serve the target instead (`peagle-trt serve MODEL "
                          "--speculative-config ...` builds the pair into a cache) or rebuild")
    if not spec.tree:  # the build's draft tree, if any
        return dataclasses.replace(spec, tree_budget=built.tree_budget, tree_schedule=built.tree_schedule,
                                   static_tree=built.static_tree, adaptive_tree=built.adaptive_tree)
    if spec.max_nodes > built.max_nodes:
        raise ConfigError(f"the draft tree verifies up to {spec.max_nodes} tokens per step but the repository was "
                          f"built for {built.max_nodes}; shrink the tree or rebuild with it")
    return spec
