"""The flags several verbs share and what they resolve to: the speculation flags (`--spec-mode`,
`--num-spec-tokens`, `--speculative-config`, `--allow-synthetic-acceptance`) of `generate`, `build` and
`export`, resolved to one `SpecConfig` by `resolve_spec`; the paged KV flags of `build` and `export`;
and the help of `--deterministic`. Each verb's own parser lives in its package's cli.py
(peagle_trt/generate/cli.py, peagle_trt/build/cli.py, ...); tested by tests/e2e/test_cli.py and
tests/speculative/test_speculative_config.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from peagle_trt.config import BLOCK_SIZE, SPEC_MODES, SpecConfig
from peagle_trt.errors import ConfigError

DETERMINISTIC_HELP = ("row- and batch-invariant forwards: a request's output does not depend on its batch, draft "
                      "count or thread count (torch / onnxruntime backends; docs/SERVING.md, Deterministic mode)")


def resolve_spec(args: argparse.Namespace, purpose: str = "generate") -> SpecConfig:
    """Spec config from --speculative-config (else $SM_VLLM_SPECULATIVE_CONFIG) and/or --spec-mode /
    --num-spec-tokens. The JSON's "model" fills --drafter when that is not given."""
    from peagle_trt import speculative_config

    parsed = speculative_config.resolve(args.speculative_config, purpose)
    if parsed is not None:
        spec = parsed.spec
        if parsed.model is not None:
            if args.drafter is None:
                args.drafter = Path(parsed.model)
            elif Path(parsed.model).resolve() != Path(args.drafter).resolve():
                raise ConfigError(f"--drafter {args.drafter} contradicts \"model\": {parsed.model!r} of the "
                                  "speculative config; pass one of them")
        if args.spec_mode not in (None, spec.mode):
            raise ConfigError(f"--spec-mode {args.spec_mode} contradicts the speculative config "
                              f"(which means {spec.mode}); pass one of them")
        if args.num_spec_tokens not in (None, spec.num_spec_tokens):
            raise ConfigError(f"--num-spec-tokens {args.num_spec_tokens} contradicts "
                              f"num_speculative_tokens={spec.num_spec_tokens} in the speculative config")
        if spec.synthetic_rates and not getattr(args, "allow_synthetic_acceptance", False):
            raise ConfigError("rejection_sample_method 'synthetic' accepts drafts whatever their tokens: the "
                              "output is NOT the target's. It is for benchmarks (peagle-trt bench synthetic); "
                              "pass --allow-synthetic-acceptance to force it here")
        return spec
    mode = args.spec_mode
    if mode is None:  # default: P-EAGLE when the head has mask_hidden, else EAGLE-3, else none
        from peagle_trt.checkpoint.safetensors_io import tensor_names

        if args.drafter is None:
            mode = "none"
        else:
            names = tensor_names(Path(args.drafter))
            mode = "peagle" if {"mask_hidden", "model.mask_hidden"} & names else "eagle3"
    if args.num_spec_tokens is not None and args.num_spec_tokens < 1 and mode != "none":
        raise ConfigError(f"--num-spec-tokens must be >= 1, got {args.num_spec_tokens}; pass --spec-mode none "
                          "to generate without speculation")
    return SpecConfig(mode, 7 if args.num_spec_tokens is None else max(args.num_spec_tokens, 1))


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--spec-mode", choices=SPEC_MODES, default=None,
                   help="none | eagle3 (K sequential drafter passes) | peagle (one parallel pass); "
                        "default: peagle if the drafter has mask_hidden, else eagle3")
    p.add_argument("--num-spec-tokens", type=int, default=None, help="K, draft tokens per step (default 7)")
    p.add_argument("--speculative-config", default=None,
                   help='vLLM form, e.g. \'{"method":"eagle3","num_speculative_tokens":7,'
                        '"parallel_drafting":true}\' (default: $SM_VLLM_SPECULATIVE_CONFIG); keys: README.md')
    p.add_argument("--allow-synthetic-acceptance", action="store_true",
                   help="accept a synthetic rejection_sample_method (benchmarks only: output is not the target's)")


def add_kv_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-blocks", type=int, default=0,
                   help="KV cache blocks (full-attention layers and drafter); requests hold the blocks their "
                        "tokens need (default 0: room for --max-batch requests of --max-seq-len)")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help=f"positions per KV block (default {BLOCK_SIZE})")
