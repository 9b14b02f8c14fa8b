"""PEagleDraftSample in Triton: greedy argmax over the draft vocabulary, then d2t to target ids.

Contract: `peagle_trt.ops.reference.draft_sample` (logits [..., V_d] -> ids [...], int64;
target_id = draft_id + d2t[draft_id]; ties go to the lowest index and NaN counts as the maximum,
as torch.argmax). One program per row scans the vocabulary in chunks of BLOCK_V, keeping per lane
the best value and its first index; the row's answer is the lowest index holding the maximum. No atomics, no split:
a draft vocabulary (~32k) is one pass of a few chunks per row.
How to test: tests/ops/test_triton_kernels.py (interpreter), tests/plugins/test_kernels_gpu.py (GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_trt.ops.triton_kernels.common import ACTIVATIONS, check_dtype, out_buffer, same_device

BLOCK_V = 1024


@triton.jit
def draft_sample_kernel(logits_ptr, d2t_ptr, ids_ptr, vocab,
                        HAS_D2T: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_nan = tl.zeros([BLOCK_V], tl.int32)  # 1: this lane's best is a NaN (torch.argmax: NaN is the maximum)
    best_idx = tl.full([BLOCK_V], 2147483647, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        idx = start + lanes
        inside = idx < vocab
        x = tl.load(logits_ptr + row * vocab + idx, mask=inside, other=float("-inf")).to(tl.float32)
        nan = (x != x).to(tl.int32)
        first = (best_idx == 2147483647) & inside
        # strict comparisons: on a tie the earlier chunk (the lower index) keeps the lane
        take = first | (nan > best_nan) | ((nan == 0) & (best_nan == 0) & (x > best))
        best = tl.where(take, x, best)
        best_nan = tl.where(take, nan, best_nan)
        best_idx = tl.where(take, idx, best_idx)
    any_nan = tl.max(best_nan, axis=0)
    top = tl.max(tl.where(best_nan == 1, float("-inf"), best), axis=0)
    winner = tl.where(any_nan == 1, best_nan == 1, best == top)
    draft = tl.min(tl.where(winner, best_idx, 2147483647), axis=0).to(tl.int64)
    if HAS_D2T:
        draft += tl.load(d2t_ptr + draft)
    tl.store(ids_ptr + row, draft)


def draft_sample(logits: torch.Tensor, d2t: torch.Tensor | None, *, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """See `reference.draft_sample`. logits [..., V_d] float32/float16/bfloat16; d2t [V_d] or None."""
    device = same_device(logits, d2t)
    check_dtype(logits, "draft_sample logits", ACTIVATIONS)
    vocab = logits.shape[-1]
    if vocab < 1:
        raise ValueError("draft_sample: empty vocabulary")
    if d2t is not None and d2t.numel() != vocab:
        raise ValueError(f"draft_sample: d2t has {d2t.numel()} entries for a vocabulary of {vocab}")
    ids = out_buffer(out, logits.shape[:-1], torch.int64, device, "draft_sample")
    rows = ids.numel()
    if rows == 0:
        return ids
    x = logits.contiguous()
    table = x if d2t is None else d2t.to(torch.int64).contiguous()  # any pointer when HAS_D2T is off
    draft_sample_kernel[(rows,)](x, table, ids, vocab, HAS_D2T=d2t is not None, BLOCK_V=BLOCK_V)
    return ids
