"""The resolved architecture of a target and a drafter: frozen dataclasses, no torch, no I/O.

checkpoint/ builds them from config.json (checkpoint/adapters/ per target family,
peagle_trt/checkpoint/drafter.py for heads); models/ builds torch modules from them. Both import this
module, neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from peagle_trt.errors import ConfigError

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")  # peagle_trt/models/rope.py computes each


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # default | linear | llama3 | yarn | proportional
    params: dict = field(default_factory=dict)  # the remaining scaling keys, as in config.json
    max_position_embeddings: int = 4096

    @classmethod
    def from_hf(cls, cfg: dict, where: str) -> RopeConfig:
        params = dict(cfg.get("rope_parameters") or {})
        if not params:
            params = dict(cfg.get("rope_scaling") or {})
            params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
        theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"{where}: rope type {rope_type!r} is not supported; "
                              f"supported: {sorted(ROPE_TYPES)}")
        return cls(theta, rope_type, params, int(cfg.get("max_position_embeddings", 4096)))


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


@dataclass(frozen=True)
class DrafterConfig:
    layout: str  # aws | speculators | eagle3
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    vocab_size: int  # size of the target vocabulary the head maps into (through d2t)
    draft_vocab_size: int
    target_hidden_size: int  # fc input width / num_aux
    num_aux: int = 3
    aux_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    has_mask_hidden: bool = False
    has_embed: bool = True  # False: the head shares the target's embedding table
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    trained_depth: int | None = None
    norm_output: bool = False  # sequential steps feed back norm(x) instead of x (EAGLE 3.1)
    embed_requires_grad: bool | None = None  # training-only flag, kept for `inspect`
    sliding_window: int | None = None  # window of the layers in `sliding_layers`
    sliding_layers: tuple[int, ...] = ()  # drafter layers with sliding-window attention

    @property
    def supports_parallel(self) -> bool:
        return self.has_mask_hidden and self.mask_token_id is not None

    def window(self, layer: int) -> int:
        """Attention window of drafter `layer` (0: full attention). Sliding layers restrict a row
        at position p to keys at positions > p - W, the library's own masks (eagle3/attention.py,
        peagle/attention.py) and transformers' convention; ops.reference.kv_attention computes it."""
        return int(self.sliding_window or 0) if layer in self.sliding_layers else 0

    @property
    def max_positions(self) -> int | None:
        """KV positions per sequence a full-causal attention op serves exactly (None: unbounded):
        the window of the sliding layers. The torch and onnxruntime backends compute windows
        (no limit); the TensorRT plugins do not (plugins/), so `check_window` bounds that backend."""
        return self.sliding_window if self.sliding_layers and self.sliding_window else None
