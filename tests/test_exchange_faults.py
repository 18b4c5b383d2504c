"""Issue 31 point 3, on the real classes: a failure anywhere inside a RAM-complement exchange batch
keeps the layer's spares and bookkeeping intact, a later swap works, and a layer whose routing table
could not be re-published is reported broken until ``repair`` heals it.

Faults are injected with the server's own hook (``swap_repair.ExchangeFault`` on ``ExpertBank.ops_hook``,
what ``REAP_FAULT_FILE`` arms in a worker); the real-server half is ``test_exchange_faults_server.py``.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from reap_swap.server_ext.bank.bank import ComplementSpec, ExpertBank, PlainBacking
from reap_swap.server_ext.control.errors import HTTPError
from reap_swap.server_ext.swap_repair import EXCHANGE_OPS, ExchangeFault, InjectedFault

E, S, K = 10, 4, 2


def make() -> tuple[ExpertBank, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    originals = {"w13_weight": torch.randn(E, 6, 4, generator=gen), "w2_weight": torch.randn(E, 4, 3, generator=gen)}
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in originals.items()}
    bank = ExpertBank(0, params, torch.zeros(E, dtype=torch.int32), S, PlainBacking(torch.device("cpu")), ComplementSpec(K, (0, 1)))
    return bank, originals


def routed_ok(bank: ExpertBank, orig: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(bank.params[n].data[bank.phys_map.long()], t) for n, t in orig.items())


def calls_of(op: str) -> int:
    """How often ``op`` runs in the 4-expert swap below (2 spares: two batches)."""
    return {"to_host": 4, "to_slot": 4, "wait": 6, "publish": 4}[op]


@pytest.mark.parametrize("op,after", [(op, n) for op in EXCHANGE_OPS for n in range(calls_of(op))])
def test_a_failure_anywhere_in_an_exchange_keeps_spares_and_bookkeeping(op: str, after: int) -> None:
    bank, orig = make()
    bank.swap((0, 1, 2, 3))
    assert bank.complement is not None and bank.complement.rows.spare_count == K
    bank.ops_hook = ExchangeFault(bank, op, after, 1)
    with pytest.raises(InjectedFault):
        bank.swap((4, 5, 6, 7))  # 4 evictions with 2 spares: two batches
    assert bank.ops_hook is None  # spent
    # every host row is owned or spare: a batch that stopped after its evictions leaves free slots
    # instead of spares (rows = E - S + K), never fewer of both
    assert bank.complement.rows.spare_count == K - len(bank.table.free_slots()), "a failed batch lost spare rows"
    assert bank.check() == [] and bank.verify() == []
    assert routed_ok(bank, orig)  # the published map routes every expert to its bytes
    bank.swap((4, 5, 6, 7))  # a later swap works (no "exchange cannot progress")
    assert bank.resident() == (4, 5, 6, 7) and bank.check() == [] and routed_ok(bank, orig)


def test_failed_republish_marks_the_layer_damaged_until_repaired() -> None:
    bank, orig = make()
    bank.swap((0, 1, 2, 3))
    bank.ops_hook = ExchangeFault(bank, "publish", 0, 3)  # the publish, its re-publish, the first repair
    with pytest.raises(InjectedFault):
        bank.swap((4, 5, 6, 7))
    assert any("not re-published" in p for p in bank.check())
    assert bank.repair() != []  # the repair's own publish fails: still damaged
    assert bank.repair() == [] and bank.check() == []
    assert routed_ok(bank, orig)
    bank.swap((4, 5, 6, 7))
    assert bank.check() == [] and routed_ok(bank, orig)


def test_lost_spares_are_reported_and_reclaimed_by_repair() -> None:
    """The state the old code left (spares popped, never given back) is seen by ``check`` and healed."""
    bank, orig = make()
    bank.swap((0, 1, 2, 3))
    rows = bank.complement.rows  # type: ignore[union-attr]
    lost = [rows.take_spare() for _ in range(K)]
    assert lost and any("neither owned nor spare" in p for p in bank.check())
    assert bank.repair() == [] and rows.spare_count == K
    bank.swap((4, 5, 6, 7))
    assert bank.check() == [] and routed_ok(bank, orig)


def test_repeated_faults_never_drain_the_pool() -> None:
    bank, orig = make()
    for i, op in zip(range(24), itertools.cycle(EXCHANGE_OPS)):
        bank.ops_hook = ExchangeFault(bank, op, i % 3, 1)
        try:
            bank.swap(((4, 5, 6, 7), (0, 1, 2, 3), (2, 5, 8, 9))[i % 3])
        except InjectedFault:
            pass
        bank.ops_hook = None
        assert bank.complement.rows.spare_count == K - len(bank.table.free_slots()) and bank.check() == [] and routed_ok(bank, orig)  # type: ignore[union-attr]


def test_control_plane_reports_a_broken_layer_until_the_repair_succeeds(tmp_path: Path) -> None:
    """Several ranks (a fault one CPU cannot cause): rank 1 reports a broken layer; the plane says
    inconsistent, naming it, answers swaps 503 while the repair fails, and is consistent once it works."""
    from tests.test_hardening import FakeRanks, _plane

    class Broken(FakeRanks):
        def __init__(self) -> None:
            super().__init__(2)
            self.problems = {"layer_1": ["rows are neither owned nor spare exactly once"]}
            self.repairs_failing = 1

        async def __call__(self, method: str, *args: Any) -> list[Any]:
            if method == "reap_repair":
                self.calls.append((method, args))
                if self.repairs_failing:
                    self.repairs_failing -= 1
                else:
                    self.problems = {}
                return [{"rank": r, "problems": self.problems if r == 1 else {}} for r in range(2)]
            out = await super().__call__(method, *args)
            if method == "reap_resident_sets":
                out[1]["problems"] = self.problems
            return out

    ranks = Broken()
    plane = _plane(tmp_path, ranks)
    assert not asyncio.run(plane.resync())  # ranks agree on the sets, but rank 1's layer 1 is broken and the repair failed
    st = plane.resident_summary()
    assert st["consistent"] is False and "layer_1" in st["inconsistent_reason"] and "rank 1" in st["inconsistent_reason"]
    last = st["last_resync"]  # what the repair saw, read by read
    assert last["consistent"] is False and [r["broken_ranks"] for r in last["reads"]] == [["rank 1"], ["rank 1"]]
    assert len(set(st["rank_signatures"])) == 1  # the sets agree; the broken bookkeeping is what keeps it inconsistent
    payload = {"request_id": "r", "phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3, 4]}}
    with pytest.raises(HTTPError) as err:  # the next swap resyncs first: the repair fails once more, so 503
        ranks.repairs_failing = 1
        asyncio.run(plane.swap(payload))
    assert err.value.status == 503 and err.value.code == "resident_state_inconsistent"
    assert asyncio.run(plane.swap(payload))["status"] == "ok"  # this time the repair works, then the swap runs
    assert plane.resident_summary()["consistent"] is True
    assert [m for m, _ in ranks.calls].count("reap_repair") == 3
