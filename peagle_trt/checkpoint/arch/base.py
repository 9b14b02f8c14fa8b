"""The resolved target architecture (`TargetConfig`) and the adapter base class.

An adapter turns one family's `config.json` into a `TargetConfig` and maps its tensor names
onto ours. Family differences live in the adapters (llama.py, qwen3.py); generic code only sees
`TargetConfig` fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle_trt.errors import ConfigError
from peagle_trt.models.rope import RopeConfig


def require(cfg: dict, key: str, where: str):
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: required key {key!r} is missing; a Hugging Face config.json "
                          f"of this model family always has it")
    return cfg[key]


def token_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (list, tuple)) else (int(value),)


def quantization(cfg: dict, where: str) -> str | None:
    """config.json `quantization_config` -> None or "fp8" (ModelOpt FP8, as `peagle-trt quantize`
    writes it; the weights load through peagle_trt/models/fp8.py)."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, dict) else None
    algo = q.get("quant_algo") if isinstance(q, dict) else None
    if method == "modelopt" and str(algo).upper() == "FP8":
        return "fp8"
    raise ConfigError(f"{where}: quantization_config (quant_method={method!r}, quant_algo={algo!r}) is "
                      "not supported; supported: ModelOpt per-tensor FP8 as written by `peagle-trt "
                      "quantize`. Start from the unquantized checkpoint and run `peagle-trt quantize`")


@dataclass(frozen=True)
class MoEConfig:
    """Sparse mixture-of-experts MLP of the layers flagged in `TargetConfig.moe_layers`."""
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    # routing: "softmax_topk" (Qwen3-MoE: softmax over all experts, then top-k, renormalised if
    # norm_topk_prob) | "topk_softmax" (GPT-OSS: top-k of the logits, softmax over those k)
    routing: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    # expert activation: "silu" (SwiGLU) | "gelu_tanh" (GeGLU, Gemma-4) | "clamped_swiglu" (GPT-OSS:
    # gate clamped above at `swiglu_limit`, up clamped to +-limit,
    # out = (up + 1) * gate * sigmoid(alpha * gate))
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # Gemma-4: the router sees rmsnorm(x) * router_scale / sqrt(H) (scale-free norm, learned [H] scale);
    # the routing weights are multiplied by a learned per-expert scale; the MoE runs beside the
    # dense MLP of a sandwich layer (each output normed, then summed) instead of replacing it
    router_input_norm: bool = False
    router_norm_eps: float = 1e-6
    per_expert_scale: bool = False
    beside_dense: bool = False

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.top_k}) must be in [1, num_experts="
                              f"{self.num_experts}]")
        if self.routing not in ("softmax_topk", "topk_softmax"):
            raise ConfigError(f"MoE routing {self.routing!r} is unknown")
        if self.activation not in ("silu", "gelu_tanh", "clamped_swiglu"):
            raise ConfigError(f"MoE expert activation {self.activation!r} is unknown")


@dataclass(frozen=True)
class LayerAttention:
    """Per-layer attention shape when layers differ (Gemma-4: full layers have their own head size,
    KV heads and rope; KV-shared layers read another layer's cache)."""
    head_dim: int
    num_kv_heads: int
    rope: RopeConfig
    kv_source: int  # the layer whose KV cache this layer reads (itself unless KV-shared)
    k_eq_v: bool = False  # no v_proj: the values are the k_proj output (before k norm and rope)


