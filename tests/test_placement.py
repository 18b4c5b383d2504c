"""Placement against the strongest simple baselines: splits, per-layer split by CV, core size, expert selection."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from reap_swap.models.families import layout_for
from reap_swap.plan import parse_plan
from reap_swap.planning import coverage as cov
from reap_swap.planning.allocation import choose_split, cv_curves, dp_split
from reap_swap.planning.budget import make_budget
from reap_swap.planning.core_size import choose_core
from reap_swap.planning.expert_select import select_experts, slice_scores, slices_touched, top_experts
from reap_swap.planning.observations import load_observations
from reap_swap.planning.planner import PlanParams, build_plan, format_choices
from reap_swap.planning.splits import SplitError, held_mask, split_indices
from tests.conftest import tiny_plan_dict


def _samples(n: int = 10) -> SimpleNamespace:
    return SimpleNamespace(sample_ids=[f"s{i}" for i in range(n)], files=["train"] * 8 + ["test"] * (n - 8),
                           tags=[("code", "cross:test" if i % 3 == 0 else "cross:train") for i in range(n)],
                           sources=["cursor" if i < 5 else "codex" for i in range(n)])


def test_split_specs() -> None:
    s = _samples()
    assert held_mask(s, "test").tolist() == [False] * 8 + [True] * 2
    assert held_mask(s, "tag:cross:test").tolist() == [i % 3 == 0 for i in range(10)]
    assert held_mask(s, "source:codex").sum() == 5 and held_mask(s, "none").sum() == 0
    assert held_mask(s, "hash:0.5").tolist() == held_mask(s, "hash:0.5").tolist()
    s.files = ["a"] * 10  # no test file: a stable hash split instead
    assert held_mask(s, "test").tolist() == held_mask(s, "hash").tolist()
    for bad in ("tag:", "hash:2", "weird:x", "hash:x"):
        with pytest.raises(SplitError):
            held_mask(s, bad)
    with pytest.raises(SplitError, match="leaves"):
        split_indices(s, "none")
    train, test = split_indices(s, "tag:cross:test")
    assert set(train) | set(test) == set(range(10)) and not set(train) & set(test)


def test_dp_split_is_the_exact_optimum() -> None:
    rng = np.random.default_rng(0)
    curve = np.concatenate([np.zeros((3, 1)), np.cumsum(rng.random((3, 5)), axis=1)], axis=1)
    curve = curve / curve[:, -1:]
    for total in (3, 7, 11, 15):
        best = max((c for c in itertools.product(range(1, 6), repeat=3) if sum(c) == total),
                   key=lambda c: sum(curve[i, k] for i, k in enumerate(c)))
        got = dp_split(curve, total)
        assert got.sum() == total and np.isclose(sum(curve[i, k] for i, k in enumerate(got)), sum(curve[i, k] for i, k in enumerate(best)))


def test_choose_split_keeps_even_unless_cv_shows_a_gain() -> None:
    rng = np.random.default_rng(1)
    flat = rng.dirichlet(np.ones(8), size=(60, 4))  # no layer is more concentrated than another
    assert choose_split(flat, 16).rule == "even"
    skewed = flat.copy()
    skewed[:, 0] = rng.dirichlet(np.r_[40.0, 40.0, np.full(6, 0.2)], size=60)  # layer 0: two experts carry everything
    skewed[:, 1] = rng.dirichlet(np.full(8, 0.3), size=60)  # layer 1: peaked, but on a different expert per sample
    choice = choose_split(skewed, 16)
    rows = {r["rule"]: r for r in choice.table}
    assert choice.rule != "even" and choice.counts[0] < 4
    assert rows[choice.rule]["cv_coverage"] > rows["even"]["cv_coverage"]
    curve = cv_curves(skewed, 5)
    assert np.all(np.diff(curve, axis=1) >= -1e-12) and np.allclose(curve[:, -1], 1.0)


def test_expert_selection_fills_slots_expert_by_expert() -> None:
    lp = parse_plan(tiny_plan_dict(layers=1, core=4, slice_size=4, specialist=3)).layers[0]
    scores = np.zeros(16)
    scores[[5, 9, 13, 14]] = [0.4, 0.3, 0.2, 0.1]
    assert select_experts(lp, scores) == [0, 1, 2, 3, 5, 9, 13]  # three experts from three different slices
    assert slices_touched(lp, select_experts(lp, scores)) == ["layer_0_slice_00", "layer_0_slice_01", "layer_0_slice_02"]
    assert np.allclose(slice_scores(lp, scores), [0.4, 0.3, 0.3])
    assert top_experts([0.0, 0.0, 1.0], 2) == [0, 2] and top_experts([1.0, 0.5, 0.2], 2, fixed=[2]) == [0, 2]


def test_oracle_bounds_every_strategy() -> None:
    rng = np.random.default_rng(2)
    plan = parse_plan(tiny_plan_dict(layers=2, core=2, slice_size=3, specialist=4))
    layers = plan.layer_ids()
    share = rng.dirichlet(np.full(16, 0.3), size=(40, 2))
    train, test = share[:30], share[30:]
    oracle = cov.coverage(test, layers, cov.expert_oracle(plan, layers, test)).mean()
    for strat in (cov.static_topk(plan, layers, train), cov.static_best(plan, layers, train), cov.oracle(plan, layers, test),
                  cov.lfu_experts(plan, layers, test, 0.9, train.mean(0)), cov.predicted(plan, layers, rng.random((10, 2, 16)))):
        assert cov.coverage(test, layers, strat).mean() <= oracle + 1e-12
    top = cov.coverage(train, layers, cov.static_topk(plan, layers, train)).mean()  # on the samples it was fitted to,
    assert top >= cov.coverage(train, layers, cov.static_best(plan, layers, train)).mean()  # whole slices only waste slots
    scores = rng.random((10, 2, 16))
    np.testing.assert_allclose(cov.predicted_coverage(test, scores, plan, layers), cov.coverage(test, layers, cov.predicted(plan, layers, scores)))
    counts = cov.even_counts(train.mean(0), 13)
    assert counts.sum() == 13 and sorted(counts.tolist()) == [6, 7]


@pytest.fixture(scope="module")
def planned(tiny_model_dir: Path, example_obs_dir: Path) -> dict:
    layout = layout_for(tiny_model_dir)
    obs = load_observations(example_obs_dir)
    return build_plan(obs, layout, make_budget(layout, ratio=0.6), PlanParams(), str(tiny_model_dir), tiny_model_dir / "tokenizer.json")


def test_planner_learns_from_training_split_only_and_never_loses_to_even(planned: dict, example_obs_dir: Path) -> None:
    obs = load_observations(example_obs_dir)
    art = planned["scorerArtifacts"]
    assert art["training"]["split"] == "test" and art["training"]["samples"] == 480 and art["training"]["held_out"] == 120
    rows = {r["rule"]: r for r in art["allocation"]["candidates"]}
    assert set(rows) == {"even", "marginal_gain", "cv_dp"}
    assert all(0 < r["cv_coverage"] <= r["train_coverage"] + 0.01 for r in rows.values())
    assert rows[art["allocation"]["rule"]]["cv_coverage"] >= rows["even"]["cv_coverage"]
    assert [c["fraction"] for c in art["core"]["candidates"]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    plan = parse_plan(planned)
    train, test = split_indices(obs, "test")
    share = obs.mass_share()
    held = {name: cov.coverage(share[test], obs.layer_ids, strat(plan, obs.layer_ids, share[train])).mean()
            for name, strat in (("topk", cov.static_topk), ("even", cov.even_split))}
    assert held["topk"] >= held["even"]


def test_core_size_falls_back_without_prompts_or_tokenizer(example_obs_dir: Path) -> None:
    share = load_observations(example_obs_dir).mass_share()[:40]
    assert choose_core(share, ["x"] * 40, None, [4, 4, 4, 4], fallback=0.25).fraction == 0.25
    assert "fewer than 10" in choose_core(share[:5], ["x"] * 5, Path(__file__), [4, 4, 4, 4]).note


def test_plan_report_compares_against_baselines_on_held_out(planned: dict, example_obs_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(planned))
    r = subprocess.run([sys.executable, "-m", "reap_swap.cli", "plan-report", str(path), "--observations", str(example_obs_dir),
                        "--out", str(tmp_path / "rep")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    summary = json.loads((tmp_path / "rep" / "summary.json").read_text())
    held = summary["coverage_tables"]["held_out"]
    assert held["samples"] == 120 and {"static_topk", "even_split", "core+oracle_experts"} <= set(held["strategies"])
    assert "per-layer split:" in r.stdout and "CV" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "reap_swap.cli", "plan", "--observations", str(example_obs_dir), "--model", str(tiny_model_dir),
                          "--budget-ratio", "0.6", "--split", "weird:x", "--out", str(tmp_path / "p.json")], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown kind 'weird'" in bad.stderr


def test_choice_tables_say_how_the_core_fraction_was_chosen() -> None:
    """One line per choice, the rule after the number (it once ran into the note: 'core fraction: 0.0 fraction 1.0 is ...')."""
    art = {"training": {"samples": 100, "split": "test", "held_out": 20},
           "allocation": {"rule": "even", "counts": [3, 3], "folds": 5, "candidates": []},
           "core": {"fraction": 0.0, "note": "fraction 1.0 is the static top-k set (no prediction)",
                    "selection": "largest core fraction within one standard error of the best",
                    "candidates": [{"fraction": f, "core_per_layer": [0, 0], "cv_coverage": 0.7} for f in (0.0, 1.0)]}}
    lines = format_choices({"scorerArtifacts": art}).splitlines()
    assert "core fraction: 0.0, chosen as the largest core fraction within one standard error of the best" in lines
    assert "  note: fraction 1.0 is the static top-k set (no prediction)" in lines
    art["core"] = {"fraction": 0.5, "candidates": [], "note": "no tokenizer.json next to the model: core fraction fixed at 0.5"}
    assert format_choices({"scorerArtifacts": art}).splitlines()[-1] == (
        "core fraction: 0.5 (no tokenizer.json next to the model: core fraction fixed at 0.5)")
