"""KV-slot bookkeeping shared by the executors: one slot per running sequence."""

from __future__ import annotations

from peagle_trt.errors import RuntimeInvariantError


class SlotPool:
    """KV-slot bookkeeping shared by the executors: one slot per running sequence."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))[::-1]

    def alloc_slot(self) -> int | None:
        return self._free.pop() if self._free else None

    def free_slot(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise RuntimeInvariantError(f"slot {slot} freed twice or out of range")
        self._free.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free)
