"""A second server: every expert resident, control token required, eager mode."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.vllm_servers import PROMPTS, complete, log_dir_for, require_vllm, start_reap

pytestmark = pytest.mark.vllm
ALL = {f"layer_{i}": list(range(16)) for i in range(4)}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_vllm()
    srv = start_reap(
        tiny_model_dir, log_dir_for(tmp_path_factory), "--resident-experts-per-layer", "16",
        "--start-resident", json.dumps(ALL), "--control-token", "s3cret", "--enforce-eager", name="reap-all",
    )
    try:
        yield srv.url
    finally:
        srv.stop()


def test_zero_misses_when_everything_is_resident(server: str, tiny_model_dir: Path) -> None:
    complete(server, tiny_model_dir, PROMPTS[3], max_tokens=16, request_id="all-res")
    rep = httpx.get(server + "/router_misses/all-res", headers={"X-Reap-Control-Token": "s3cret"}).json()
    assert rep["summary"]["observed_mass_total"] > 0
    assert rep["summary"]["inactive_mass_total"] == 0.0 and rep["summary"]["missed_pairs"] == 0
    assert all(v["inactive_experts"] == [] for v in rep["by_layer"].values())


def test_control_token_is_required(server: str) -> None:
    body = {"request_id": "t", "phase": "prefill", "active_set": {"layer_0": list(range(8))}}
    r = httpx.post(server + "/swap_active_set", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_control_token"
    r = httpx.post(server + "/swap_active_set", json=body, headers={"X-Reap-Control-Token": "wrong"})
    assert r.status_code == 403
    st = httpx.get(server + "/reap/status", headers={"X-Reap-Control-Token": "s3cret"}).json()
    assert st["resident"]["by_layer"]["layer_0"] == list(range(16))
    # OpenAI routes are not behind the control token
    assert httpx.get(server + "/v1/models").status_code == 200


def test_synthetic_plan_has_no_core(server: str) -> None:
    h = {"X-Reap-Control-Token": "s3cret"}
    r = httpx.post(server + "/swap_active_set", headers=h, json={"request_id": "s", "phase": "prefill", "active_set": {"layer_2": [1, 2]}})
    assert r.status_code == 200 and r.json()["experts_evicted"] == 14
