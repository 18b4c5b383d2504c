"""Gate-mass coverage of placement strategies on observed samples (pure numpy).

Coverage of a sample in a layer = the share of that sample's routed gate
mass that lands on the layer's resident experts. The plan report, the
classifier's evaluation and the demo all compare strategies with these
functions, so they measure the same thing. Non-predictive baselines:

* ``core_only``; ``static_best``: core + the slices heaviest over training;
* ``static_topk``: core + the experts heaviest over training, at the plan's
  per-layer slot counts (the strongest static set for that split);
* ``even_split``: the same total slots spread evenly over layers (remainder to
  the layers where one more expert gains most), heaviest experts first;
* ``lfu_experts`` / ``lfu_online``: online caches ranked by the decayed mass of
  the preceding requests, expert- or slice-granular.

Bounds: ``expert_oracle`` (core + each sample's own heaviest experts) and
``oracle`` (core + each sample's best slices).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from reap_swap.plan import Plan
from reap_swap.selection import select_layer

from .expert_select import top_experts

# A strategy maps (sample index, layer position) -> resident experts.
Strategy = Callable[[int, int], list[int]]


def coverage(share: np.ndarray, layer_ids: list[int], strategy: Strategy) -> np.ndarray:
    """[N, L] coverage for every sample and layer; share is [N, L, E]."""
    n, num_layers, _ = share.shape
    out = np.zeros((n, num_layers))
    for s in range(n):
        for li in range(num_layers):
            out[s, li] = share[s, li, strategy(s, li)].sum()
    return out


def slice_mass(plan: Plan, layer: int, share_row: np.ndarray) -> list[float]:
    """Mass share of each slice of ``layer`` under one sample's (or the corpus') expert shares."""
    return [float(share_row[list(s.experts)].sum()) for s in plan.layers[layer].slices]


def core_only(plan: Plan, layer_ids: list[int]) -> Strategy:
    return lambda s, li: list(plan.layers[layer_ids[li]].core)


def static_best(plan: Plan, layer_ids: list[int], train_share: np.ndarray) -> Strategy:
    """Core + the slices that hold the most mass over the training samples (one set for all)."""
    mean = train_share.mean(axis=0)  # [L, E]
    fixed = {li: select_layer(plan.layers[l], slice_mass(plan, l, mean[li]), mean[li])[0] for li, l in enumerate(layer_ids)}
    return lambda s, li: fixed[li]


def static_topk(plan: Plan, layer_ids: list[int], train_share: np.ndarray) -> Strategy:
    """Core + the experts heaviest over the training samples, up to each layer's slots (one set for all)."""
    mean = train_share.mean(axis=0)
    fixed = {li: top_experts(mean[li], plan.layers[l].resident_capacity, plan.layers[l].core) for li, l in enumerate(layer_ids)}
    return lambda s, li: fixed[li]


def even_counts(mean: np.ndarray, total: int) -> np.ndarray:
    """[L] slots: ``total // L`` each, the remainder to the layers whose next heaviest expert is heaviest."""
    num_layers, num_experts = mean.shape
    per, extra = divmod(total, num_layers)
    counts = np.full(num_layers, min(per, num_experts), dtype=np.int64)
    ranked = -np.sort(-mean, axis=1)
    gain = np.array([ranked[li, counts[li]] if counts[li] < num_experts else -np.inf for li in range(num_layers)])
    for li in np.lexsort((np.arange(num_layers), -gain))[:extra]:
        counts[li] += 1 if counts[li] < num_experts else 0
    return counts


def even_split(plan: Plan, layer_ids: list[int], train_share: np.ndarray) -> Strategy:
    """The plan's total resident experts spread evenly over layers, heaviest experts first (no core)."""
    mean = train_share.mean(axis=0)
    counts = even_counts(mean, sum(plan.layers[l].resident_capacity for l in layer_ids))
    fixed = {li: top_experts(mean[li], int(counts[li])) for li in range(len(layer_ids))}
    return lambda s, li: fixed[li]


