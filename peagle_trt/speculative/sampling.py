"""Turn logits into probabilities (temperature, top-k, top-p) and sample from them.

Numerically safe for every temperature SamplingParams accepts (>= TEMPERATURE_FLOOR; smaller ones
never get here, they are greedy): the top logit is subtracted first, so the scaled logits are
<= 0 with the top one at exactly 0 and softmax cannot overflow; a temperature too large for
float32 flattens the distribution to uniform instead of turning masked logits into NaN.
Tested by tests/speculative/test_sampling.py and tests/faults/test_requests.py.
"""

from __future__ import annotations

import torch

from peagle_trt.config import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [N, V] -> probs [N, V] after temperature, then top-k, then top-p (nucleus)."""
    logits = logits.float()
    logits = logits - logits.max(dim=-1, keepdim=True).values  # [N, V], <= 0, top logit at 0
    scaled = logits / params.temperature
    # -inf / inf (T beyond float32) is NaN: a token that had no mass keeps none
    logits = torch.where(torch.isneginf(logits), logits, scaled)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] -> token ids [N]."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
