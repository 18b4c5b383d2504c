"""Exchanges of one layer in RAM-complement mode: planning, publication order, counters.

Pure logic over a ``SlotTable`` and a ``LayerHostRows``; the bytes move
through ``ExchangeOps`` (row copies inside the bank tensor on CPU or the
CUDA-VMM range; plain byte arrays in the storage test). One batch:

1. evicted experts: GPU slot -> a spare host row (D2H), wait;
2. route them to their new rows (publish), only now that their bytes landed;
3. promoted experts: their host row -> the freed slot (H2D), wait;
4. route them to their slots (publish), wait, and only then hand their old
   rows to the spare pool (rotation: no host memcpy, addresses unchanged).

A batch evicts at most as many experts as there are spares, so a layer
needs >= 1 spare; the whole batch list is planned (and refused) before any
byte or table entry changes. Residency readers on other threads see an
immutable (slot, host row) pair per expert, swapped in whole.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol

from .host_rows import HostRowError, LayerHostRows, SpareRow
from .slots import SlotError, SlotMove, SlotPlan, SlotTable


@dataclass
class ExchangeCounters:
    rounds: int = 0
    """Swaps that moved bytes in this layer (summed over layers: layer-swaps)."""
    exchanges: int = 0
    """Evict/promote pairs: the evicted expert took a spare, the promoted one gave its row back."""
    rotated_blocks: int = 0
    """Host rows handed over instead of being copied into (one per exchange)."""
    d2h_bytes: int = 0
    h2d_bytes: int = 0
    memcpy_bytes_avoided: int = 0
    """Payload a copy path would have moved host -> host (counted once, not read + write)."""

    def add(self, other: "ExchangeCounters") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: int(getattr(self, f.name)) for f in fields(self)}


@dataclass(frozen=True)
class Batch:
    evict: tuple[SlotMove, ...]
    load: tuple[SlotMove, ...]


class ExchangeOps(Protocol):
    def to_host(self, slot: int, row: int) -> None:
        """Queue the copy of slot ``slot``'s bytes into host row ``row`` (D2H)."""

    def to_slot(self, row: int, slot: int) -> None:
        """Queue the copy of host row ``row``'s bytes into slot ``slot`` (H2D)."""

    def wait(self) -> None:
        """Return once every queued copy and publish has landed."""

    def publish(self, physical_map: list[int]) -> None:
        """Point the kernel's routing table at these physical rows."""


def plan_batches(plan: SlotPlan, free_slots: set[int], spares: int) -> tuple[Batch, ...]:
    """Split a slot plan into batches that never need more spares than exist.

    Loads go to whichever slots are free by then (the plan's slot choice is
    only a hint), so every batch frees rows for the next one's evictions.
    """
    evicts, pending, free = list(plan.evict), [m.expert for m in plan.load], sorted(free_slots)
    batches: list[Batch] = []
    while evicts or pending:
        k = min(spares, len(evicts))
        ev, evicts = evicts[:k], evicts[k:]
        free = sorted(set(free) | {m.slot for m in ev})
        n = min(len(free), len(pending))
        ld = tuple(SlotMove(e, s) for e, s in zip(pending[:n], free[:n]))
        pending, free = pending[n:], free[n:]
        if not ev and not ld:
            raise HostRowError("exchange cannot progress: no spare host row and no free slot (reserve >= 1 spare)")
        spares += len(ld) - len(ev)
        batches.append(Batch(tuple(ev), ld))
    return tuple(batches)


