"""The online cache in RAM-complement mode (``server_ext/cache/online_cache.py`` with ``host_rows``), on CPU tensors:
the host bank holds only non-resident experts plus spares, so every eviction writes the victim's
slot into a spare row and the promoted expert's old row becomes a spare (rotation, no host memcpy).
Thousands of random steps keep one home per expert with its bytes behind it, the policy is
exactly the full-copy cache's, and the Triton copies (interpreted) equal the torch reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from reap_swap.server_ext.bank.host_rows import complement_owners
from reap_swap.server_ext.cache.online_cache import CacheParams, LayerCache, check_bijection
from reap_swap.server_ext.cache.promote import copy_rows, copy_rows_triton, exchange_rows_reference, exchange_rows_triton
from tests.test_online_cache import Layer, _adversarial_ids

GARBAGE = 0x5A


class RamLayer(Layer):
    """``Layer`` with a complement host bank: rows [H, H + R), R = E - S + spares; spare rows hold garbage."""

    def __init__(self, e: int, s: int, spares: int, pad: int = 1, cap: int = 2, hysteresis: float | None = None, decay: float = 0.9,
                 start: tuple[int, ...] = (), protected: tuple[int, ...] = ()):
        self.e, self.s, self.h, self.spares = e, s, s + pad, spares
        self.r = e - s + spares
        gen = torch.Generator().manual_seed(e * 100 + s)
        self.orig = {"w13": torch.randn(e, 6, 4, generator=gen), "w2": torch.randint(0, 255, (e, 5), generator=gen, dtype=torch.uint8)}
        row_owners = complement_owners(e, set(start), self.r)
        self.rows = []
        for t in self.orig.values():
            bank = torch.zeros((self.h + self.r, *t.shape[1:]), dtype=t.dtype)
            bank.view(torch.uint8).fill_(GARBAGE)
            for row, x in enumerate(row_owners):
                if x >= 0:
                    bank[self.h + row] = t[x]
            for slot, x in enumerate(start):
                bank[slot] = t[x]
            self.rows.append(bank)
        self.phys_map = torch.zeros(e, dtype=torch.int32)
        for row, x in enumerate(row_owners):
            if x >= 0:
                self.phys_map[x] = self.h + row
        owners = [-1] * s
        for slot, x in enumerate(start):
            owners[slot] = x
            self.phys_map[x] = slot
        self.cache = LayerCache(e, s, self.h, self.phys_map, CacheParams(cap, decay, hysteresis), host_rows=self.r)
        self.cache.install(owners, prior=(), protected=protected, row_owners=row_owners)

    def check(self) -> None:
        owners, rows = self.cache.expert_in_slot.tolist(), self.cache.read_row_owners()
        assert check_bijection(owners, self.phys_map.tolist(), self.h, rows) == []
        for x in range(self.e):
            at = int(self.phys_map[x])
            for bank, t in zip(self.rows, self.orig.values()):
                assert torch.equal(bank[at], t[x]), f"expert {x}'s bytes are not at row {at}"
        assert rows.count(-1) >= self.spares, "the spare pool never shrinks below its start count"


def test_an_eviction_rotates_rows_by_hand() -> None:
    lay = RamLayer(6, 2, spares=1, cap=1, start=(0, 1))  # host rows 0..4 hold 2, 3, 4, 5, spare 4
    assert lay.cache.read_row_owners() == [2, 3, 4, 5, -1]
    lay.step([[3]])  # 3 (row 1) replaces 0 (score 0): 0 goes to the spare row 4, row 1 is the new spare
    assert lay.resident() == {1, 3} and lay.cache.read_row_owners() == [2, -1, 4, 5, 0]
    assert int(lay.phys_map[0]) == lay.h + 4 and int(lay.phys_map[3]) == 0
    lay.check()
    lay.step([[5]])  # 5 (row 3) replaces 1: 1 goes to row 1 (the spare), row 3 is spare from now on
    assert lay.resident() == {3, 5} and lay.cache.read_row_owners() == [2, 1, 4, -1, 0]
    lay.check()
    assert lay.cache.counters() == {"promotions": 2, "evictions": 2, "steps": 2}


def test_a_step_never_writes_a_row_it_frees_nor_copies_host_to_host() -> None:
    calls: list[tuple[Any, ...]] = []

    def spy(rows: Any, valid: torch.Tensor, src: torch.Tensor, src_off: int, dst: torch.Tensor, dst_off: int) -> None:
        calls.append((valid.clone(), src.clone(), src_off, dst.clone(), dst_off))
        copy_rows(rows, valid, src, src_off, dst, dst_off)

    rng = np.random.default_rng(3)
    lay = RamLayer(16, 6, spares=3, cap=3, start=(0, 1, 2, 3, 4, 5))
    for _ in range(300):
        calls.clear()
        spare_before = {r for r, x in enumerate(lay.cache.read_row_owners()) if x < 0}
        ids = torch.tensor([[int(x) for x in rng.permutation(16)[:4]] for _ in range(2)], dtype=torch.int32)
        lay.cache.step(ids, lay.rows, None, None, copy=spy)
        (ev_valid, _, ev_src_off, ev_dst, ev_dst_off), (pr_valid, pr_src, pr_src_off, _, pr_dst_off) = calls
        assert (ev_src_off, ev_dst_off, pr_src_off, pr_dst_off) == (0, lay.h, lay.h, 0), "slot -> host, then host -> slot"
        written = {int(r) for r, ok in zip(ev_dst, ev_valid) if ok}
        read = {int(r) for r, ok in zip(pr_src, pr_valid) if ok}
        assert written <= spare_before and not written & read, "victims land in rows spare before the step, never a row it frees"
    lay.check()
    assert int(lay.cache.evictions) > 100


@pytest.mark.parametrize("cap,hyst,spares", [(1, None, 1), (3, None, 3), (2, 0.5, 5)])
def test_random_steps_keep_one_home_per_expert_with_its_bytes(cap: int, hyst: float | None, spares: int) -> None:
    rng = np.random.default_rng(cap + 10 * spares)
    e, s, k = 16, 5, 4
    protected = (2,)
    lay = RamLayer(e, s, spares, pad=3, cap=cap, hysteresis=hyst, start=(2, 9, 4, 7, 11), protected=protected)
    for step in range(2000):
        t = int(rng.integers(1, 4))
        ids = _adversarial_ids(rng, lay, t, k)
        valid = int(rng.integers(1, t + 1))
        before = lay.resident()
        hits, out, _ = lay.step(ids, valid_rows=valid)
        routed = {x for row in ids[:valid] for x in row}
        assert not (before - lay.resident()) & routed, f"step {step}: evicted an expert this step routes"
        lay.gathered(out, torch.tensor(ids))
        if step % 97 == 0:
            lay.check()
    lay.check()
    assert 2 in lay.resident() and int(lay.cache.evictions) > 200


def test_the_policy_is_the_full_copy_caches() -> None:
    """Same hits, promotions, evictions and resident sets step by step: complement only changes where victims live."""
    rng = np.random.default_rng(7)
    start = (1, 4, 6, 8)
    full, ram = Layer(20, 4, cap=2, start=start), RamLayer(20, 4, spares=2, cap=2, start=start)
    for step in range(1500):
        ids = [[int(x) for x in rng.permutation(12)[:3]] for _ in range(int(rng.integers(1, 4)))]
        ha, oa, ta = full.step(ids)
        hb, ob, tb = ram.step(ids)
        assert torch.equal(ha, hb) and torch.equal(ta, tb) and full.resident() == ram.resident(), f"step {step}"
        assert torch.equal(full.cache.expert_in_slot, ram.cache.expert_in_slot) and torch.equal(full.cache.score, ram.cache.score)
        ram.gathered(ob, torch.tensor(ids))
    assert full.cache.counters() == ram.cache.counters()
    ram.check()


def test_triton_copies_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rng = np.random.default_rng(5)
    a, b = RamLayer(12, 4, spares=2, cap=2, start=(0, 1, 2, 3)), RamLayer(12, 4, spares=2, cap=2, start=(0, 1, 2, 3))
    for _ in range(30):
        ids = torch.tensor([[int(x) for x in rng.permutation(12)[:3]] for _ in range(2)], dtype=torch.int32)
        a.cache.step(ids, a.rows, None, None)
        b.cache.step(ids, b.rows, None, None, copy=lambda *args: copy_rows_triton(*args, block=16))
    for ra, rb in zip(a.rows, b.rows):
        assert torch.equal(ra, rb)
    b.check()
    assert int(b.cache.evictions) > 5


def test_bad_complement_setups_are_refused() -> None:
    pm = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="host rows"):
        LayerCache(8, 3, 3, pm, CacheParams(2), host_rows=5)  # the 5 non-residents and no spare
    cache = LayerCache(8, 3, 3, pm, CacheParams(2), host_rows=7)
    with pytest.raises(ValueError, match="owners of all 7 host rows"):
        cache.install([0, 1, 2])


def test_fused_exchange_kernel_equals_the_two_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-launch exchange (Triton, interpreted) leaves every byte as evictions-then-promotions does,
    a free-slot pair (no victim) included, and pairs not taken untouched."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    h, r = 6, 7
    gen = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        rows = [torch.randint(0, 255, (h + r, 3, 7), generator=gen).to(dtype), torch.randint(0, 255, (h + r, 2, 4099), generator=gen).to(dtype)]
        want = [t.clone() for t in rows]
        valid = torch.tensor([True, True, False, True])
        evict = torch.tensor([True, False, False, True])
        src = torch.tensor([1, 4, 0, 6])  # host rows read (the candidates')
        slot = torch.tensor([2, 5, 2, 0])  # pair 1 fills a free slot; pair 2 is not taken
        dst = torch.tensor([0, -1, -1, 3])  # spare rows the victims go to
        exchange_rows_reference(want, h, valid, evict, src, slot, dst)
        exchange_rows_triton(rows, h, valid, evict, src, slot, dst, block=1024)
        for a, b in zip(rows, want):
            assert torch.equal(a, b), dtype


def test_steps_with_the_fused_exchange_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import reap_swap.server_ext.cache.online_cache as oc

    rng = np.random.default_rng(9)
    a, b = RamLayer(12, 4, spares=2, cap=2, start=(0, 1, 2, 3)), RamLayer(12, 4, spares=2, cap=2, start=(0, 1, 2, 3))
    fused_calls = []

    def fused(*args: Any) -> None:
        fused_calls.append(1)
        exchange_rows_triton(*args, block=16)

    for _ in range(30):
        ids = torch.tensor([[int(x) for x in rng.permutation(12)[:3]] for _ in range(2)], dtype=torch.int32)
        a.cache.step(ids, a.rows, None, None)  # CPU default: the two reference copies
        with monkeypatch.context() as m:
            m.setattr(oc, "exchange_rows", fused)  # what CUDA runs
            b.cache.step(ids, b.rows, None, None)
    for ra, rb in zip(a.rows, b.rows):
        assert torch.equal(ra, rb)
    b.check()
    assert len(fused_calls) == 30 and int(b.cache.evictions) > 5


def test_the_control_plane_adopts_the_caches_rows_and_counts_its_exchanges() -> None:
    from reap_swap.server_ext.bank.exchange import ComplementLayer
    from reap_swap.server_ext.bank.host_rows import HostRowError, LayerHostRows
    from reap_swap.server_ext.bank.slots import SlotTable

    table = SlotTable(6, 2, 2)
    table.assign([0, 1])
    comp = ComplementLayer(table, LayerHostRows(0, 6, 5, (10,), complement_owners(6, {0, 1}, 5)), 2)
    table.assign([3, 1])  # the cache promoted 3 over 0; 0 went to the spare row 4, 3's row 1 is spare now
    comp.adopt_rows([2, -1, 4, 5, 0], cache_evictions=1, cache_promotions=1)
    assert comp.where(0) == (-1, 4) and comp.where(3) == (0, -1)
    c = comp.counters.as_dict()
    assert (c["exchanges"], c["rotated_blocks"], c["d2h_bytes"], c["h2d_bytes"], c["memcpy_bytes_avoided"]) == (1, 1, 10, 10, 10)
    comp.adopt_rows([2, -1, 4, 5, 0], cache_evictions=1, cache_promotions=1)  # read back again: nothing new
    assert comp.counters.exchanges == 1
    comp.adopt_rows([2, -1, 4, 5, 0], cache_evictions=0, cache_promotions=0)  # the device counters were reset
    comp.adopt_rows([2, -1, 4, 5, 0], cache_evictions=2, cache_promotions=3)
    assert comp.counters.exchanges == 3 and comp.counters.h2d_bytes == 40, "counted from the reset on; free-slot loads are h2d only"
    with pytest.raises(HostRowError, match="disagree"):
        comp.adopt_rows([2, 3, 4, 5, 0], cache_evictions=2, cache_promotions=3)  # 3 is in a slot and would own a row
    assert comp.where(3) == (0, -1), "a refused read-back changes nothing"
    assert check_bijection([3, 1], [6, 1, 2, 0, 4, 5], 2, [2, -1, 4, 5, 0]) == []
    assert any("outside" in x for x in check_bijection([3, 1], [6, 1, 2, 0, 4, 5], 2, [2, 9, 4, 5, 0])), "row owners out of range are reported"
