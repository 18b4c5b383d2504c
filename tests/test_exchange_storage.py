"""RAM-complement storage without CUDA (in the spirit of Strata's exchange_storage_test).

Three layers of different block sizes live in one host byte array; thousands
of random exchanges must keep every expert's bytes, pair each host row with
exactly one owner, publish a route only after its bytes landed, refuse bad
handles before changing anything, count exactly, and show a concurrent
reader only consistent (slot, host row) pairs.
"""

from __future__ import annotations

import random
import threading

import pytest

from reap_swap.server_ext.bank.exchange import ComplementLayer, ExchangeCounters, plan_batches
from reap_swap.server_ext.bank.host_rows import HostRegions, HostRowError, LayerHostRows, SpareRow, complement_owners
from reap_swap.server_ext.bank.slots import SlotError, SlotMove, SlotPlan, SlotTable

# layer -> (experts, slots, spares, block sizes per parameter)
LAYERS = {0: (12, 5, 1, (48, 16)), 1: (16, 6, 2, (96,)), 2: (10, 4, 3, (24, 8, 8))}


def content(layer: int, expert: int, nbytes: int) -> bytes:
    return random.Random(layer * 1000 + expert).randbytes(nbytes)


class ByteOps:
    """Slot rows and this layer's window of the shared host array; checks publication order."""

    def __init__(self, layer: int, host: bytearray, base: int, block: int, slots: int, experts: int):
        self.layer, self.host, self.base, self.block, self.experts = layer, host, base, block, experts
        self.slots = bytearray(slots * block)
        self.offset = slots
        self.published: list[int] = []
        self.d2h = self.h2d = self.host_copies = 0

    def _host(self, row: int) -> slice:
        return slice(self.base + row * self.block, self.base + (row + 1) * self.block)

    def _slot(self, slot: int) -> slice:
        return slice(slot * self.block, (slot + 1) * self.block)

    def read(self, phys: int) -> bytes:
        return bytes(self.slots[self._slot(phys)] if phys < self.offset else self.host[self._host(phys - self.offset)])

    def to_host(self, slot: int, row: int) -> None:
        assert self.offset + row not in self.published, "D2H into a row the kernel still reads"
        self.host[self._host(row)] = self.slots[self._slot(slot)]
        self.d2h += self.block

    def to_slot(self, row: int, slot: int) -> None:
        assert slot not in self.published, "H2D into a slot the kernel still reads"
        self.slots[self._slot(slot)] = self.host[self._host(row)]
        self.h2d += self.block

    def wait(self) -> None:
        pass

    def publish(self, physical_map: list[int]) -> None:
        assert len(set(physical_map)) == len(physical_map), "two experts routed to one row"
        for e, phys in enumerate(physical_map):  # a route goes live only once its bytes are there
            assert self.read(phys) == content(self.layer, e, self.block), f"expert {e} routed before its bytes landed"
        self.published = list(physical_map)


def build(start: dict[int, tuple[int, ...]] | None = None) -> tuple[bytearray, HostRegions, dict[int, ComplementLayer], dict[int, ByteOps]]:
    regions = HostRegions()
    sizes = {i: sum(b) * (e - s + k) for i, (e, s, k, b) in LAYERS.items()}
    host = bytearray(sum(sizes.values()))
    layers, ops, base = {}, {}, 0
    for i, (e, s, k, block) in LAYERS.items():
        regions.register(i, block, [(base, sizes[i])], k)
        op = ByteOps(i, host, base, sum(block), s, e)
        table = SlotTable(e, s)
        resident = (start or {}).get(i, tuple(range(s)))
        for slot, ex in enumerate(resident):
            table.apply_loads(SlotPlan((), (SlotMove(ex, slot),)))
            op.slots[op._slot(slot)] = content(i, ex, op.block)
        owners = complement_owners(e, resident, e - s + k)
        for row, ex in enumerate(owners):
            if ex >= 0:
                host[op._host(row)] = content(i, ex, op.block)
        layers[i] = ComplementLayer(table, LayerHostRows(i, e, e - s + k, block, owners), s)
        op.publish(layers[i].physical_map())
        ops[i] = op
        base += sizes[i]
    regions.freeze()
    return host, regions, layers, ops


def consistent(snap: tuple[tuple[int, int], ...]) -> bool:
    slots = [s for s, r in snap if s >= 0]
    rows = [r for s, r in snap if r >= 0]
    return all((s >= 0) != (r >= 0) for s, r in snap) and len(set(slots)) == len(slots) and len(set(rows)) == len(rows)


