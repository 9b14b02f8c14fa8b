"""The interface the speculative step needs from the models: owned here, by its consumer.

`SpecDecoder` (decoder.py) and the drafters (drafting.py) call `target(...)` for prefill and
verify, `draft_parallel(...)` for the one-pass P-EAGLE draft, `drafter(...)` / `project(...)` /
`to_target_ids(...)` for sequential EAGLE-3 drafting, plus KV-slot bookkeeping. The torch,
onnxruntime and TensorRT executors of peagle_trt/executors/ implement it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Executor(Protocol):
    device: torch.device
    num_slots: int
    max_len: int  # KV positions per slot

    def alloc_slot(self) -> int | None: ...
    def free_slot(self, slot: int) -> None: ...
    @property
    def free_slots(self) -> int: ...
    def target(self, tokens, positions, slots, logit_rows=None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def draft_parallel(self, tokens, aux, num_pending, cur, slots, k: int) -> torch.Tensor: ...
    def drafter(self, tokens, hidden, positions, slots) -> tuple[torch.Tensor, torch.Tensor]: ...
    def project(self, aux: torch.Tensor) -> torch.Tensor: ...
    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...
