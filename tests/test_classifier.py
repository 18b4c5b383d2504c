"""The prompt -> per-expert mass classifier: estimator contract, coverage, feedback, deadline, persistence, refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.utils.estimator_checks import parametrize_with_checks

from reap_swap.classifier.evaluate import run_evaluation
from reap_swap.classifier.feedback import FeedbackMemory, FeedbackParams
from reap_swap.classifier.model import ClassifierError, SliceClassifier
from reap_swap.classifier.scorer import ExpertScorer, ridge_solve
from reap_swap.classifier.train import train
from reap_swap.models.families import layout_for
from reap_swap.plan import load_plan, parse_plan
from reap_swap.planning.budget import make_budget
from reap_swap.planning.observations import load_observations
from reap_swap.planning.planner import PlanParams, build_plan


def _not_applicable(estimator: ExpertScorer) -> dict[str, str]:
    # predict_proba on a regressor is deliberate (a distribution over each layer's slices); these
    # checks assume any estimator with predict_proba is a classifier. Sparse input is tested below.
    reason = "predict_proba gives per-layer slice distributions; sklearn treats it as a classifier API"
    return {
        "check_regressors_no_decision_function": reason,
        "check_estimator_sparse_array": reason,
        "check_estimator_sparse_matrix": reason,
    }


@parametrize_with_checks(
    [ExpertScorer(method="ridge"), ExpertScorer(method="knn", n_neighbors=3), ExpertScorer(method="mlp", max_iter=200)],
    expected_failed_checks=_not_applicable,
)
def test_sklearn_estimator_checks(estimator, check) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(estimator)


@pytest.mark.parametrize("method", ["ridge", "knn", "mlp"])
def test_sparse_input_matches_dense(method: str) -> None:
    from scipy.sparse import csr_matrix

    rng = np.random.default_rng(1)
    X, Y = rng.normal(size=(30, 6)), rng.random((30, 3))
    dense = ExpertScorer(method=method, max_iter=100).fit(X, Y).predict(X)
    sparse = ExpertScorer(method=method, max_iter=100).fit(csr_matrix(X), Y).predict(csr_matrix(X))
    np.testing.assert_allclose(dense, sparse, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(30, 80), (80, 12)])
def test_ridge_solve_matches_sklearn_in_both_forms(shape: tuple[int, int]) -> None:
    from scipy.sparse import random as sparse_random
    from sklearn.linear_model import Ridge

    rng = np.random.default_rng(3)
    X = sparse_random(*shape, density=0.2, random_state=3, format="csr") + 0.0
    Y = rng.random((shape[0], 5))
    coef, intercept = ridge_solve(X, Y, 0.7)
    ref = Ridge(alpha=0.7, solver="cholesky").fit(X.toarray(), Y)
    np.testing.assert_allclose(X @ coef + intercept, ref.predict(X.toarray()), atol=1e-9)


def test_predict_proba_is_a_distribution_per_group() -> None:
    rng = np.random.default_rng(0)
    X, Y = rng.normal(size=(40, 5)), rng.random((40, 6))
    m = ExpertScorer(output_groups=(2, 4)).fit(X, Y)
    p = m.predict_proba(X)
    assert np.allclose(p[:, :2].sum(1), 1) and np.allclose(p[:, 2:].sum(1), 1) and (p >= 0).all()
    assert clone(m).get_params() == m.get_params()
    with pytest.raises(ValueError, match="output_groups"):
        ExpertScorer(output_groups=(3,)).fit(X, Y)


@pytest.fixture(scope="module")
def trained(tiny_model_dir: Path, example_obs_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    layout = layout_for(tiny_model_dir)
    plan = build_plan(load_observations(example_obs_dir), layout, make_budget(layout, ratio=0.6), PlanParams(core_fraction=0.5), str(tiny_model_dir))
    d = tmp_path_factory.mktemp("clf")
    plan_path = d / "plan.json"
    plan_path.write_text(json.dumps(plan))
    train(example_obs_dir, plan_path, d / "clf", "test", None, None)
    return plan_path, d / "clf"


def test_prediction_beats_every_baseline_on_held_out(example_obs_dir: Path, trained: tuple[Path, Path]) -> None:
    plan_path, clf_dir = trained
    res = run_evaluation(example_obs_dir, plan_path, clf_dir, "test", latency_prompts=5)
    st = res["strategies"]
    assert res["samples"] == 120 and not res["warnings"]
    for order, e in res["orders"].items():
        pred = st[e["predicted_row"]]["mean"]
        assert pred > st[e["best_baseline"]]["mean"], order
        assert st["oracle"]["mean"] >= pred >= st["core"]["mean"]
        assert 0 < e["gap_closed"] <= 1
    assert res["gap_closed"] == min(e["gap_closed"] for e in res["orders"].values())
    meta = json.loads((clf_dir / "classifier.json").read_text())
    assert meta["model_selection"]["runner_up"] is not None and len(meta["model_selection"]["table"]) >= 6


def test_save_load_gives_identical_predictions(example_obs_dir: Path, trained: tuple[Path, Path]) -> None:
    plan_path, clf_dir = trained
    plan = load_plan(plan_path)
    a = SliceClassifier.load(clf_dir, plan)
    b = SliceClassifier.load(clf_dir, plan, embedder=a.features.embedder)
    texts = load_observations(example_obs_dir).prompts[:8]
    np.testing.assert_array_equal(a.score_texts(texts), b.score_texts(texts))
    sel = a.select("kubectl rollout restart deployment/api -n prod and check the pods")
    for layer, experts in sel.active.items():
        lp = plan.layers[layer]
        assert set(lp.core) <= set(experts) and len(experts) == lp.resident_capacity
        best = np.argsort(-np.asarray(sel.expert_scores[layer]), kind="stable")
        assert set(experts) - set(lp.core) == set([e for e in best if e not in lp.core][: lp.specialist_experts])
        assert len(sel.scores[layer]) == len(lp.slices)  # slice scores for slice-ranking policies
    assert sel.slices and sel.embed_ms > 0 and not sel.fallback


def test_feedback_moves_predictions_toward_what_was_routed(example_obs_dir: Path, trained: tuple[Path, Path]) -> None:
    plan_path, clf_dir = trained
    clf = SliceClassifier.load(clf_dir, load_plan(plan_path))
    clf.memory = FeedbackMemory(FeedbackParams(k=3, beta=1.0))
    obs = load_observations(example_obs_dir)
    text, observed = obs.prompts[0], obs.mass_share()[0]
    before = np.asarray(clf.score_texts([text])[0])
    err_before = np.abs(np.array([clf.select(text).expert_scores[l] for l in clf.layout.layer_ids]) - observed).sum()
    clf.feedback(text, {l: obs.sample_mass[0, i] for i, l in enumerate(obs.layer_ids)})
    after = np.array([clf.select(text).expert_scores[l] for l in clf.layout.layer_ids])
    assert np.abs(after - observed).sum() < err_before and np.allclose(clf.score_texts([text])[0], before)
    with pytest.raises(ClassifierError, match="shape"):
        clf.feedback(text, np.ones((2, 2)))
    clf.memory.clear()
    assert np.allclose([clf.select(text).expert_scores[l] for l in clf.layout.layer_ids], before)


def test_select_within_falls_back_to_the_prior_past_its_budget(trained: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    plan_path, clf_dir = trained
    clf = SliceClassifier.load(clf_dir, load_plan(plan_path))
    fast = clf.select_within("SELECT * FROM users WHERE id = 1", budget_ms=5000)
    assert not fast.fallback
    real = clf.select
    monkeypatch.setattr(clf, "select", lambda text: (time.sleep(0.3), real(text))[1])
    slow = clf.select_within("SELECT * FROM users WHERE id = 1", budget_ms=20)
    assert "budget" in slow.fallback and slow.timings["waited_ms"] < 250
    assert slow.active == clf.prior_selection().active


@pytest.mark.parametrize("method", ["knn", "mlp"])
def test_every_method_round_trips(example_obs_dir: Path, trained: tuple[Path, Path], tmp_path: Path, method: str) -> None:
    plan_path, _ = trained
    train(example_obs_dir, plan_path, tmp_path / method, "test", method, None, features="tokens+routing")
    plan = load_plan(plan_path)
    clf = SliceClassifier.load(tmp_path / method, plan)
    assert clf.meta["model_selection"]["chosen"]["method"] == method
    texts = load_observations(example_obs_dir).prompts[:4]
    np.testing.assert_array_equal(clf.score_texts(texts), SliceClassifier.load(tmp_path / method, plan).score_texts(texts))


def test_refuses_another_plan_or_tampered_files(tmp_path: Path, trained: tuple[Path, Path]) -> None:
    import shutil

    plan_path, clf_dir = trained
    other = json.loads(plan_path.read_text())
    other["budget"]["max_refreshes_per_request"] = 3
    with pytest.raises(ClassifierError, match="trained for plan"):
        SliceClassifier.load(clf_dir, parse_plan(other, "other"))
    bad = tmp_path / "clf"
    shutil.copytree(clf_dir, bad)
    (bad / "tokenizer.json").write_text("{}")
    with pytest.raises(ClassifierError, match="tokenizer"):
        SliceClassifier.load(bad, load_plan(plan_path))
    with pytest.raises(ClassifierError, match="no classifier.json"):
        SliceClassifier.load(tmp_path / "nothing", load_plan(plan_path))


def test_bad_inputs(trained: tuple[Path, Path], example_obs_dir: Path, tmp_path: Path) -> None:
    plan_path, clf_dir = trained
    clf = SliceClassifier.load(clf_dir, load_plan(plan_path))
    with pytest.raises(ClassifierError, match="empty"):
        clf.select("   ")
    with pytest.raises(ClassifierError):
        clf.score_texts([])
    cli = [sys.executable, "-m", "reap_swap.cli"]
    r = subprocess.run(cli + ["evaluate", "--observations", str(example_obs_dir), "--plan", str(tmp_path / "nope.json"),
                              "--classifier", str(clf_dir)], capture_output=True, text=True)
    assert r.returncode == 2 and "cannot read" in r.stderr
