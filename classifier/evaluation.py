"""Coverage of placement strategies on held-out samples, against the strongest simple baseline (pure numpy).

Every strategy gets the plan's slots per layer (the even split: the same
total, spread evenly). Rows:

* ``core``: the plan's core alone (the floor);
* ``static slices``: core + the slices heaviest over training (the seed's rule);
* ``static top-k``: core + the experts heaviest over training, plan counts;
* ``even split``: the heaviest experts, same total, even counts per layer;
* ``LFU``: online expert cache, decayed mass of the preceding held-out requests
  (warm-started from training), requests in a seeded random order (mixed
  traffic); ``LFU (bursts)``: the same in id order, where a domain's requests
  arrive together (the most favourable order for a cache);
* ``predicted (no feedback)``: core + the experts the classifier scores highest;
* ``predicted`` / ``predicted (bursts)``: the same, corrected online by the
  routing of the requests already served (``feedback.py``), in the LFU rows'
  two arrival orders;
* ``oracle``: core + each sample's own heaviest experts (once-per-request bound).

The headline is the share of the gap between the best non-predictive row and
the oracle that the prediction closes, per arrival order (mixed: ``predicted``
against static slices, static top-k, even split and LFU; bursts:
``predicted (bursts)`` against the same with ``LFU (bursts)``), and the smaller
of the two.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from reap_swap.plan import Plan
from reap_swap.planning import coverage as cov

LFU_DECAY = 0.9
STATIC = ("static slices", "static top-k", "even split")
BASELINES = STATIC + ("LFU", "LFU (bursts)")
ORDERS = {"mixed": ("predicted", STATIC + ("LFU",)), "bursts": ("predicted (bursts)", STATIC + ("LFU (bursts)",))}
ORDER_SEED = 0


def arrival_orders(n: int) -> dict[str, np.ndarray]:
    """``mixed``: a seeded random order (requests of all domains interleaved); ``bursts``: stored (id) order."""
    return {"mixed": np.random.default_rng(ORDER_SEED).permutation(n), "bursts": np.arange(n)}


def lfu_strategy(plan: Plan, layer_ids: list[int], train_share: np.ndarray, test_share: np.ndarray, order: np.ndarray) -> cov.Strategy:
    """Expert LFU serving the held-out samples in ``order``; returns a strategy indexed by sample."""
    inner = cov.lfu_experts(plan, layer_ids, test_share[order], LFU_DECAY, warm=train_share.mean(axis=0))
    pos = np.empty(len(order), dtype=np.int64)
    pos[order] = np.arange(len(order))
    return lambda s, li: inner(int(pos[s]), li)


def strategies(plan: Plan, layer_ids: list[int], train_share: np.ndarray, test_share: np.ndarray,
               predicted: dict[str, np.ndarray] | None) -> dict[str, cov.Strategy]:
    """``predicted`` maps row names (``predicted (no feedback)``, ``predicted``, ``predicted (bursts)``) to [N, L, E] scores."""
    orders = arrival_orders(test_share.shape[0])
    out = {
        "core": cov.core_only(plan, layer_ids),
        "static slices": cov.static_best(plan, layer_ids, train_share),
        "static top-k": cov.static_topk(plan, layer_ids, train_share),
        "even split": cov.even_split(plan, layer_ids, train_share),
        "LFU": lfu_strategy(plan, layer_ids, train_share, test_share, orders["mixed"]),
        "LFU (bursts)": lfu_strategy(plan, layer_ids, train_share, test_share, orders["bursts"]),
    }
    for name, scores in (predicted or {}).items():
        out[name] = cov.predicted(plan, layer_ids, scores)
    out["oracle"] = cov.expert_oracle(plan, layer_ids, test_share)
    return out


def gap_closed(pred: float, base: float, oracle: float) -> float:
    gap = oracle - base
    return (pred - base) / gap if gap > 1e-12 else float("nan")


def evaluate(plan: Plan, layer_ids: list[int], train_share: np.ndarray, test_share: np.ndarray,
             predicted: dict[str, np.ndarray] | None) -> dict[str, Any]:
    """Coverage per strategy (mean and per layer), the best baseline per arrival order and the gap the prediction closes."""
    result: dict[str, Any] = {"layers": layer_ids, "samples": int(test_share.shape[0]), "strategies": {},
                              "capacity": [plan.layers[l].resident_capacity for l in layer_ids],
                              "core": [len(plan.layers[l].core) for l in layer_ids]}
    for name, strat in strategies(plan, layer_ids, train_share, test_share, predicted).items():
        c = cov.coverage(test_share, layer_ids, strat)
        result["strategies"][name] = {"mean": float(c.mean()), "per_layer": c.mean(axis=0).tolist(),
                                      "sample_se": float(c.mean(axis=1).std(ddof=1) / np.sqrt(len(c))) if len(c) > 1 else 0.0}
    st = result["strategies"]
    result["best_baseline"] = max(BASELINES, key=lambda b: st[b]["mean"])
    result["orders"] = {}
    for order, (row, baselines) in ORDERS.items():
        best = max(baselines, key=lambda b: st[b]["mean"])
        entry: dict[str, Any] = {"best_baseline": best, "predicted_row": row}
        if row in st:
            entry["gap_closed"] = gap_closed(st[row]["mean"], st[best]["mean"], st["oracle"]["mean"])
            entry["gap_closed_per_layer"] = [gap_closed(st[row]["per_layer"][i], st[best]["per_layer"][i], st["oracle"]["per_layer"][i])
                                             for i in range(len(layer_ids))]
        result["orders"][order] = entry
    closed = [e["gap_closed"] for e in result["orders"].values() if "gap_closed" in e]
    if closed:
        result["gap_closed"] = float(min(closed))
    return result


def format_table(result: dict[str, Any]) -> str:
    layers = result["layers"]
    shown = layers if len(layers) <= 12 else layers[:: max(1, len(layers) // 12)]
    idx = [layers.index(l) for l in shown]
    lines = [f"gate-mass coverage on {result['samples']} held-out samples (resident experts per layer: "
             f"{' '.join(map(str, [result['capacity'][i] for i in idx]))}, core {' '.join(map(str, [result['core'][i] for i in idx]))})"]
    lines.append(f"{'strategy':<24}" + "".join(f"{'L' + str(l):>7}" for l in shown) + f"{'mean':>8}")
    best = {e["best_baseline"] for e in result["orders"].values()}
    for name, row in result["strategies"].items():
        mark = " *" if name in best else ""
        lines.append(f"{name:<24}" + "".join(f"{row['per_layer'][i]:>7.3f}" for i in idx) + f"{row['mean']:>8.3f}{mark}")
    for order, e in result["orders"].items():
        if "gap_closed" in e:
            lines.append(f"{'gap closed, ' + order:<24}" + "".join(f"{e['gap_closed_per_layer'][i]:>7.2f}" for i in idx) + f"{e['gap_closed']:>8.2f}")
    for order, e in result["orders"].items():
        if "gap_closed" in e:
            lines.append(f"* {order} arrival: best non-predictive baseline {e['best_baseline']}; {e['predicted_row']} closes "
                         f"{e['gap_closed']:.0%} of its gap to the oracle")
    return "\n".join(lines)
