"""GPT-OSS (gpt-oss-20b / -120b): every layer is a sparse MoE (router with bias, top-k of the
logits then softmax over those k, experts with biases and the clamped SwiGLU: alpha, limit, +1 on
the linear half); attention with biases on q/k/v/o, one learned sink logit per head, and
alternating sliding-window / full layers (`layer_types`, `sliding_window`); YaRN rope.

Experts on disk (stacked per layer, transformers' layout): `mlp.experts.gate_up_proj` [E, H, 2I]
with gate and up INTERLEAVED along the last axis (gate = [..., 0::2], up = [..., 1::2]),
`gate_up_proj_bias` [E, 2I], `down_proj` [E, I, H], `down_proj_bias` [E, H]; the released
checkpoints store the two weights in MXFP4 instead (`*_blocks` + `*_scales`,
`quantization_config.quant_method: "mxfp4"`), dequantized exactly here (peagle_trt/checkpoint/mxfp4.py).
`convert` maps them onto our stacked layout (peagle_trt/models/moe.py: [E, 2I, H] with the gate rows
first, [E, H, I]); the router `mlp.router.*` becomes `mlp.gate.*`.
FP8 (`peagle-trt quantize`): ModelOpt writes each stacked projection as one float8_e4m3fn tensor
with ONE per-tensor `*_weight_scale` / `*_input_scale` shared by all experts; every expert gets
that shared pair ([E] scales of one value: the same per-tensor FP8 math).
"""

from __future__ import annotations

import re

import torch

from peagle_trt.architecture import MoEConfig, TargetConfig
from peagle_trt.checkpoint import mxfp4
from peagle_trt.checkpoint.adapters.base import TargetAdapter, quantization, require
from peagle_trt.errors import CheckpointError, ConfigError

_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)"
                      r"(_bias|_blocks|_scales|_weight_scale|_input_scale)?$")
_FP8_SCALES = {"_weight_scale": "scale", "_input_scale": "input_scale"}  # ours: `<proj>_scale`, `<proj>_input_scale`


class GptOssAdapter(TargetAdapter):
    name = "gpt_oss"
    model_types = ("gpt_oss",)

    def quantization(self, cfg: dict, where: str) -> str | None:
        q = cfg.get("quantization_config")
        if isinstance(q, dict) and q.get("quant_method") == "mxfp4":
            return None  # MXFP4 experts are dequantized exactly on load; the model is unquantized
        return quantization(cfg, where)

    def extra_fields(self, cfg: dict, where: str) -> dict:
        layers = int(require(cfg, "num_hidden_layers", where))
        window = int(cfg.get("sliding_window") or 0)
        types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                           for i in range(layers)]
        if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise ConfigError(f"{where}: layer_types must list 'sliding_attention' / 'full_attention' for "
                              f"each of the {layers} layers, got {types}")
        if "sliding_attention" in types and window <= 0:
            raise ConfigError(f"{where}: sliding_attention layers need a positive sliding_window, got {window}")
        moe = MoEConfig(num_experts=int(require(cfg, "num_local_experts", where)),
                        top_k=int(require(cfg, "num_experts_per_tok", where)),
                        intermediate_size=int(require(cfg, "intermediate_size", where)),
                        routing="topk_softmax", router_bias=True, expert_bias=True,
                        activation="clamped_swiglu", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
        return {"layer_windows": tuple(window if t == "sliding_attention" else 0 for t in types),
                "attention_sinks": True, "moe": moe, "moe_layers": (True,) * layers}

    def convert(self, tensors: dict, config: TargetConfig, where: str) -> dict:
        out, stacked = {}, {}
        for name, tensor in tensors.items():
            ours = self.our_name(name)
            if ours is None:
                continue
            m = _EXPERTS.match(ours)
            if m:
                stacked[(int(m.group(1)), m.group(2), m.group(3) or "")] = tensor
            else:
                out[ours.replace(".mlp.router.", ".mlp.gate.")] = tensor
        for (layer, proj, kind), tensor in sorted(stacked.items()):
            prefix = f"layers.{layer}.mlp.experts.{proj}"
            if kind == "_scales":
                continue
            if kind in _FP8_SCALES:  # one per-tensor scale for the stacked projection: every expert's
                experts = stacked[(layer, proj, "")].shape[0]
                out[f"{prefix}_{_FP8_SCALES[kind]}"] = tensor.float().reshape(()).expand(experts).contiguous()
                continue
            if kind == "_blocks":
                scales = stacked.get((layer, proj, "_scales"))
                if scales is None:
                    raise CheckpointError(f"{where}: layers.{layer}.mlp.experts.{proj}_blocks has no _scales")
                tensor = mxfp4.dequantize(tensor, scales, f"{where}: layers.{layer} {proj}")  # [E, in, out]
            if kind == "_bias":  # [E, out]
                out[f"{prefix}_bias"] = _gate_then_up(tensor, 1) if proj == "gate_up_proj" else tensor
                continue
            weight = _bytes(tensor).transpose(1, 2)  # [E, out, in]
            weight = _gate_then_up(weight, 1) if proj == "gate_up_proj" else weight
            out[prefix] = weight.contiguous().view(tensor.dtype)
        return out


def _bytes(t):
    """FP8 tensors moved as bytes (indexing, transposes); others as they are."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _gate_then_up(t, axis: int):
    """The interleaved gate / up halves along `axis` (gate = 0::2, up = 1::2) as [gate | up]."""
    view = _bytes(t)
    idx = torch.arange(view.shape[axis])
    order = torch.cat([idx[0::2], idx[1::2]])
    return view.index_select(axis, order).view(t.dtype)
