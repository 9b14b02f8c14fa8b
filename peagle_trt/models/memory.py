"""KV-cache memory a build needs per sequence slot (what `build` prints and `inspect` can call).

Full-attention layers keep `max_len` positions per slot; sliding-window layers keep only
W + max_rows - 1 positions (a ring, see ops.reference.kv_attention) when the most rows one
forward carries (`max_rows` = max(prefill chunk, K + 1)) is known, so the memory grows with the
number of full layers, not all layers. KV-shared layers (Gemma-4 `num_kv_shared_layers`) read
another layer's cache and hold none; layers may differ in KV heads and head size. Every cache
also keeps one trash row.

    kv_slot_memory(target_cfg, drafter_cfg, max_len, max_rows, dtype_bytes=2) -> KVMemory
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from peagle_trt.models.target import kv_layer_lens


@dataclass(frozen=True)
class KVMemory:
    target_bytes_per_slot: int
    drafter_bytes_per_slot: int
    full_layers: int  # target layers holding max_len positions
    windowed_layers: int  # target layers holding only their window
    window_positions: int  # positions a windowed layer keeps (0 when none)
    shared_layers: int = 0  # target layers reading another layer's cache (no memory of their own)

    @property
    def bytes_per_slot(self) -> int:
        return self.target_bytes_per_slot + self.drafter_bytes_per_slot

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_per_slot": self.bytes_per_slot}

    def describe(self, slots: int) -> str:
        mib = 1 / 2 ** 20
        shared = f", {self.shared_layers} KV-shared" if self.shared_layers else ""
        return (f"KV cache per slot: target {self.target_bytes_per_slot * mib:.2f} MiB ({self.full_layers} "
                f"full layers, {self.windowed_layers} windowed of {self.window_positions} positions{shared}), "
                f"drafter {self.drafter_bytes_per_slot * mib:.2f} MiB; x {slots} slots = "
                f"{self.bytes_per_slot * slots * mib:.2f} MiB")


def _bytes(kv_heads: int, head_dim: int, positions: int, dtype_bytes: int) -> int:
    return 2 * kv_heads * (positions + 1) * head_dim * dtype_bytes  # K and V


def kv_slot_memory(target, drafter=None, max_len: int = 2048, max_rows: int | None = None,
                   dtype_bytes: int = 2) -> KVMemory:
    """`target`: a TargetConfig; `drafter`: a DrafterConfig or None."""
    lens = kv_layer_lens(target, max_len, max_rows)
    owners = [i for i in range(target.num_layers) if target.attention(i).kv_source == i]
    windowed = [lens[i] for i in owners if lens[i] < max_len]
    shapes = {i: target.attention(i) for i in owners}
    target_bytes = sum(_bytes(a.num_kv_heads, a.head_dim, lens[i], dtype_bytes) for i, a in shapes.items())
    drafter_bytes = 0
    if drafter is not None:
        drafter_bytes = drafter.num_layers * _bytes(drafter.num_kv_heads, drafter.head_dim, max_len,
                                                    dtype_bytes)
    return KVMemory(target_bytes, drafter_bytes, len(owners) - len(windowed), len(windowed),
                    max(windowed, default=0), target.num_layers - len(owners))
