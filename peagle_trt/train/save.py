"""Write a trained head as a checkpoint: the AWS P-EAGLE layout (default) or the `speculators` layout.

  aws          Llama-style config.json (`architectures: LlamaForCausalLMEagle3`, `ptd_token_id`
               for P-EAGLE heads, `draft_vocab_size`, `target_hidden_size`,
               `eagle_aux_hidden_state_layer_ids`); tensors `midlayer.*`, `layers.N.*`, `fc`,
               `norm`, `lm_head`, `embed_tokens` (not with --freeze-embeddings: the loader then uses the
               target's table), `d2t`, `t2d`, and `mask_hidden` [1, 1, 3·H_t].
  speculators  `speculators_model_type` peagle | eagle3 with a nested `transformer_layer_config`,
               `mask_token_id`, `speculators_config` (algorithm, proposal methods with the trained
               depth, verifier); tensors `layers.0.*` instead of `midlayer.*`.
Both load with `peagle_trt.checkpoint.load_drafter` (tests/train/test_train_run.py checks it).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from peagle_trt.atomic import staged_dir
from peagle_trt.errors import ConfigError
from peagle_trt.train.curve import write_curve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _rope_fields(rope) -> dict:
    fields = {"rope_theta": rope.theta, "max_position_embeddings": rope.max_position_embeddings}
    if rope.rope_type != "default":
        fields["rope_scaling"] = {"rope_type": rope.rope_type, **rope.params}
    return fields


def head_tensors(head, draft_ids: torch.Tensor, dtype: torch.dtype, layer0: str, embed: bool = True) -> dict:
    model, c = head.model, head.model.config
    out = {}
    for name, t in model.state_dict().items():
        if name in ("d2t", "mask_hidden") or (name == "embed_tokens.weight" and not embed):
            continue
        if name.startswith("layers.0."):
            name = layer0 + name[len("layers.0."):]
        out[name] = t.detach().to("cpu", dtype).contiguous()
    out["d2t"] = (draft_ids - torch.arange(len(draft_ids))).long()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    out["t2d"] = t2d
    if head.parallel:
        out["mask_hidden"] = head.mask_hidden.detach().to("cpu", dtype).reshape(1, 1, -1).contiguous()
    return out


def layer_config(c) -> dict:
    return {"model_type": "llama", "hidden_size": c.hidden_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
            "vocab_size": c.vocab_size, "attention_bias": False, **_rope_fields(c.rope)}


def write_head(output: Path, head, config, draft_ids: torch.Tensor, cfg, curve: tuple | None = None) -> None:
    """The head in `cfg.layout`; with `curve` = (rows, title), its learning curve beside it (train/curve.py)."""
    from safetensors.torch import save_file

    if cfg.save_dtype not in DTYPES:
        raise ConfigError(f"--save-dtype {cfg.save_dtype!r}: expected one of {sorted(DTYPES)}")
    c = config
    speculators = cfg.layout == "speculators"
    tensors = head_tensors(head, draft_ids, DTYPES[cfg.save_dtype], "layers.0." if speculators else "midlayer.",
                           embed=not cfg.freeze_embeddings)
    common = {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size,
              "fc_norm": c.fc_norm,
              "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "norm_before_residual": False,
              "torch_dtype": cfg.save_dtype, "trained_with": "peagle-trt train",
              "training": {"method": cfg.method, "depths": cfg.depths, "steps": cfg.steps,
                           "down_sample_ratio": cfg.down_sample_ratio,
                           "down_sample_ratio_min": cfg.down_sample_ratio_min}}
    if speculators:
        config_json = {"speculators_model_type": cfg.method, "architectures": [
            "PeagleSpeculator" if cfg.method == "peagle" else "Eagle3Speculator"],
            "transformer_layer_config": layer_config(c), **common,
            "norm_before_fc": c.norm_before_fc, "norm_output": c.norm_output,
            "embed_requires_grad": cfg.method == "peagle" and not cfg.freeze_embeddings,
            "speculators_config": {"algorithm": cfg.method, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy",
                                                         "speculative_tokens": cfg.depths}],
                                   "verifier": {"name_or_path": Path(cfg.target).name,
                                                "architectures": ["LlamaForCausalLM"]}}}
        if c.mask_token_id is not None:
            config_json["mask_token_id"] = c.mask_token_id
    else:
        config_json = {**layer_config(c), "architectures": ["LlamaForCausalLMEagle3"], **common,
                       "num_speculative_tokens": cfg.depths}
        if c.mask_token_id is not None:
            config_json["ptd_token_id"] = c.mask_token_id
    with staged_dir(output, "the drafter head") as tmp:
        save_file(tensors, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        if curve is not None:
            write_curve(tmp, *curve)
