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

from reap_swap.plan import Plan
from reap_swap.server_ext.control.active_set import signature

from .policy_arrays import PlanArrays
from .wish_sums import WishSums

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


MODES = ("union", "latest")


class ResidencyPolicy:
    """``union`` (default) as described above; ``latest`` = every request installs its own set
    (the naive per-request swap the seed did), kept for comparison in the benchmark.

    ``decide_sums`` reads the incrementally kept ``WishSums`` (O(layers x experts) per decision,
    whatever the number of wishes); ``decide`` builds them from a list first (tests, one-offs)."""

    def __init__(self, plan: Plan, hysteresis: float = 0.05, mode: str = "union"):
        if not 0 <= hysteresis < 1:
            raise ValueError("hysteresis must be in [0, 1)")
        if mode not in MODES:
            raise ValueError(f"policy must be one of {MODES}")
        self.plan = plan
        self.hysteresis = hysteresis if mode == "union" else 0.0
        self.mode = mode
        self.layout = PlanArrays(plan)

    def sums(self, wishes: Sequence[Wish]) -> WishSums:
        out = WishSums(self.plan, max_wishes=max(len(wishes), 1))
        for i, w in enumerate(wishes):
            out.add(str(i), w)
        return out

    def decide(self, wishes: Sequence[Wish], current: Mapping[int, tuple[int, ...]], prior: Mapping[int, Sequence[float]] | None = None) -> Decision:
        return self.decide_sums(self.sums(wishes), current, prior)

    def decide_sums(self, sums: WishSums, current: Mapping[int, tuple[int, ...]], prior: Mapping[int, Sequence[float]] | None = None) -> Decision:
        if not len(sums):
            return Decision(dict(current), signature(current), False, "no requests in flight", 1.0)
        if self.mode == "latest":
            last = sums.latest()
            assert last is not None
            per_expert = last.experts is not None
            scores = last.experts if last.experts is not None else last.slices
        else:
            per_expert = sums.without_experts == 0
            scores = sums.expert_sum if per_expert else sums.slice_sum
        if per_expert:
            target, got, kept = self.layout.select_experts(scores, current)
        else:
            target, got, kept = self.layout.select_slices(scores, current, prior)
        sig = signature(target)
        fraction = kept / got if got > 0 else 1.0
        if sig == signature(current):
            return Decision(target, sig, False, "already resident", 1.0)
        if fraction >= 1.0 - self.hysteresis and all(set(self.plan.layers[l].core) <= set(current.get(l, ())) for l in self.plan.layers):
            return Decision(dict(current), signature(current), False, f"current set keeps {fraction:.1%} of the target's score", fraction)
        return Decision(target, sig, True, f"current set keeps {fraction:.1%} of the target's score", fraction)
