"""Plan parsing and validation (pure; no vLLM)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path

import pytest

from reap_swap.plan import PlanError, canonical_sha256, check_plan_fits_model, load_plan, parse_plan
from tests.conftest import SEED_PLAN, tiny_plan_dict


def test_vendored_seed_files_are_the_ones_their_notice_names() -> None:
    notice = (SEED_PLAN.parent / "NOTICE.md").read_text()
    assert "Apache License, Version 2.0" in notice and "Copyright 2026 reap-expert-swap contributors" in notice
    for name in ("strict30-v2-plan.json", "reap_plan.schema.md"):
        assert hashlib.sha256((SEED_PLAN.parent / name).read_bytes()).hexdigest() in notice, name


def test_seed_plan_loads(seed_plan_path: Path) -> None:
    plan = load_plan(seed_plan_path)
    assert len(plan.layers) == 40
    lp = plan.layers[0]
    assert lp.num_experts == 256
    assert len(lp.core) == 49
    assert len(lp.slices) == 26
    assert lp.resident_capacity == 65  # 49 core + 16 specialist, as the seed's active set
    assert plan.per_expert_bytes == 6_291_456
    assert plan.max_refreshes_per_request == 1
    assert plan.sha256 == canonical_sha256(json.loads(seed_plan_path.read_text()))
    assert sum(lp.resident_capacity for lp in plan.layers.values()) * plan.per_expert_bytes == 16_357_785_600


def test_seed_plan_fits_its_model_shape(seed_plan_path: Path) -> None:
    plan = load_plan(seed_plan_path)
    check_plan_fits_model(plan, list(range(40)), 256)
    with pytest.raises(PlanError, match="numExperts=256 but the model has 128"):
        check_plan_fits_model(plan, list(range(40)), 128)
    with pytest.raises(PlanError, match="not an MoE layer"):
        check_plan_fits_model(plan, list(range(24)), 256)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda p: p.update(mode="static"), "mode must be"),
        (lambda p: p.pop("budget"), "budget"),
        (lambda p: p["budget"].update(per_expert_bytes=0), "per_expert_bytes"),
        (lambda p: p.update(perLayer={}), "perLayer"),
        (lambda p: p["perLayer"]["layer_0"].update(coreExperts=[0, 0, 1]), "duplicate expert ids"),
        (lambda p: p["perLayer"]["layer_0"].update(coreExperts=[0, 99]), "out of range"),
        (lambda p: p["perLayer"]["layer_0"].update(coreExperts=[0, "1"]), "not an integer"),
        (lambda p: p["perLayer"]["layer_0"]["sliceCatalog"][0].update(experts=[0, 5]), "already in core"),
        (lambda p: p["perLayer"]["layer_0"]["sliceCatalog"][1].update(sliceId="layer_0_slice_00"), "duplicate sliceId"),
        (lambda p: p["perLayer"].update(bogus={}), "not 'layer_N'"),
        (lambda p: p["perLayer"]["layer_0"].update(numExperts=-1), "numExperts"),
        (lambda p: p["perLayer"]["layer_0"].update(specialistActiveExpertTarget=40), "exceeds numExperts"),
    ],
)
def test_bad_plans_are_refused_with_the_reason(mutate, message: str) -> None:
    plan = copy.deepcopy(tiny_plan_dict())
    mutate(plan)
    with pytest.raises(PlanError, match=message):
        parse_plan(plan)


def test_all_problems_reported_at_once() -> None:
    plan = tiny_plan_dict()
    plan["mode"] = "x"
    plan["perLayer"]["layer_1"]["coreExperts"] = [100]
    with pytest.raises(PlanError) as info:
        parse_plan(plan)
    assert len(info.value.problems) == 2


def test_unreadable_plan_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        load_plan(bad)


def test_capacity_and_core() -> None:
    plan = parse_plan(tiny_plan_dict(core=4, specialist=4))
    assert plan.capacity() == {i: 8 for i in range(4)}
    assert plan.core_set()[2] == (0, 1, 2, 3)
    assert plan.layers[0].slice_by_id("layer_0_slice_01").experts == (8, 9, 10, 11)
