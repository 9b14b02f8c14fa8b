"""The training forward of a drafter head over the flat multi-depth sequence, and its loss.

The head's weights are the inference module's (`peagle_trt.models.drafter.DrafterModel`); only
the attention differs: instead of a KV cache, rows are run in groups, each group attending a bank
of keys/values of the earlier groups plus itself under the (anchor, depth) mask (train/cod.py).

  group 0   the depth-0 (real) rows of the segment: token x_{a+1}, hidden fc(taps g_a), causal
  P-EAGLE   one more group with every deeper element: mask token + fc(mask_hidden)
  EAGLE-3   one group per depth d: token x_{p+1} (the true next token) and, as hidden, what the
            same chain's element at depth d-1 feeds back (`DrafterModel.feedback`: its pre-norm
            output, or the post-norm one for norm_output heads), the training-time test

Loss: KL(p_target || softmax(draft logits)) over the draft vocabulary per supervised element,
summed and divided by the caller's normaliser (the batch's supervised count), so per-segment
losses add up to the flat loss. Tests: tests/train/test_train_forward.py (against the inference model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from peagle_trt.models.drafter import DrafterModel
from peagle_trt.models.rope import apply_rope, rope_cos_sin
from peagle_trt.train.cod import Elements, mask_formula, segment_rows


class TrainHead(nn.Module):
    """The drafter module plus the learned pre-fc `mask_hidden` as a parameter (P-EAGLE)."""

    def __init__(self, model: DrafterModel, parallel: bool):
        super().__init__()
        self.model = model
        width = model.config.num_aux * model.config.target_hidden_size
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, width)) if parallel else None

    @property
    def parallel(self) -> bool:
        return self.mask_hidden is not None


@dataclass(frozen=True)
class SeqFeatures:
    """One training sequence as the drafter sees it (EAGLE shift, as in the P-EAGLE paper): position i holds
    token x_{i+1}, the target taps at i, and the target's distribution for x_{i+2}. The distribution is
    made where it is needed (`probs_at`: each partition's supervised rows), from the target's final-normed
    hidden state at i + 1 and its lm_head rows of the draft vocabulary: O(N * H) kept, not O(N * V_d)."""
    tokens: torch.Tensor  # [N] int64
    aux: torch.Tensor  # [N, num_aux * H_t] (the feature cache's float16, or float32: made float per block)
    normed: torch.Tensor  # [N, H_t] the target's final-normed hidden state (any float dtype: the cache's float16)
    lm_rows: torch.Tensor  # [V_d, H_t] the target's lm_head rows of the draft vocabulary (shared)
    loss_mask: torch.Tensor  # [N] bool
    softcap: float | None = None  # the target family's logit soft-cap (TargetModel.head_logits)

    def probs_at(self, idx: torch.Tensor) -> torch.Tensor:
        """The target's distribution over the draft vocabulary at positions `idx`: [len(idx), V_d]."""
        logits = F.linear(self.normed[idx].to(self.lm_rows.dtype), self.lm_rows).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return torch.softmax(logits, dim=-1)

    @property
    def probs(self) -> torch.Tensor:
        """[N, V_d] at every position (tests, small sequences: training takes `probs_at` of its rows)."""
        return self.probs_at(torch.arange(len(self.tokens), device=self.tokens.device))


def _attention(m, h: torch.Tensor, cos, sin, bank, mask: torch.Tensor | None):
    # h [R, in]; cos/sin [R, d]; bank (k, v) [KV, Rb, d] or None; mask [R, Rb + R] (None = causal)
    r = h.shape[0]
    q = m.q_proj(h).view(r, m.num_heads, m.head_dim)
    k = m.k_proj(h).view(r, m.num_kv_heads, m.head_dim)
    v = m.v_proj(h).view(r, m.num_kv_heads, m.head_dim).transpose(0, 1)  # [KV, R, d]
    if hasattr(m, "q_norm"):
        q, k = m.q_norm(q), m.k_norm(k)
    q = apply_rope(q.transpose(0, 1)[None], cos[None], sin[None])  # [1, H, R, d]
    k = apply_rope(k.transpose(0, 1)[None], cos[None], sin[None])[0]  # [KV, R, d]
    new = (k, v)
    if bank is not None:
        k, v = torch.cat((bank[0], k), dim=1), torch.cat((bank[1], v), dim=1)
    # grouped-query attention without repeating the keys/values per head (no [H, Rk, d] copies)
    out = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=None if mask is None else mask[None, None],
                                         is_causal=mask is None, enable_gqa=m.num_heads != m.num_kv_heads)
    return m.o_proj(out[0].transpose(0, 1).reshape(r, -1)), new