@dataclass(frozen=True)
class TargetConfig:
    arch: str  # adapter name
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v/o projections carry biases (as transformers builds them)
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: str | None = None  # None (unquantized) or "fp8" (ModelOpt per-tensor FP8)
    # per-layer attention window: 0 = full attention, W > 0 = keys at positions > p - W only;
    # () means full attention everywhere
    layer_windows: tuple[int, ...] = ()
    attention_sinks: bool = False  # GPT-OSS: one learned softmax sink logit per head and layer
    moe: MoEConfig | None = None
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse MoE MLP (True) or dense MLP
    # -- options of sandwich-norm families (Gemma-4); the defaults give the Llama layer ------------
    hidden_act: str = "silu"  # dense MLP activation: "silu" | "gelu_tanh"
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    sandwich_norm: bool = False  # norms on each block's output too (pre/post attention and MLP)
    v_norm: bool = False  # scale-free per-head RMSNorm of v (needs qk_norm)
    attn_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    layer_scalar: bool = False  # each layer's output is multiplied by a learned scalar
    logit_softcap: float | None = None  # logits = c * tanh(logits / c)
    per_layer_input_size: int = 0  # per-layer input embeddings of this width (0: none)
    per_layer_input_vocab: int = 0  # rows of that table (tokens >= it get the zero row's lookup)
    layer_attention: tuple[LayerAttention, ...] = ()  # () : every layer as the global fields say
    layer_intermediate_sizes: tuple[int, ...] = ()  # () : intermediate_size everywhere

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"MLP activation {self.hidden_act!r} is unknown")
        for name in ("layer_windows", "moe_layers", "layer_attention", "layer_intermediate_sizes"):
            value = getattr(self, name)
            if value and len(value) != self.num_layers:
                raise ConfigError(f"{name} has {len(value)} entries for {self.num_layers} layers")
        if any(self.moe_layers) and self.moe is None:
            raise ConfigError("moe_layers marks sparse layers but no MoE config is given")
        if self.moe is not None and self.moe.beside_dense != self.sandwich_norm:
            raise ConfigError("an MoE beside the dense MLP needs sandwich-norm layers, and only there")
        for i, a in enumerate(self.layer_attention):
            if self.num_heads % a.num_kv_heads:
                raise ConfigError(f"layer {i}: num_attention_heads ({self.num_heads}) must be a multiple of "
                                  f"its {a.num_kv_heads} KV heads")
            src = self.layer_attention[a.kv_source] if 0 <= a.kv_source < self.num_layers else None
            if src is None or src.kv_source != a.kv_source or (src.head_dim, src.num_kv_heads) != (
                    a.head_dim, a.num_kv_heads) or self.window(a.kv_source) != self.window(i):
                raise ConfigError(f"layer {i} shares the KV cache of layer {a.kv_source}, which must own its "
                                  "cache and have the same head size, KV heads and window")

    def window(self, layer: int) -> int:
        """Attention window of `layer` (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def attention(self, layer: int) -> LayerAttention:
        """Attention shape of `layer` (the global fields unless `layer_attention` sets it)."""
        if self.layer_attention:
            return self.layer_attention[layer]
        return LayerAttention(self.head_dim, self.num_kv_heads, self.rope, layer)

    def intermediate(self, layer: int) -> int:
        sizes = self.layer_intermediate_sizes
        return sizes[layer] if sizes else self.intermediate_size

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def default_taps(self) -> tuple[int, int, int]:
        """vLLM's default EAGLE-3 tap layers (2, L//2, L-3): residual streams entering those layers."""
        n = self.num_layers
        return (2, n // 2, n - 3)


class TargetAdapter:
    """Llama-family parsing; subclasses override the class attributes or `extra_fields`."""

    name = "llama"
    model_types: tuple[str, ...] = ("llama",)
    qk_norm = False
    weight_prefix = "model."

    hidden_act = "silu"

    def parse(self, cfg: dict, where: str) -> TargetConfig:
        self.check_activation(cfg, where)
        hidden = int(require(cfg, "hidden_size", where))
        heads = int(require(cfg, "num_attention_heads", where))
        return TargetConfig(
            arch=self.name,
            vocab_size=int(require(cfg, "vocab_size", where)),
            hidden_size=hidden,
            num_layers=int(require(cfg, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(require(cfg, "intermediate_size", where)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg, where),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=self.qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=token_ids(cfg.get("eos_token_id")),
            quantization=self.quantization(cfg, where),
            **self.extra_fields(cfg, where),
        )

    def check_activation(self, cfg: dict, where: str) -> None:
        act = cfg.get("hidden_act", "silu")
        if act != self.hidden_act:
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported (expected {self.hidden_act!r})")

    def extra_fields(self, cfg: dict, where: str) -> dict:
        return {}

    def quantization(self, cfg: dict, where: str) -> str | None:
        return quantization(cfg, where)

    def convert(self, tensors: dict, config: TargetConfig, where: str) -> dict:
        """Checkpoint tensors -> our canonical names and layouts (default: `our_name` renames)."""
        out = {}
        for name, tensor in tensors.items():
            ours = self.our_name(name)
            if ours is not None:
                out[ours] = tensor
        return out

    def our_name(self, hf_name: str) -> str | None:
        """Our parameter name for a checkpoint tensor (None: not a weight we use)."""
        if hf_name.startswith(self.weight_prefix):
            return hf_name[len(self.weight_prefix):]
        return hf_name if hf_name.startswith("lm_head.") else None
