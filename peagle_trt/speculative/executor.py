"""The interface the speculative step needs from the models: owned here, by its consumer.

`SpecDecoder` (decoder.py) and the drafters (drafting.py) call `target(...)` for prefill and
verify, `draft_parallel(...)` for the one-pass P-EAGLE draft, `drafter(...)` / `project(...)` /
`to_target_ids(...)` for sequential EAGLE-3 drafting. Draft trees (speculative/tree.py) also use
`target(..., tree_mask=)` (the rows' ancestor bits), `draft_parallel_top(...)` (each position's top
W candidates) and `move_kv(...)` (the accepted path's target KV into place). Every forward gets block tables [G, B, M]
(int64, -1 = no block; G KV groups: group 0 full attention and the drafter, one group per sliding
window, `windows`) into the executor's paged caches, laid out by `kv` (a KVLayout); the runtime
decides which blocks each request holds (runtime/blocks.py). The torch, onnxruntime and TensorRT
executors of peagle_trt/executors/ implement it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from peagle_trt.config import KVLayout


class Executor(Protocol):
    device: torch.device
    kv: KVLayout  # blocks, block size, positions per request, batch
    windows: tuple[int, ...]  # per KV group its window (group 0: 0, full attention)

    def target(self, tokens, positions, tables, logit_rows=None,
               tree_mask=None) -> tuple[torch.Tensor, torch.Tensor]: ...
    def move_kv(self, tables, src, dst) -> None: ...
    def draft_parallel_top(self, tokens, aux, num_pending, cur, tables, k: int, width: int): ...
    def draft_parallel(self, tokens, aux, num_pending, cur, tables, k: int) -> torch.Tensor: ...
    def drafter(self, tokens, hidden, positions, tables) -> tuple[torch.Tensor, torch.Tensor]: ...
    def project(self, aux: torch.Tensor) -> torch.Tensor: ...
    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor: ...
