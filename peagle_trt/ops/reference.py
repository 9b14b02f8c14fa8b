"""Reference implementations of the P-EAGLE custom ops (torch; CPU and generic CUDA).

These define the contract the ONNX function bodies and the CUDA/TensorRT plugins must match.
Cache layout: [num_slots, kv_heads, T + 1, head_dim] (T = max_len, or a window's worth of
positions for sliding-window layers); row T is a trash row that padding rows (position -1) write to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """PEagleKVAttention.

    q [B, S, H*d], k/v [B, S, KV*d] (RoPE applied); positions [B, S] int64 (-1 = padding row);
    slots [B] int64; k_cache/v_cache [N, KV, T+1, d], updated IN PLACE at (slot, position % T).
    Row (b, s) attends to the cached keys of slot b at positions 0..positions[b, s] (its own new
    key included; rows of one request are causal among themselves through their positions).

    Optional (defaults give the original op): `sliding_window` W > 0 restricts a row at position p
    to keys at positions > p - W (Mistral / GPT-OSS / Gemma sliding layers); `sinks` [H] adds one
    learned logit per head to the softmax denominator (GPT-OSS attention sinks, no value);
    k = v = None reads the cache without writing (Gemma-4 KV-shared layers: this forward's keys
    were written by the layer that owns the cache).
    The cache is a ring of T positions (position q lives at row q % T): with T >= every position
    this is plain absolute indexing; a windowed layer may use T >= W + S - 1 (S: most rows of one
    forward) and still see every key of its window, so its memory is bounded by the window.
    Returns out [B, S, H*d]; padding rows return finite values that callers ignore.
    """
    b, s, _ = q.shape
    ring = k_cache.shape[2] - 1  # T; row T is the trash row
    if sliding_window and s > ring - sliding_window + 1 and int(positions.max()) >= ring:
        from peagle_trt.errors import RuntimeInvariantError

        raise RuntimeInvariantError(f"kv_attention: {s} rows in one forward overrun a windowed KV ring of {ring} "
                                    f"positions (window {sliding_window}); allocate W + rows - 1 >= "
                                    f"{sliding_window + s - 1}")
    if k is not None:  # k = v = None: read only (a KV-shared layer over the cache another layer wrote)
        write = torch.where(positions >= 0, positions % ring, ring)  # [B, S]
        rows = slots[:, None]
        k_cache[rows, :, write] = k.view(b, s, num_kv_heads, head_dim).to(k_cache.dtype)
        v_cache[rows, :, write] = v.view(b, s, num_kv_heads, head_dim).to(v_cache.dtype)
    length = min(int(positions.max()) + 1, ring)
    keys = k_cache[slots, :, :length].to(q.dtype)  # [B, KV, L, d]
    values = v_cache[slots, :, :length].to(q.dtype)
    j = torch.arange(length, device=q.device)[None, None]  # [1, 1, L] ring rows
    pos = positions[:, :, None]  # [B, S, 1]
    key_pos = pos - (pos - j) % ring  # absolute position held by ring row j, as seen from the row
    visible = key_pos >= 0  # [B, S, L]
    if sliding_window:
        visible &= key_pos > pos - sliding_window
    visible[..., 0] |= positions < 0  # keep padding rows' softmax finite
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, H, S, d]
    if sinks is None:
        out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=visible[:, None], enable_gqa=True,
                                             scale=scale)
    else:
        group = num_heads // num_kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [B, H, L, d]
        scores = qh @ keys.transpose(-1, -2) * (scale if scale is not None else head_dim ** -0.5)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))  # [B, H, S, L]
        sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, s, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink takes mass, no value
        out = probs @ values
    return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)


def draft_inputs(pending_tokens: torch.Tensor, pending_hidden: torch.Tensor, num_pending: torch.Tensor,
                 cur: torch.Tensor, embed_tokens: torch.Tensor, h_mask: torch.Tensor,
                 num_spec_tokens: int, mask_token_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PEagleDraftInputs: the rows of one parallel drafting pass for a batch.

    pending_tokens [B, P] int64 (padded), pending_hidden [B, P, H] (fc-projected target taps),
    num_pending [B] int64 (n >= 1 real rows), cur [B] int64 (pending rows sit at cur-n .. cur-1),
    embed_tokens [V, H], h_mask [H] = fc(mask_hidden).
    Returns, with R = P + K - 1 rows per request:
      embeds [B, R, H], hidden [B, R, H], positions [B, R] int64 (-1 = padding), sample_rows [B, K].
    Row j < n: (pending_tokens[j], pending_hidden[j]); n <= j < n+K-1: (mask token, h_mask);
    positions cur-n+j; drafts are read from rows n-1 .. n+K-2 (the NTP row, then the mask rows).
    Example, K=3, n=2, cur=12: rows (t0,h0,@10) (t1,h1,@11)* (M,hm,@12)* (M,hm,@13)*; sample 1,2,3.
    """
    bsz, p = pending_tokens.shape
    k = num_spec_tokens
    r = p + k - 1
    j = torch.arange(r, device=pending_tokens.device)[None]  # [1, R]
    n = num_pending[:, None]  # [B, 1]
    real, mask = j < n, (j >= n) & (j < n + k - 1)
    idx = j.clamp(max=p - 1).expand(bsz, -1)  # [B, R]
    tokens = torch.where(real, torch.gather(pending_tokens, 1, idx), torch.full_like(idx, mask_token_id))
    tokens = torch.where(real | mask, tokens, torch.zeros_like(tokens))
    embeds = F.embedding(tokens, embed_tokens) * (real | mask)[..., None]
    gathered = torch.gather(pending_hidden, 1, idx[..., None].expand(-1, -1, pending_hidden.shape[-1]))
    hidden = torch.where(real[..., None], gathered, h_mask.to(gathered.dtype).expand_as(gathered))
    hidden = hidden * (real | mask)[..., None]
    positions = torch.where(real | mask, cur[:, None] - n + j, torch.full_like(idx, -1))
    sample_rows = n - 1 + torch.arange(k, device=pending_tokens.device)[None]  # [B, K]
    return embeds, hidden, positions, sample_rows


def draft_sample(logits: torch.Tensor, d2t: torch.Tensor) -> torch.Tensor:
    """PEagleDraftSample: logits [B, K, V_d] -> target-vocabulary ids [B, K] (argmax, then
    target_id = draft_id + d2t[draft_id])."""
    draft = logits.argmax(dim=-1)
    return draft + d2t[draft]
