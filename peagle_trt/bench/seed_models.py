"""The seeds' targets and heads with random weights, built directly on a device from their published configs.

The P-EAGLE releases target three mixture-of-experts models: Qwen3-Coder-30B-A3B (FP8, block-wise),
GPT-OSS-20B and GPT-OSS-120B. Their config.json contents (the fields our adapters read, source named
on each) live here, so no run downloads anything; `target_config` resolves them through the family
adapters (peagle_trt/checkpoint/adapters/: qwen3_moe, gpt_oss) into the same `TargetConfig` a real
checkpoint gets: every shape, routing rule and attention detail as released (GPT-OSS: alternating
sliding (128) / full layers, sinks, router bias, clamped SwiGLU; Qwen3: q/k norms, softmax top-k
renormalised). `build_target` builds the model on the meta device, then materializes it LAYER BY
LAYER on the device with random weights (`materialize`: matrices and biases N(0, 0.02), norms and
sinks 1) and converts each layer's experts (and attention, where the seed says) to FP8 before
the next layer exists, so a model larger than memory in bf16 is never whole in bf16: GPT-OSS-120B's
experts are 114.7 GB in FP8 and 229 GB in bf16; `weight_bytes` checks the fit first.

FP8 experts (`fp8_experts`): `quantize_experts(moe, kind)` of peagle_trt/models/moe.py (kind "tensor" |
"channel" | "block": the stacked experts in place, dynamic activation scales); `BuiltTarget` says
what was built (`experts`) and how (`experts_note`).

Heads (`build_head`): P-EAGLE 4 layers (peagle-spec.md 1.5), EAGLE-3 1 layer, hidden, attention and
rope as `HEADS` states per seed (published values named; ASSUMED where no config was read). Their
sizes follow the target's: intermediate and draft vocabulary keep the published ratios to the
target's hidden size and vocabulary, the mask token its distance from the vocabulary's end, so the
published target gives the published numbers and a shrunken target a shrunken head (one code path).

Reduced shapes: `layers=N` builds the first N layers of the real architecture (a GPU layer slice, or
a CPU run); `small=True` also shrinks widths, experts and vocabulary (`SMALL`, tests and --smoke),
keeping every routing rule and attention detail. How to test: tests/bench/test_seeds.py (the full
configs on the meta device, small builds on CPU); used by `peagle-trt bench seeds`
(peagle_trt/bench/seeds.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from peagle_trt.architecture import DrafterConfig, RopeConfig, TargetConfig
from peagle_trt.bench.gpu import GPT_OSS_ROPE
from peagle_trt.checkpoint.adapters import adapter_for
from peagle_trt.errors import ConfigError
from peagle_trt.models import moe as moe_module
from peagle_trt.models.drafter import DrafterModel
from peagle_trt.models.fp8 import FP8_DTYPE, FP8_MAX, FP8Linear
from peagle_trt.models.layers import Attention
from peagle_trt.models.rope import inv_freq
from peagle_trt.models.target import TargetModel

QWEN3_CODER_30B_A3B = {  # Qwen/Qwen3-Coder-30B-A3B-Instruct config.json (the -FP8 repository's is the same
    # but for quantization_config: fp8, e4m3, weight_block_size [128, 128], dynamic activations)
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 5472, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 10000000, "max_position_embeddings": 262144,
    "vocab_size": 151936, "tie_word_embeddings": False, "hidden_act": "silu"}
GPT_OSS_20B = {  # openai/gpt-oss-20b config.json
    "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 24,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
    "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True, "rms_norm_eps": 1e-5,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "swiglu_limit": 7.0, "hidden_act": "silu",
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "rope_theta": 150000, "max_position_embeddings": 131072, "vocab_size": 201088,
    "tie_word_embeddings": False}
GPT_OSS_120B = {**GPT_OSS_20B,  # openai/gpt-oss-120b config.json: 20b's but for depth and experts
                "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}
QWEN3_ROPE = RopeConfig(theta=10000000.0, max_position_embeddings=262144)

# The reduced shape of tests and --smoke: widths, experts and vocabulary small, every rule kept (a
# window of 8 positions, below the smoke context, so that sliding layers slide; Qwen3's experts keep
# an intermediate size of 128, the least block-scaled FP8 experts take)
SMALL = {"qwen3_moe": {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 128,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16,
                       "num_experts_per_tok": 4, "vocab_size": 512},
         "gpt_oss": {"hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 8, "num_experts_per_tok": 2,
                     "sliding_window": 8, "vocab_size": 512}}
EXPERT_FORMATS = ("bf16", "fp8-tensor", "fp8-channel", "fp8-block")  # bf16: the model dtype


@dataclass(frozen=True)
class HeadShape:
    """A published head's shape, relative to its target (see the module docstring)."""
    layers: int
    intermediate: int  # at the published target's hidden size
    draft_vocab: int  # at the published target's vocabulary
    mask_token: int | None  # P-EAGLE's mask token at the published vocabulary (None: EAGLE-3, no mask slots)
    rope: RopeConfig
    source: str


