"""From slice scores to an active set that fits each layer's slot bank (pure).

Shared by the proxy (live requests), the classifier's evaluation and the
plan report, so all three measure the same selection rule: core experts
always; then slices in descending score, whole while they fit; then the
heaviest experts of the next slices until the layer's capacity is full.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .plan import LayerPlan, Plan


def select_layer(lp: LayerPlan, slice_scores: Sequence[float], expert_mass: Sequence[float] | None = None) -> tuple[list[int], list[str]]:
    """Active experts of one layer and the ids of the slices chosen (whole or in part)."""
    chosen = list(lp.core)
    room = lp.resident_capacity - len(chosen)
    picked: list[str] = []
    order = sorted(range(len(lp.slices)), key=lambda j: (-float(slice_scores[j]), j))
    for j in order:
        if room <= 0:
            break
        s = lp.slices[j]
        experts = [e for e in s.experts if e not in chosen]
        if len(experts) > room:
            experts = sorted(experts, key=lambda e: (-(expert_mass[e] if expert_mass is not None else 0.0), e))[:room]
        chosen += experts
        room -= len(experts)
        picked.append(s.slice_id)
    return sorted(chosen), picked


def select_active_set(
    plan: Plan,
    scores: Mapping[int, Sequence[float]],
    expert_mass: Mapping[int, Sequence[float]] | None = None,
) -> tuple[dict[int, list[int]], dict[int, list[str]]]:
    """Per layer: active experts and chosen slice ids, within the plan's budget."""
    active: dict[int, list[int]] = {}
    slices: dict[int, list[str]] = {}
    for layer, lp in plan.layers.items():
        mass = expert_mass.get(layer) if expert_mass is not None else None
        active[layer], slices[layer] = select_layer(lp, scores.get(layer, [0.0] * len(lp.slices)), mass)
    return active, slices


def to_payload(active: Mapping[int, Sequence[int]]) -> dict[str, list[int]]:
    return {f"layer_{layer}": sorted(int(e) for e in experts) for layer, experts in sorted(active.items())}