class ComplementLayer:
    """Slot table + host-row ownership of one layer, changed only by ``exchange``."""

    def __init__(self, table: SlotTable, rows: LayerHostRows, host_row_offset: int):
        if rows.num_experts != table.num_experts:
            raise HostRowError("slot table and host rows disagree on the expert count")
        if host_row_offset < table.num_slots:
            raise HostRowError("host rows cannot overlap slot rows")
        self.table = table
        self.rows = rows
        self.host_row_offset = host_row_offset
        self.min_residents = max(0, table.num_experts - rows.num_rows)
        self.counters = ExchangeCounters()
        self._cache_evictions_seen = self._cache_promotions_seen = 0
        self.damaged: str | None = None
        """Why the device's routing table may disagree with the tables (a re-publish failed), else None."""
        problems = rows.check(set(table.resident()))
        if problems:
            raise HostRowError(f"layer {rows.layer}: inconsistent start state: {problems[:3]}")
        self._snapshot = self._take_snapshot()

    def adopt_rows(self, row_owners: list[int], cache_evictions: int, cache_promotions: int) -> None:
        """Take the host-row owners the online cache left on the device (the slot table was
        assigned first) and count its exchanges: every eviction of the cache in this mode wrote
        the victim to a spare row and handed the promoted expert's row to the pool."""
        rows = LayerHostRows(self.rows.layer, self.rows.num_experts, self.rows.num_rows, self.rows.block, list(row_owners))
        problems = rows.check(set(self.table.resident()))
        if problems:
            raise HostRowError(f"layer {self.rows.layer}: the online cache's host rows disagree with its slots: {problems[:3]}")
        self.rows = rows
        if cache_evictions < self._cache_evictions_seen or cache_promotions < self._cache_promotions_seen:  # counters were reset
            self._cache_evictions_seen = self._cache_promotions_seen = 0
        n = cache_evictions - self._cache_evictions_seen
        loads = cache_promotions - self._cache_promotions_seen  # a promotion into a free slot loads without an exchange
        self._cache_evictions_seen, self._cache_promotions_seen = cache_evictions, cache_promotions
        block = rows.block_bytes
        self.counters.add(ExchangeCounters(0, n, n, n * block, loads * block, n * block))
        self._snapshot = self._take_snapshot()

    def cache_counters_reset(self) -> None:
        """The online cache's device counters restart from zero (its evictions are counted from there)."""
        self._cache_evictions_seen = self._cache_promotions_seen = 0

    def _take_snapshot(self) -> tuple[tuple[int, int], ...]:
        return tuple((self.table.slot_of(e), self.rows.row_of(e)) for e in range(self.table.num_experts))

    def where(self, expert: int) -> tuple[int, int]:
        """(slot, host row) of ``expert``, exactly one of them >= 0; safe from any thread."""
        return self._snapshot[expert]

    def snapshot(self) -> tuple[tuple[int, int], ...]:
        return self._snapshot

    def physical_map(self) -> list[int]:
        out = []
        for e in range(self.table.num_experts):
            slot = self.table.slot_of(e)
            out.append(slot if slot >= 0 else self.host_row_offset + self.rows.row_of(e))
        return out

    def padded_target(self, target: tuple[int, ...] | list[int] | set[int]) -> tuple[int, ...]:
        """``target`` plus as few experts as needed for the others to fit the host rows.

        An expert leaves the GPU only when a host row can take it: current
        residents are kept first (lowest ids), then the lowest free ids.
        """
        self.table.plan(target)  # validates ids and size
        want = set(target)
        need = self.min_residents - len(want)
        if need > 0:
            keep = [e for e in self.table.resident() if e not in want]
            rest = [e for e in range(self.table.num_experts) if e not in want and e not in keep]
            want |= set((keep + rest)[:need])
        return tuple(sorted(want))

    def exchange(self, target: tuple[int, ...] | list[int] | set[int], ops: ExchangeOps) -> tuple[SlotPlan, ExchangeCounters]:
        """Make ``padded_target(target)`` resident, batch by batch, in publication order."""
        plan = self.table.plan(self.padded_target(target))
        delta = ExchangeCounters()
        if plan.empty:
            return plan, delta
        batches = plan_batches(plan, self.table.free_slots(), self.rows.spare_count)
        block = self.rows.block_bytes
        done: list[Batch] = []
        try:
            for b in batches:
                self._run_batch(b, ops)
                done.append(b)
                pairs = min(len(b.evict), len(b.load))
                delta.exchanges += pairs
                delta.rotated_blocks += pairs
                delta.memcpy_bytes_avoided += pairs * block
                delta.d2h_bytes += len(b.evict) * block
                delta.h2d_bytes += len(b.load) * block
        finally:  # the batches that completed moved bytes even when a later one failed
            delta.rounds = int(bool(done))
            self.counters.add(delta)
        done_plan = SlotPlan(tuple(m for b in done for m in b.evict), tuple(m for b in done for m in b.load))
        return done_plan, delta

    def _run_batch(self, b: Batch, ops: ExchangeOps) -> None:
        """One batch; on any failure the layer is put back to a consistent state before the error
        propagates: spares taken for copies that did not land are given back, a table change whose
        publish failed is undone (the bytes it routed away from are still there) and the last
        consistent map is published again. Only a failing re-publish leaves the layer ``damaged``."""
        spares: list[SpareRow] = []
        try:
            for _ in b.evict:
                spares.append(self.rows.take_spare())
            for m, sp in zip(b.evict, spares):
                ops.to_host(m.slot, sp.row)
            ops.wait()
        except BaseException:
            for sp in spares:  # nothing routes to them: their half-written bytes are garbage nobody reads
                self.rows.give_back(sp)
            raise
        self.table.apply_evictions(SlotPlan(b.evict, ()))
        for m, sp in zip(b.evict, spares):
            self.rows.adopt(m.expert, sp)
        if b.evict:
            try:
                ops.publish(self.physical_map())
            except BaseException as exc:  # the slots still hold the evicted bytes: route them back there
                for m in b.evict:
                    self.rows.release(m.expert)
                self.table.apply_loads(SlotPlan((), b.evict))
                self._republish(ops, exc)
                raise
            self._snapshot = self._take_snapshot()
        # From here the evictions are committed; a failing load copy changes no table entry (its
        # target slots are free and unrouted).
        for m in b.load:
            ops.to_slot(self.rows.row_of(m.expert), m.slot)
        ops.wait()
        self.table.apply_loads(SlotPlan((), b.load))
        if b.load:
            try:
                ops.publish(self.physical_map())
                ops.wait()
            except BaseException as exc:  # the promoted experts still own their host rows and bytes
                self.table.apply_evictions(SlotPlan(b.load, ()))
                self._republish(ops, exc)
                raise
        for m in b.load:
            self.rows.release(m.expert)
        self._snapshot = self._take_snapshot()

    def _republish(self, ops: ExchangeOps, cause: BaseException) -> None:
        """Publish the (restored) consistent map; if that fails too the device may route to rows
        the tables call free, so the layer is marked damaged until ``repair`` succeeds."""
        self._snapshot = self._take_snapshot()
        try:
            ops.publish(self.physical_map())
            ops.wait()
        except BaseException as again:  # noqa: BLE001 - the original failure is what propagates
            self.damaged = (f"layer {self.rows.layer}: routing table not re-published after a failed exchange "
                            f"({type(cause).__name__}: {cause}; re-publish: {type(again).__name__}: {again})")

    def check(self) -> list[str]:
        """Every invariant of this layer (empty when all hold): host-row ownership against the slot
        table, every row owned or spare exactly once, and no unrepaired routing-table damage."""
        problems = self.rows.check(set(self.table.resident()))
        if self.damaged is not None:
            problems.append(self.damaged)
        return problems

    def repair(self, ops: ExchangeOps) -> list[str]:
        """Heal what can be healed without the weights: rows neither owned nor spare go back to the
        spare pool (they hold no expert anybody routes to) and the map is published again. Returns
        the problems left (an expert with neither a slot nor a row cannot be healed here)."""
        self.rows.reclaim_spares()
        try:
            ops.publish(self.physical_map())
            ops.wait()
            self.damaged = None
        except Exception as exc:  # noqa: BLE001 - reported, the layer stays damaged
            self.damaged = f"layer {self.rows.layer}: repair could not publish the routing table: {type(exc).__name__}: {exc}"
        self._snapshot = self._take_snapshot()
        return self.check()


__all__ = ["Batch", "ComplementLayer", "ExchangeCounters", "ExchangeOps", "HostRowError", "SlotError", "plan_batches"]