@dataclass(frozen=True)
class Seed:
    """One seed target: its published config, its weight formats, its heads."""
    config: dict
    experts: str  # EXPERT_FORMATS: how its experts are built (the published checkpoint's, or the nearest)
    attention_fp8: bool  # attention projections as per-tensor FP8Linear
    heads: dict  # "peagle" | "eagle3" -> HeadShape
    note: str


_EAGLE3_SRC = ("1 layer (EAGLE-3); intermediate 17280 and draft vocabulary 32000 from SpecForge's "
               "gpt-oss-120B-eagle3.json (no config of the served EAGLE-3 heads was read)")
_PEAGLE_GPT_OSS = ("4 layers (peagle-spec.md 1.5), vocabulary 201088, mask token 201020 (GPT-OSS-20B, nkipy); "
                   "intermediate 17280 ASSUMED (fits nkipy's ~1.8B parameters); llama3 rope ASSUMED")
SEEDS = {
    "qwen3-coder-30b-a3b": Seed(
        QWEN3_CODER_30B_A3B, "fp8-block", True,
        {"peagle": HeadShape(4, 5472, 151936, 151935, QWEN3_ROPE,
                             "4 layers (peagle-spec.md 1.5); intermediate = the target config's 5472, full "
                             "vocabulary, last id as mask token, the target's rope: ASSUMED (no config read)"),
         "eagle3": HeadShape(1, 5472, 32000, None, QWEN3_ROPE,
                             "1 layer (EAGLE-3); intermediate 5472 ASSUMED; draft vocabulary 32000 as "
                             "SpecForge's Qwen3 EAGLE-3 configs")},
        "Qwen3-Coder-30B-A3B-Instruct-FP8: block-wise FP8 (128 x 128) experts and attention; here attention is "
        "per-tensor FP8, lm_head, embeddings and router bf16"),
    "gpt-oss-20b": Seed(
        GPT_OSS_20B, "bf16", False,
        {"peagle": HeadShape(4, 17280, 201088, 201020, GPT_OSS_ROPE, _PEAGLE_GPT_OSS),
         "eagle3": HeadShape(1, 17280, 32000, None, GPT_OSS_ROPE, _EAGLE3_SRC)},
        "released with MXFP4 experts; built bf16, as peagle-trt's loader widens MXFP4 exactly"),
    "gpt-oss-120b": Seed(
        GPT_OSS_120B, "fp8-tensor", False,
        {"peagle": HeadShape(4, 17280, 201088, 201020, GPT_OSS_ROPE, _PEAGLE_GPT_OSS + "; mask token as 20B's"),
         "eagle3": HeadShape(1, 17280, 32000, None, GPT_OSS_ROPE, _EAGLE3_SRC)},
        "released with MXFP4 experts; built FP8 (bf16 experts, 229 GB, would not fit one 141 GB GPU)"),
}


def seed(name: str) -> Seed:
    if name not in SEEDS:
        raise ConfigError(f"unknown seed target {name!r}; expected one of {sorted(SEEDS)}")
    return SEEDS[name]


