"""`peagle-trt inspect DIR [DIR]`: what a checkpoint directory is, and whether a pair fits.

    peagle-trt inspect DRAFTER_DIR                    # layout, flags, K trained for, taps, vocab map
    peagle-trt inspect TARGET_DIR DRAFTER_DIR [--spec-mode peagle] [--num-spec-tokens 7] [--max-seq-len 2048]
                      [--backend torch|onnxruntime|tensorrt]

A directory is a drafter when its config.json names a `speculators_model_type` or its weights
hold an `fc` projection; otherwise it is read as a target. A pair goes through the checks
`build` runs (`validate_pair`; for --backend tensorrt the drafter's sliding-window limit), so a head that will not
load fails here, before anything is built, with the same message. The last stdout line is one
JSON object (printed by peagle_trt/cli.py). Tests: tests/checkpoint/test_inspect.py.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from peagle_trt.checkpoint.drafter import DrafterCheckpoint, check_window, load_drafter
from peagle_trt.checkpoint.safetensors_io import read_config, tensor_names
from peagle_trt.checkpoint.target import load_target_config
from peagle_trt.checkpoint.validate import validate_pair
from peagle_trt.config import PREFILL_CHUNK, SPEC_MODES, SpecConfig
from peagle_trt.errors import ConfigError

DRAFTER_TENSORS = {"fc.weight", "model.fc.weight"}


def add_parser(sub) -> argparse.ArgumentParser:
    """Register `inspect` on an argparse subparsers object; sets func=cmd_inspect."""
    p = sub.add_parser("inspect", help="describe a target / drafter directory and check whether a pair fits")
    p.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="one checkpoint directory, or a target "
                   "and a drafter (either order); hub ids (org/name) are resolved into the Hugging Face cache")
    p.add_argument("--spec-mode", choices=SPEC_MODES, default=None,
                   help="mode to check the pair for (default: peagle for P-EAGLE heads, else eagle3)")
    p.add_argument("--num-spec-tokens", type=int, default=None,
                   help="K to check (default: the K the head was trained for, else 7)")
    p.add_argument("--max-seq-len", type=int, default=2048,
                   help="prompt + output tokens to check (default 2048)")
    p.add_argument("--backend", choices=("torch", "onnxruntime", "tensorrt"), default="torch",
                   help="backend to check for (default torch; torch and onnxruntime compute sliding "
                        "windows exactly, the TensorRT plugins do not)")
    p.set_defaults(func=cmd_inspect)
    return p


def is_drafter(path: Path) -> bool:
    return "speculators_model_type" in read_config(path) or bool(DRAFTER_TENSORS & tensor_names(path))


def describe_target(path: Path) -> dict:
    c = load_target_config(path)
    return {"kind": "target", "path": str(path), "family": c.arch, "layers": c.num_layers,
            "hidden_size": c.hidden_size, "vocab_size": c.vocab_size, "heads": c.num_heads,
            "kv_heads": c.num_kv_heads, "head_dim": c.head_dim, "rope": asdict(c.rope),
            "qk_norm": c.qk_norm, "quantization": c.quantization, "default_taps": list(c.default_taps),
            **({"layer_attention": [_layer_line(c, i) for i in range(c.num_layers)]} if c.layer_attention else {})}


def _layer_line(c, i: int) -> str:
    """One layer of a target whose layers differ (Gemma-4): window, head size, KV heads, KV sharing."""
    a = c.attention(i)
    shared = f", reads layer {a.kv_source}'s KV cache" if a.kv_source != i else ""
    return (f"{f'window {c.window(i)}' if c.window(i) else 'full'}, head_dim {a.head_dim}, "
            f"kv_heads {a.num_kv_heads}, rope {a.rope.rope_type}{shared}")


def describe_drafter(d: DrafterCheckpoint) -> dict:
    c, cfg = d.config, read_config(d.path)
    layer_family = (cfg.get("transformer_layer_config") or cfg).get("model_type", "llama")
    return {"kind": "drafter", "path": str(d.path), "layout": c.layout,
            "speculators_model_type": cfg.get("speculators_model_type"),
            "head": "P-EAGLE (parallel)" if c.supports_parallel else "EAGLE-3 (sequential)",
            "spec_modes": ["none", "eagle3"] + (["peagle"] if c.supports_parallel else []),
            "layer_family": layer_family, "layers": c.num_layers, "hidden_size": c.hidden_size,
            "heads": c.num_heads, "kv_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "flags": {"norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm, "norm_output": c.norm_output,
                      "norm_before_residual": c.norm_before_residual, "qk_norm": c.qk_norm,
                      "embed_requires_grad": c.embed_requires_grad, "own_embeddings": c.has_embed},
            "trained_k": c.trained_depth,
            "taps": list(c.aux_layer_ids) if c.aux_layer_ids else "target default (2, L//2, L-3)",
            "num_taps": c.num_aux, "target_hidden_size": c.target_hidden_size,
            "vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size,
            "vocab_mapping": "d2t offsets" if "d2t" in d.tensors else "identity",
            "mask_token_id": c.mask_token_id,
            "sliding_window": ({"window": c.sliding_window, "layers": list(c.sliding_layers),
                                "exact_on": f"torch, onnxruntime; tensorrt up to {c.max_positions} KV positions"}
                               if c.max_positions else None)}


def check_pair(target_dir: Path, drafter: DrafterCheckpoint, args: argparse.Namespace) -> dict:
    """The checks `build` runs for this pair; raises their `PairingError` / `ConfigError`."""
    c = drafter.config
    mode = args.spec_mode or ("peagle" if c.has_mask_hidden else "eagle3")
    spec = SpecConfig(mode, args.num_spec_tokens or c.trained_depth or 7)
    taps = validate_pair(load_target_config(target_dir), drafter, spec)
    if mode != "none":
        # KV positions as export/runtime size them
        check_window(c, args.max_seq_len + spec.num_spec_tokens + 1, args.backend, f"drafter {drafter.path}")
    return {"fits": True, "spec_mode": mode, "num_spec_tokens": spec.num_spec_tokens, "taps": list(taps),
            "max_seq_len": args.max_seq_len, "backend": args.backend}


def _print(info: dict) -> None:
    print(f"{info['path']}: {info['kind']}")
    for key, value in info.items():
        if key not in ("kind", "path"):
            print(f"  {key}: {value}")


def cmd_inspect(args: argparse.Namespace) -> dict:
    if len(args.dirs) > 2:
        raise ConfigError(f"inspect takes one directory or a target and a drafter, got {len(args.dirs)}")
    from peagle_trt import hub

    args.dirs = [hub.resolve(d, what="inspect") for d in args.dirs]
    drafters = [p for p in args.dirs if is_drafter(p)]
    targets = [p for p in args.dirs if p not in drafters]
    if len(args.dirs) == 2 and len(drafters) != 1:
        raise ConfigError(f"inspect of a pair needs one target and one drafter directory; found "
                          f"{len(drafters)} drafter(s) among {[str(p) for p in args.dirs]}")
    loaded = load_drafter(drafters[0]) if drafters else None
    infos = [describe_target(p) for p in targets] + ([describe_drafter(loaded)] if loaded else [])
    for info in infos:
        _print(info)
    result = {info["kind"]: info for info in infos}
    if targets:  # KV memory of one full-length request as `build` lays it out (bf16/fp16, default chunk)
        from peagle_trt.config import KVLayout
        from peagle_trt.models.memory import kv_memory

        layout = KVLayout.for_sequences(1, args.max_seq_len, max_rows=PREFILL_CHUNK)
        memory = kv_memory(load_target_config(targets[0]), loaded.config if loaded else None, layout)
        print(f"{memory.describe()} (one request of max_seq_len {args.max_seq_len}, 2-byte KV)")
        result["kv_memory"] = memory.as_dict()
    if targets and loaded:
        result["pair"] = check_pair(targets[0], loaded, args)
        print(f"pair: fits ({result['pair']['spec_mode']}, K={result['pair']['num_spec_tokens']}, "
              f"taps {result['pair']['taps']})")
    return result
