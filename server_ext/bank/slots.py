"""Which expert sits in which GPU slot of one MoE layer (pure logic).

The physical expert bank of a layer has ``num_slots`` device rows followed by
``num_experts`` host rows (one per logical expert). A resident expert is
computed from its slot row, every other expert from its host row, so the
kernel sees one tensor and one routing table: ``physical_row(e)``.
"""

from __future__ import annotations

from dataclasses import dataclass


class SlotError(ValueError):
    pass


@dataclass(frozen=True)
class SlotMove:
    expert: int
    slot: int


@dataclass(frozen=True)
class SlotPlan:
    """A swap for one layer: evictions first, then loads into the freed slots."""

    evict: tuple[SlotMove, ...]
    load: tuple[SlotMove, ...]

    @property
    def empty(self) -> bool:
        return not self.evict and not self.load


class SlotTable:
    """Slot assignment for one layer; never holds more residents than slots."""

    def __init__(self, num_experts: int, num_slots: int, host_row_offset: int | None = None):
        if num_experts <= 0:
            raise SlotError("num_experts must be positive")
        if not 0 <= num_slots <= num_experts:
            raise SlotError(f"num_slots must be in [0, {num_experts}], got {num_slots}")
        self.num_experts = num_experts
        self.num_slots = num_slots
        # Host rows start after the slot rows; a backing may pad the slot region.
        self.host_row_offset = num_slots if host_row_offset is None else host_row_offset
        if self.host_row_offset < num_slots:
            raise SlotError("host rows cannot overlap slot rows")
        self._slot_of: list[int] = [-1] * num_experts
        self._expert_in: list[int] = [-1] * num_slots

    @property
    def physical_rows(self) -> int:
        return self.host_row_offset + self.num_experts

    def resident(self) -> tuple[int, ...]:
        return tuple(sorted(e for e in self._expert_in if e >= 0))

    def slot_of(self, expert: int) -> int:
        return self._slot_of[expert]

    def is_resident(self, expert: int) -> bool:
        return self._slot_of[expert] >= 0

    def free_slots(self) -> set[int]:
        return {s for s, e in enumerate(self._expert_in) if e < 0}

    def physical_row(self, expert: int) -> int:
        slot = self._slot_of[expert]
        return slot if slot >= 0 else self.host_row_offset + expert

    def physical_map(self) -> list[int]:
        return [self.physical_row(e) for e in range(self.num_experts)]

    def owners(self) -> list[int]:
        """Expert in each slot, -1 for a free slot."""
        return list(self._expert_in)

    def assign(self, owners: list[int]) -> None:
        """Adopt a whole slot assignment (read back from the device's online cache); validated first."""
        if len(owners) != self.num_slots:
            raise SlotError(f"{len(owners)} slot owners for {self.num_slots} slots")
        held = [e for e in owners if e >= 0]
        if len(held) != len(set(held)) or any(not -1 <= e < self.num_experts for e in owners):
            raise SlotError(f"slot owners are not a valid assignment: {owners}")
        self._expert_in = [int(e) for e in owners]
        self._slot_of = [-1] * self.num_experts
        for slot, e in enumerate(self._expert_in):
            if e >= 0:
                self._slot_of[e] = slot

    def plan(self, target: tuple[int, ...] | list[int] | set[int]) -> SlotPlan:
        """Moves that make ``target`` the resident set; validates before anything changes."""
        want = set(target)
        if len(want) > self.num_slots:
            raise SlotError(f"{len(want)} experts requested but the slot bank holds {self.num_slots}")
        bad = sorted(e for e in want if not 0 <= e < self.num_experts)
        if bad:
            raise SlotError(f"expert ids out of range [0, {self.num_experts}): {bad}")
        current = {e for e in self._expert_in if e >= 0}
        evict = tuple(SlotMove(e, self._slot_of[e]) for e in sorted(current - want))
        free = sorted([s for s, e in enumerate(self._expert_in) if e < 0] + [m.slot for m in evict])
        load = tuple(SlotMove(e, free[i]) for i, e in enumerate(sorted(want - current)))
        return SlotPlan(evict, load)

    def apply_evictions(self, plan: SlotPlan) -> None:
        for m in plan.evict:
            if self._expert_in[m.slot] != m.expert:
                raise SlotError(f"slot {m.slot} does not hold expert {m.expert}")
            self._expert_in[m.slot] = -1
            self._slot_of[m.expert] = -1

    def apply_loads(self, plan: SlotPlan) -> None:
        for m in plan.load:
            if self._expert_in[m.slot] != -1:
                raise SlotError(f"slot {m.slot} is not free")
            self._expert_in[m.slot] = m.expert
            self._slot_of[m.expert] = m.slot
