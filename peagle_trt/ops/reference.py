"""Reference implementations of the P-EAGLE custom ops (torch; CPU and generic CUDA).

These define the contract the ONNX function bodies and the CUDA/TensorRT plugins must match.
Paged KV cache: per layer, k_cache / v_cache [N + 1, bs, KV, d]: N blocks of `bs` positions, then
one trash block (index N) that padding rows (position -1) write to. A request's block table
[M] int64 lists its blocks in position order (entry j holds positions j*bs .. j*bs + bs - 1);
-1 marks an entry without a block (past the request's end, or slid out of a window), read as
the trash block and never visible. Blocks are assigned by the runtime (peagle_trt/runtime/blocks.py).

Mixture of experts (PEagleMoE): `moe` is the contract of the fused MoE op (its Triton kernel:
peagle_trt/ops/triton_kernels/moe.py; the plugin: plugins/src/plugins/moePlugin.cpp), with small
public helpers the ONNX body and the CPU path reuse: `moe_route` (routing with the stable tie rule),
`quantize_activation` (the three FP8 activation rules), `fp8_matmul`, `moe_act`, `moe_check`.
How to test: tests/ops/test_reference_ops.py, tests/ops/test_moe_kernel.py (the MoE: its checks, and
the kernel against it).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from peagle_trt.errors import OpInputError
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


def kv_store(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """What a KV cache of `cache_dtype` holds for values x: x in that dtype, or for an FP8 cache
    (float8_e4m3fn) the codes fp8(clamp(x / scale, -448, 448)), divided in float32 (round to nearest
    even; NaN stays NaN)."""
    if cache_dtype != _FP8:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(_FP8)


def kv_load(stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Values of cache entries `stored` in the compute `dtype`: FP8 codes read as code * scale in
    float32, rounded once to `dtype` (as the kernels do); other caches converted as they are."""
    if stored.dtype != _FP8:
        return stored.to(dtype)
    values = stored.float()
    return (values if scale == 1.0 else values * scale).to(dtype)  # x * 1.0 is x: one pass fewer


def kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 block_tables: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int = 0, sinks: torch.Tensor | None = None,
                 tree_mask: torch.Tensor | None = None, *, k_scale: float = 1.0, v_scale: float = 1.0
                 ) -> torch.Tensor:
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

    The caches hold q's dtype, or FP8 (float8_e4m3fn) codes with per-tensor scales `k_scale` /
    `v_scale` (ignored otherwise): a row writes `kv_store` (fp8(clamp(value / scale, +-448)), in
    float32) and attention reads `kv_load` (code * scale in float32, rounded once to q's dtype), its
    own new key included.
    Returns out [B, S, H*d]; padding rows return finite values that callers ignore.
    """
    b, s, _ = q.shape
    trash, bs = k_cache.shape[0] - 1, k_cache.shape[1]
    slots = positions if tree_mask is None else tree_slots(positions)  # [B, S] where rows write
    if k is not None:  # k = v = None: read only (a KV-shared layer over the cache another layer wrote)
        block, offset = block_rows(block_tables, slots, trash, bs)  # [B, S]
        k_cache[block, offset] = kv_store(k.view(b, s, num_kv_heads, head_dim), k_cache.dtype, k_scale)
        v_cache[block, offset] = kv_store(v.view(b, s, num_kv_heads, head_dim), v_cache.dtype, v_scale)
    if deterministic.active():  # one query row at a time over exactly its visible keys
        return _kv_attention_rows(q, positions, slots, tree_mask, block_tables, k_cache, v_cache, num_heads,
                                  num_kv_heads, head_dim, scale, sliding_window, sinks, k_scale, v_scale)
    span = _KEY_SPAN.get()
    length = min(int(slots.max()) + 1 if span is None else span, block_tables.shape[1] * bs)
    nb = -(-length // bs)  # blocks spanned by the longest row
    keys = kv_load(_blocks(k_cache, block_tables, nb, trash)[:, :length].transpose(1, 2), k_scale, q.dtype)
    values = kv_load(_blocks(v_cache, block_tables, nb, trash)[:, :length].transpose(1, 2), v_scale, q.dtype)
    key_pos = torch.arange(length, device=q.device)[None, None]  # [1, 1, L]
    pos = positions[:, :, None]  # [B, S, 1]
    visible = key_pos <= pos if tree_mask is None else tree_visible(tree_mask, positions, key_pos)  # [B, S, L]
    if sliding_window:
        visible &= key_pos > pos - sliding_window
    visible[..., 0] |= positions < 0  # keep padding rows' softmax finite
    if sinks is not None:
        qh = q.view(b, s, num_heads, head_dim).transpose(1, 2)  # [B, H, S, d]
        out = _attend(qh, keys, values, visible[:, None], num_heads, num_kv_heads, head_dim, scale, sinks)
        return out.transpose(1, 2).reshape(b, s, num_heads * head_dim)
    # GQA as rows: a KV head's G query heads are G * S rows of one attention over its keys, read once
    # (not G times, nor repeated per head); a mask only where some key is hidden from some row (a
    # decode row at the end of its context sees every key: the kernel then needs none)
    g = num_heads // num_kv_heads
    qh = q.view(b, s, num_kv_heads, g, head_dim).permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, g * s, head_dim)
    mask = None
    if q.device.type != "cpu" or not visible.numpy().all():  # a CPU tensor's numpy view: no device read
        mask = visible[:, None, None].expand(b, 1, g, s, length).reshape(b, 1, g * s, length)
    out = F.scaled_dot_product_attention(qh, keys, values, attn_mask=mask, scale=scale)  # [B, KV, G*S, d]
    return out.view(b, num_kv_heads, g, s, head_dim).permute(0, 3, 1, 2, 4).reshape(b, s, num_heads * head_dim)


def _blocks(cache: torch.Tensor, block_tables: torch.Tensor, nb: int, trash: int) -> torch.Tensor:
    """The first `nb` blocks of each request's table as [B, nb * bs, KV, d] rows of `cache`
    [N + 1, bs, KV, d] (entries -1: the trash block): on the CPU, a single request whose blocks
    follow each other (what a fresh allocation gives) is a view, no copy; else one index_select."""
    table = block_tables[:, :nb]
    if table.device.type == "cpu" and table.shape[0] == 1:
        t = table[0].numpy()
        if t[0] >= 0 and (nb == 1 or (t[-1] - t[0] == nb - 1 and bool((t[1:] - t[:-1] == 1).all()))):
            return cache[int(t[0]):int(t[0]) + nb].flatten(0, 1)[None]
    table = torch.where(table >= 0, table, trash)  # [B, nb]
    return cache.index_select(0, table.flatten()).view(table.shape[0], -1, *cache.shape[2:])


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
                       head_dim, scale, sliding_window, sinks, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
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
        keys = kv_load(k_cache[table].flatten(0, 1)[:length].transpose(0, 1), k_scale, q.dtype)  # [KV, L, d]
        values = kv_load(v_cache[table].flatten(0, 1)[:length].transpose(0, 1), v_scale, q.dtype)
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


# -- mixture of experts (PEagleMoE) ---------------------------------------------------------------

MOE_ROUTINGS = ("softmax_topk", "topk_softmax")  # position = the ONNX attribute `routing`
MOE_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")  # position = the ONNX attribute `activation`
FP8_MAX = 448.0  # largest float8_e4m3fn value
FP8_GROUP = 128  # block FP8: 128 x 128 weight blocks, activations in 128-column groups
FP8_MIN_AMAX = 1e-12  # dynamic scales: amax floored here (an all-zero row quantizes to zeros)
_FP8 = getattr(torch, "float8_e4m3fn", None)
_ACTS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MoEShape:
    """The sizes of one valid `moe` call and its FP8 scale kind: "none" (act-dtype weights), "tensor",
    "channel" or "block" (read from w13_scale's shape, see `moe`)."""
    tokens: int
    hidden: int
    experts: int
    inter: int
    top_k: int
    scale_kind: str


def _refuse(what: str, expected: str, got, fix: str = "") -> None:
    raise OpInputError(f"moe: {what} must be {expected}, got {got}" + (f"; {fix}" if fix else ""))


def _desc(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{t.dtype} {tuple(t.shape)}"


def moe_scale_kind(scale: torch.Tensor, experts: int, n: int, k: int) -> str:
    """The FP8 scale kind of an [E, N, K] weight's scale, from its shape: [E] per tensor, [E, N] per
    channel, [E, ceil(N/128), ceil(K/128)] per 128 x 128 block; OpInputError for any other shape."""
    g = FP8_GROUP
    kinds = {(experts,): "tensor", (experts, n): "channel", (experts, -(-n // g), -(-k // g)): "block"}
    kind = kinds.get(tuple(scale.shape))
    if kind is None or scale.dtype != torch.float32:
        _refuse("an FP8 weight scale", f"float32 [{experts}] (per tensor), [{experts}, {n}] (per channel) or "
                f"[{experts}, {-(-n // g)}, {-(-k // g)}] (128 x 128 blocks)", _desc(scale))
    return kind


def moe_check(x, router_logits, w13, w2, b13=None, b2=None, expert_scale=None, w13_scale=None, w2_scale=None,
              a13_scale=None, a2_scale=None, *, top_k: int, routing: str = "softmax_topk",
              activation: str = "silu") -> MoEShape:
    """Validate `moe`'s arguments (shapes, dtypes, devices, the scale kind); OpInputError naming what
    is wrong. Shared by the reference and the Triton kernel."""
    if x.dim() != 2 or x.dtype not in _ACTS:
        _refuse("x", "a 2-D float32 / float16 / bfloat16 tensor [T, H]", _desc(x))
    t, h = x.shape
    if router_logits.dim() != 2 or router_logits.shape[0] != t or not router_logits.is_floating_point():
        _refuse("router_logits", f"a float tensor [{t}, E]", _desc(router_logits))
    e = router_logits.shape[1]
    if w13.dim() != 3 or w13.shape[0] != e or w13.shape[2] != h or w13.shape[1] % 2 or w13.shape[1] == 0:
        _refuse("w13", f"[{e}, 2I, {h}] (experts, gate rows then up rows, hidden)", _desc(w13))
    i = w13.shape[1] // 2
    if w2.shape != (e, h, i):
        _refuse("w2", f"[{e}, {h}, {i}]", _desc(w2))
    fp8 = _FP8 is not None and w13.dtype == _FP8
    if w13.dtype != (_FP8 if fp8 else x.dtype) or w2.dtype != w13.dtype:
        _refuse("w13 / w2", f"both x's dtype ({x.dtype}) or both float8_e4m3fn", f"{w13.dtype} / {w2.dtype}")
    if not isinstance(top_k, int) or not 1 <= top_k <= e:
        _refuse("top_k", f"an int in 1..{e} (the experts)", repr(top_k))
    if routing not in MOE_ROUTINGS or activation not in MOE_ACTIVATIONS:
        _refuse("routing / activation", f"one of {MOE_ROUTINGS} / {MOE_ACTIVATIONS}", f"{routing!r} / {activation!r}")
    for name, b, n in (("b13", b13, 2 * i), ("b2", b2, h)):
        if b is not None and (b.shape != (e, n) or b.dtype not in (x.dtype, torch.float32)):
            _refuse(name, f"[{e}, {n}] in x's dtype or float32", _desc(b))
    if expert_scale is not None and (expert_scale.shape != (e,) or expert_scale.dtype != torch.float32):
        _refuse("expert_scale", f"float32 [{e}]", _desc(expert_scale))
    kind = "none"
    if not fp8:
        if any(s is not None for s in (w13_scale, w2_scale, a13_scale, a2_scale)):
            _refuse("w13_scale / w2_scale / a13_scale / a2_scale", "None for unquantized weights", "a scale",
                    "pass FP8 (float8_e4m3fn) weights with their scales, or no scales")
    else:
        if w13_scale is None or w2_scale is None:
            _refuse("w13_scale / w2_scale", "given with FP8 weights", f"{_desc(w13_scale)} / {_desc(w2_scale)}")
        kind = moe_scale_kind(w13_scale, e, 2 * i, h)
        if moe_scale_kind(w2_scale, e, h, i) != kind:
            _refuse("w2_scale", f"the kind of w13_scale ({kind})", _desc(w2_scale))
        if kind == "block" and i % FP8_GROUP:
            _refuse("the intermediate size I", f"a multiple of {FP8_GROUP} with 128 x 128 block scales (gate and "
                    "up blocks must not straddle)", i)
        static = [s for s in (a13_scale, a2_scale) if s is not None]
        if kind == "block" and static:
            _refuse("a13_scale / a2_scale", "None with block scales (activations are quantized per 128-column "
                    "group)", "a static scale")
        if (kind == "tensor" or static) and (len(static) != 2 or any(s.shape != (e,) or s.dtype != torch.float32
                                                                     for s in static)):
            _refuse("a13_scale / a2_scale", f"float32 [{e}] each with per-tensor scales, or with per-channel "
                    "scales and static activations (the experts' input scales)",
                    f"{_desc(a13_scale)} / {_desc(a2_scale)}")
    tensors = (x, router_logits, w13, w2, b13, b2, expert_scale, w13_scale, w2_scale, a13_scale, a2_scale)
    devices = {a.device for a in tensors if a is not None}
    if len(devices) != 1:
        _refuse("every tensor", "on one device", sorted(str(d) for d in devices))
    return MoEShape(t, h, e, i, top_k, kind)


def moe_route(logits: torch.Tensor, top_k: int, routing: str = "softmax_topk", renormalize: bool = False,
              expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), in float32.

    The experts are picked by descending float32 logit, ties to the LOWER expert id, so ids and the
    pick order j agree bit for bit with the kernel. softmax_topk picks by logit, not by probability:
    softmax is monotone, so the set is the same unless two different logits round to one probability
    (then this picks the larger logit, top-k of the probabilities the lower id). Then
      softmax_topk: w = softmax(logits)[ids], divided by its sum over the k picks if `renormalize`;
      topk_softmax: w = softmax(the k picked logits) (GPT-OSS; its router bias is in the logits);
    and w *= expert_scale[ids] (Gemma-4's per-expert scale). NaN logits: unspecified."""
    logits = logits.float()
    top, ids = torch.sort(logits, dim=-1, descending=True, stable=True)  # stable: equal logits by id
    top, ids = top[:, :top_k], ids[:, :top_k]
    if routing == "softmax_topk":
        weights = logits.softmax(dim=-1).gather(1, ids)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    else:
        weights = top.softmax(dim=-1)
    if expert_scale is not None:
        weights = weights * expert_scale.float()[ids]
    return weights, ids


def quantize_activation(x: torch.Tensor, kind: str, scale: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [R, K] -> (codes [R, K] float8_e4m3fn, a float32) with codes = fp8(clamp(x / a, +-448)):
      tensor   a = scale (static: [R] per row, or one value), returned [R or 1, 1];
      channel  a [R, 1] = max(amax_k |x[r, k]|, 1e-12) / 448 (dynamic, per row);
      block    a [R, G] = max(amax |x[r, 128g : 128g + 128]|, 1e-12) / 448 (G = ceil(K / 128)).
    IEEE division, round to nearest even (torch's conversion)."""
    xf = x.float()
    rows, k = xf.shape
    if kind == "tensor":
        a = scale.float().reshape(-1, 1)
        div = a
    elif kind == "channel":
        a = xf.abs().amax(dim=-1, keepdim=True).clamp(min=FP8_MIN_AMAX) / FP8_MAX
        div = a
    elif kind == "block":
        groups = -(-k // FP8_GROUP)
        padded = F.pad(xf.abs(), (0, groups * FP8_GROUP - k))
        a = padded.view(rows, groups, FP8_GROUP).amax(dim=-1).clamp(min=FP8_MIN_AMAX) / FP8_MAX
        div = a.repeat_interleave(FP8_GROUP, dim=-1)[:, :k]
    else:
        raise OpInputError(f"quantize_activation: kind must be 'tensor', 'channel' or 'block', got {kind!r}")
    return (xf / div).clamp(-FP8_MAX, FP8_MAX).to(_FP8), a


def fp8_matmul(codes_x: torch.Tensor, a: torch.Tensor, codes_w: torch.Tensor, s: torch.Tensor,
               kind: str) -> torch.Tensor:
    """codes_x [R, K] with its activation scale a (`quantize_activation`) times codes_w [N, K] with its
    scale s (one expert's: [] per tensor, [N] per channel, [ceil(N/128), ceil(K/128)] per block) ->
    [R, N] float32: sum_k code_x * code_w * a * s, the products exact in float32, summed in float32;
    block: each 128-column group's partial sum scaled by a[r, g] * s[n // 128, g], then summed."""
    cx, cw = codes_x.float(), codes_w.float()
    if kind != "block":  # F.linear: row-blocked in deterministic mode (peagle_trt/ops/deterministic.py)
        return F.linear(cx, cw) * (a * s)
    (rows, k), n = cx.shape, cw.shape[0]
    groups = -(-k // FP8_GROUP)
    cx = F.pad(cx, (0, groups * FP8_GROUP - k)).view(rows, groups, FP8_GROUP).transpose(0, 1)  # [G, R, 128]
    cw = F.pad(cw, (0, groups * FP8_GROUP - k)).view(n, groups, FP8_GROUP).permute(1, 2, 0)  # [G, 128, N]
    s_cols = s.float().repeat_interleave(FP8_GROUP, dim=0)[:n]  # [N, G]
    scale = a.T[:, :, None] * s_cols.T[:, None, :]  # [G, R, N]
    return (torch.bmm(cx, cw) * scale).sum(dim=0)


def moe_act(g: torch.Tensor, u: torch.Tensor, activation: str, alpha: float = 1.702,
            limit: float = 7.0) -> torch.Tensor:
    """The gated activation of one expert, in g's dtype (float32 in `moe`): silu(g) * u,
    gelu_tanh(g) * u, or GPT-OSS's clamped SwiGLU (u + 1) * g * sigmoid(alpha * g) with g <= limit and
    |u| <= limit."""
    if activation == "silu":
        return F.silu(g) * u
    if activation == "gelu_tanh":
        return F.gelu(g, approximate="tanh") * u
    g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(alpha * g))


def moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
        b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, expert_scale: torch.Tensor | None = None,
        w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
        a13_scale: torch.Tensor | None = None, a2_scale: torch.Tensor | None = None, *, top_k: int,
        routing: str = "softmax_topk", renormalize: bool = False, activation: str = "silu",
        swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0) -> torch.Tensor:
    """PEagleMoE: a sparse mixture-of-experts MLP over rows x [T, H] -> y [T, H] (x's dtype).

    router_logits [T, E] (any float dtype; routing in float32, `moe_route`); w13 [E, 2I, H] (rows
    [0, I) gate, [I, 2I) up: nn.Linear's [out, in], experts stacked), w2 [E, H, I], both x's dtype or
    float8_e4m3fn; b13 [E, 2I] / b2 [E, H] optional (GPT-OSS; x's dtype or float32); expert_scale [E]
    float32 optional (Gemma-4). Per row t and pick j (e = ids[t, j]), in float32:
      g, u = x[t] @ w13[e, :I]^T (+ b13[e, :I]), x[t] @ w13[e, I:]^T (+ b13[e, I:])
      h = act(g, u) (`moe_act`), rounded ONCE to x's dtype; o_j = h @ w2[e]^T (+ b2[e])
      y[t] = sum over j = 0, 1, .., k-1 in that order of w[t, j] * o_j, rounded once to x's dtype.
    FP8 weights: the scale kind comes from w13_scale's shape (`moe_scale_kind`; w2_scale of the same
    kind): per tensor [E] with static activation scales a13_scale / a2_scale [E] (ModelOpt's input
    scales; required there); per channel [E, N] with static scales (ModelOpt's experts stacked: gate and
    up keep their own weight scales) or dynamic ones, per row; 128 x 128 blocks [E, N/128, K/128] with
    activations quantized dynamically per row and 128-column group (`quantize_activation`); each GEMM
    is `fp8_matmul`; h is quantized for the second GEMM by the same rule. Block scales need I % 128 == 0.

    Decided here where the contract left it open: experts are picked by logit (`moe_route`); the
    scales multiply the float32 sum as acc * (a * s); the bias is added after the scales.

    The CPU path of the torch target: each expert a row picked runs once, over the rows that picked
    it, by F.linear (row-blocked in deterministic mode, peagle_trt/ops/deterministic.py). Which experts
    and how many rows: a count per expert read through a CPU tensor's numpy view (no device read and
    no data-dependent op, as the step's CPU argmax), on another device by a copy (the reference only;
    the kernel, triton_kernels/moe.py, reads nothing back)."""
    moe_check(x, router_logits, w13, w2, b13, b2, expert_scale, w13_scale, w2_scale, a13_scale, a2_scale,
              top_k=top_k, routing=routing, activation=activation)
    t, h = x.shape
    i = w2.shape[2]
    kind = "none" if w13_scale is None else moe_scale_kind(w13_scale, w13.shape[0], 2 * i, h)
    static = a13_scale is not None
    weights, ids = moe_route(router_logits, top_k, routing, renormalize, expert_scale)  # [T, k] each
    flat = ids.reshape(-1)  # [P]: pair p = t * k + j
    order = torch.sort(flat, stable=True).indices  # the pairs grouped by expert
    counts = torch.zeros(w13.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    counts = (counts if counts.device.type == "cpu" else counts.cpu()).numpy()  # [E]
    ends = np.cumsum(counts)
    xq = quantize_activation(x, kind) if kind in ("channel", "block") and not static else None  # per row: once
    o = torch.zeros(t * top_k, h, dtype=torch.float32, device=x.device)  # [P, H]
    for e in np.flatnonzero(counts).tolist():  # numpy ints, not tensor reads
        pairs = order[int(ends[e] - counts[e]):int(ends[e])]
        o[pairs] = _expert(x, xq, pairs // top_k, e, w13, w2, b13, b2, w13_scale, w2_scale, a13_scale, a2_scale,
                           kind, activation, swiglu_alpha, swiglu_limit)
    o = o.view(t, top_k, h)
    y = weights[:, 0, None] * o[:, 0]
    for j in range(1, top_k):  # in pick order, float32
        y = y + weights[:, j, None] * o[:, j]
    return y.to(x.dtype)


def _expert(x, xq, rows, e, w13, w2, b13, b2, w13_scale, w2_scale, a13_scale, a2_scale, kind, activation,
            alpha, limit) -> torch.Tensor:
    """o [n, H] float32 of expert e over x's rows `rows` [n] (see `moe`)."""
    i = w2.shape[2]
    if kind == "none":
        gu = F.linear(x[rows], w13[e]).float()  # [n, 2I]
    else:
        cx, a = quantize_activation(x[rows], "tensor", a13_scale[e]) if a13_scale is not None else (
            xq[0][rows], xq[1][rows])
        gu = fp8_matmul(cx, a, w13[e], w13_scale[e], kind)
    if b13 is not None:
        gu = gu + b13[e].float()
    h = moe_act(gu[:, :i], gu[:, i:], activation, alpha, limit).to(x.dtype)  # [n, I], rounded once
    if kind == "none":
        o = F.linear(h, w2[e]).float()
    else:
        ch, a = quantize_activation(h, "tensor", a2_scale[e]) if a2_scale is not None else quantize_activation(h, kind)
        o = fp8_matmul(ch, a, w2[e], w2_scale[e], kind)
    return o if b2 is None else o + b2[e].float()


def moe_expand_scale(scale: torch.Tensor, weight_shape) -> torch.Tensor:
    """An FP8 weight scale broadcast to its weight [..., N, K]; the kind is told by the rank gap:
    per expert (2 fewer dims), per channel [.., N] (1 fewer) or 128 x 128 blocks [.., N/128, K/128]."""
    n, k = weight_shape[-2:]
    gap = len(weight_shape) - scale.dim()
    if gap == 2:
        return scale[..., None, None]
    if gap == 1:
        return scale[..., None]
    return scale.repeat_interleave(FP8_GROUP, -2).repeat_interleave(FP8_GROUP, -1)[..., :n, :k]


def moe_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP8 expert weight [..., N, K] under its scale (`moe_expand_scale`)."""
    return weight.float() * moe_expand_scale(scale.float(), weight.shape)
