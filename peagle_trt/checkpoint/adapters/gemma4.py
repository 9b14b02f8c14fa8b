"""Gemma-4 text (`gemma4_text`, Gemma4ForCausalLM) and the multimodal wrapper (`gemma4`,
Gemma4ForConditionalGeneration: its `text_config`, weights under `model.language_model.`; the
vision / audio towers are not loaded).

What the config sets, resolved into `TargetConfig` (semantics of transformers 5.23's
modeling_gemma4, the oracle of tests/models/test_gemma4.py):
  layer_types / sliding_window    sliding (window W: keys > p - W) or full attention per layer
                                  (default: every 6th layer full; the last layer is always full)
  head sizes                      full layers use `global_head_dim` (default 512) and, with
                                  attention_k_eq_v, `num_global_key_value_heads`; configs written
                                  by transformers >= 5.23 say it as `per_layer_config`
  rope_parameters                 one rope per layer type (full layers: "proportional", partial)
  attention                       q/k per-head RMSNorm, scale-free v RMSNorm, softmax scale 1
  attention_k_eq_v                full layers have no v_proj: values = k_proj output
  num_kv_shared_layers            the last n layers read the KV cache of the last earlier layer
                                  of their type (no k/v weights, no cache of their own)
  use_double_wide_mlp             KV-shared layers have 2 x intermediate_size
  sandwich norms, layer_scalar    norms on each block's input and output; output x layer_scalar
  embedding                       x sqrt(hidden_size); GELU-tanh MLPs
  hidden_size_per_layer_input     per-layer input embeddings (peagle_trt/models/gemma4.py)
  final_logit_softcapping         logits = c * tanh(logits / c)
  enable_moe_block                every layer also has a sparse MoE beside its dense MLP (26B-A4B):
                                  router on rmsnorm(x) * scale / sqrt(H), softmax, top-k,
                                  renormalised, x per_expert_scale; GeGLU experts stored stacked
                                  (`experts.gate_up_proj` [E, 2I, H]: gate rows first, `down_proj`
                                  [E, H, I]), our layout as it is;
                                  ModelOpt's FP8 export writes them per expert (`experts.{e}.*`)
Refused with a ConfigError naming the feature: `use_bidirectional_attention: "all"`, activations
other than GELU-tanh.
"""

from __future__ import annotations

import re

from peagle_trt.architecture import LayerAttention, MoEConfig, RopeConfig, TargetConfig
from peagle_trt.checkpoint.adapters.base import TargetAdapter, require
from peagle_trt.errors import ConfigError

TYPES = ("sliding_attention", "full_attention")
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1000000.0}}
_PER_LAYER_KEYS = {"head_dim", "num_key_value_heads"}
_EXPERTS = re.compile(r"^layers\.(\d+)\.experts\.(gate_up_proj|down_proj)$")
_PLE = ("embed_tokens_per_layer.", "per_layer_model_projection.", "per_layer_projection_norm.")
_PER_EXPERT = re.compile(r"^layers\.\d+\.experts\.\d+\.")
_ROUTER = {"router.proj.weight": "moe.gate.weight", "router.scale": "moe.router_scale",
           "router.per_expert_scale": "moe.per_expert_scale"}


