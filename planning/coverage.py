"""Gate-mass coverage of placement strategies on observed samples (pure numpy).

Coverage of a sample in a layer = the share of that sample's routed gate
mass that lands on the layer's resident experts. Used by the plan report and
by the classifier's evaluation, so both compare strategies the same way.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from reap_swap.plan import Plan
from reap_swap.selection import select_layer

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


def oracle(plan: Plan, layer_ids: list[int], share: np.ndarray) -> Strategy:
    """Core + the slices that hold the most of *this* sample's mass (the best any selector can do)."""
    return lambda s, li: select_layer(
        plan.layers[layer_ids[li]], slice_mass(plan, layer_ids[li], share[s, li]), share[s, li]
    )[0]


def uniform(plan: Plan, layer_ids: list[int], train_share: np.ndarray) -> Strategy:
    """The same number of resident experts, spread evenly over layers, heaviest experts first."""
    total = sum(plan.layers[l].resident_capacity for l in layer_ids)
    per, extra = divmod(total, len(layer_ids))
    mean = train_share.mean(axis=0)
    fixed = {}
    for li in range(len(layer_ids)):
        k = per + (1 if li < extra else 0)
        fixed[li] = [int(e) for e in np.argsort(-mean[li], kind="stable")[:k]]
    return lambda s, li: fixed[li]


def lfu_online(plan: Plan, layer_ids: list[int], share: np.ndarray, decay: float = 1.0) -> Strategy:
    """Core + slices ranked by the mass the *preceding* samples put on them (an online frequency cache).

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