def oracle(plan: Plan, layer_ids: list[int], share: np.ndarray) -> Strategy:
    """Core + the slices that hold the most of *this* sample's mass (the best whole-slice selector)."""
    return lambda s, li: select_layer(
        plan.layers[layer_ids[li]], slice_mass(plan, layer_ids[li], share[s, li]), share[s, li]
    )[0]


def expert_oracle(plan: Plan, layer_ids: list[int], share: np.ndarray, with_core: bool = True) -> Strategy:
    """Core + *this* sample's heaviest experts up to the layer's slots (the best once-per-request choice)."""
    def pick(s: int, li: int) -> list[int]:
        lp = plan.layers[layer_ids[li]]
        return top_experts(share[s, li], lp.resident_capacity, lp.core if with_core else ())
    return pick


def predicted(plan: Plan, layer_ids: list[int], scores: np.ndarray) -> Strategy:
    """Core + the experts a predictor scored highest for each sample; ``scores`` is [N, L, E]."""
    return lambda s, li: top_experts(scores[s, li], plan.layers[layer_ids[li]].resident_capacity, plan.layers[layer_ids[li]].core)


def lfu_experts(plan: Plan, layer_ids: list[int], share: np.ndarray, decay: float = 0.9, warm: np.ndarray | None = None) -> Strategy:
    """Online expert cache: sample s gets core + the experts with the most decayed mass over samples < s.

    ``warm`` ([L, E], e.g. the training mean) seeds the counts as one earlier request.
    """
    counts = np.zeros(share.shape[1:]) if warm is None else np.array(warm, dtype=np.float64)
    chosen: dict[tuple[int, int], list[int]] = {}
    for s in range(share.shape[0]):
        for li, layer in enumerate(layer_ids):
            lp = plan.layers[layer]
            chosen[(s, li)] = top_experts(counts[li], lp.resident_capacity, lp.core)
        counts = counts * decay + share[s]
    return lambda s, li: chosen[(s, li)]


def lfu_online(plan: Plan, layer_ids: list[int], share: np.ndarray, decay: float = 1.0) -> Strategy:
    """Core + slices ranked by the mass the *preceding* samples put on them (an online slice cache).

    Sample s is served with what samples 0..s-1 taught; it learns from s only after being served.
    """
    num_layers = len(layer_ids)
    counts = np.zeros(share.shape[1:])
    chosen: dict[tuple[int, int], list[int]] = {}
    for s in range(share.shape[0]):
        for li in range(num_layers):
            lp = plan.layers[layer_ids[li]]
            chosen[(s, li)] = select_layer(lp, slice_mass(plan, layer_ids[li], counts[li]), counts[li])[0]
        counts = counts * decay + share[s]
    return lambda s, li: chosen[(s, li)]


def topk_coverage(share: np.ndarray, ranking: np.ndarray, counts: Sequence[int]) -> np.ndarray:
    """[L] mean coverage of each layer's ``counts[l]`` experts ranked first by ``ranking`` [L, E]."""
    out = np.zeros(share.shape[1])
    for li in range(share.shape[1]):
        order = np.lexsort((np.arange(ranking.shape[1]), -ranking[li]))[: int(counts[li])]
        out[li] = share[:, li, order].sum(axis=1).mean()
    return out


def predicted_coverage(share: np.ndarray, scores: np.ndarray, plan: Plan, layer_ids: list[int]) -> np.ndarray:
    """[N, L] coverage of core + top-scored experts (vectorized ``coverage(..., predicted(...))``)."""
    out = np.zeros(share.shape[:2])
    for li, layer in enumerate(layer_ids):
        lp = plan.layers[layer]
        s = np.array(scores[:, li], dtype=np.float64)
        s[:, list(lp.core)] = np.inf
        pick = np.argsort(-s, axis=1, kind="stable")[:, : lp.resident_capacity]
        out[:, li] = np.take_along_axis(share[:, li], pick, axis=1).sum(axis=1)
    return out
