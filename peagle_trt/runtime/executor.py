"""Executors: the two model forwards the speculative step needs, behind one small interface.

`SpecDecoder` only calls `target(...)`, `drafter(...)`, `project(...)`, `to_target_ids(...)` and
reads `h_mask` / `mask_token_id`; onnxruntime and TensorRT executors implement the same methods.
KV caches live in the executor, one slot per running sequence, indexed by absolute position.
"""

from __future__ import annotations

import torch

from peagle_trt.errors import RuntimeInvariantError


class TorchExecutor:
    """Reference executor over `TargetModel` / `DrafterModel` (CPU or CUDA)."""

    def __init__(self, target, drafter=None, num_slots: int = 1, max_len: int = 2048):
        self.target_model, self.drafter_model = target, drafter
        self.num_slots, self.max_len = num_slots, max_len
        self.device = target.lm_head.weight.device
        self.target_cache = target.new_cache(num_slots, max_len)
        self.drafter_cache = drafter.new_cache(num_slots, max_len) if drafter is not None else None
        self.mask_token_id = drafter.config.mask_token_id if drafter is not None else None
        self.h_mask = drafter.h_mask if drafter is not None else None  # [H] = fc(mask_hidden)
        self._free = list(range(num_slots))[::-1]

    # -- slots ---------------------------------------------------------------------------------
    def alloc_slot(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_slot(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeInvariantError(f"slot {slot} freed twice or out of range")
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    # -- forwards ------------------------------------------------------------------------------
    @torch.inference_mode()
    def target(self, tokens, positions, slots, logit_rows=None):
        # tokens, positions [B, S]; slots [B]; logit_rows [B, R] | None
        # -> logits [B, R or S, V] float32, aux [B, S, 3 * H_t]
        return self.target_model(tokens, positions, slots, self.target_cache, logit_rows)

    @torch.inference_mode()
    def drafter(self, tokens, hidden, positions, slots):
        # tokens, positions [B, S]; hidden [B, S, H] -> draft logits [B, S, V_d], pre-norm [B, S, H]
        return self.drafter_model(tokens, hidden, positions, slots, self.drafter_cache)

    @torch.inference_mode()
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return self.drafter_model.project(aux)  # [..., 3 * H_t] -> [..., H]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.drafter_model.to_target_ids(draft_ids)