def seed_config(name: str, layers: int | None = None, small: bool = False) -> dict:
    """The published config.json of seed `name`, with its first `layers` layers only (None: all) and
    SMALL's widths when `small`."""
    cfg = dict(seed(name).config)
    if small:
        cfg.update(SMALL[cfg["model_type"]])
    if layers is not None:
        if not 3 <= layers <= cfg["num_hidden_layers"]:
            raise ConfigError(f"{name}: layers must be in [3, {cfg['num_hidden_layers']}] (the drafter taps layers "
                              f"2, L // 2 and L - 3), got {layers}")
        cfg["num_hidden_layers"] = layers
        if "layer_types" in cfg:
            cfg["layer_types"] = cfg["layer_types"][:layers]
    return cfg


def target_config(name: str, layers: int | None = None, small: bool = False) -> TargetConfig:
    """`seed_config` resolved by its family adapter, as a checkpoint of it would be."""
    cfg = seed_config(name, layers, small)
    where = f"{name} published config"
    return adapter_for(cfg, where).parse(cfg, where)


@dataclass(frozen=True)
class BuiltTarget:
    model: TargetModel
    experts: str  # what the experts were built as (EXPERT_FORMATS)
    experts_note: str  # how (or why not what was asked)
    attention_fp8: bool
    weight_bytes: int  # as built, on the device


def materialize(module: nn.Module, device, dtype: torch.dtype) -> nn.Module:
    """A meta-device `module` on `device` in `dtype`, in place: matrices and biases N(0, 0.02), other
    vectors (norm weights, attention sinks) 1. Biases are random, not 1 as peagle_trt/bench/gpu.py
    `randomize` makes every vector: a bias of 1 on every o_proj and expert output adds the same vector
    to every row's residual, and the routers then send all rows to the same experts."""
    module = module.to(dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 or name.endswith("bias") else p.fill_(1.0)
    return module.eval().requires_grad_(False)


def _moes(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, moe_module.SparseMoE)]


def weight_bytes(model: nn.Module, experts: str, attention_fp8: bool, dtype: torch.dtype) -> int:
    """Bytes the weights of `model` (meta or real) take once built: experts (every SparseMoE parameter
    but its router's) at 1 byte in FP8, attention projections too when `attention_fp8`, the rest in `dtype`."""
    size = torch.empty(0, dtype=dtype).element_size()
    total = sum(p.numel() for p in model.parameters()) * size
    expert = sum(p.numel() for m in _moes(model) for p in m.parameters()) - sum(
        p.numel() for m in _moes(model) for p in m.gate.parameters())
    attention = sum(p.numel() for m in model.modules() if isinstance(m, Attention) for p in m.parameters()
                    if p.dim() == 2)
    return total - (size - 1) * (expert * (experts != "bf16") + attention * attention_fp8)


def fp8_linears(module: nn.Module) -> int:
    """Every plain nn.Linear under `module` becomes an FP8Linear of its own weights (per-tensor E4M3,
    ModelOpt's layout: weight scale amax / 448, a static input scale for activations of amax ~4, as
    peagle_trt/bench/gpu.py `to_fp8`); the bf16 weight is freed as each goes. Returns how many."""
    done = 0
    for name, m in list(module.named_modules()):
        if type(m) is not nn.Linear:
            continue
        w = m.weight.detach().float()
        with torch.device(w.device):
            new = FP8Linear(m.in_features, m.out_features, m.bias is not None)
        scale = w.abs().max().clamp(min=1e-12) / FP8_MAX
        new.weight.data = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        new.weight_scale.data = scale.reshape(())
        new.input_scale.data = torch.tensor(4.0 / FP8_MAX, device=w.device)
        if m.bias is not None:
            new.bias.data = m.bias.data
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent) if parent else module, child, new)
        done += 1
    return done


def fp8_experts(moe: nn.Module, fmt: str) -> tuple[str, str]:
    """The experts of one SparseMoE in `fmt` (EXPERT_FORMATS), in place -> (the format built, how)."""
    if fmt == "bf16":
        return fmt, "model dtype"
    moe_module.quantize_experts(moe, fmt.removeprefix("fp8-"))  # dynamic activation scales, as the checkpoints
    return fmt, "peagle_trt/models/moe.py quantize_experts"


