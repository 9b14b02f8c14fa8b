"""The EAGLE-3 / P-EAGLE drafter head (the P-EAGLE paper's architecture).

Per row: e = embed(token), g = hidden input (fc-projected target taps, the projected
`mask_hidden` for mask rows, or the drafter's own previous output in sequential mode).
  layer 0 (fusion midlayer): x = res + attn(cat(input_layernorm(e), hidden_norm(g)))  [2H -> H]
                             x = x + mlp(post_attention_layernorm(x)); res = g (or hidden_norm(g))
  layers 1..N-1: plain pre-norm decoder layers;  logits_d = lm_head(norm(x))  [V_d]
Taps -> g: fc(aux), after RMSNorm(aux) (norm_before_fc) or per-tap RMSNorms (fc_norm).
Sequential (EAGLE-3) steps feed back x, or norm(x) for norm_output (EAGLE 3.1) heads.
Draft ids map to target ids through d2t offsets: target_id = draft_id + d2t[draft_id].
The drafter keeps its own KV cache, written by absolute position like the target's; its
sliding-window layers (`layer_types`, `sliding_window`) attend to keys at positions > p - W.
Flag meanings follow the `speculators` library; tests/compat/ checks logits against its forward.
The fusion layer writes its own ONNX nodes (`FusionLayer.write_onnx`); the drafter graphs are
assembled in peagle_trt/export/graphs.py.
"""

from __future__ import annotations

import torch
from torch import nn

from peagle_trt.architecture import DrafterConfig
from peagle_trt.config import BLOCK_SIZE, KVLayout
from peagle_trt.models.kv_cache import KVCache, storage_dtype
from peagle_trt.models.layers import MLP, Attention, DecoderLayer, RMSNorm
from peagle_trt.models.rope import inv_freq as rope_inv_freq
from peagle_trt.models.rope import rope_cos_sin
from peagle_trt.models.target import load_strict


def _attention(c: DrafterConfig, layer: int, in_dim: int) -> Attention:
    """Drafter layer `layer`'s attention (its window from the config; 0: full attention)."""
    return Attention(in_dim, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias,
                     c.rms_norm_eps if c.qk_norm else None, window=c.window(layer))


class FusionLayer(nn.Module):
    """Layer 0: attention over concat(embedding, hidden) of width 2H."""

    def __init__(self, c: DrafterConfig):
        super().__init__()
        h = c.hidden_size
        self.input_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, c.rms_norm_eps)
        self.self_attn = _attention(c, 0, 2 * h)
        self.post_attention_layernorm = RMSNorm(h, c.rms_norm_eps)
        self.mlp = MLP(h, c.intermediate_size)
        self.norm_before_residual = c.norm_before_residual

    def forward(self, e, g, cos, sin, cache, tables, positions):
        g_normed = self.hidden_norm(g)
        residual = g_normed if self.norm_before_residual else g
        x = torch.cat((self.input_layernorm(e), g_normed), dim=-1)
        x = residual + self.self_attn(x, cos, sin, cache, 0, tables, positions)
        return x + self.mlp(self.post_attention_layernorm(x))

    def write_onnx(self, w, e: str, g: str, cos: str, sin: str, positions: str, table: str, past,
                   present) -> str:
        """The same layer as ONNX nodes (`w`: the ModelWriter of peagle_trt/export/graphs.py):
        e, g [B, S, H] -> [B, S, H]."""
        g_normed = self.hidden_norm.write_onnx(w, g, "layers.0.hidden_norm")
        residual = g_normed if self.norm_before_residual else g
        e_normed = self.input_layernorm.write_onnx(w, e, "layers.0.input_layernorm")
        x = w.op("Concat", e_normed, g_normed, axis=-1)
        h = self.self_attn.write_onnx(w, x, 0, "layers.0.self_attn", cos, sin, positions, table, past,
                                      present)
        x = w.op("Add", residual, h)
        h = self.post_attention_layernorm.write_onnx(w, x, "layers.0.post_attention_layernorm")
        return w.op("Add", x, self.mlp.write_onnx(w, h, "layers.0.mlp"))


