"""Expert sets for the GPU benchmark's learned-routing arms, and their offline score on routing traces (pure).

The GPU benchmark replays recorded routing (``trace_routing.py``) and installs,
per MoE layer, ``S = round(fraction x E)`` resident experts. This module says
which experts each learned-routing arm installs and what routed-pair hit rate
each one reaches on a trace, counted the way the server's accounting counts it
(``/router_misses``: every (token, layer, k) routed pair is a hit when its
expert is resident; rates pool the pairs of every request of a run):

* ``static_topk``: per layer the S experts with the most summed gate mass over
  the observation's training samples (the ``llm_probe.top_mass_target`` rule);
* ``plan``: what a proxy holding the plan but no classifier installs with no
  prompt information: its prior wish (every slice scored equal) through the
  proxy's policy, i.e. the core + the plan's slices in catalogue order
  (heaviest ``activationMass`` first) while they fit, the last one trimmed to
  its lowest ids (``selection.select_layer``);
* ``classifier_prior``: what the proxy installs with the classifier loaded but
  no usable prediction (classification over budget): core + the experts of
  the highest mean training share (the classifier's ``expert_prior``);
* ``classifier`` / ``classifier_bs8``: the proxy's policy (``proxy/policy.py``,
  per-expert union, hysteresis) fed the classifier's per-expert scores, replayed
  over the trace in order: one request in flight at a time, or each
  consecutive group of 8 requests in flight together;
* ``classifier_bs<B>`` / ``oracle_bs<B>`` (``learned-sets --extra-batches B``): the same
  over each consecutive group of B requests in flight (``groups_bs<B>``);
* ``oracle`` / ``oracle_bs8``: each request's (group's) own top-S experts by
  decode gate mass: the most decode gate mass any S experts per layer can
  capture for it (the pair hit rate is not bounded by it: a set chosen for mass
  may route fewer pairs than one chosen for counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from reap_swap.plan import Plan
from reap_swap.planning.expert_select import top_experts
from reap_swap.planning.traces import DECODE, PREFILL, RoutingTrace
from reap_swap.proxy.policy import ResidencyPolicy, Wish
from reap_swap.selection import to_payload

Sets = dict[int, list[int]]
"""MoE layer index (the model's, as the plan and the swap API use) -> sorted resident experts."""
SetsFor = Callable[[int], Mapping[int, Sequence[int]]]
"""Trace request index -> the set resident while it runs."""


class SetsError(ValueError):
    pass


def slots_for(fraction: float, num_experts: int) -> int:
    """Resident experts per layer for a share of the layer's experts (the bench-gpu rule)."""
    if not 0 < fraction <= 1:
        raise SetsError(f"--slots-fraction must be in (0, 1], got {fraction}")
    return max(1, round(fraction * num_experts))


def payload(sets: Mapping[int, Sequence[int]]) -> dict[str, list[int]]:
    """``{"layer_<i>": [experts]}``: the swap target format of ``/swap_active_set`` and the worker RPC."""
    return to_payload(sets)


def top_sets(mass: np.ndarray, layer_ids: Sequence[int], slots: int) -> Sets:
    """Per layer the ``slots`` experts with the largest ``mass`` ([L, E]; ties: lower id)."""
    if mass.shape[0] != len(layer_ids):
        raise SetsError(f"mass has {mass.shape[0]} layers, {len(layer_ids)} layer ids given")
    return {int(layer): top_experts(mass[li], slots) for li, layer in enumerate(layer_ids)}


def static_topk(sample_mass: np.ndarray, layer_ids: Sequence[int], slots: int) -> Sets:
    """Top-``slots`` experts per layer by gate mass summed over samples ([N, L, E] per-sample mass)."""
    return top_sets(np.asarray(sample_mass, dtype=np.float64).sum(axis=0), layer_ids, slots)


def check_capacity(plan: Plan, slots: int) -> None:
    """Every layer of the plan holds exactly ``slots`` experts (core + specialist)."""
    bad = {l: lp.resident_capacity for l, lp in plan.layers.items() if lp.resident_capacity != slots}
    if bad:
        raise SetsError(f"plan layers hold {sorted(set(bad.values()))} experts, not {slots}: layers {sorted(bad)[:6]}...")


def prior_of(plan: Plan, expert_prior: np.ndarray | None) -> dict[int, Sequence[float]]:
    """The coordinator's ``prior`` argument (as ``proxy/app.py`` builds it): {} without a classifier."""
    if expert_prior is None:
        return {}
    return {layer: expert_prior[li] for li, layer in enumerate(plan.layer_ids())}


@dataclass
class Replay:
    """Sets the policy holds after each group of wishes, and why (``swap`` or the reason it kept)."""

    sets: list[Sets] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    @property
    def swaps(self) -> int:
        return sum(r == "swap" for r in self.reasons)


def replay_policy(policy: ResidencyPolicy, groups: Sequence[Sequence[Wish]], prior: Mapping[int, Sequence[float]],
                  start: Mapping[int, Sequence[int]] | None = None) -> Replay:
    """Feed ``policy.decide`` one group of in-flight wishes after another, as the proxy's coordinator does.

    The resident set starts at the plan's core (``serve`` starts with ``--start-resident core``);
    each group's wishes are all the requests in flight (earlier groups have finished and released theirs).
    """
    current: dict[int, tuple[int, ...]] = {l: tuple(v) for l, v in (start or policy.plan.core_set()).items()}
    out = Replay()
    for wishes in groups:
        d = policy.decide(list(wishes), current, prior)
        current = {l: tuple(v) for l, v in d.target.items()}
        out.sets.append({l: sorted(int(e) for e in v) for l, v in sorted(current.items())})
        out.reasons.append("swap" if d.swap else d.reason)
    return out


def static_policy_set(policy: ResidencyPolicy, wish: Wish, prior: Mapping[int, Sequence[float]]) -> Sets:
    """The set one wish installs on a server that holds the core (the proxy's first install)."""
    return replay_policy(policy, [[wish]], prior).sets[0]


def groups_of(n: int, size: int) -> list[list[int]]:
    """Consecutive groups of ``size`` request indices (the last may be smaller)."""
    if size < 1:
        raise SetsError("group size must be >= 1")
    return [list(range(a, min(a + size, n))) for a in range(0, n, size)]


def routed_mass(ids: np.ndarray, weights: np.ndarray, num_experts: int) -> np.ndarray:
    """[L, E] summed gate weight of the routed pairs of ``ids`` / ``weights`` ([T, L, K])."""
    num_layers = ids.shape[1]
    flat = ids.astype(np.int64) + num_experts * np.arange(num_layers)[None, :, None]
    total = np.bincount(flat.ravel(), weights=weights.astype(np.float64).ravel(), minlength=num_layers * num_experts)
    return total.reshape(num_layers, num_experts)


def request_rows(trace: RoutingTrace, r: int, phase: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights) of request ``r``'s rows, of one phase or all."""
    a, b = int(trace.offsets[r]), int(trace.offsets[r + 1])
    ids, w = trace.ids[a:b], trace.weights[a:b]
    if phase is None:
        return ids, w
    keep = trace.phase[a:b] == phase
    return ids[keep], w[keep]


def oracle_sets(trace: RoutingTrace, requests: Sequence[int], slots: int) -> Sets:
    """Top-``slots`` experts per layer by the requests' own decode gate mass (all their rows if none decoded)."""
    layers = [int(x) for x in trace.meta["moe_layers"]]
    mass = np.zeros((trace.num_layers, trace.num_experts))
    for r in requests:
        mass += routed_mass(*request_rows(trace, r, DECODE), trace.num_experts)
    if mass.sum() <= 0:
        for r in requests:
            mass += routed_mass(*request_rows(trace, r), trace.num_experts)
    return top_sets(mass, layers, slots)


def resident_mask(sets: Mapping[int, Sequence[int]], layer_ids: Sequence[int], num_experts: int, slots: int | None = None) -> np.ndarray:
    """[L, E] bool in trace layer order; refuses a missing layer, bad or duplicate ids, or a size other than ``slots``."""
    mask = np.zeros((len(layer_ids), num_experts), dtype=bool)
    for li, layer in enumerate(layer_ids):
        if layer not in sets:
            raise SetsError(f"no set for layer {layer}")
        experts = [int(e) for e in sets[layer]]
        if len(set(experts)) != len(experts) or any(not 0 <= e < num_experts for e in experts):
            raise SetsError(f"layer {layer}: duplicate or out-of-range experts in {experts}")
        if slots is not None and len(experts) != slots:
            raise SetsError(f"layer {layer}: {len(experts)} experts, expected {slots}")
        mask[li, experts] = True
    return mask


def tally(ids: np.ndarray, weights: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """[hit pairs, routed pairs, hit gate mass, routed gate mass] of ``ids`` / ``weights`` [T, L, K] under ``mask`` [L, E]."""
    if ids.size == 0:
        return np.zeros(4)
    hit = mask[np.arange(mask.shape[0])[None, :, None], ids.astype(np.int64)]
    w = weights.astype(np.float64)
    return np.array([float(hit.sum()), float(hit.size), float(w[hit].sum()), float(w.sum())])


def _ratio(a: float, b: float) -> float | None:
    return float(a / b) if b > 0 else None


def score(trace: RoutingTrace, sets_for: SetsFor, slots: int | None = None, requests: Sequence[int] | None = None) -> dict[str, float | int | None]:
    """Routed-pair hit rates, decode and prefill rows apart, with request ``r`` served by ``sets_for(r)``.

    Pairs are pooled over the requests (what the server's ``__all__`` accounting sums over a run);
    ``gate_mass_hit_*`` is the share of routed gate weight on resident experts.
    """
    layers = [int(x) for x in trace.meta["moe_layers"]]
    dec, pre = np.zeros(4), np.zeros(4)
    chosen = list(range(trace.num_requests)) if requests is None else list(requests)
    for r in chosen:
        mask = resident_mask(sets_for(r), layers, trace.num_experts, slots)
        dec += tally(*request_rows(trace, r, DECODE), mask)
        pre += tally(*request_rows(trace, r, PREFILL), mask)
    return {"hit_rate_decode": _ratio(dec[0], dec[1]), "hit_rate_prefill": _ratio(pre[0], pre[1]),
            "gate_mass_hit_decode": _ratio(dec[2], dec[3]), "gate_mass_hit_prefill": _ratio(pre[2], pre[3]),
            "decode_pairs": int(dec[1]), "prefill_pairs": int(pre[1]), "requests": len(chosen)}


def fixed(sets: Mapping[int, Sequence[int]]) -> SetsFor:
    """Every request served by the same set."""
    return lambda r: sets


def per_request(sets: Sequence[Mapping[int, Sequence[int]]]) -> SetsFor:
    """Request ``r`` served by ``sets[r]``."""
    return lambda r: sets[r]


def grouped(group_sets: Sequence[Mapping[int, Sequence[int]]], size: int) -> SetsFor:
    """Consecutive groups of ``size`` requests share one set (group ``r // size``)."""
    return lambda r: group_sets[r // size]


def format_table(scores: Mapping[str, Mapping[str, Mapping[str, object]]]) -> str:
    """Markdown: one row per arm; decode hit, prefill hit and decode gate-mass hit per trace."""
    traces = list(scores)
    arms = list(dict.fromkeys(a for t in traces for a in scores[t]))
    lines = ["| arm | " + " | ".join(f"{t} decode hit | {t} prefill hit | {t} decode mass" for t in traces) + " |",
             "|---|" + "---:|" * (3 * len(traces))]

    def cell(v: object) -> str:
        return f"{v:.3f}" if isinstance(v, float) else "–"

    for arm in arms:
        row = []
        for t in traces:
            s = scores[t].get(arm, {})
            row += [cell(s.get("hit_rate_decode")), cell(s.get("hit_rate_prefill")), cell(s.get("gate_mass_hit_decode"))]
        lines.append(f"| {arm} | " + " | ".join(row) + " |")
    return "\n".join(lines)