def build_target(name: str, device, dtype: torch.dtype, layers: int | None = None, small: bool = False,
                 experts: str | None = None, attention_fp8: bool | None = None) -> BuiltTarget:
    """Seed `name`'s target with random weights on `device`, built one layer at a time (module
    docstring); `experts` / `attention_fp8` override the seed's formats."""
    s, device = seed(name), torch.device(device)
    experts = s.experts if experts is None else experts
    attention_fp8 = s.attention_fp8 if attention_fp8 is None else attention_fp8
    if experts not in EXPERT_FORMATS:
        raise ConfigError(f"experts format {experts!r} is unknown; expected one of {EXPERT_FORMATS}")
    c = target_config(name, layers, small)
    with torch.device("meta"):
        model = TargetModel(c, c.default_taps)
    need = weight_bytes(model, experts, attention_fp8, dtype)
    if device.type == "cuda" and need > 0.9 * torch.cuda.get_device_properties(device).total_memory:
        raise ConfigError(f"{name}: its weights take {need / 1e9:.1f} GB as asked (experts {experts}), more than 90% "
                          f"of this GPU's {torch.cuda.get_device_properties(device).total_memory / 1e9:.1f} GB; "
                          "build FP8 experts (--experts fp8-tensor) or fewer layers (--layers)")
    built, notes = experts, set()
    for child_name, child in model.named_children():
        if child_name != "layers":
            materialize(child, device, dtype)
            continue
        for layer in child:
            materialize(layer, device, dtype)  # this layer only: the model is never whole in bf16
            for m in _moes(layer):
                built, note = fp8_experts(m, experts)
                notes.add(note)
            if attention_fp8:
                for m in layer.modules():
                    if isinstance(m, Attention):
                        fp8_linears(m)
    model.set_inv_freqs()
    for buffer, value in list(model.named_buffers(recurse=False)):
        setattr(model, buffer, value.to(device=device, dtype=dtype))
    model.eval().requires_grad_(False)
    real = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    return BuiltTarget(model, built, "; ".join(sorted(notes)) or "no MoE layers", attention_fp8, real)


def head_config(name: str, kind: str, target: TargetConfig) -> DrafterConfig:
    """Seed `name`'s `kind` ("peagle" | "eagle3") head for `target` (the seed's config, any size)."""
    s = seed(name)
    if kind not in s.heads:
        raise ConfigError(f"head kind {kind!r} is unknown; expected one of {sorted(s.heads)}")
    h, published = s.heads[kind], s.config
    vocab = target.vocab_size
    mask = None if h.mask_token is None else vocab - (published["vocab_size"] - h.mask_token)
    return DrafterConfig(
        layout="aws" if kind == "peagle" else "eagle3", hidden_size=target.hidden_size, num_layers=h.layers,
        num_heads=target.num_heads, num_kv_heads=target.num_kv_heads, head_dim=target.head_dim,
        intermediate_size=round(h.intermediate * target.hidden_size / published["hidden_size"]),
        rms_norm_eps=target.rms_norm_eps, rope=h.rope, vocab_size=vocab,
        draft_vocab_size=max(16, round(h.draft_vocab * vocab / published["vocab_size"])),
        target_hidden_size=target.hidden_size, mask_token_id=mask, has_mask_hidden=mask is not None,
        has_embed=kind == "peagle")


def build_head(name: str, kind: str, target: TargetModel, dtype: torch.dtype) -> DrafterModel:
    """Seed `name`'s random `kind` head on `target`'s device; an EAGLE-3 head reads the target's
    embedding table (has_embed False), a P-EAGLE head has its own (trained with it)."""
    config = head_config(name, kind, target.config)
    device = target.lm_head.weight.device
    with torch.device("meta"):
        model = DrafterModel(config)
    shared = None if config.has_embed else model.embed_tokens
    if shared is not None:
        del model.embed_tokens
    model = materialize(model, device, dtype)
    if shared is not None:
        model.embed_tokens = target.embed_tokens
    with torch.no_grad():
        model.d2t = torch.zeros(config.draft_vocab_size, dtype=torch.long, device=device)
        model.inv_freq = inv_freq(config.rope, config.head_dim)[0].to(device=device, dtype=dtype)
        aux = config.num_aux * config.target_hidden_size
        model.mask_hidden = torch.randn(1, 1, aux, device=device, dtype=dtype) if config.has_mask_hidden else (
            torch.zeros(1, 1, aux, device=device, dtype=dtype))
        model.h_mask = model.project(model.mask_hidden).reshape(-1)
    return model
