"""The online cache around the device core: settings and ``serve`` flags, per-request promotion
accounting, and a control plane that reads the device's resident sets back before it swaps
and reports (pure logic; the real engine is in ``test_online_cache_e2e.py``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from reap_swap.server_ext import config as reap_config
from reap_swap.server_ext.step.accounting import RoutingAccounting, accumulate_promotions
from reap_swap.server_ext.step.arena import new_arena
from reap_swap.server_ext.step.capture import StepLayout
from reap_swap.server_ext.control.control_plane import ControlPlane
from reap_swap.server_ext.launcher import build_parser, plan_env
from reap_swap.server_ext.step.misses import MissLedger
from reap_swap.server_ext.bank.slots import SlotError, SlotTable
from tests.conftest import tiny_plan_dict


def test_env_knobs_and_refusals() -> None:
    off = reap_config.from_env({})
    assert off.online_cache is None and off.cache_cap == reap_config.DEFAULT_CACHE_CAP and off.cache_hysteresis is None
    on = reap_config.from_env({"REAP_ONLINE_CACHE": "LFRU", "REAP_ONLINE_CACHE_CAP": "3", "REAP_ONLINE_CACHE_DECAY": "0.8",
                               "REAP_ONLINE_CACHE_HYSTERESIS": "0.5"})
    assert (on.online_cache, on.cache_cap, on.cache_decay, on.cache_hysteresis) == ("lfru", 3, 0.8, 0.5)
    assert reap_config.from_env({"REAP_ONLINE_CACHE": "off", "REAP_ONLINE_CACHE_HYSTERESIS": "none"}).online_cache is None
    for env, match in (
        ({"REAP_ONLINE_CACHE": "lru"}, "REAP_ONLINE_CACHE must be"),
        ({"REAP_ONLINE_CACHE": "lfru", "REAP_RAM_COMPLEMENT": "1", "REAP_COMPLEMENT_SPARES": "3"}, r"REAP_COMPLEMENT_SPARES=3 \(--complement-spares\) is too few"),
        ({"REAP_ONLINE_CACHE_CAP": "0"}, "REAP_ONLINE_CACHE_CAP"),
        ({"REAP_ONLINE_CACHE_DECAY": "1"}, r"\(0, 1\)"),
        ({"REAP_ONLINE_CACHE_HYSTERESIS": "-1"}, "REAP_ONLINE_CACHE_HYSTERESIS"),
    ):
        with pytest.raises(reap_config.ResidencyConfigError, match=match):
            reap_config.from_env(env)


def _env(model: Path, *flags: str) -> dict[str, str]:
    args, _ = build_parser().parse_known_args(["--model", str(model), "--resident-experts-per-layer", "8", *flags])
    return plan_env(args)


def test_serve_flags(tiny_model_dir: Path) -> None:
    assert not any(k.startswith("REAP_ONLINE_CACHE") for k in _env(tiny_model_dir))
    env = _env(tiny_model_dir, "--online-cache", "lfru", "--online-cache-cap", "2", "--online-cache-hysteresis", "1")
    assert env["REAP_ONLINE_CACHE"] == "lfru" and env["REAP_ONLINE_CACHE_CAP"] == "2" and env["REAP_ONLINE_CACHE_HYSTERESIS"] == "1.0"
    with pytest.raises(ValueError, match="need --online-cache"):
        _env(tiny_model_dir, "--online-cache-cap", "2")
    both = _env(tiny_model_dir, "--online-cache", "lfru", "--ram-complement")  # composes: default spares >= default cap
    assert both["REAP_ONLINE_CACHE"] == "lfru" and both["REAP_RAM_COMPLEMENT"] == "1"
    assert reap_config.from_env({"REAP_ONLINE_CACHE": "lfru", "REAP_RAM_COMPLEMENT": "1"}).ram_complement
    with pytest.raises(ValueError, match="too few"):
        _env(tiny_model_dir, "--online-cache", "lfru", "--online-cache-cap", "6", "--ram-complement")
    with pytest.raises(ValueError, match="DECAY"):
        _env(tiny_model_dir, "--online-cache", "lfru", "--online-cache-decay", "1.5")


def test_slot_table_adopts_a_read_back_assignment() -> None:
    t = SlotTable(6, 3, 4)
    t.assign([4, -1, 0])
    assert t.resident() == (0, 4) and t.slot_of(4) == 0 and t.physical_map() == [2, 5, 6, 7, 0, 9] and t.free_slots() == {1}
    for bad in ([4, 4, 0], [6, -1, 0], [0, 1]):
        with pytest.raises(SlotError):
            t.assign(bad)
    assert t.owners() == [4, -1, 0], "a refused assignment changes nothing"


def test_promotions_are_booked_to_the_request_of_their_first_row() -> None:
    layers, cap, e = 3, 2, 8
    arena = new_arena(layers, 16, 2, e, 4, promo_cap=cap)
    ledger = MissLedger([0, 2], e, expert_bytes=1000)
    acct = RoutingAccounting(arena, [0, 2], ledger)
    arena.codes.zero_()
    arena.promo_rows.copy_(torch.tensor([[0, 4], [1, 1], [3, -1]], dtype=torch.int32))  # layer 1 has no bank: ignored
    acct.record_step(StepLayout(["a", "b"], [3, 2]))  # rows 0-2: a, rows 3-4: b
    arena.promo_rows.copy_(torch.tensor([[-1, -1], [0, 0], [0, 1]], dtype=torch.int32))
    acct.record_step(StepLayout(["b"], [2]))
    acct.flush()
    a, b = ledger.report("a"), ledger.report("b")
    assert a["by_layer"]["layer_0"]["promoted_experts"] == 1 and a["by_layer"]["layer_2"]["promoted_experts"] == 0
    assert b["by_layer"]["layer_0"]["promoted_experts"] == 1 and b["by_layer"]["layer_2"]["promoted_experts"] == 3
    assert a["summary"]["promotion_link_bytes"] == 1000 and b["summary"]["promoted_experts"] == 4
    # No pair missed here (codes zeroed): link bytes count missed pairs, promotions included in them.
    assert a["summary"]["link_bytes"] == a["summary"]["missed_pairs"] * 1000
    assert arena.promo_acc.abs().sum() == 0, "drained"
    acc = torch.zeros(2, layers)
    accumulate_promotions(torch.tensor([[5, 0], [0, 0], [0, 0]], dtype=torch.int32), torch.tensor([0]), torch.tensor([1, 0, 0, 0, 0, 0], dtype=torch.int32), 4, acc)
    assert acc.tolist() == [[0, 0, 0], [1, 0, 0]], "rows past the step's real rows are ignored"


def test_accounting_without_the_cache_books_zero_promotions() -> None:
    arena = new_arena(2, 8, 2, 4, 2)
    assert arena.promo_cap == 0 and arena.promo_acc.numel() == 0
    ledger = MissLedger([0, 1], 4)
    acct = RoutingAccounting(arena, [0, 1], ledger)
    acct.record_step(StepLayout(["x"], [2]))
    acct.flush()
    assert ledger.report("x")["summary"]["promoted_experts"] == 0


class MovingRanks:
    """One rank whose resident sets change between calls, as the online cache moves experts."""

    def __init__(self) -> None:
        self.resident = {i: [0, 1, 2, 3, 4] for i in range(4)}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def promote(self, layer: int, out: int, into: int) -> None:
        self.resident[layer] = sorted({*self.resident[layer]} - {out} | {into})

    def view(self) -> dict[str, list[int]]:
        return {f"layer_{i}": list(v) for i, v in self.resident.items()}

    async def __call__(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, args))
        if method == "reap_install":
            return [{"layers": [0, 1, 2, 3], "num_experts": 16, "slots": {f"layer_{i}": 8 for i in range(4)}, "expert_bytes": 10,
                     "resident": self.view(), "online_cache": {"enabled": True, "promotions": 0}}]
        if method == "reap_cache_view":
            return [{"rank": 0, "resident": self.view(), "online_cache": {"enabled": True, "promotions": len(self.calls)}}]
        if method == "reap_swap":
            self.resident = {int(k.removeprefix("layer_")): list(v) for k, v in args[0].items()}
            return [{"bytes_copied": 0, "experts_loaded": 1, "experts_evicted": 0, "copy_ms": 0.0, "publish_ms": 0.0,
                     "resident": self.view(), "online_cache": {"enabled": True, "promotions": -1}}]
        return [None]


def _plane(tmp_path: Path, ranks: MovingRanks, **env: str) -> ControlPlane:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(tiny_plan_dict()))
    plane = ControlPlane(reap_config.from_env({"REAP_PLAN_FILE": str(path), **env}), ranks)
    asyncio.run(plane.start())
    return plane


def test_control_plane_reads_the_device_back_before_a_swap_and_for_reports(tmp_path: Path) -> None:
    ranks = MovingRanks()
    plane = _plane(tmp_path, ranks, REAP_ONLINE_CACHE="lfru")
    ranks.promote(2, 4, 11)  # the cache moved layer 2 behind the plane's back
    asyncio.run(plane.read_back())
    assert plane.resident[2] == (0, 1, 2, 3, 11) and plane.status()["worker"]["online_cache"]["promotions"] > 0
    ranks.promote(3, 4, 12)
    out = asyncio.run(plane.swap({"request_id": "r", "phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3, 9]}}))
    sent = [a[0] for m, a in ranks.calls if m == "reap_swap"][-1]
    assert sent["layer_3"] == [0, 1, 2, 3, 12], "a layer the payload does not name keeps what the device holds now"
    assert sent["layer_0"] == [0, 1, 2, 3, 9] and out["delta"] == {"layer_0": {"added": [9], "removed": [4], "reused": 4}}
    assert plane.worker_info["online_cache"]["promotions"] == -1


def test_without_the_cache_nothing_is_read_back(tmp_path: Path) -> None:
    ranks = MovingRanks()
    plane = _plane(tmp_path, ranks)
    asyncio.run(plane.read_back())
    asyncio.run(plane.swap({"request_id": "r", "phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3, 9]}}))
    assert not any(m == "reap_cache_view" for m, _ in ranks.calls)


def test_bijection_checker_names_the_problem() -> None:
    from reap_swap.server_ext.cache.online_cache import check_bijection

    assert check_bijection([2, -1], [4, 5, 0], 4) == []
    assert any("two slots" in p for p in check_bijection([2, 2], [4, 5, 0], 4))
    assert any("table entry is 6" in p for p in check_bijection([1, -1], [4, 6, 0], 4))
    assert any("not resident" in p for p in check_bijection([-1, -1], [0, 5, 6], 4))