def run_group(model: DrafterModel, e: torch.Tensor, g: torch.Tensor, positions: torch.Tensor,
              banks: list | None, mask: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    """e, g [R, H] (token embeddings, fc-projected hidden); positions [R]; banks: per layer (k, v)
    of earlier groups or None; mask [R, Rb + R] or None (causal). -> pre-norm x [R, H], new (k, v)."""
    cos, sin = rope_cos_sin(model.inv_freq, model.rope_scale, positions, e.dtype)  # [R, d]
    new_kv = []
    fusion = model.layers[0]
    g_normed = fusion.hidden_norm(g)
    residual = g_normed if fusion.norm_before_residual else g
    h = torch.cat((fusion.input_layernorm(e), g_normed), dim=-1)  # [R, 2H]
    a, kv = _attention(fusion.self_attn, h, cos, sin, banks[0] if banks else None, mask)
    new_kv.append(kv)
    x = residual + a
    x = x + fusion.mlp(fusion.post_attention_layernorm(x))
    for i, layer in enumerate(model.layers[1:], start=1):
        a, kv = _attention(layer.self_attn, layer.input_layernorm(x), cos, sin,
                           banks[i] if banks else None, mask)
        new_kv.append(kv)
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x, new_kv


def depth0_group(model: DrafterModel, seq: SeqFeatures, pos0: torch.Tensor,
                 block: int = 0) -> tuple[torch.Tensor, list]:
    """The depth-0 rows at positions pos0 (consecutive, causal): x [R0, H] and per layer (k, v). With
    `block` and more rows than it: in checkpointed blocks (segment_forward's `recompute`), each
    saving only its own inputs (positions, the earlier blocks' keys/values as they were made)."""
    def rows_of(idx: torch.Tensor, earlier: list, mask: torch.Tensor | None = None):
        if earlier:  # the earlier blocks' keys/values, joined here (recomputed, not kept), and a causal mask
            banks = [(torch.cat([kv[i][0] for kv in earlier], dim=1), torch.cat([kv[i][1] for kv in earlier], dim=1))
                     for i in range(len(earlier[0]))]
            start = int(idx[0])
            mask = torch.arange(start + len(idx), device=idx.device)[None] <= idx[:, None]  # [B, start + B]
        aux = seq.aux[idx].to(model.embed_tokens.weight.dtype)  # the cache's float16 taps, per block
        return run_group(model, model.embed_tokens(seq.tokens[idx]), model.project(aux), idx,
                         banks if earlier else None, mask)

    if not block or len(pos0) <= block:
        return rows_of(pos0, [])
    xs, made = [], []
    for a in range(0, len(pos0), block):
        x, kv = checkpoint(rows_of, pos0[a:a + block], list(made), use_reentrant=False)
        xs.append(x)
        made.append(kv)
    banks = [(torch.cat([kv[i][0] for kv in made], dim=1), torch.cat([kv[i][1] for kv in made], dim=1))
             for i in range(len(made[0]))]
    return torch.cat(xs), banks


def _extend(banks: list | None, kv: list) -> list:
    if banks is None:
        return kv
    return [(torch.cat((bk, k), dim=1), torch.cat((bv, v), dim=1)) for (bk, bv), (k, v) in zip(banks, kv)]


def segment_forward(head: TrainHead, seq: SeqFeatures, el: Elements, owned: torch.Tensor,
                    mask_token_id: int | None, recompute: int = 0) -> tuple[Elements, torch.Tensor, torch.Tensor]:
    """Run the rows of one segment. Returns (elements of the rows, pre-norm outputs x [R, H]
    (`head.model.logits(x)` gives their draft logits), charged [R] bool: the rows this segment owns).
    `recompute` (a block size; 0: off): the depth-0 group (the segment's context: every earlier
    position) runs in blocks of that many positions, each attending the earlier blocks' keys, and
    keeps only its outputs (x, keys, values) for backward, where it runs again one block at a time
    (activation checkpointing: the same loss and gradients up to float rounding, and a partition's
    memory no longer grows with its context)."""
    model = head.model
    rows, charged = segment_rows(el, owned)
    sub = el.select(rows)
    is0 = sub.depth == 0
    pos0 = sub.anchor[is0]  # [R0] consecutive positions 0..last
    x0, banks = depth0_group(model, seq, pos0, recompute if torch.is_grad_enabled() else 0)
    outs, order = [x0], [torch.nonzero(is0).flatten()]
    keys = sub.select(order[0])
    if head.parallel:
        deep = torch.nonzero(~is0).flatten()
        if deep.numel():
            d = sub.select(deep)
            e = model.embed_tokens.weight[mask_token_id].expand(len(d), -1)
            g = model.project(head.mask_hidden.reshape(1, -1)).expand(len(d), -1)
            x, _ = run_group(model, e, g, d.position, banks, mask_formula(d, _cat(keys, d)))
            outs.append(x)
            order.append(deep)
    else:  # EAGLE-3 training-time test: depth by depth, feeding back the previous depth's output
        prev_anchor, prev_x = pos0, model.feedback(x0)
        for depth in range(1, int(sub.depth.max()) + 1):
            idx = torch.nonzero(sub.depth == depth).flatten()
            d = sub.select(idx)
            parent = torch.searchsorted(prev_anchor, d.anchor)  # chains are contiguous (COD)
            g = prev_x[parent]
            all_keys = _cat(keys, d)
            x, kv = run_group(model, model.embed_tokens(seq.tokens[d.position]), g, d.position, banks,
                              mask_formula(d, all_keys))
            banks, keys = _extend(banks, kv), all_keys
            outs.append(x)
            order.append(idx)
            prev_anchor, prev_x = d.anchor, model.feedback(x)
    perm = torch.cat(order)
    return sub.select(perm), torch.cat(outs), charged[perm]


def _cat(a: Elements, b: Elements) -> Elements:
    return Elements(torch.cat((a.anchor, b.anchor)), torch.cat((a.depth, b.depth)))


def kl_terms(logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Per-row KL(p || softmax(logits)): logits, probs [R, V_d] -> [R]."""
    logq = F.log_softmax(logits.float(), dim=-1)
    logp = torch.log(probs.clamp_min(1e-30))
    return (probs * (logp - logq)).sum(-1)


def segment_loss(head: TrainHead, seq: SeqFeatures, el: Elements, owned: torch.Tensor,
                 mask_token_id: int | None, normaliser: float, stats: dict | None = None,
                 depth_weights: torch.Tensor | None = None, recompute: int = 0) -> torch.Tensor:
    """Summed KL over the segment's owned supervised elements / normaliser. Only those rows go
    through the lm_head: prompt rows and rows of other segments are context only. `stats`
    (optional) accumulates per-depth counts and top-1 agreement: {depth: [count, correct]}.
    `depth_weights` [depths] (optional) weights each element's KL by its depth; `recompute`: segment_forward's."""
    sub, x, charged = segment_forward(head, seq, el, owned, mask_token_id, recompute)
    pos = sub.position
    sup = charged & seq.loss_mask[pos]
    logits = head.model.logits(x[sup])
    probs = seq.probs_at(pos[sup])
    terms = kl_terms(logits, probs)
    if depth_weights is not None:
        terms = terms * depth_weights.to(terms.device)[sub.depth[sup]]
    loss = terms.sum() / normaliser
    if stats is not None:
        with torch.no_grad():
            hit = logits.argmax(-1) == probs.argmax(-1)
            for depth, ok in zip(sub.depth[sup].tolist(), hit.tolist()):
                entry = stats.setdefault(depth, [0, 0])
                entry[0] += 1
                entry[1] += int(ok)
    return loss
