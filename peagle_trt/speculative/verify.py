"""Verification of a chain of K drafts against the target's K+1 distributions.

Both rules emit between 1 and K+1 tokens: the accepted drafts, then one target token (the
correction at the first rejection, or the bonus after K acceptances).
  greedy:    accept while d_{i+1} == argmax p_i.
  rejection: drafts are greedy (draft distribution q one-hot), so accept d_{i+1} with probability
             p_i(d_{i+1}); on rejection sample from normalize(max(p_i - q_i, 0)) = p_i with d_{i+1}
             zeroed. This keeps the output distributed exactly as the target's (lossless).
"""

from __future__ import annotations

import torch

from peagle_trt.config import SamplingParams
from peagle_trt.speculative.sampling import probabilities, sample


def verify_greedy(drafts: list[int], logits: torch.Tensor) -> list[int]:
    # drafts [K]; logits [K+1, V] -> emitted tokens (accepted drafts + correction/bonus)
    target = logits.argmax(dim=-1).tolist()  # [K+1]
    a = 0
    while a < len(drafts) and drafts[a] == target[a]:
        a += 1
    return drafts[:a] + [target[a]]


def verify_rejection(drafts: list[int], logits: torch.Tensor, params: SamplingParams,
                     generator: torch.Generator | None) -> list[int]:
    # drafts [K]; logits [K+1, V] -> emitted tokens
    probs = probabilities(logits, params)  # [K+1, V]
    u = torch.rand(len(drafts), generator=generator, device=probs.device)  # [K]
    for i, d in enumerate(drafts):
        if u[i] < probs[i, d]:
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        mass = residual.sum()
        if mass <= 0:  # all mass on d (the rest underflowed): p == q, nothing to correct towards
            continue
        return drafts[:i] + [int(sample((residual / mass)[None], generator))]
    return drafts + [int(sample(probs[len(drafts)][None], generator))]


def verify(drafts: list[int], logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    if params.greedy:
        return verify_greedy(drafts, logits)
    return verify_rejection(drafts, logits, params, generator)
