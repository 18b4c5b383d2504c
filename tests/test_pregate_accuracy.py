"""``reap-swap pregate-accuracy`` on the committed 4-layer 128-expert sibling: the recall maths,
the hooks' self-check (a layer's router on its own captured input must reproduce the gate's ids)
against the random-router control, and the CLI's refusals."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from reap_swap.benchmarks.pregate_accuracy import PREDICTORS, main, ranked
from reap_swap.benchmarks.pregate_metrics import coverage, static_ranked
from reap_swap.paths import learned128_cpu_dir


def test_coverage_counts_hits_and_their_gate_weight() -> None:
    pred = np.array([[0, 1, 2, 3], [7, 6, 5, 4]])
    ids, w = np.array([[1, 5], [4, 9]]), np.array([[0.75, 0.25], [0.4, 0.6]])
    recall, mass = coverage(pred, ids, w, 2)
    assert recall.tolist() == [0.5, 0.0] and mass.tolist() == [0.75, 0.0]
    recall, mass = coverage(pred, ids, w, 4)
    assert recall.tolist() == [0.5, 0.5] and mass.tolist() == pytest.approx([0.75, 0.4])


def test_static_baseline_leaves_the_scored_request_out() -> None:
    totals, own = np.array([5, 1, 3, 0]), np.array([5, 0, 0, 0])
    assert static_ranked(totals, own, 2, 2).tolist() == [[2, 1], [2, 1]]


def test_ranking_keeps_the_routers_own_top_k_first_under_ties() -> None:
    logits = torch.randint(0, 3, (64, 32)).to(torch.bfloat16)  # many ties
    r = ranked(logits, 4)
    first = torch.topk(torch.softmax(logits, -1, dtype=torch.float32), 4, -1).indices.numpy()
    assert r.shape == (64, 8) and np.array_equal(r[:, :4], first)
    assert all(len(set(row)) == 8 for row in r.tolist())


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("pregate") / "pregate.json"
    assert main(["--model", str(learned128_cpu_dir()), "--per-file", "3", "1", "--max-tokens", "64", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_every_layer_pair_and_method_is_scored_within_bounds(result: dict[str, Any]) -> None:
    assert result["model"]["moe_layers"] == [0, 1, 2, 3] and result["model"]["top_k"] == 8
    assert len(result["workload"]["requests"]) == result["requests_measured"] == 4 and not result["stopped_by_budget"]
    assert result["rows_scored"] > 100
    for d, pairs in (("1", [(0, 1), (1, 2), (2, 3)]), ("2", [(0, 2), (1, 3)])):
        rows = result["lookahead"][d]["per_layer"]
        assert [(r["from_layer"], r["target_layer"]) for r in rows] == pairs
        for s in [m for r in rows for m in r["methods"].values()] + list(result["lookahead"][d]["mean"].values()):
            assert all(0.0 <= s[k] <= 1.0 for k in ("recall_k", "recall_2k", "mass_k", "mass_2k"))
            assert s["recall_2k"] >= s["recall_k"] and s["mass_2k"] >= s["mass_k"]
        assert set(result["lookahead"][d]["mean"]) == set(PREDICTORS)


def test_hooks_self_check_is_exact_and_the_random_router_is_near_chance(result: dict[str, Any]) -> None:
    assert [c["recall_k"] for c in result["self_check"]["per_layer"]] == [1.0] * 4
    chance = result["chance"]["recall_k"]
    for d in ("1", "2"):
        mean = result["lookahead"][d]["mean"]
        assert mean["random_router"]["recall_k"] < 2 * chance
        assert mean["residual_normed"]["recall_k"] > mean["random_router"]["recall_k"] + 0.25


def test_refusals_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path / "nope"), "--out", str(tmp_path / "x.json")]) == 2
    assert "model directory not found" in capsys.readouterr().err
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}))
    assert main(["--model", str(dense), "--out", str(tmp_path / "x.json")]) == 2
    assert "not a supported MoE family" in capsys.readouterr().err
    for bad in ("0", "4"):
        assert main(["--model", str(learned128_cpu_dir()), "--lookahead", "1", bad, "--out", str(tmp_path / "x.json")]) == 2
        assert "--lookahead" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