class Gemma4Adapter(TargetAdapter):
    name = "gemma4"
    model_types = ("gemma4_text", "gemma4")
    qk_norm = True

    def parse(self, cfg: dict, where: str) -> TargetConfig:
        text = cfg
        if cfg.get("model_type") == "gemma4":
            text = require(cfg, "text_config", where)
            if text.get("model_type", "gemma4_text") != "gemma4_text":
                raise ConfigError(f"{where}: text_config.model_type {text.get('model_type')!r}, "
                                  "expected 'gemma4_text'")
            quant = cfg.get("quantization_config") or text.get("quantization_config")
            tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
            text = {**text, "quantization_config": quant, "tie_word_embeddings": tie}
            where = f"{where} text_config"
        if text.get("use_bidirectional_attention") == "all":
            raise ConfigError(f"{where}: use_bidirectional_attention='all' (non-causal text attention) is "
                              "not supported; a decoder for generation needs causal attention")
        layers = int(require(text, "num_hidden_layers", where))
        default = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
        types = list(text.get("layer_types") or default)
        if len(types) != layers or not set(types) <= set(TYPES):
            raise ConfigError(f"{where}: layer_types must list {TYPES} for each of the {layers} layers, "
                              f"got {types}")
        types[-1] = "full_attention"  # as transformers forces it
        ropes = text.get("rope_parameters") or DEFAULT_ROPE
        if not set(types) <= set(ropes):
            raise ConfigError(f"{where}: rope_parameters must have one entry per layer type "
                              f"{sorted(set(types))}, got keys {sorted(ropes)}")
        flat = {**text, "rope_parameters": ropes[types[0]], "hidden_act": "silu", "_layer_types": types,
                "_ropes": ropes, "tie_word_embeddings": text.get("tie_word_embeddings", True)}
        return super().parse(flat, where)

    def check_activation(self, cfg: dict, where: str) -> None:
        pass  # hidden_activation is read in extra_fields

    def extra_fields(self, cfg: dict, where: str) -> dict:
        act = cfg.get("hidden_activation") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ConfigError(f"{where}: hidden_activation {act!r} is not supported "
                              "(expected 'gelu_pytorch_tanh')")
        types, layers = cfg["_layer_types"], len(cfg["_layer_types"])
        hidden = int(require(cfg, "hidden_size", where))
        window = int(cfg.get("sliding_window") or 0)
        if "sliding_attention" in types and window <= 0:
            raise ConfigError(f"{where}: sliding_attention layers need a positive sliding_window, "
                              f"got {window}")
        heads, sources = self.head_shapes(cfg, types, where), self.kv_sources(cfg, types, where)
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        mpe = int(cfg.get("max_position_embeddings", 131072))
        ropes = {t: RopeConfig.from_hf({"rope_parameters": params, "max_position_embeddings": mpe},
                                       f"{where} {t}") for t, params in cfg["_ropes"].items() if t in types}
        attn = tuple(LayerAttention(d, kv, ropes[t], src, k_eq_v and t == "full_attention")
                     for t, (d, kv), src in zip(types, heads, sources))
        inter = int(require(cfg, "intermediate_size", where))
        wide = bool(cfg.get("use_double_wide_mlp", False))
        ple = int(cfg.get("hidden_size_per_layer_input", 256) or 0)  # transformers' defaults when absent
        softcap = cfg.get("final_logit_softcapping")
        moe = {}
        if cfg.get("enable_moe_block"):
            experts = MoEConfig(num_experts=int(require(cfg, "num_experts", where)),
                                top_k=int(require(cfg, "top_k_experts", where)),
                                intermediate_size=int(require(cfg, "moe_intermediate_size", where)),
                                routing="softmax_topk", norm_topk_prob=True, activation="gelu_tanh",
                                router_input_norm=True, router_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                                per_expert_scale=True, beside_dense=True)
            moe = {"moe": experts, "moe_layers": (True,) * layers}
        return {**moe, "layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
                "hidden_act": "gelu_tanh", "embed_scale": hidden ** 0.5, "sandwich_norm": True,
                "v_norm": True, "attn_scale": 1.0, "layer_scalar": True,
                "logit_softcap": float(softcap) if softcap else None,
                "per_layer_input_size": ple,
                "per_layer_input_vocab": int(cfg.get("vocab_size_per_layer_input", 262144)) if ple else 0,
                "layer_attention": attn,
                "layer_intermediate_sizes": tuple(inter * (2 if wide and src != i else 1)
                                                  for i, src in enumerate(sources))}

    @staticmethod
    def head_shapes(cfg: dict, types: list[str], where: str) -> list[tuple[int, int]]:
        """(head_dim, num_kv_heads) per layer."""
        heads = int(require(cfg, "num_attention_heads", where))
        base = (int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                int(cfg.get("num_key_value_heads") or heads))
        per_layer = cfg.get("per_layer_config")
        if per_layer is None:  # released configs: global_head_dim / num_global_key_value_heads
            full = {"head_dim": int(cfg.get("global_head_dim") or 512)}
            if cfg.get("attention_k_eq_v") and cfg.get("num_global_key_value_heads") is not None:
                full["num_key_value_heads"] = int(cfg["num_global_key_value_heads"])
            per_layer = {str(i): full for i, t in enumerate(types) if t == "full_attention"}
        out = [base] * len(types)
        for key, over in per_layer.items():
            if not str(key).isdigit() or not 0 <= int(key) < len(types) or set(over) - _PER_LAYER_KEYS:
                raise ConfigError(f"{where}: per_layer_config entry {key!r}: {over} is not supported; "
                                  f"supported: layer indices with {sorted(_PER_LAYER_KEYS)}")
            out[int(key)] = (int(over.get("head_dim", base[0])),
                             int(over.get("num_key_value_heads", base[1])))
        return out

    @staticmethod
    def kv_sources(cfg: dict, types: list[str], where: str) -> list[int]:
        """Per layer, the layer whose KV cache it reads: the last n = num_kv_shared_layers layers
        read the last earlier layer of their own type (transformers' kv_sharing_modes)."""
        n = int(cfg.get("num_kv_shared_layers") or 0)
        first = len(types) - n
        if not 0 <= n < len(types) or (n and not set(types[first:]) <= set(types[:first])):
            raise ConfigError(f"{where}: num_kv_shared_layers={n}: every shared layer needs an earlier layer "
                              f"of its type to share with (layer_types {types})")
        last = {t: i for i, t in enumerate(types[:first])}
        return [i if i < first else last[t] for i, t in enumerate(types)]

    def our_name(self, hf_name: str) -> str | None:
        for prefix in ("model.language_model.", "model."):
            if hf_name.startswith(prefix):
                rest = hf_name[len(prefix):]
                if rest.startswith(("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.")):
                    return None
                if rest.startswith(_PLE):
                    return "per_layer_inputs." + rest
                return rest
        return hf_name if hf_name.startswith("lm_head.") else None

    def convert(self, tensors: dict, config: TargetConfig, where: str) -> dict:
        out = {}
        for name, tensor in super().convert(tensors, config, where).items():
            m = _EXPERTS.match(name)
            if m:  # stacked experts ([E, 2I, H] gate rows first, [E, H, I]): our layout already
                out[f"layers.{m.group(1)}.moe.experts.{m.group(2)}"] = tensor
                continue
            if _PER_EXPERT.match(name):  # ModelOpt's FP8 export writes them one by one (stacked on load)
                out[name.replace(".experts.", ".moe.experts.", 1)] = tensor
                continue
            layer, _, rest = name.partition(".")[2].partition(".")
            key = rest if name.startswith("layers.") else None
            out[f"layers.{layer}.{_ROUTER[key]}" if key in _ROUTER else name] = tensor
        for i in range(config.num_layers):  # KV-shared layers: transformers ignores their k/v weights too
            if config.attention(i).kv_source != i:
                for name in ("k_proj", "v_proj", "k_norm", "v_norm"):
                    for key in [k for k in out if k.startswith(f"layers.{i}.self_attn.{name}.")]:
                        del out[key]
        return out
