"""Router-miss ledger and request-id matching (pure)."""

from __future__ import annotations

import numpy as np
import pytest

from reap_swap.server_ext.step.misses import ALL_REQUESTS, MissLedger, client_request_id, engine_id_matches


@pytest.mark.parametrize(
    "engine_id, client_id",
    [
        ("cmpl-abc-0-1a2b3c4d", "abc"),
        ("chatcmpl-abc-1a2b3c4d", "abc"),
        ("abc", "abc"),
        ("cmpl-my-req-7-3-deadbeef", "my-req-7"),
    ],
)
def test_engine_ids_map_back_to_client_ids(engine_id: str, client_id: str) -> None:
    assert engine_id_matches(engine_id, client_id)
    assert client_request_id(engine_id) == client_id


@pytest.mark.parametrize(
    "engine_id, client_id",
    [("cmpl-abcd-0-1a2b3c4d", "abc"), ("cmpl-xabc-1a2b3c4d", "abc"), ("chatcmpl-abc-1-1a2b3c4d", "abc"), ("cmpl-abc", "abc")],
)
def test_no_false_matches(engine_id: str, client_id: str) -> None:
    assert not engine_id_matches(engine_id, client_id)


def step(ledger: MissLedger, ids: list[str], tokens: list[int], obs: float, ina: float) -> None:
    L, R, E = len(ledger.layer_ids), len(ids), ledger.num_experts
    hits = np.ones((L, R, E), np.int64)
    miss = np.zeros((L, R, E), np.int64)
    miss[:, :, 1] = 1
    ledger.record_step(ids, np.array(tokens), np.full((L, R), obs), np.full((L, R), ina), hits, miss)


def test_accumulates_across_steps_and_reports_seed_shape() -> None:
    ledger = MissLedger([0, 3], num_experts=4)
    step(ledger, ["cmpl-a-0-11111111", "cmpl-b-0-22222222"], [5, 2], obs=2.0, ina=0.5)
    step(ledger, ["cmpl-a-0-11111111"], [1], obs=1.0, ina=1.0)
    rep = ledger.report("a")
    assert rep is not None
    layer = rep["by_layer"]["layer_3"]
    assert layer["observed_mass"] == 3.0 and layer["inactive_mass"] == 1.5
    assert layer["inactive_experts"] == [1]
    assert rep["summary"]["inactive_ratio"] == pytest.approx(0.5)
    assert rep["summary"]["tokens"] == 6
    total = ledger.report(ALL_REQUESTS)
    assert total is not None and total["summary"]["observed_mass_total"] == 2 * (2.0 + 2.0 + 1.0)
    assert ledger.report("nobody") is None


def test_reset_and_bounded_size() -> None:
    ledger = MissLedger([0], num_experts=2, max_requests=2)
    for rid in ("x", "y", "z"):
        step(ledger, [rid], [1], 1.0, 0.0)
    assert ledger.report("x") is None and ledger.evicted == 1
    assert ledger.reset("y") == 1 and ledger.report("y") is None
    assert ledger.reset(ALL_REQUESTS) == 1
    assert ledger.report(ALL_REQUESTS)["summary"]["observed_mass_total"] == 0.0


def test_stats_report_entries_and_their_bytes() -> None:
    """``worker.miss_ledger`` on /reap/status: an entry of a 48-layer x 128-expert model holds ~149 KB of arrays."""
    ledger = MissLedger(list(range(48)), num_experts=128, max_requests=3)
    per = 48 * 8 * 4 + 48 * 128 * 8 * 3  # observed, inactive, promoted, staged [L]; hits, miss_hits, expert_mass [L, E]
    assert ledger.stats() == {"entries": 0, "bytes": 0, "bytes_per_entry": per, "max_entries": 3, "evicted": 0}
    for rid in "abcd":
        step(ledger, [rid], [1], 1.0, 0.0)
    assert ledger.stats() == {"entries": 3, "bytes": 3 * per, "bytes_per_entry": per, "max_entries": 3, "evicted": 1}
    assert per == 148_992 and ledger.collect("b").nbytes == per
    ledger.reset("b")
    assert ledger.stats()["entries"] == 2 and ledger.stats()["bytes"] == 2 * per
