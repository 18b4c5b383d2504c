"""Gate-mass coverage of slice selection strategies on held-out samples (pure numpy).

Strategies, all with the plan's core always resident and the same per-layer
capacity: static (the slices best over the training set), an online LFU
cache (slices ranked by decayed mass of the preceding held-out samples,
warm-started from the training set), the classifier, and the oracle (each
sample's own best slices). The headline is the share of the static->oracle
gap the classifier closes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reap_swap.plan import Plan
from reap_swap.planning import coverage as cov
from reap_swap.selection import select_layer

from .dataset import SliceLayout

LFU_DECAY = 0.9


def classifier_strategy(plan: Plan, layout: SliceLayout, scores: np.ndarray, prior: np.ndarray) -> cov.Strategy:
    layer_ids = list(layout.layer_ids)
    chosen = {}
    for s in range(scores.shape[0]):
        per_layer = layout.split(scores[s])
        for li, layer in enumerate(layer_ids):
            chosen[(s, li)] = select_layer(plan.layers[layer], per_layer[layer], prior[li])[0]
    return lambda s, li: chosen[(s, li)]


def lfu_warm(plan: Plan, layer_ids: list[int], train_share: np.ndarray, test_share: np.ndarray, decay: float = LFU_DECAY) -> cov.Strategy:
    """Online LFU with exponential decay, warm-started with the training mass (worth one request)."""
    stacked = np.concatenate([train_share.mean(axis=0, keepdims=True), test_share], axis=0)
    inner = cov.lfu_online(plan, layer_ids, stacked, decay)
    return lambda s, li: inner(s + 1, li)


def evaluate(plan: Plan, layout: SliceLayout, train_share: np.ndarray, test_share: np.ndarray, scores: np.ndarray) -> dict[str, Any]:
    layer_ids = list(layout.layer_ids)
    prior = train_share.mean(axis=0)
    strategies = {
        "core": cov.core_only(plan, layer_ids),
        "static": cov.static_best(plan, layer_ids, train_share),
        "lfu": lfu_warm(plan, layer_ids, train_share, test_share),
        "classifier": classifier_strategy(plan, layout, scores, prior),
        "oracle": cov.oracle(plan, layer_ids, test_share),
    }
    result: dict[str, Any] = {"layers": layer_ids, "samples": int(test_share.shape[0]), "strategies": {}}
    for name, strat in strategies.items():
        c = cov.coverage(test_share, layer_ids, strat)
        result["strategies"][name] = {"mean": float(c.mean()), "per_layer": c.mean(axis=0).tolist()}
    st = result["strategies"]
    gap = st["oracle"]["mean"] - st["static"]["mean"]
    result["gap_closed"] = (st["classifier"]["mean"] - st["static"]["mean"]) / gap if gap > 1e-12 else float("nan")
    per_gap = []
    for li in range(len(layer_ids)):
        g = st["oracle"]["per_layer"][li] - st["static"]["per_layer"][li]
        per_gap.append((st["classifier"]["per_layer"][li] - st["static"]["per_layer"][li]) / g if g > 1e-12 else float("nan"))
    result["gap_closed_per_layer"] = per_gap
    return result


def format_table(result: dict[str, Any]) -> str:
    layers = result["layers"]
    shown = layers if len(layers) <= 12 else layers[:: max(1, len(layers) // 12)]
    idx = [layers.index(l) for l in shown]
    lines = [f"gate-mass coverage on {result['samples']} held-out samples (core + slices within each layer's budget)"]
    lines.append(f"{'strategy':<12}" + "".join(f"{'L' + str(l):>7}" for l in shown) + f"{'mean':>8}")
    for name, row in result["strategies"].items():
        lines.append(f"{name:<12}" + "".join(f"{row['per_layer'][i]:>7.3f}" for i in idx) + f"{row['mean']:>8.3f}")
    lines.append(f"{'gap closed':<12}" + "".join(f"{result['gap_closed_per_layer'][i]:>7.2f}" for i in idx) + f"{result['gap_closed']:>8.2f}")
    return "\n".join(lines)
