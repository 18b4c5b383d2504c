"""Which device accumulator slot each live engine request writes to (pure logic).

Slots are handed out on a request's first step and given back when it
finishes. When every slot is taken, the least recently scheduled request loses
its slot: the caller drains that slot's sums to the host ledger first, and the
request gets a fresh slot on its next step, so nothing is lost. With at least
as many slots as requests per step, a request of the current step is never
the one evicted.
"""

from __future__ import annotations

from collections import OrderedDict


class RequestSlots:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # LRU order: oldest first
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._slot_of

    def get(self, request_id: str) -> int | None:
        return self._slot_of.get(request_id)

    def live(self) -> list[tuple[str, int]]:
        return list(self._slot_of.items())

    def acquire(self, request_id: str) -> tuple[int, tuple[str, int] | None]:
        """(slot, evicted (request, slot) or None); marks the request most recently used."""
        slot = self._slot_of.get(request_id)
        if slot is not None:
            self._slot_of.move_to_end(request_id)
            return slot, None
        evicted = None
        if not self._free:
            victim, vslot = self._slot_of.popitem(last=False)
            evicted = (victim, vslot)
            self._free.append(vslot)
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        return slot, evicted

    def release(self, request_id: str) -> int | None:
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        return slot
