"""Swap payload validation, signatures and deltas (pure; no vLLM)."""

from __future__ import annotations

from typing import Any

import pytest

from reap_swap.plan import parse_plan
from reap_swap.server_ext.control.active_set import PayloadError, compute_delta, parse_swap_request, signature
from tests.conftest import tiny_plan_dict

PLAN = parse_plan(tiny_plan_dict())
CURRENT = {i: (0, 1, 2, 3) for i in range(4)}
CAPACITY = PLAN.capacity()


def parse(payload: Any, warm: bool = False):
    return parse_swap_request(payload, PLAN, CURRENT, CAPACITY, warm=warm)


def ok(**overrides: Any) -> dict[str, Any]:
    body = {"request_id": "r", "phase": "prefill", "active_set": {"layer_0": [0, 1, 2, 3, 4, 5]}}
    body.update(overrides)
    return body


def test_valid_payload_builds_full_target() -> None:
    req = parse(ok())
    assert req.target[0] == (0, 1, 2, 3, 4, 5)
    assert req.target[1] == (0, 1, 2, 3)  # unnamed layers keep their residents
    assert req.named_layers == (0,)


def test_numeric_layer_keys_accepted() -> None:
    assert parse(ok(active_set={"2": [3, 2, 1, 0, 9]})).target[2] == (0, 1, 2, 3, 9)


@pytest.mark.parametrize(
    "body, code, status",
    [
        ([], "invalid_body", 400),
        (ok(request_id=""), "missing_field", 400),
        (ok(request_id=7), "missing_field", 400),
        (ok(request_id="x" * 300), "invalid_value", 400),
        (ok(phase="decode"), "invalid_phase", 400),
        ({"request_id": "r", "active_set": {"layer_0": [0, 1, 2, 3]}}, "invalid_phase", 400),
        (ok(active_set={}), "invalid_active_set", 400),
        (ok(active_set=[1, 2]), "invalid_active_set", 400),
        (ok(active_set={"layer_9": [0, 1, 2, 3]}), "unknown_layer", 400),
        (ok(active_set={"layer_x": [0]}), "unknown_layer", 400),
        (ok(active_set={"layer_0": [0, 1, 2, 3], "0": [0, 1, 2, 3]}), "duplicate_layer", 400),
        (ok(active_set={"layer_0": [0, 1, 2, 3, 16]}), "expert_out_of_range", 400),
        (ok(active_set={"layer_0": [0, 1, 2, 3, -1]}), "expert_out_of_range", 400),
        (ok(active_set={"layer_0": [0, 1, 2, 3, 4, 4]}), "duplicate_experts", 400),
        (ok(active_set={"layer_0": [0, 1, 2, 3, True]}), "invalid_type", 400),
        (ok(active_set={"layer_0": "0,1"}), "invalid_type", 400),
        (ok(active_set={"layer_0": [1, 2, 3, 4]}), "missing_core", 400),
        (ok(active_set={"layer_0": list(range(9))}), "over_budget", 400),
        (ok(budget_bytes=-1), "invalid_value", 400),
        (ok(budget_bytes=98304), "over_budget", 400),
        (ok(allow_missing_core="yes"), "invalid_type", 400),
        (ok(extra=1), "unknown_field", 400),
        (ok(reset_router_stats=True), "unknown_field", 400),
    ],
)
def test_bad_payloads(body: Any, code: str, status: int) -> None:
    with pytest.raises(PayloadError) as info:
        parse(body)
    assert info.value.code == code
    assert info.value.status == status


def test_missing_core_allowed_when_deliberate() -> None:
    req = parse(ok(active_set={"layer_0": [5, 6]}, allow_missing_core=True))
    assert req.target[0] == (5, 6)


def test_budget_bytes_within_limit() -> None:
    # 4 layers x 4 core + 2 extra experts = 18 experts
    assert parse(ok(budget_bytes=18 * 98304)).budget_bytes == 18 * 98304


def test_warm_defaults_phase_and_accepts_reset() -> None:
    req = parse({"request_id": "w", "active_set": {"layer_1": [0, 1, 2, 3]}, "reset_router_stats": True}, warm=True)
    assert req.phase == "prefill" and req.warm and req.reset_router_stats


def test_signature_is_canonical() -> None:
    a = {0: (3, 1, 2), 1: (5,)}
    b = {1: (5,), 0: (1, 2, 3)}
    assert signature(a) == signature(b)
    assert len(signature(a)) == 16
    assert signature(a) != signature({0: (1, 2, 3), 1: (6,)})


def test_delta() -> None:
    d = compute_delta({0: (0, 1, 2), 1: (4,)}, {0: (1, 2, 7), 1: (4,)})
    assert d.layers[0].added == (7,) and d.layers[0].removed == (0,) and d.layers[0].reused == 2
    assert d.experts_added == 1 and d.experts_removed == 1
    assert d.to_json() == {"layer_0": {"added": [7], "removed": [0], "reused": 2}}
