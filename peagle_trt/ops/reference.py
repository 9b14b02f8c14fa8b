"""Reference implementations of the P-EAGLE custom ops (torch; CPU and generic CUDA).

These define the contract the ONNX function bodies and the CUDA/TensorRT plugins must match.
Paged KV cache: per layer, k_cache / v_cache [N + 1, bs, KV, d]: N blocks of `bs` positions, then
one trash block (index N) that padding rows (position -1) write to. A request's block table
[M] int64 lists its blocks in position order (entry j holds positions j*bs .. j*bs + bs - 1);
-1 marks an entry without a block (past the request's end, or slid out of a window), read as
the trash block and never visible. Blocks are assigned by the runtime (peagle_trt/runtime/blocks.py).
"""

from __future__ import annotations

import contextlib
import contextvars

import numpy as np
import torch
import torch.nn.functional as F

from peagle_trt.ops import deterministic

_KEY_SPAN: contextvars.ContextVar[int | None] = contextvars.ContextVar("key_span", default=None)


@contextlib.contextmanager
def key_span(length: int | None):
    """Within: kv_attention reads keys at slots 0 .. length - 1, `length` being the forward's
    highest slot + 1 as the host knows it (the speculative step: its requests' positions), instead
    of reading that slot back from the device (a host sync per layer). Must equal the slots'
    maximum + 1: the result is then the same to the bit."""
    token = _KEY_SPAN.set(length)
    try:
        yield
    finally:
        _KEY_SPAN.reset(token)


def current_span() -> int | None:
    """The key span set by the innermost `key_span` (None: none set)."""
    return _KEY_SPAN.get()


