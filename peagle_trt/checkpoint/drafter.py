"""Drafter checkpoints: P-EAGLE (AWS layout and `speculators` layout) and plain EAGLE-3 heads.

Layouts (as the AWS P-EAGLE heads, `speculators` and EAGLE-3 heads write them):
  aws          Llama-style config.json; tensors `midlayer.*` (or `layers.0.*`) + `layers.N.*`,
               `fc`, `mask_hidden` [1,1,3·H_t], `d2t`, `t2d`; mask token id under one of
               `ptd_token_id` / `pard_token` / `mask_token_id` / `dflash_config.mask_token_id`.
  speculators  `speculators_model_type: "peagle"` (or "eagle3") with a nested
               `transformer_layer_config` (llama or qwen3 layers); tensors `layers.N.*`, optional
               `input_norm` (norm_before_fc) and `fc_norm.{i}` (fc_norm).
  eagle3       the AWS layout without `mask_hidden`: a sequential EAGLE-3 head.
Tensors are renamed to one canonical set (`layers.0.*` for the fusion midlayer, no `model.`
prefix, `t2d` dropped) so the model code sees a single layout.

Flags mean what the `speculators` library (0.9.0, models/eagle3) means by them:
  norm_before_fc        one RMSNorm over the concatenated taps before fc (`input_norm.weight`)
  fc_norm               one RMSNorm per tap before concatenation (`fc_norm.{i}.weight`);
                        the library refuses it together with norm_before_fc, and so do we
  norm_output           EAGLE 3.1: sequential steps feed back the post-norm hidden state
                        (logits are lm_head(norm(x)) either way; the parallel pass is unaffected)
  norm_before_residual  layer 0 keeps hidden_norm(g) as its residual instead of g
  embed_requires_grad   training only (the library saves embed_tokens either way)
  eagle_aux_hidden_state_layer_ids  the taps; their count is fc's number of inputs (default 3)
  layer_types / sliding_window      drafter layers with sliding-window attention (keys > p - W)
Tested against the library itself: tests/compat/ (heads it writes, its own forward as oracle).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_trt.architecture import DrafterConfig, RopeConfig
from peagle_trt.checkpoint.adapters.base import require
from peagle_trt.checkpoint.safetensors_io import load_tensors, read_config
from peagle_trt.errors import CheckpointError, ConfigError

# Where producers store the mask token id, most explicit first (vLLM accepts all of these).
MASK_TOKEN_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "pard_token", "ptd_token_id")
# transformer_layer_config families speculators 0.9.0 builds drafter layers for (eagle3 model_classes)
LAYER_FAMILIES = ("llama", "qwen3")


WINDOWED_BACKENDS = ("torch", "onnxruntime")  # backends whose attention honours sliding windows


def check_window(c: DrafterConfig, max_len: int, backend: str, where: str = "drafter") -> None:
    """Raise `ConfigError` when `backend` cannot compute the drafter's sliding windows for KV
    positions up to `max_len` - 1 (TensorRT: its plugins are full-causal, exact only inside W)."""
    limit = c.max_positions
    if backend not in WINDOWED_BACKENDS and limit is not None and max_len > limit:
        raise ConfigError(f"{where}: drafter layers {list(c.sliding_layers)} use sliding-window attention "
                          f"(window {limit}) but this run needs {max_len} KV positions per sequence, and the "
                          f"{backend} backend's PEagleKVAttention plugin (plugins/) does not implement windows: "
                          f"it is exact only up to {limit} positions. Lower --max-seq-len so that "
                          f"max_seq_len + K + 1 <= {limit}, or use --backend torch / onnxruntime (exact windows)")


@dataclass(frozen=True)
class DrafterCheckpoint:
    path: Path
    config: DrafterConfig
    tensors: dict  # canonical name -> tensor


def _dig(cfg: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return None
        cfg = cfg[part]
    return cfg


def mask_token_id(cfg: dict, where: str) -> int | None:
    found = {k: _dig(cfg, k) for k in MASK_TOKEN_KEYS if _dig(cfg, k) is not None}
    if len(set(found.values())) > 1:
        raise ConfigError(f"{where}: conflicting mask token ids {found}; keep one key")
    return int(next(iter(found.values()))) if found else None


def canonical_name(name: str) -> str | None:
    """Our name for a drafter tensor; None for tensors inference ignores (t2d)."""
    if name.startswith("model."):  # Automodel exports carry a `model.` prefix
        name = name[len("model."):]
    if name.startswith("midlayer."):
        name = "layers.0." + name[len("midlayer."):]
    return None if name == "t2d" else name


def _trained_depth(cfg: dict) -> int | None:
    methods = _dig(cfg, "speculators_config.proposal_methods") or []
    for method in methods:
        if isinstance(method, dict) and method.get("speculative_tokens"):
            return int(method["speculative_tokens"])
    return cfg.get("num_speculative_tokens")


def load_drafter(path: str | Path) -> DrafterCheckpoint:
    path = Path(path)
    cfg = read_config(path)
    where = f"drafter {path / 'config.json'}"
    tensors = {}
    for name, tensor in load_tensors(path).items():
        ours = canonical_name(name)
        if ours is not None:
            tensors[ours] = tensor
    kind = cfg.get("speculators_model_type")
    if kind is not None and kind not in ("peagle", "eagle3"):
        raise ConfigError(f"{where}: speculators_model_type {kind!r} is not supported "
                          "(expected 'peagle' or 'eagle3')")
    layer_cfg = require(cfg, "transformer_layer_config", where) if kind else cfg
    _check_flags(cfg, layer_cfg, kind, where)
    for key in ("fc.weight", "lm_head.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"):
        if key not in tensors:
            raise CheckpointError(f"drafter {path}: tensor {key!r} is missing; not an EAGLE-3 / "
                                  "P-EAGLE head (expected midlayer.* or layers.0.* plus fc, norm, lm_head)")
    hidden = int(require(layer_cfg, "hidden_size", where))
    heads = int(require(layer_cfg, "num_attention_heads", where))
    lm_rows = tensors["lm_head.weight"].shape[0]
    fc_in = tensors["fc.weight"].shape[1]
    taps = cfg.get("eagle_aux_hidden_state_layer_ids") or _dig(cfg, "eagle_config.eagle_aux_hidden_state_layer_ids")
    num_aux = len(taps) if taps else (1 if _dig(cfg, "eagle_config.use_aux_hidden_state") is False else 3)
    target_hidden = int(cfg.get("target_hidden_size") or layer_cfg.get("target_hidden_size") or fc_in // num_aux)
    has_mask_hidden = "mask_hidden" in tensors
    layout = "speculators" if kind else ("aws" if has_mask_hidden else "eagle3")
    layer_types = list(layer_cfg.get("layer_types") or [])
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    config = DrafterConfig(
        layout=layout,
        hidden_size=hidden,
        num_layers=int(require(layer_cfg, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(layer_cfg.get("num_key_value_heads") or heads),
        head_dim=int(layer_cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(require(layer_cfg, "intermediate_size", where)),
        rms_norm_eps=float(layer_cfg.get("rms_norm_eps", 1e-6)),
        rope=RopeConfig.from_hf(layer_cfg, where),
        vocab_size=int(require(layer_cfg, "vocab_size", where)),
        draft_vocab_size=int(cfg.get("draft_vocab_size") or layer_cfg.get("draft_vocab_size") or lm_rows),
        target_hidden_size=target_hidden,
        num_aux=num_aux,
        aux_layer_ids=tuple(int(t) for t in taps) if taps else None,
        mask_token_id=mask_token_id(cfg, where),
        has_mask_hidden=has_mask_hidden,
        has_embed="embed_tokens.weight" in tensors,
        norm_before_residual=bool(cfg.get("norm_before_residual",
                                          layer_cfg.get("norm_before_residual", kind == "eagle3"))),
        norm_before_fc=bool(cfg.get("norm_before_fc", False)) or "input_norm.weight" in tensors,
        fc_norm=bool(cfg.get("fc_norm", False)) or "fc_norm.0.weight" in tensors,
        attention_bias=bool(layer_cfg.get("attention_bias", False)),
        qk_norm="layers.0.self_attn.q_norm.weight" in tensors,
        trained_depth=_trained_depth(cfg),
        norm_output=bool(cfg.get("norm_output", False)),
        embed_requires_grad=cfg.get("embed_requires_grad"),
        sliding_window=int(layer_cfg["sliding_window"]) if sliding and layer_cfg.get("sliding_window")
        else None,
        sliding_layers=sliding,
    )
    _check_tensors(config, tensors, path)
    return DrafterCheckpoint(path, config, tensors)


def _check_flags(cfg: dict, layer_cfg: dict, kind: str | None, where: str) -> None:
    """Refuse what the library refuses (with its reason) and what our layers cannot compute."""
    if cfg.get("norm_before_fc") and cfg.get("fc_norm"):
        raise ConfigError(f"{where}: norm_before_fc and fc_norm are both true; the speculators library "
                          "refuses this too: 'norm_before_fc and fc_norm are mutually exclusive - enable "
                          "one or the other, not both' (set one of them to false)")
    family = layer_cfg.get("model_type", "llama")
    if kind and family not in LAYER_FAMILIES:
        raise ConfigError(f"{where}: transformer_layer_config.model_type {family!r} is not supported; the "
                          f"speculators library builds EAGLE-3 / P-EAGLE drafter layers for "
                          f"{list(LAYER_FAMILIES)} only")
    act = layer_cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: drafter hidden_act {act!r} is not supported (expected 'silu', the "
                          "speculators trainer default --draft-hidden-act)")
    if layer_cfg.get("mlp_bias"):
        raise ConfigError(f"{where}: mlp_bias=true drafter layers are not supported (expected false)")
    types = set(layer_cfg.get("layer_types") or []) - {"full_attention", "sliding_attention"}
    if types:
        raise ConfigError(f"{where}: drafter layer_types {sorted(types)} are not supported "
                          "(expected full_attention / sliding_attention)")


def _check_tensors(c: DrafterConfig, tensors: dict, path: Path) -> None:
    """Shape checks that need only the drafter itself (pairing checks live in peagle_trt/checkpoint/validate.py)."""
    lm_rows = tensors["lm_head.weight"].shape[0]
    if lm_rows != c.draft_vocab_size:
        raise CheckpointError(f"drafter {path}: lm_head has {lm_rows} rows but draft_vocab_size is "
                              f"{c.draft_vocab_size}")
    d2t = tensors.get("d2t")
    if d2t is not None and tuple(d2t.shape) != (c.draft_vocab_size,):
        raise CheckpointError(f"drafter {path}: d2t has shape {tuple(d2t.shape)}, expected "
                              f"({c.draft_vocab_size},) = [draft_vocab_size]; the head was exported "
                              "with a different draft vocabulary")
    if d2t is None and c.draft_vocab_size != c.vocab_size:
        raise CheckpointError(f"drafter {path}: draft vocabulary ({c.draft_vocab_size}) is smaller than "
                              f"the target vocabulary ({c.vocab_size}) but there is no d2t map")
    if d2t is not None:
        target_ids = torch.arange(c.draft_vocab_size) + d2t.long()
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= c.vocab_size:
            raise CheckpointError(f"drafter {path}: d2t maps draft ids outside [0, {c.vocab_size}); "
                                  "d2t must hold offsets (target_id = draft_id + d2t[draft_id])")
    fc_in = tensors["fc.weight"].shape[1]
    if fc_in != c.num_aux * c.target_hidden_size:
        raise CheckpointError(f"drafter {path}: fc.weight takes {fc_in} inputs but config.json implies "
                              f"{c.num_aux} x target_hidden_size {c.target_hidden_size}; fix "
                              "target_hidden_size in config.json")
    mask_hidden = tensors.get("mask_hidden")
    expected = c.num_aux * c.target_hidden_size
    if mask_hidden is not None and mask_hidden.numel() != expected:
        raise CheckpointError(f"drafter {path}: mask_hidden has {mask_hidden.numel()} values, expected "
                              f"{expected} (= {c.num_aux} x target hidden {c.target_hidden_size}, pre-fc)")
