"""The target model: a Llama / Qwen3 / Qwen3-MoE / GPT-OSS decoder over a `KVCache`, returning
logits and the residual streams at the drafter's tap layers. Per-layer differences (sliding
windows, attention sinks, sparse MoE MLPs) come from the resolved `TargetConfig`.

Tap semantics (vLLM): tap i = the hidden state ENTERING decoder layer i (= output of layer i-1,
before any norm); tap 0 is the embedding and tap L the last layer's output before the final norm.
The taps are concatenated in tap order: aux [B, S, len(taps) * hidden].
"""

from __future__ import annotations

import torch
from torch import nn

from peagle_trt.checkpoint.arch import TargetConfig
from peagle_trt.models.fp8 import fp8_swap
from peagle_trt.models.kv_cache import KVCache
from peagle_trt.models.layers import Attention, DecoderLayer, RMSNorm
from peagle_trt.models.moe import SparseMoE
from peagle_trt.models.rope import rope_cos_sin


class TargetModel(nn.Module):
    def __init__(self, config: TargetConfig, taps: tuple[int, ...] = ()):
        super().__init__()
        c = self.config = config
        self.taps = tuple(taps)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(decoder_layer(c, i) for i in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv_freq, self.rope_scale = c.rope.inv_freq(c.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def new_cache(self, num_slots: int, max_len: int, max_rows: int | None = None) -> KVCache:
        """KV cache of `num_slots` sequences of up to `max_len` positions. With `max_rows` (most
        rows one forward may carry), sliding-window layers keep only W + max_rows - 1 positions."""
        c, p = self.config, self.lm_head.weight
        return KVCache(c.num_layers, num_slots, c.num_kv_heads, max_len, c.head_dim, p.dtype, p.device,
                       layer_lens=kv_layer_lens(c, max_len, max_rows))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                cache: KVCache, logit_rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # tokens, positions [B, S] (position -1 = padding row); slots [B]
        # logit_rows [B, R] row indices to compute logits for (None: all S rows)
        # returns logits [B, R, V] (float32), aux [B, S, len(taps) * hidden]
        x = self.embed_tokens(tokens)
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, positions.clamp(min=0), x.dtype)
        tapped = {}
        for i, layer in enumerate(self.layers):
            if i in self.taps:
                tapped[i] = x
            x = layer(x, cos, sin, cache, i, slots, positions)
        tapped[len(self.layers)] = x
        aux = [tapped[t] for t in self.taps]
        if logit_rows is not None:
            x = torch.gather(x, 1, logit_rows[..., None].expand(-1, -1, x.shape[-1]))
        logits = self.lm_head(self.norm(x)).float()
        return logits, (torch.cat(aux, dim=-1) if aux else x.new_zeros(*tokens.shape, 0))

    @classmethod
    def from_tensors(cls, config: TargetConfig, tensors: dict, taps: tuple[int, ...],
                     device="cpu", dtype=torch.float32, name: str = "target") -> "TargetModel":
        with torch.device("meta"):
            model = cls(config, taps)
        # FP8 checkpoints (`peagle-trt quantize`): FP8 linears become FP8Linear; no-op otherwise
        fp8_swap(model, tensors, name)
        load_strict(model, tensors, name)
        inv_freq, _ = config.rope.inv_freq(config.head_dim)
        model.inv_freq = inv_freq
        return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def decoder_layer(c: TargetConfig, i: int) -> DecoderLayer:
    """Decoder layer `i` as the resolved config describes it (window, sinks, dense or MoE MLP)."""
    attn = Attention(c.hidden_size, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias,
                     c.rms_norm_eps if c.qk_norm else None, o_bias=c.attention_bias, window=c.window(i),
                     sinks=c.attention_sinks)
    mlp = SparseMoE(c.hidden_size, c.moe) if c.is_moe(i) else None
    return DecoderLayer(c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                        c.rms_norm_eps, c.attention_bias, c.mlp_bias, c.qk_norm, attn=attn, mlp=mlp)


def kv_layer_lens(c: TargetConfig, max_len: int, max_rows: int | None = None) -> tuple[int, ...]:
    """KV positions each layer keeps per slot: `max_len` for full attention; for a window W,
    min(max_len, W + max_rows - 1) when the most rows per forward is known (the ring then still
    holds every key of each row's window, see ops.reference.kv_attention)."""
    lens = []
    for i in range(c.num_layers):
        w = c.window(i)
        lens.append(min(max_len, w + max_rows - 1) if w and max_rows else max_len)
    return tuple(lens)


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
