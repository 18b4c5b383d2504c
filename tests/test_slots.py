"""Slot assignment (pure)."""

from __future__ import annotations

import pytest

from reap_swap.server_ext.bank.slots import SlotError, SlotTable


def fill(table: SlotTable, target: tuple[int, ...]) -> None:
    plan = table.plan(target)
    table.apply_evictions(plan)
    table.apply_loads(plan)


def test_physical_rows_map_residents_to_slots_and_the_rest_to_host_rows() -> None:
    t = SlotTable(num_experts=8, num_slots=3)
    fill(t, (5, 1))
    assert t.resident() == (1, 5)
    assert t.physical_map() == [3, 0, 5, 6, 7, 1, 9, 10]
    assert t.physical_rows == 11


def test_evictions_free_slots_reused_by_loads() -> None:
    t = SlotTable(8, 3)
    fill(t, (0, 1, 2))
    plan = t.plan((0, 6, 7))
    assert {m.expert for m in plan.evict} == {1, 2}
    assert sorted(m.slot for m in plan.load) == sorted(m.slot for m in plan.evict)
    fill(t, (0, 6, 7))
    assert t.resident() == (0, 6, 7)
    assert t.slot_of(0) == 0


def test_never_above_budget_and_validation_before_change() -> None:
    t = SlotTable(8, 2)
    fill(t, (3,))
    with pytest.raises(SlotError, match="holds 2"):
        t.plan((0, 1, 2))
    with pytest.raises(SlotError, match="out of range"):
        t.plan((9,))
    assert t.resident() == (3,)


def test_noop_plan_is_empty() -> None:
    t = SlotTable(8, 4)
    fill(t, (1, 2))
    assert t.plan((2, 1)).empty


def test_padded_host_offset() -> None:
    t = SlotTable(4, 2, host_row_offset=3)
    assert t.physical_map() == [3, 4, 5, 6]
    with pytest.raises(SlotError):
        SlotTable(4, 2, host_row_offset=1)
