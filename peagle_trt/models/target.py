"""The target model: a Llama / Qwen3 / Qwen3-MoE / GPT-OSS / Gemma-4 decoder over a `KVCache`,
returning logits and the residual streams at the drafter's tap layers. Per-layer differences
(sliding windows, attention sinks, sparse MoE MLPs, head sizes and rope, KV sharing, sandwich
norms and per-layer inputs) come from the resolved `TargetConfig`.

Tap semantics (vLLM): tap i = the hidden state ENTERING decoder layer i (= output of layer i-1,
before any norm); tap 0 is the embedding (Gemma-4: scaled by sqrt(H), as vLLM taps it) and tap L the
last layer's output before the final norm.
The taps are concatenated in tap order: aux [B, S, len(taps) * hidden].
"""

from __future__ import annotations

import torch
from torch import nn

from peagle_trt.architecture import TargetConfig
from peagle_trt.config import BLOCK_SIZE, KVLayout
from peagle_trt.models.fp8 import fp8_swap
from peagle_trt.models.gemma4 import Gemma4DecoderLayer, Gemma4PerLayerInputs
from peagle_trt.models.kv_cache import KVCache, storage_dtype
from peagle_trt.models.layers import MLP, Attention, DecoderLayer, RMSNorm
from peagle_trt.models.moe import SparseMoE, fp8_experts_swap
from peagle_trt.models.rope import inv_freq, rope_cos_sin


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig, taps: tuple[int, ...] = ()):
        super().__init__()
        c = self.config = config
        self.taps = tuple(taps)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        if c.per_layer_input_size:
            self.per_layer_inputs = Gemma4PerLayerInputs(c.hidden_size, c.num_layers, c.per_layer_input_size,
                                                   c.per_layer_input_vocab, c.rms_norm_eps)
        self.layers = nn.ModuleList(decoder_layer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.layer_rope, self.rope_scales = rope_tables(c)  # layer -> table index; cos/sin scale per table
        self.set_inv_freqs()

    def set_inv_freqs(self) -> None:
        """Buffers `inv_freq` (table 0, the first layer's rope), `inv_freq_1`, ... (distinct ropes)."""
        seen = {}
        for i in range(self.config.num_layers):
            a = self.config.attention(i)
            seen.setdefault(self.layer_rope[i], inv_freq(a.rope, a.head_dim)[0])
        for j, inv in sorted(seen.items()):
            self.register_buffer("inv_freq" if j == 0 else f"inv_freq_{j}", inv, persistent=False)
        self.rope_scale = self.rope_scales[0]

    def inv_freqs(self) -> list[torch.Tensor]:
        return [self.inv_freq if j == 0 else getattr(self, f"inv_freq_{j}")
                for j in range(len(self.rope_scales))]

    @property
    def kv_windows(self) -> tuple[int, ...]:
        """Per KV group its window (group 0: full attention), see `kv_groups`."""
        return kv_groups(self.config)[0]

    def new_cache(self, layout: KVLayout | int, max_len: int | None = None) -> KVCache:
        """The paged KV cache for `layout` (a KVLayout: the runtime's), or for `layout` = N
        sequences of `max_len` positions in the static layout (offline forwards, see
        peagle_trt/models/kv_cache.py). Windowed layers form groups of their own; KV-shared layers hold none."""
        c, p = self.config, self.lm_head.weight
        attn = [c.attention(i) for i in range(c.num_layers)]
        windows, groups = kv_groups(c)
        if isinstance(layout, KVLayout):
            counts = layout.group_blocks(windows)
            block_size, max_len = layout.block_size, layout.max_len
        else:
            block_size = BLOCK_SIZE
            counts = (KVCache.static_blocks(layout, max_len, block_size),) * len(windows)
        return KVCache(tuple((a.num_kv_heads, a.head_dim) for a in attn), groups, counts, block_size, max_len,
                       storage_dtype(layout, p.dtype), p.device, tuple(a.kv_source for a in attn),
                       tuple(layer.self_attn.kv_scales() for layer in self.layers))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
                cache: KVCache, logit_rows: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # tokens, positions [B, S] (position -1 = padding row); tables [G, B, M] block tables
        # (or [B] sequence indices of a static cache: KVCache.tables)
        # logit_rows [B, R] row indices to compute logits for (None: all S rows)
        # tree_mask [B, S, W] int32 | None: draft-tree rows (positions by depth; ops.reference.kv_attention)
        # returns logits [B, R, V] (float32), aux [B, S, len(taps) * hidden]
        c = self.config
        tables = cache.tables(tables)
        x = self.embed_tokens(tokens)
        if c.embed_scale != 1.0:
            x = x * torch.tensor(c.embed_scale, dtype=x.dtype)
        pli = self.per_layer_inputs(tokens, x) if c.per_layer_input_size else None  # [B, S, L, P]
        ropes = [rope_cos_sin(inv, scale, positions.clamp(min=0), x.dtype)
                 for inv, scale in zip(self.inv_freqs(), self.rope_scales)]
        tapped = {}
        for i, layer in enumerate(self.layers):
            if i in self.taps:
                tapped[i] = x
            cos, sin = ropes[self.layer_rope[i]]
            if pli is None:
                x = layer(x, cos, sin, cache, i, tables, positions, tree_mask=tree_mask)
            else:
                x = layer(x, cos, sin, cache, i, tables, positions, pli[:, :, i], tree_mask=tree_mask)
        tapped[len(self.layers)] = x
        aux = [tapped[t] for t in self.taps]
        if logit_rows is not None:
            x = torch.gather(x, 1, logit_rows[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.head_logits(self.norm(x))
        return logits, (torch.cat(aux, dim=-1) if aux else x.new_zeros(*tokens.shape, 0))

    def head_logits(self, normed: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """lm_head (+ the family's logit soft-cap) of the final-normed hidden state [..., H]:
        logits [..., V] float32, or of the vocabulary `rows` only [..., len(rows)] (training
        keeps the draft vocabulary's)."""
        w = self.lm_head.weight if rows is None else self.lm_head.weight[rows]
        logits = torch.nn.functional.linear(normed, w).float()
        cap = self.config.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @classmethod
    def from_tensors(cls, config: TargetConfig, tensors: dict, taps: tuple[int, ...],
                     device="cpu", dtype=torch.float32, name: str = "target") -> TargetModel:
        with torch.device("meta"):
            model = cls(config, taps)
        # FP8 checkpoints: FP8 experts and FP8 linears (FP8Linear) get their scales; no-op otherwise
        experts = tuple(f"{p}." for p in fp8_experts_swap(model, tensors, name))
        fp8_swap(model, {k: t for k, t in tensors.items() if not k.startswith(experts)}, name)
        load_strict(model, tensors, name)
        model.set_inv_freqs()
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def rope_tables(c: TargetConfig) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(per layer: index of its rope table, per table: cos/sin scale); one table per distinct
    (rope, head size), table 0 being the first layer's."""
    keys, layer_rope, scales = [], [], []
    for i in range(c.num_layers):
        a = c.attention(i)
        key = (a.rope, a.head_dim)
        if key not in keys:
            keys.append(key)
            scales.append(inv_freq(a.rope, a.head_dim)[1])
        layer_rope.append(keys.index(key))
    return tuple(layer_rope), tuple(scales)


def decoder_layer(c: TargetConfig, i: int) -> nn.Module:
    """Decoder layer `i` as the resolved config describes it (window, sinks, head size, KV sharing,
    dense or MoE MLP, Llama pre-norm or sandwich norms)."""
    a = c.attention(i)
    attn = Attention(c.hidden_size, c.hidden_size, c.num_heads, a.num_kv_heads, a.head_dim, c.attention_bias,
                     c.rms_norm_eps if c.qk_norm else None, o_bias=c.attention_bias, window=c.window(i),
                     sinks=c.attention_sinks, scale=c.attn_scale, v_norm=c.v_norm, k_eq_v=a.k_eq_v,
                     kv_shared=a.kv_source != i)
    dense = MLP(c.hidden_size, c.intermediate(i), c.mlp_bias, c.hidden_act)
    moe = SparseMoE(c.hidden_size, c.moe) if c.is_moe(i) else None
    if c.sandwich_norm:  # an MoE there runs beside the dense MLP (MoEConfig.beside_dense)
        return Gemma4DecoderLayer(c.hidden_size, c.rms_norm_eps, attn, dense, c.hidden_act,
                                  c.per_layer_input_size, c.layer_scalar, moe)
    mlp = moe or dense
    return DecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.rms_norm_eps, c.attention_bias, c.mlp_bias, c.qk_norm, attn=attn, mlp=mlp)


def kv_groups(c: TargetConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(windows, groups): per KV group its window (group 0: 0, full attention, present even when
    every layer is windowed: the drafter's), per layer its group (a KV-shared layer: its source's)."""
    windows = (0,) + tuple(sorted({c.window(i) for i in range(c.num_layers)} - {0}))
    groups = [windows.index(c.window(i)) for i in range(c.num_layers)]
    return windows, tuple(groups[c.attention(i).kv_source] for i in range(c.num_layers))


def load_strict(model: nn.Module, tensors: dict, what: str) -> None:
    # `what` names the checkpoint (e.g. "drafter /path/to/dir") for the messages below
    """Load `tensors` into `model` (possibly on the meta device); every parameter must be present
    with the right shape, and no unexpected weight may be left over."""
    from peagle_trt.errors import CheckpointError

    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(k for k in set(tensors) - set(params) if not k.endswith("rotary_emb.inv_freq"))
    if missing:
        raise CheckpointError(f"{what}: weights missing from the checkpoint: {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise CheckpointError(f"{what}: unexpected weights in the checkpoint: {unexpected[:5]}; "
                              "the config does not describe these tensors")
    for name, p in params.items():
        if tuple(tensors[name].shape) != tuple(p.shape):
            raise CheckpointError(f"{what}: weight {name!r} has shape {tuple(tensors[name].shape)}, "
                                  f"config.json implies {tuple(p.shape)}")
    model.load_state_dict({k: tensors[k] for k in params}, strict=False, assign=True)
