"""PEagleDraftInputs in Triton: the input rows of one parallel drafting pass.

Contract: `peagle_trt.ops.reference.draft_inputs`. With R = P + K - 1 rows per request and n real
(pending) rows, row j is: j < n -> (pending_tokens[j] embedded, pending_hidden[j]); n <= j < n+K-1
-> (mask token embedded, h_mask); later -> zeros, position -1. positions[j] = cur - n + j for the
real and mask rows; sample_rows = n-1 .. n+K-2. Example, K=3, n=2, cur=12, P=2 (R=4):
rows (t0,h0,@10) (t1,h1,@11) (M,hm,@12) (M,hm,@13); sample_rows 1,2,3.
One program per (request, row) copies BLOCK_H columns at a time. Every gather index is clamped
into range before the load (the interpreter returns garbage, not a fault, on an out-of-bounds load;
on a GPU a bad token id must not read outside the embedding table: ids are clamped to [0, V)).
How to test: tests/ops/test_triton_kernels.py (interpreter), tests/plugins/test_kernels_gpu.py (GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_trt.ops.triton_kernels.common import check_dtype, next_pow2, out_buffer, same_device


@triton.jit
def draft_inputs_kernel(tokens_ptr, hidden_ptr, num_pending_ptr, cur_ptr, embed_ptr, h_mask_ptr,
                        embeds_out, hidden_out, positions_out, sample_rows_out,
                        P, R, H, K, V, mask_token_id, BLOCK_H: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    n = tl.load(num_pending_ptr + b)
    cur = tl.load(cur_ptr + b)
    real = j < n
    mask_row = (j >= n) & (j < n + K - 1)
    live = real | mask_row
    src = tl.minimum(j, P - 1)
    token = tl.where(real, tl.load(tokens_ptr + b * P + src), mask_token_id)
    token = tl.minimum(tl.maximum(token, 0), V - 1)  # a bad id never reads outside the table
    # column limits per source: a row's mask is `c < limit` (a scalar & vector mask fails in the interpreter)
    live_h = tl.where(live, H, 0)
    real_h = tl.where(real, H, 0)
    mask_h = tl.where(mask_row, H, 0)
    cols = tl.arange(0, BLOCK_H)
    for start in range(0, H, BLOCK_H):
        c = start + cols
        inside = c < H
        emb = tl.load(embed_ptr + token * H + c, mask=c < live_h, other=0.0)
        pend = tl.load(hidden_ptr + (b * P + src) * H + c, mask=c < real_h, other=0.0)
        hm = tl.load(h_mask_ptr + c, mask=c < mask_h, other=0.0)
        tl.store(embeds_out + (b * R + j) * H + c, emb, mask=inside)
        tl.store(hidden_out + (b * R + j) * H + c, tl.where(real, pend, hm.to(pend.dtype)), mask=inside)
    tl.store(positions_out + b * R + j, tl.where(live, cur - n + j, -1))
    if j < K:
        tl.store(sample_rows_out + b * K + j, n - 1 + j)


def draft_inputs(pending_tokens: torch.Tensor, pending_hidden: torch.Tensor, num_pending: torch.Tensor,
                 cur: torch.Tensor, embed_tokens: torch.Tensor, h_mask: torch.Tensor, num_spec_tokens: int,
                 mask_token_id: int, *, out: tuple[torch.Tensor, ...] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.draft_inputs`. Returns embeds [B, R, H] (embed_tokens' dtype), hidden [B, R, H]
    (pending_hidden's dtype), positions [B, R] int64, sample_rows [B, K] int64; `out=` takes the
    four buffers (tests poison them)."""
    device = same_device(pending_tokens, pending_hidden, num_pending, cur, embed_tokens, h_mask)
    bsz, p = pending_tokens.shape
    hs = pending_hidden.shape[-1]
    if pending_hidden.shape != (bsz, p, hs) or embed_tokens.shape[-1] != hs or h_mask.shape != (hs,):
        raise ValueError(f"draft_inputs: pending_hidden {tuple(pending_hidden.shape)}, embed_tokens "
                         f"{tuple(embed_tokens.shape)}, h_mask {tuple(h_mask.shape)} do not match pending_tokens "
                         f"{tuple(pending_tokens.shape)}")
    check_dtype(pending_hidden, "draft_inputs pending_hidden")
    check_dtype(embed_tokens, "draft_inputs embed_tokens")
    k = int(num_spec_tokens)
    vocab = embed_tokens.shape[0]
    if k < 1 or not 0 <= int(mask_token_id) < vocab:
        raise ValueError(f"draft_inputs: num_spec_tokens={k} must be >= 1 and mask_token_id={mask_token_id} "
                         f"inside the vocabulary [0, {vocab})")
    r = p + k - 1
    outs = out or (None, None, None, None)
    embeds = out_buffer(outs[0], (bsz, r, hs), embed_tokens.dtype, device, "draft_inputs embeds")
    hidden = out_buffer(outs[1], (bsz, r, hs), pending_hidden.dtype, device, "draft_inputs hidden")
    positions = out_buffer(outs[2], (bsz, r), torch.int64, device, "draft_inputs positions")
    sample_rows = out_buffer(outs[3], (bsz, k), torch.int64, device, "draft_inputs sample_rows")
    if bsz == 0:
        return embeds, hidden, positions, sample_rows
    draft_inputs_kernel[(bsz, r)](
        pending_tokens.to(torch.int64).contiguous(), pending_hidden.contiguous(),
        num_pending.to(torch.int64).contiguous(), cur.to(torch.int64).contiguous(), embed_tokens.contiguous(),
        h_mask.to(pending_hidden.dtype).contiguous(), embeds, hidden, positions, sample_rows,
        p, r, hs, k, vocab, int(mask_token_id), BLOCK_H=min(next_pow2(hs, 16), 1024))
    return embeds, hidden, positions, sample_rows
