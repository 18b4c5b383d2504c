"""Expert-granular selection: core + the best-scored experts, up to a layer's slots (pure).

Whole slices waste slots whenever a slice's experts are not all wanted; filling
the specialist slots expert by expert, by predicted (or observed) mass, is what
an oracle does and what a predictor should imitate. Slices remain the plan's
unit for the seed's API and cartridges; ``slice_scores`` turns expert scores
back into slice scores for code that still ranks slices.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from reap_swap.plan import LayerPlan, Plan


def top_experts(scores: Sequence[float] | np.ndarray, k: int, fixed: Sequence[int] = ()) -> list[int]:
    """``fixed`` plus the ``k - len(fixed)`` highest-scored other experts (ties: lower id), sorted."""
    chosen = list(dict.fromkeys(int(e) for e in fixed))
    room = k - len(chosen)
    if room > 0:
        s = np.asarray(scores, dtype=np.float64)
        order = np.lexsort((np.arange(len(s)), -s))
        have = set(chosen)
        chosen += [int(e) for e in order if int(e) not in have][:room]
    return sorted(chosen)


def select_experts(lp: LayerPlan, scores: Sequence[float] | np.ndarray) -> list[int]:
    """The layer's active set: core, then the highest-scored experts until the slot bank is full."""
    return top_experts(scores, lp.resident_capacity, lp.core)


def slice_scores(lp: LayerPlan, scores: Sequence[float] | np.ndarray) -> list[float]:
    """Each slice's summed expert score (what slice-ranking code such as the proxy's policy consumes)."""
    s = np.asarray(scores, dtype=np.float64)
    return [float(s[list(sl.experts)].sum()) for sl in lp.slices]


def slices_touched(lp: LayerPlan, active: Sequence[int]) -> list[str]:
    """Ids of the slices with at least one active expert."""
    have = set(active)
    return [sl.slice_id for sl in lp.slices if have & set(sl.experts)]


def select_active_experts(plan: Plan, scores: Mapping[int, Sequence[float]]) -> tuple[dict[int, list[int]], dict[int, list[str]]]:
    """Per layer: active experts and the slices they touch."""
    active: dict[int, list[int]] = {}
    touched: dict[int, list[str]] = {}
    for layer, lp in plan.layers.items():
        active[layer] = select_experts(lp, scores.get(layer, np.zeros(lp.num_experts)))
        touched[layer] = slices_touched(lp, active[layer])
    return active, touched
