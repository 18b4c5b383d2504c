"""Which experts the backend should hold while several requests are in flight (pure).

The backend has one resident set for every request it is serving. Swapping
to each new request's own set would evict experts the requests already in
flight still route to, and two alternating domains would thrash. The
policy instead:

* scores every expert (or, for wishes that carry only slice scores, every
  slice) by the sum, over in-flight requests, of each request's predicted
  share for it (each request's scores normalized per layer), and selects core
  + the best experts (slices) by that score within the plan's budget: the
  union of the in-flight requests' wishes, trimmed by score;
* keeps the current set when it already captures at least ``1 - hysteresis``
  of the score the new target would (no swap for a marginal gain);
* lets the caller coalesce: equal targets have equal signatures, and a swap
  to the signature already resident or being installed is not issued again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from reap_swap.planning.expert_select import select_experts
from reap_swap.plan import Plan
from reap_swap.selection import select_layer
from reap_swap.server_ext.control.active_set import signature

Resident = dict[int, tuple[int, ...]]


@dataclass
class Wish:
    """One in-flight request's predicted slice scores (per layer, plan order) and, from an
    expert-granular classifier, its per-expert scores (per layer, expert order)."""

    scores: dict[int, list[float]]
    expert_prior: dict[int, Sequence[float]] = field(default_factory=dict)
    expert_scores: dict[int, Sequence[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    target: Resident
    signature: str
    swap: bool
    reason: str
    kept_fraction: float


def _normalized(scores: Sequence[float]) -> list[float]:
    clipped = [max(float(s), 0.0) for s in scores]
    total = sum(clipped)
    return [s / total for s in clipped] if total > 0 else [1.0 / max(len(clipped), 1)] * len(clipped)


MODES = ("union", "latest")


class ResidencyPolicy:
    """``union`` (default) as described above; ``latest`` = every request installs its own set
    (the naive per-request swap the seed did), kept for comparison in the benchmark."""

    def __init__(self, plan: Plan, hysteresis: float = 0.05, mode: str = "union"):
        if not 0 <= hysteresis < 1:
            raise ValueError("hysteresis must be in [0, 1)")
        if mode not in MODES:
            raise ValueError(f"policy must be one of {MODES}")
        self.plan = plan
        self.hysteresis = hysteresis if mode == "union" else 0.0
        self.mode = mode

    def combined_scores(self, wishes: Sequence[Wish]) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for layer, lp in self.plan.layers.items():
            acc = [0.0] * len(lp.slices)
            for w in wishes:
                for j, s in enumerate(_normalized(w.scores.get(layer, [0.0] * len(lp.slices)))):
                    acc[j] += s
            out[layer] = acc
        return out

    def _value(self, layer: int, experts: Sequence[int], slice_scores: Sequence[float]) -> float:
        """Score a resident set captures: each slice counts by the fraction of it resident."""
        have = set(experts)
        lp = self.plan.layers[layer]
        return sum(sc * len(have & set(s.experts)) / len(s.experts) for s, sc in zip(lp.slices, slice_scores) if s.experts)

    def combined_expert_scores(self, wishes: Sequence[Wish]) -> dict[int, list[float]]:
        out: dict[int, list[float]] = {}
        for layer, lp in self.plan.layers.items():
            acc = [0.0] * lp.num_experts
            for w in wishes:
                for e, s in enumerate(_normalized(w.expert_scores.get(layer, [0.0] * lp.num_experts))):
                    acc[e] += s
            out[layer] = acc
        return out

    def decide(self, wishes: Sequence[Wish], current: Mapping[int, tuple[int, ...]], prior: Mapping[int, Sequence[float]] | None = None) -> Decision:
        if not wishes:
            return Decision(dict(current), signature(current), False, "no requests in flight", 1.0)
        if self.mode == "latest":
            wishes = [wishes[-1]]
        per_expert = all(w.expert_scores for w in wishes)
        scores = self.combined_expert_scores(wishes) if per_expert else self.combined_scores(wishes)
        target: Resident = {}
        kept = got = 0.0
        for layer, lp in self.plan.layers.items():
            cur = current.get(layer, lp.core)
            if per_expert:
                chosen = select_experts(lp, scores[layer])
                got += sum(scores[layer][e] for e in chosen)
                kept += sum(scores[layer][e] for e in cur if 0 <= e < lp.num_experts)
            else:
                chosen, _ = select_layer(lp, scores[layer], prior.get(layer) if prior else None)
                got += self._value(layer, chosen, scores[layer])
                kept += self._value(layer, cur, scores[layer])
            target[layer] = tuple(chosen)
        sig = signature(target)
        fraction = kept / got if got > 0 else 1.0
        if sig == signature(current):
            return Decision(target, sig, False, "already resident", 1.0)
        if fraction >= 1.0 - self.hysteresis and all(set(self.plan.layers[l].core) <= set(current.get(l, ())) for l in self.plan.layers):
            return Decision(dict(current), signature(current), False, f"current set keeps {fraction:.1%} of the target's score", fraction)
        return Decision(target, sig, True, f"current set keeps {fraction:.1%} of the target's score", fraction)
