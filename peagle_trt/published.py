"""The published P-EAGLE heads by hub id, and the targets they were trained for.

    head = published_head("amazon/gpt-oss-120b-p-eagle")   # PublishedHead, or None for any other head
    target = default_target(head)                            # "openai/gpt-oss-120b": its card's target
    check_pairing(head, "Qwen/Qwen3-8B", None)               # HubError: trained for openai/gpt-oss-120b

Why: `build --drafter amazon/gpt-oss-120b-p-eagle` needs no `--target` (the head's card names it),
and a head paired with another model is refused before anything is fetched or built, saying which
target it was trained for. The check compares hub ids when the target is one, else the target's
family (config.json `model_type`); a head not listed here is only checked by the pair's own
shape checks (peagle_trt/checkpoint/validate.py).

Sources, each entry from the model card of the head on huggingface.co (read through the mirrors
and captures cited in the shared reference docs, peagle-spec.md 1.5 / 4.5 and benchmarks.md):
layers and "number of parallel-token prediction" (trained depth) from "Model Details", the target
from "Model Description" / "Target model", `card_k` from the card's `vllm serve` command. Gemma-4-31B
has a P-EAGLE head on SageMaker JumpStart (secondary sources only) but no hub id was found: it is
not listed. Tested by tests/test_hub.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from peagle_trt.errors import HubError


@dataclass(frozen=True)
class PublishedHead:
    head: str  # hub id, as the card writes it
    targets: tuple[str, ...]  # hub ids it serves: first the card's `vllm serve` model, then what it was trained on
    family: str  # the target's config.json model_type
    layers: int
    trained_depth: int  # parallel tokens trained ("number of parallel-token prediction")
    card_k: int  # num_speculative_tokens of the card's command
    source: str


_CARD = "model card on huggingface.co, 'Model Details' and 'Usage'"
HEADS = (
    PublishedHead("amazon/gpt-oss-120b-p-eagle", ("openai/gpt-oss-120b",), "gpt_oss", 4, 8, 5, _CARD),
    PublishedHead("amazon/gpt-oss-120b-p-eagle-long-context", ("openai/gpt-oss-120b",), "gpt_oss", 4, 8, 5, _CARD),
    PublishedHead("amazon/GPT-OSS-20B-P-EAGLE", ("openai/gpt-oss-20b",), "gpt_oss", 4, 10, 7, _CARD),
    PublishedHead("amazon/gpt-oss-20b-p-eagle-long-context", ("openai/gpt-oss-20b",), "gpt_oss", 4, 10, 7, _CARD),
    # trained on the FP8 checkpoint; the card serves the bf16 one
    PublishedHead("amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE",
                  ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8"), "qwen3_moe",
                  4, 18, 10, _CARD),
    PublishedHead("amazon/Qwen3-Coder-30B-A3B-Instruct-P-EAGLE-long-context",
                  ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "Qwen/Qwen3-Coder-30B-A3B-Instruct-FP8"), "qwen3_moe",
                  4, 18, 10, _CARD),
)
_BY_ID = {h.head.lower(): h for h in HEADS}  # hub ids are case-insensitive


def published_head(repo_id: str | None) -> PublishedHead | None:
    """The registry entry of a hub id (without its @revision), or None."""
    return _BY_ID.get(repo_id.lower()) if repo_id else None


def default_target(head: PublishedHead) -> str:
    """The target of the head's card command: what `--target` means when it is not given."""
    return head.targets[0]


def check_pairing(head: PublishedHead, target_id: str | None, target_family: str | None) -> None:
    """HubError when `head` is paired with a target it was not trained for: by hub id when the
    target is named by one (`target_id`), else by its config.json model_type (`target_family`)."""
    if target_id is not None:
        if target_id.lower() not in {t.lower() for t in head.targets}:
            raise HubError(f"{head.head} was trained for {' / '.join(head.targets)}, not {target_id}; pass "
                           f"--target {default_target(head)} (or leave --target out), or a head trained for "
                           f"{target_id}")
    elif target_family is not None and target_family != head.family:
        raise HubError(f"{head.head} was trained for {default_target(head)} (model_type {head.family!r}), but the "
                       f"target is a {target_family!r} model; pass --target {default_target(head)} or a head "
                       "trained for this target")