def block_rows(tables: torch.Tensor, positions: torch.Tensor, trash: int, block_size: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) [B, S] each of position `positions[b, s]` under `tables` [B, M]: padding
    rows (position -1), positions past the table (M * bs and beyond: a drafter's lookahead rows at
    the end of the context) and entries -1 go to (trash, 0)."""
    pos = positions.clamp(min=0)
    entry = pos // block_size
    block = torch.gather(tables, 1, entry.clamp(max=tables.shape[1] - 1))
    valid = (positions >= 0) & (entry < tables.shape[1]) & (block >= 0)
    return torch.where(valid, block, trash), torch.where(valid, pos % block_size, 0)


def kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 block_tables: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int = 0, sinks: torch.Tensor | None = None,
                 tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """PEagleKVAttention over a paged cache.

    q [B, S, H*d], k/v [B, S, KV*d] (RoPE applied); positions [B, S] int64 (-1 = padding row);
    block_tables [B, M] int64 (-1 = no block); k_cache/v_cache [N+1, bs, KV, d], updated IN PLACE:
    row (b, s) writes its k/v at (block_tables[b, p // bs], p % bs), p = positions[b, s].
    Row (b, s) attends to the keys of request b at positions 0..positions[b, s] (its own new key
    included; rows of one request are causal among themselves through their positions).

    Optional (defaults give the plain op): `sliding_window` W > 0 restricts a row at position p
    to keys at positions > p - W (Mistral / GPT-OSS / Gemma sliding layers; the blocks before the
    window may be -1); `sinks` [H] adds one learned logit per head to the softmax denominator
    (GPT-OSS attention sinks, no value); k = v = None reads the cache without writing (Gemma-4
    KV-shared layers: this forward's keys were written by the layer that owns the cache).

    `tree_mask` [B, S, W] int32 (packed bits, TensorRT-LLM's spec_decoding_packed_mask layout):
    the rows of request b are a draft tree (speculative/tree.py). `positions` are then the RoPE
    positions (by depth, for the window) and row s lives at KV slot positions[b, 0] + s: the rows
    of a request are contiguous and padding rows come last. A row sees the keys at slots below
    positions[b, 0] (the committed context; within the window) and the rows j of this forward
    whose bit j % 32 of word j // 32 is set (its ancestors and itself; the tree is assumed
    shallower than the window). The causal mask (row i sees rows 0..i) gives the plain op.
    Returns out [B, S, H*d]; padding rows return finite values that callers ignore.
    """
    b, s, _ = q.shape
    trash, bs = k_cache.shape[0] - 1, k_cache.shape[1]
    slots = positions if tree_mask is None else tree_slots(positions)  # [B, S] where rows write
    if k is not None:  # k = v = None: read only (a KV-shared layer over the cache another layer wrote)
        block, offset = block_rows(block_tables, slots, trash, bs)  # [B, S]
        k_cache[block, offset] = k.view(b, s, num_kv_heads, head_dim).to(k_cache.dtype)
        v_cache[block, offset] = v.view(b, s, num_kv_heads, head_dim).to(v_cache.dtype)
    if deterministic.active():  # one query row at a time over exactly its visible keys
        return _kv_attention_rows(q, positions, slots, tree_mask, block_tables, k_cache, v_cache, num_heads,
                                  num_kv_heads, head_dim, scale, sliding_window, sinks)
    span = _KEY_SPAN.get()
    length = min(int(slots.max()) + 1 if span is None else span, block_tables.shape[1] * bs)
    nb = -(-length // bs)  # blocks spanned by the longest row
    table = block_tables[:, :nb]
    table = torch.where(table >= 0, table, trash)  # [B, nb]
    keys = k_cache[table].flatten(1, 2)[:, :length].transpose(1, 2).to(q.dtype)  # [B, KV, L, d]
    values = v_cache[table].flatten(1, 2)[:, :length].transpose(1, 2).to(q.dtype)
    key_pos = torch.arange(length, device=q.device)[None, None]  # [1, 1, L]
    pos = positions[:, :, None]  # [B, S, 1]
    visible = key_pos <= pos if tree_mask is None else tree_visible(tree_mask, positions, key_pos)  # [B, S, L]
    if sliding_window:
        visible &= key_pos > pos - sliding_window
    visible[..., 0] |= positions < 0  # keep padding rows' softmax finite
    qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, H, S, d]
    out = _attend(qh, keys, values, visible[:, None], num_heads, num_kv_heads, head_dim, scale, sinks)
    return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)


def _attend(qh: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None,
            num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None,
            sinks: torch.Tensor | None) -> torch.Tensor:
    """qh [B, H, S, d], keys/values [B, KV, L, d], visible [B, 1, S, L] bool (None: all) -> [B, H, S, d]."""
    if sinks is None:
        return F.scaled_dot_product_attention(qh, keys, values, attn_mask=visible, enable_gqa=True, scale=scale)
    b, _, s, _ = qh.shape
    group = num_heads // num_kv_heads
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [B, H, L, d]
    scores = qh @ keys.transpose(-1, -2) * (scale if scale is not None else head_dim ** -0.5)
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))  # [B, H, S, L]
    sink = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(b, -1, s, 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]  # the sink takes mass, no value
    return probs @ values


def _kv_attention_rows(q, positions, slots, tree_mask, block_tables, k_cache, v_cache, num_heads, num_kv_heads,
                       head_dim, scale, sliding_window, sinks) -> torch.Tensor:
    """kv_attention's read side, one query row at a time over exactly the keys that row sees (its
    request's positions max(0, p - W + 1) .. p, cut at the table's end; with a tree mask, the
    context below the request's first slot and the rows its bits name), copied contiguous: every
    reduction has the row's own length and layout, whatever else shares the forward
    (ops/deterministic.py). Padding rows get 0."""
    b, s, _ = q.shape
    trash, bs = k_cache.shape[0] - 1, k_cache.shape[1]
    out = q.new_zeros(b, s, num_heads, head_dim)
    limit = block_tables.shape[1] * bs
    for i, row in enumerate(positions.tolist()):
        length = min(int(slots[i].max()) + 1, limit)
        if length <= 0:
            continue
        tree = None if tree_mask is None else tree_visible(  # [S, L] the keys each row sees
            tree_mask[i:i + 1], positions[i:i + 1], torch.arange(length, device=q.device)[None, None])[0]
        table = block_tables[i, :-(-length // bs)]
        table = torch.where(table >= 0, table, trash)
        keys = k_cache[table].flatten(0, 1)[:length].transpose(0, 1).to(q.dtype)  # [KV, L, d]
        values = v_cache[table].flatten(0, 1)[:length].transpose(0, 1).to(q.dtype)
        for j, p in enumerate(row):
            if p < 0:
                continue
            qh = q[i, j].view(1, num_heads, 1, head_dim)
            if tree is None:
                lo, hi = max(0, p - sliding_window + 1) if sliding_window else 0, min(p + 1, limit)
                k, v = keys[None, :, lo:hi].contiguous(), values[None, :, lo:hi].contiguous()  # [1, KV, L_row, d]
            else:  # trees are refused with sliding windows (speculative_config.py)
                seen = torch.nonzero(tree[j]).flatten()
                k, v = keys[None, :, seen].contiguous(), values[None, :, seen].contiguous()
            out[i, j] = _attend(qh, k, v, None, num_heads, num_kv_heads, head_dim, scale, sinks)[0, :, 0]
    return out.reshape(b, s, num_heads * head_dim)


def tree_slots(positions: torch.Tensor) -> torch.Tensor:
    """KV slots [B, S] of tree rows: positions[b, 0] + s for real rows, -1 for padding rows."""
    s = torch.arange(positions.shape[1], device=positions.device)
    return torch.where(positions >= 0, positions[:, :1] + s, -1)


def tree_visible(tree_mask: torch.Tensor, positions: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """[B, S, L]: row (b, s) sees key slot p (key_pos [1, 1, L]) below positions[b, 0], or this
    forward's row p - positions[b, 0] when its bit is set in tree_mask [B, S, W] (see kv_attention)."""
    bit = key_pos - positions[:, :1, None]  # [B, 1, L]: the key's row in this forward (< 0: context)
    inside = (bit >= 0) & (bit < tree_mask.shape[-1] * 32)
    index = bit.clamp(0, tree_mask.shape[-1] * 32 - 1).expand(-1, tree_mask.shape[1], -1)  # [B, S, L]
    word = torch.gather(tree_mask.to(torch.int64), 2, index // 32)  # [B, S, L]
    return (bit < 0) | (inside & (((word >> (index % 32)) & 1) == 1))


def pack_tree_mask(trees: list[tuple[int, ...]], rows: int) -> np.ndarray:
    """Ancestor masks as packed bits: [B, rows, ceil(rows / 32)] int32; bit j % 32 of word j // 32
    of row i is set when row i attends to row j of its request (the layout of TensorRT-LLM's
    spec_decoding_packed_mask). `trees`: per request the parents of its nodes (-1: the root;
    parents[n] < n); root = row 0, node n = row n + 1; a row sees the root, its ancestors and
    itself. Rows past a tree (padding) see the root only."""
    bits = np.zeros((len(trees), rows, -(-rows // 32) * 32), dtype=bool)
    bits[:, :, 0] = True
    for b, parents in enumerate(trees):
        for n, p in enumerate(parents):
            bits[b, n + 1] = bits[b, p + 1]
            bits[b, n + 1, n + 1] = True
    return _pack(bits)


def causal_tree_mask(batch: int, rows: int) -> np.ndarray:
    """The packed mask of plain causal rows (a chain per request): row i sees rows 0..i."""
    return np.repeat(_pack(np.tri(rows, -(-rows // 32) * 32, dtype=bool))[None], batch, axis=0)  # writable


def causal_tree_mask_on(batch: int, rows: int, device) -> torch.Tensor:
    """`causal_tree_mask` built on `device` by tensor ops (no host copy, so no sync on a GPU): word w of
    row i has its low min(max(i - 32 w + 1, 0), 32) bits set. [batch, rows, ceil(rows / 32)] int32."""
    i = torch.arange(rows, device=device)[:, None]
    w = torch.arange(-(-rows // 32), device=device)[None]
    n = (i - 32 * w + 1).clamp(0, 32)  # [rows, W] bits set
    words = torch.where(n == 32, -1, (1 << n.clamp(max=31)) - 1)  # int64, in int32's range
    return words.to(torch.int32).repeat(batch, 1, 1)


def _pack(bits: np.ndarray) -> np.ndarray:
    """[..., 32 W] bool -> [..., W] int32, bit j % 32 of word j // 32 (least significant first)."""
    weights = np.left_shift(np.uint64(1), np.arange(32, dtype=np.uint64))
    words = (bits.reshape(*bits.shape[:-1], -1, 32) * weights).sum(-1, dtype=np.uint64)
    return words.astype(np.uint32).view(np.int32)


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


# -- PEagleMoE ---------------------------------------------------------------------------------------
# The sparse MoE MLP of the target's MoE layers (peagle_trt/models/moe.py); the contract, FP8 kinds
# included, is docs/EXPORT.md "PEagleMoE".

MOE_ROUTINGS = ("softmax_topk", "topk_softmax")
MOE_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")
MOE_BLOCK = 128  # FP8 block scales: 128 x 128 weight blocks, 128-column activation groups
FP8_MAX = 448.0  # largest finite E4M3 value


def moe_route(logits: torch.Tensor, top_k: int, routing: str = "softmax_topk", renormalize: bool = False,
              expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), in float32.

    softmax_topk (Qwen3-MoE, Gemma-4): top-k of softmax(logits), divided by their sum if `renormalize`;
    topk_softmax (GPT-OSS): softmax over the top-k logits. Picks in descending order, ties to the
    lower expert id (a stable sort: what the kernel does). `expert_scale` [E] (Gemma-4) scales each
    pick's weight."""
    p = logits.float()
    if routing == "softmax_topk":
        p = p.softmax(dim=-1)
    elif routing != "topk_softmax":
        raise ValueError(f"MoE routing {routing!r} is not one of {MOE_ROUTINGS}")
    vals, ids = torch.sort(p, dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :top_k], ids[:, :top_k]
    if routing == "topk_softmax":
        vals = vals.softmax(dim=-1)
    elif renormalize:
        vals = vals / vals.sum(dim=-1, keepdim=True)
    if expert_scale is not None:
        vals = vals * expert_scale.float()[ids]
    return vals, ids


def moe_act(gu: torch.Tensor, activation: str, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """[..., 2I] gate | up (float32) -> [..., I]: SwiGLU, GeGLU, or GPT-OSS's clamped SwiGLU
    (gate clamped above at `limit`, up to +-limit, (up + 1) * gate * sigmoid(alpha * gate))."""
    gate, up = gu.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    if activation != "clamped_swiglu":
        raise ValueError(f"MoE activation {activation!r} is not one of {MOE_ACTIVATIONS}")
    gate = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_expand_scale(scale: torch.Tensor, weight_shape) -> torch.Tensor:
    """An FP8 weight scale broadcast to its weight [..., N, K]; the kind is told by the rank gap:
    per expert (2 fewer dims), per channel [.., N] (1 fewer) or 128 x 128 blocks [.., N/128, K/128]."""
    n, k = weight_shape[-2:]
    gap = len(weight_shape) - scale.dim()
    if gap == 2:
        return scale[..., None, None]
    if gap == 1:
        return scale[..., None]
    return scale.repeat_interleave(MOE_BLOCK, -2).repeat_interleave(MOE_BLOCK, -1)[..., :n, :k]


def moe_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP8 expert weight [..., N, K] under its scale (`moe_expand_scale`)."""
    return weight.float() * moe_expand_scale(scale.float(), weight.shape)


def moe_quantize_act(x: torch.Tensor, act_scale: torch.Tensor | None, block: bool) -> torch.Tensor:
    """x [n, K] float32 as the FP8 GEMM sees it, code(x) * a: a static scale `act_scale` (a scalar:
    ModelOpt's), else dynamic per row, or per row and 128-column group for block-scaled weights
    (a = max(amax, 1e-12) / 448)."""
    if act_scale is not None:
        a = act_scale.float()
    elif block:
        n, k = x.shape
        groups = F.pad(x, (0, -k % MOE_BLOCK)).reshape(n, -1, MOE_BLOCK)  # [n, G, 128]
        a = (groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX).expand_as(groups)
        a = a.reshape(n, -1)[:, :k]
    else:
        a = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    codes = (x / a).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.float() * a


def _moe_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, act_scale: torch.Tensor | None,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [n, K] @ one expert's weight [N, K]^T (+ bias) -> [n, N] float32 (FP8: quantized activations)."""
    if scale is None:
        y = F.linear(x, weight).float()
    else:
        y = F.linear(moe_quantize_act(x.float(), act_scale, scale.dim() == 2), moe_dequantize(weight, scale))
    return y if bias is None else y + bias.float()


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, expert_scale: torch.Tensor | None = None,
        w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
        a13_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None, *, top_k: int,
        routing: str = "softmax_topk", renormalize: bool = False, activation: str = "silu",
        swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """PEagleMoE: x [T, H], router_logits [T, E] -> y [T, H] in x's dtype.

    w13 [E, 2I, H] (rows [0, I) gate, [I, 2I) up), w2 [E, H, I], biases b13 [E, 2I] / b2 [E, H],
    in x's dtype or float8_e4m3fn with float32 scales w13_scale / w2_scale ([E], [E, N] or blocks
    [E, N/128, K/128]) and optional static activation scales a13_scale / a2_scale [E] (else dynamic).
    Per row t and pick j (`moe_route`), expert e: h = act(x @ w13[e]^T + b13[e]) in float32, rounded
    once to x's dtype; o_j = h @ w2[e]^T + b2[e]; y[t] = sum_j weight[t, j] * o_j in float32 in pick
    order, rounded once.

    Each expert a row picked runs once, over the rows that picked it. Which experts and how many
    rows: a count per expert read on the host through a CPU tensor's numpy view (no device read,
    no data-dependent op: the CPU path of the torch target), on another device by a copy (the
    reference only; the GPU kernel reads nothing back)."""
    weights, ids = moe_route(router_logits, top_k, routing, renormalize, expert_scale)  # [T, k] each
    t, k = ids.shape
    picks = ids.reshape(-1)  # [T k] pair p = row p // k, pick p % k
    order = torch.sort(picks, stable=True).indices  # [T k] the pairs grouped by expert
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=ids.device).scatter_add_(
        0, picks, torch.ones_like(picks))  # [E]
    counts = (counts if counts.device.type == "cpu" else counts.cpu()).numpy()
    ends = np.cumsum(counts)
    out = x.new_zeros(t * k, x.shape[-1], dtype=torch.float32)  # [T k, H] each pick's down projection
    for e in np.flatnonzero(counts).tolist():  # numpy ints, not tensor reads
        pairs = order[int(ends[e] - counts[e]):int(ends[e])]  # [n] the pairs routed to e
        gu = _moe_linear(x[pairs // k], w13[e], None if w13_scale is None else w13_scale[e],
                         None if a13_scale is None else a13_scale[e], None if b13 is None else b13[e])
        h = moe_act(gu, activation, swiglu_alpha, swiglu_limit).to(x.dtype)  # [n, I]
        out[pairs] = _moe_linear(h, w2[e], None if w2_scale is None else w2_scale[e],
                                 None if a2_scale is None else a2_scale[e], None if b2 is None else b2[e])
    return (out.view(t, k, -1) * weights[..., None]).sum(dim=1).to(x.dtype)
