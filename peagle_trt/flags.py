"""The flags several verbs share and what they resolve to: the speculation flags (`--spec-mode`,
`--num-spec-tokens`, `--speculative-config`, `--allow-synthetic-acceptance`) of `generate`, `build` and
`export`, resolved to one `SpecConfig` by `resolve_spec`; the paged KV flags of `build` and `export`
(`--kv-cache-dtype` also of `generate`);
the help of `--deterministic`; `resolve_models`, which turns `--target` / `--drafter` (and the
speculative config's "model") into local directories through peagle_trt/hub.py, the published heads
of peagle_trt/published.py naming a missing target and refusing a wrong one; and `normalize_argv`
(a leading typographic dash, `—tp`, as web pages print `--tp`, read as `--`). Each verb's own parser
lives in its package's cli.py (peagle_trt/generate/cli.py, peagle_trt/build/cli.py, ...); tested by
tests/e2e/test_cli.py, tests/speculative/test_speculative_config.py and tests/test_hub.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from peagle_trt.config import BLOCK_SIZE, KV_CACHE_DTYPES, SPEC_MODES, SpecConfig
from peagle_trt.errors import ConfigError

KV_DTYPE_HELP = ("what the KV caches (target and drafter) store: auto = the model's dtype (default); fp8 = E4M3 "
                 "codes with the checkpoint's calibrated k_scale / v_scale, else 1.0 (vLLM's --kv-cache-dtype fp8)")
DETERMINISTIC_HELP = ("row- and batch-invariant forwards: a request's output does not depend on its batch, draft "
                      "count or thread count (torch / onnxruntime backends; docs/SERVING.md, Deterministic mode)")


def resolve_spec(args: argparse.Namespace, purpose: str = "generate") -> SpecConfig:
    """Spec config from --speculative-config (else $SM_VLLM_SPECULATIVE_CONFIG) and/or --spec-mode /
    --num-spec-tokens. The JSON's "model" fills --drafter when that is not given."""
    from peagle_trt import speculative_config

    parsed = speculative_config.resolve(args.speculative_config, purpose)
    if parsed is not None and parsed.model is not None:
        if args.drafter is None:
            args.drafter = parsed.model
        elif str(parsed.model) != str(args.drafter) and Path(parsed.model).resolve() != Path(args.drafter).resolve():
            raise ConfigError(f"--drafter {args.drafter} contradicts \"model\": {parsed.model!r} of the "
                              "speculative config; pass one of them")
    resolve_models(args, parsed.revision if parsed is not None else None)
    if parsed is not None:
        spec = parsed.spec
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


def fill_target(args: argparse.Namespace) -> None:
    """No --target but a published head as --drafter: the target of the head's card (said on stderr)."""
    from peagle_trt import hub, published

    ref = hub.parse_id(getattr(args, "drafter", None))
    head = published.published_head(ref.repo_id) if ref else None
    if head is not None and getattr(args, "target", None) is None:
        args.target = published.default_target(head)
        print(f"[models] --target {args.target}: the target {head.head} was trained for (its model card)",
              file=sys.stderr, flush=True)


def resolve_models(args: argparse.Namespace, drafter_revision: str | None = None) -> None:
    """args.target and args.drafter as local directories: hub ids resolved into the Hugging Face
    cache (peagle_trt/hub.py); a published head as --drafter (peagle_trt/published.py) gives a missing
    --target and refuses one it was not trained for, before anything is fetched."""
    from peagle_trt import hub, published

    fill_target(args)
    drafter_ref = hub.parse_id(args.drafter)
    head = published.published_head(drafter_ref.repo_id) if drafter_ref else None
    target_ref = hub.parse_id(args.target)
    if head is not None and target_ref is not None:
        published.check_pairing(head, target_ref.repo_id, None)
    if args.target is None:
        raise ConfigError("--target is required: a target directory or hub id (org/name); it may be left out "
                          "only when --drafter names a published P-EAGLE head (peagle_trt/published.py)")
    args.target = hub.resolve(args.target, what="--target")
    if head is not None and target_ref is None:
        published.check_pairing(head, None, model_type(args.target))
    if args.drafter is not None:
        args.drafter = hub.resolve(args.drafter, revision=drafter_revision, what="--drafter")


def model_type(model_dir: Path) -> str | None:
    """config.json's model_type (a multimodal wrapper's text_config one when it has none), or None."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("model_type") or (config.get("text_config") or {}).get("model_type")


def normalize_argv(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """A leading em or en dash (`—tp`: how web pages and word processors print `--tp`) read as `--`
    where that makes a flag `parser` (or one of its verbs) knows, said on stderr; all else unchanged
    (a prompt that starts with a dash stays as it is)."""
    known = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for verb in action.choices.values():
                known |= set(verb._option_string_actions)
    out = []
    for arg in argv:
        fixed = "--" + arg[1:]
        if arg[:1] in ("\u2014", "\u2013") and fixed.split("=", 1)[0] in known:
            print(f"[cli] read {arg!r} as {fixed!r} (a typographic dash)", file=sys.stderr, flush=True)
            arg = fixed
        out.append(arg)
    return out


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
    add_kv_dtype_flag(p)


def add_kv_dtype_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_DTYPE_HELP)