def test_thousands_of_random_exchanges_keep_bytes_owners_and_counters() -> None:
    host, regions, layers, ops = build()
    assert regions.spares_by_size() == {40: 3, 64: 1, 96: 2}
    stop = threading.Event()
    bad: list[tuple] = []
    reads = [0]

    def reader() -> None:
        while not stop.is_set():
            for layer in layers.values():
                snap = layer.snapshot()
                if not consistent(snap):
                    bad.append(snap)
                reads[0] += 1

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    rng = random.Random(7)
    total_pairs = 0
    try:
        for step in range(2400):
            i = rng.choice(list(LAYERS))
            e, s, k, block = LAYERS[i]
            layer, op = layers[i], ops[i]
            target = rng.sample(range(e), rng.randint(0, s))
            before = layer.counters.as_dict()
            d2h0, h2d0 = op.d2h, op.h2d
            plan, delta = layer.exchange(target, op)
            resident = set(layer.table.resident())
            assert set(target) <= resident and len(resident) >= layer.min_residents
            assert layer.rows.check(resident) == []
            assert layer.rows.spare_count == layer.rows.num_rows - (e - len(resident))
            for ex in range(e):  # what the kernel reads through the published map
                assert op.read(op.published[ex]) == content(i, ex, op.block)
            assert op.published == layer.physical_map()
            assert delta.d2h_bytes == op.d2h - d2h0 == len(plan.evict) * op.block
            assert delta.h2d_bytes == op.h2d - h2d0 == len(plan.load) * op.block
            assert delta.rotated_blocks == delta.exchanges <= min(len(plan.evict), len(plan.load))
            assert delta.memcpy_bytes_avoided == delta.exchanges * op.block
            after = layer.counters.as_dict()
            assert all(after[key] - before[key] == v for key, v in delta.as_dict().items())
            total_pairs += delta.exchanges
    finally:
        stop.set()
        t.join()
    assert not bad and reads[0] > 0
    assert total_pairs >= 2000  # thousands of exchanges, none by host memcpy


def test_spare_of_another_layer_or_size_is_refused_and_changes_nothing() -> None:
    _, _, layers, _ = build()
    a, b = layers[0], layers[1]
    owners_before = a.rows.owners()
    foreign = b.rows.take_spare()
    with pytest.raises(HostRowError, match="layer 1 offered to layer 0"):
        a.rows.adopt(0, foreign)
    wrong_size = SpareRow(0, (96,), a.rows.spares()[0])
    with pytest.raises(HostRowError, match="block size"):
        a.rows.adopt(0, wrong_size)
    owned = SpareRow(0, a.rows.block, 0)  # row 0 belongs to a non-resident expert
    with pytest.raises(HostRowError, match="owned by expert"):
        a.rows.adopt(0, owned)
    with pytest.raises(HostRowError, match="owns no host row"):
        a.rows.release(0)  # expert 0 is resident
    with pytest.raises(HostRowError, match="already owns"):
        a.rows.adopt(7, a.rows.take_spare())  # expert 7 is not resident: it has a row
    assert a.rows.owners() == owners_before
    b.rows.give_back(foreign)
    with pytest.raises(HostRowError, match="already spare"):
        b.rows.give_back(foreign)


def test_overlapping_regions_and_growing_a_live_pool_are_refused() -> None:
    regions = HostRegions()
    regions.register(0, (64,), [(0, 640)], 2)
    with pytest.raises(HostRowError, match="overlap"):
        regions.register(1, (64,), [(2000, 64), (600, 640)], 2)
    with pytest.raises(HostRowError, match="overlap"):  # two parameters of one layer
        regions.register(1, (64,), [(3000, 64), (3032, 64)], 2)
    with pytest.raises(HostRowError, match="already registered"):
        regions.register(0, (64,), [(1000, 64)], 1)
    regions.register(1, (16, 16), [(640, 160), (800, 160)], 1)
    regions.freeze()
    with pytest.raises(HostRowError, match="growing"):
        regions.register(2, (64,), [(5000, 64)], 1)
    assert regions.spares_by_size() == {32: 1, 64: 2}
    assert regions.spare_bytes() == 64 * 2 + 32 and regions.host_bytes() == 960


def test_bad_targets_and_no_spares_are_refused_before_any_change() -> None:
    _, _, layers, ops = build()
    layer, op = layers[0], ops[0]
    snap, published = layer.snapshot(), list(op.published)
    with pytest.raises(SlotError):
        layer.exchange([99], op)
    with pytest.raises(SlotError):
        layer.exchange(list(range(6)), op)
    assert layer.snapshot() == snap and op.published == published
    full = SlotPlan(tuple(SlotMove(e, e) for e in range(3)), tuple(SlotMove(e + 5, e) for e in range(3)))
    with pytest.raises(HostRowError, match="cannot progress"):
        plan_batches(full, set(), 0)
    batches = plan_batches(full, set(), 1)  # one spare: one pair at a time
    assert [(len(b.evict), len(b.load)) for b in batches] == [(1, 1)] * 3


def test_small_targets_are_padded_so_non_residents_fit_the_rows() -> None:
    _, _, layers, ops = build()
    layer, op = layers[1], ops[1]  # 16 experts, 6 slots, 2 spares -> >= 4 resident
    plan, delta = layer.exchange([9], op)
    assert len(layer.table.resident()) == 4 and 9 in layer.table.resident()
    assert set(layer.table.resident()) - {9} <= {0, 1, 2, 3, 4, 5}  # kept from the previous residents
    assert delta.rounds == 1 and ExchangeCounters(**delta.as_dict()) == delta
    assert layer.rows.spare_count == 0 + (layer.rows.num_rows - 12)


def test_initial_owners_must_fit() -> None:
    with pytest.raises(HostRowError, match="do not fit"):
        complement_owners(8, (0,), 5)
    with pytest.raises(HostRowError, match="owns rows"):
        LayerHostRows(0, 4, 3, (8,), [1, 1, -1])
