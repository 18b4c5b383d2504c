"""``reap-swap evaluate``: held-out coverage of every strategy, the best baseline, the gap closed, latency.

The held-out samples are those of the classifier's own split (or ``--split``).
A plan that was built with held-out samples makes every row optimistic; that
is reported as a warning, with how many samples overlap.
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
from reap_swap.planning.observations import ObservationError, Observations, load_observations
from reap_swap.planning.splits import SplitError, held_mask

from .dataset import DatasetError, split_indices
from .embedder import EmbedderError
from .evaluation import arrival_orders, evaluate, format_table
from .feedback import online_predictions
from .model import ClassifierError, SliceClassifier


def plan_leak(plan: Plan, obs: Observations, test_idx: np.ndarray) -> str | None:
    """A warning when the plan learnt from held-out samples (its recorded split covers them), else None."""
    training = plan.raw.get("scorerArtifacts", {}).get("training")
    if not training:
        return "the plan does not record which samples it was built from (older planner): baselines may be optimistic"
    try:
        plan_held = held_mask(obs, training.get("split", "none"))
    except SplitError:
        return f"the plan's split {training.get('split')!r} cannot be applied to these observations"
    overlap = int((~plan_held[test_idx]).sum())
    if overlap:
        return f"the plan was built with {overlap} of the {len(test_idx)} held-out samples (plan split {training.get('split')!r}): coverage is optimistic"
    return None


def latency(clf: SliceClassifier, prompts: list[str], n: int) -> dict[str, Any]:
    lat = []
    for text in prompts[:n]:
        t = time.perf_counter()
        clf.select(text)
        lat.append((time.perf_counter() - t) * 1e3)
    return {"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)), "n": len(lat),
            "what": "features + predict + select, one prompt at a time, this process alone (see reap-swap bench-classify for under load)"}


def run_evaluation(obs_dir: Path, plan_path: Path, clf_dir: Path, split: str | None = None, latency_prompts: int = 50) -> dict[str, Any]:
    plan = load_plan(plan_path)
    obs = load_observations(obs_dir)
    clf = SliceClassifier.load(clf_dir, plan)
    split = split or clf.meta.get("split", "test")
    if split != clf.meta.get("split"):
        raise DatasetError(f"the classifier was trained with split {clf.meta.get('split')!r}; evaluating on {split!r} would score samples it learnt from")
    train_idx, test_idx = split_indices(obs, split)
    order = [obs.layer_ids.index(l) for l in plan.layer_ids()]
    share = obs.mass_share()[:, order, :]
    prompts = [obs.prompts[i] for i in test_idx]
    clf.memory.clear()
    raw = clf.score_texts(prompts)
    x = clf.features.transform(prompts)
    test = share[test_idx]
    orders = arrival_orders(len(test_idx))
    predicted = {"predicted (no feedback)": raw,
                 "predicted": online_predictions(x, raw, test, orders["mixed"], clf.memory.params),
                 "predicted (bursts)": online_predictions(x, raw, test, orders["bursts"], clf.memory.params)}
    result = evaluate(plan, plan.layer_ids(), share[train_idx], test, predicted)
    result["split"] = split
    result["train_samples"] = int(len(train_idx))
    warning = plan_leak(plan, obs, test_idx)
    result["warnings"] = [warning] if warning else []
    result["latency_ms"] = latency(clf, prompts, latency_prompts)
    ms = clf.meta["model_selection"]
    result["classifier"] = {"path": str(clf_dir), "features": ms["chosen_features"], "chosen": ms["chosen"],
                            "feedback": clf.memory.params.to_json(), "cv_groups": ms.get("cv_groups"),
                            "runner_up": ms["runner_up"], "cv_coverage": ms["chosen_cv_coverage"], "cv_table": ms["table"]}
    result["plan"] = {"path": str(plan_path), "sha256": plan.sha256, "allocation": plan.raw.get("scorerArtifacts", {}).get("allocation")}
    return result


def main_evaluate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap evaluate", description="Held-out coverage of the classifier against every baseline.", formatter_class=HelpFormatter)
    p.add_argument("--observations", type=Path, required=True, help="observation directory (reap-swap observe)")
    p.add_argument("--plan", type=Path, required=True, help="plan JSON (reap-swap plan)")
    p.add_argument("--classifier", type=Path, required=True, help="classifier folder (reap-swap train)")
    p.add_argument("--split", help="held-out samples (default: the classifier's training split)")
    p.add_argument("--latency-prompts", type=int, default=50, help="held-out prompts timed for the classification latency")
    p.add_argument("--out", type=Path, help="JSON output (default: CLASSIFIER/evaluation.json)")
    a = p.parse_args(argv)
    try:
        result = run_evaluation(a.observations, a.plan, a.classifier, a.split, a.latency_prompts)
    except (PlanError, ObservationError, DatasetError, EmbedderError, ClassifierError) as exc:
        print(f"reap-swap evaluate: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    for w in result["warnings"]:
        print(f"warning: {w}")
    c = result["classifier"]
    print(f"classifier: {c['features']} {json.dumps(c['chosen'])} (CV coverage {c['cv_coverage']:.4f}), feedback {json.dumps(c['feedback'])}; "
          f"split {result['split']!r}, {result['train_samples']} training samples")
    lat = result["latency_ms"]
    print(f"features+predict+select, one prompt, idle process: p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms (n={lat['n']})")
    out = a.out or a.classifier / "evaluation.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0
