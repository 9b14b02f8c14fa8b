"""What two numerical backends (torch, onnxruntime) are held to: near-equality, stated with margins.

Across backends the same graph is computed with different kernels (GEMM blocking and reduction
order, fused ops), so logits agree only within a tolerance, and a greedy token is guaranteed equal
only where the reference's top-2 logit margin exceeds what that tolerance can flip. With FP8 Q/DQ a
float32 rounding difference can move an activation across an E4M3 rounding boundary (one step =
1/8 of its binade), so the FP8 tolerance is orders of magnitude wider (docs/EXPORT.md,
"Cross-backend numerics"). Within one backend, speculative decoding must still equal target-only
decoding token for token: that stays an exact assertion in the tests.

The same holds between any two implementations (ours against transformers' `generate`, torch
against onnxruntime, drafts or chunked prefill): one helper judges every such token comparison.

    check_greedy_streams(ref_logits, ref, got, tie, min_agreed)   # the rule, on given logits
    check_greedy_near_equal(ref_ex_factory, got_ex_factory, prompt, ref_out, got_out, tol)
    hf_teacher_forced_logits(hf_model, prompt, ref_out)            # reference logits from transformers
    torch_teacher_forced_logits(checkpoint_dir, prompt, ref_out)   # ... from our torch target
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    """How two greedy runs of one prompt compare (for assertion messages and reports)."""

    max_logit_error: float  # max |logits_a - logits_b| teacher-forced along the reference's output
    agreed: int  # leading tokens identical
    divergence_margin: float | None  # reference's top-2 margin where the runs part (None: never)


def teacher_forced_logits(executor, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logits [len(output), V] predicting each output token, from one prefill of prompt + output[:-1]
    on `executor`'s first blocks (a new executor per call: its KV cache starts empty)."""
    from tests.helpers import static_tables

    tokens = torch.tensor([prompt + output[:-1]])  # [1, T]
    positions = torch.arange(tokens.shape[1])[None]  # [1, T]
    logits, _ = executor.target(tokens, positions, static_tables(executor, [0]))  # [1, T, V]
    return logits[0, len(prompt) - 1:].float()


def hf_teacher_forced_logits(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' logits [len(output), V] predicting each output token, from one full forward of
    prompt + output[:-1]."""
    with torch.no_grad():
        return model(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1:].float()


def torch_teacher_forced_logits(checkpoint, prompt: list[int], output: list[int]) -> torch.Tensor:
    """As teacher_forced_logits, on our fp32 torch target of the checkpoint at `checkpoint` (for a
    reference served or run elsewhere: a tritonserver, a Dynamo worker)."""
    from peagle_trt.checkpoint import load_pair
    from peagle_trt.config import SpecConfig
    from peagle_trt.executors.torch import TorchExecutor

    target, _ = load_pair(checkpoint, None, SpecConfig("none", 1)).build()
    executor = TorchExecutor(target, None, 1, len(prompt) + len(output) + 1, deterministic=True)
    return teacher_forced_logits(executor, prompt, output)


def check_greedy_streams(ref_logits: torch.Tensor, ref: list[int], got: list[int], tie: float,
                         min_agreed: int = 1, max_logit_error: float = 0.0) -> Agreement:
    """Assert that two greedy token streams of one prompt agree as far as numerics can guarantee.

    ref_logits [len(ref), V>=2]: the reference's logits (or log-probs) behind each of its tokens,
    teacher-forced on its own output. The streams must be identical, or part first at a position
    where the reference's top-2 margin is <= `tie` (a near-tie the backends' rounding can flip),
    after at least `min_agreed` identical tokens (so a broken backend that parts early, even at a
    tie, still fails; pick prompts whose reference has no tie before `min_agreed`). After a
    divergence the contexts differ and nothing further is compared."""
    assert len(ref) == len(got), f"streams of different lengths: {len(ref)} != {len(got)}"
    first = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
    if first is None:
        return Agreement(max_logit_error, len(ref), None)
    top2 = ref_logits[first].float().topk(2).values  # [2]
    margin = float(top2[0] - top2[1])
    assert margin <= tie, (f"greedy tokens part at {first} ({ref[first]} != {got[first]}) where the reference's "
                           f"top-2 margin {margin:.3g} exceeds {tie:.3g}: not a rounding tie")
    assert first >= min_agreed, (f"greedy tokens part at {first} ({ref[first]} != {got[first]}), at a near-tie "
                                 f"(margin {margin:.3g}) but before the {min_agreed} tokens that must agree")
    return Agreement(max_logit_error, first, margin)


def check_greedy_near_equal(make_ref, make_got, prompt: list[int], ref: list[int], got: list[int],
                            tol: float, min_agreed: int = 8) -> Agreement:
    """Assert the cross-backend guarantee for one prompt; returns the measured agreement.

    make_ref / make_got: () -> a fresh executor of each backend; ref / got: their greedy outputs.
    1. Logits within `tol` at every position of the reference's output (teacher-forced, so both
       backends see the same context).
    2. Tokens identical up to the first divergence, which is accepted only at a position whose
       reference top-2 margin is <= 2 * tol (the most an error of `tol` per logit can overturn),
       after `min_agreed` identical tokens at least (check_greedy_streams)."""
    assert len(ref) == len(got), (len(ref), len(got))
    a = teacher_forced_logits(make_ref(), prompt, ref)  # [T, V]
    b = teacher_forced_logits(make_got(), prompt, ref)  # [T, V]
    err = (a - b).abs().amax(-1)  # [T]
    assert float(err.max()) <= tol, (f"logits differ by {float(err.max()):.3g} > {tol} at position "
                                     f"{int(err.argmax())} (prompt {prompt[:5]}...)")
    return check_greedy_streams(a, ref, got, 2 * tol, min_agreed, float(err.max()))