class DrafterModel(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = self.config = config
        h, aux_width = c.hidden_size, c.num_aux * c.target_hidden_size
        self.embed_tokens = nn.Embedding(c.vocab_size, h)
        if c.norm_before_fc:
            self.input_norm = RMSNorm(aux_width, c.rms_norm_eps)
        if c.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps)
                                         for _ in range(c.num_aux))
        self.fc = nn.Linear(aux_width, h, bias=False)
        self.layers = nn.ModuleList([FusionLayer(c)] + [
            DecoderLayer(h, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
                         c.rms_norm_eps, c.attention_bias, False, c.qk_norm, attn=_attention(c, i, h))
            for i in range(1, c.num_layers)])
        self.norm = RMSNorm(h, c.rms_norm_eps)
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("mask_hidden", torch.zeros(1, 1, aux_width))
        inv_freq, self.rope_scale = rope_inv_freq(c.rope, c.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("h_mask", torch.zeros(h), persistent=False)

    def new_cache(self, layout: KVLayout | int, max_len: int | None = None) -> KVCache:
        """The paged KV cache (every layer in group 0, sharing the target's full-attention block
        tables) for a KVLayout, or for N sequences of `max_len` positions (static layout)."""
        c, p = self.config, self.fc.weight
        if isinstance(layout, KVLayout):
            blocks, block_size, max_len = layout.num_blocks, layout.block_size, layout.max_len
        else:
            block_size = BLOCK_SIZE
            blocks = KVCache.static_blocks(layout, max_len, block_size)
        return KVCache(((c.num_kv_heads, c.head_dim),) * c.num_layers, (0,) * c.num_layers, (blocks,), block_size,
                       max_len, storage_dtype(layout, p.dtype), p.device,
                       scales=tuple(layer.self_attn.kv_scales() for layer in self.layers))

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """Target taps [..., num_aux * H_t] -> drafter hidden input [..., H] (fc norms, then fc)."""
        if self.config.norm_before_fc:  # (the library refuses both flags together)
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            chunks = aux.chunk(self.config.num_aux, dim=-1)
            aux = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward_rows(self, e: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     tables: torch.Tensor, cache: KVCache) -> torch.Tensor:
        # e (token embeddings), hidden [B, S, H]; positions [B, S] (-1 = padding); tables [G, B, M]
        # block tables (group 0 is read) or [B] sequence indices of a static cache
        # returns the pre-norm output [B, S, H]
        tables = cache.tables(tables)[:1]
        cos, sin = rope_cos_sin(self.inv_freq, self.rope_scale, positions.clamp(min=0), e.dtype)
        x = self.layers[0](e, hidden, cos, sin, cache, tables, positions)
        for i, layer in enumerate(self.layers[1:], start=1):
            x = layer(x, cos, sin, cache, i, tables, positions)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x)).float()  # [..., V_d]

    def feedback(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden state a sequential step passes to the next: x, or norm(x) (norm_output)."""
        return self.norm(x) if self.config.norm_output else x

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                tables: torch.Tensor, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        # tokens, positions [B, S] (position -1 = padding row); hidden [B, S, H]; tables: as forward_rows
        # returns draft-vocab logits [B, S, V_d] (float32) and the hidden fed to the next
        # sequential step [B, S, H] (`feedback`: pre-norm output, post-norm for norm_output)
        x = self.forward_rows(self.embed_tokens(tokens), hidden, positions, tables, cache)
        return self.logits(x), self.feedback(x)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @classmethod
    def from_tensors(cls, config: DrafterConfig, tensors: dict, target_embed: torch.Tensor | None = None,
                     device="cpu", dtype=torch.float32, name: str = "drafter") -> DrafterModel:
        tensors = dict(tensors)
        if "embed_tokens.weight" not in tensors:
            tensors["embed_tokens.weight"] = target_embed  # EAGLE-3 heads without their own table
        buffers = {"d2t": tensors.pop("d2t", None), "mask_hidden": tensors.pop("mask_hidden", None)}
        with torch.device("meta"):
            model = cls(config)
        load_strict(model, tensors, name)
        aux_width = config.num_aux * config.target_hidden_size
        model.d2t = (buffers["d2t"].long() if buffers["d2t"] is not None
                     else torch.zeros(config.draft_vocab_size, dtype=torch.long))
        mask_hidden = buffers["mask_hidden"]
        model.mask_hidden = (mask_hidden.float().reshape(1, 1, aux_width) if mask_hidden is not None
                             else torch.zeros(1, 1, aux_width))
        model.inv_freq = rope_inv_freq(config.rope, config.head_dim)[0]
        model.h_mask = torch.zeros(config.hidden_size)
        model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        model.d2t = model.d2t.long()
        with torch.no_grad():  # h_mask = fc(mask_hidden), computed once (the P-EAGLE paper)
            model.h_mask = model.project(model.mask_hidden.to(dtype)).reshape(-1)
        return model
