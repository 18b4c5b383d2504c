"""Expert cache policies for one MoE layer, as the simulator replays them (pure numpy).

Every policy sees the same stream: per step the distinct experts the step
routes to (``routed``, with their gate mass), one step per decoded token and
one per prefill; after a request's prefill, ``begin_request`` with the
prompt's routing mass (what the server knows once prefill has run: a
stand-in for a prompt prior). ``access`` returns which routed experts were resident
*before* the step (hits as routed) and updates the resident set; promotions of
an expert the step routed cost no extra link bytes (issue: promote on miss —
the bytes cross the link anyway), others cost one expert each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class StepResult:
    hits: np.ndarray  # bool per routed expert
    promoted: int
    promoted_unrouted: int  # promotions whose bytes were not read by the step anyway
    evicted: int = 0  # residents dropped to make room (reported by the capped LFRU)


class CachePolicy:
    """Base: a fixed resident set (``static``)."""

    name = "static"

    def __init__(self, slots: int, num_experts: int, initial: np.ndarray | None = None):
        self.slots = slots
        self.num_experts = num_experts
        self.resident = np.zeros(num_experts, dtype=bool)
        if initial is not None:
            self.resident[np.asarray(initial[:slots], dtype=np.int64)] = True

    def begin_request(self, prompt_mass: np.ndarray) -> int:
        """Called once a request's prefill has routed; returns promotions made."""
        return 0

    def access(self, routed: np.ndarray, mass: np.ndarray) -> StepResult:
        return StepResult(self.resident[routed].copy(), 0, 0)

    def _set_resident(self, chosen: np.ndarray, routed: np.ndarray | None = None) -> tuple[int, int]:
        new = np.zeros(self.num_experts, dtype=bool)
        new[chosen] = True
        added = new & ~self.resident
        self.resident = new
        unrouted = added.copy()
        if routed is not None:
            unrouted[routed] = False
        return int(added.sum()), int(unrouted.sum())


def top_by_mass(mass: np.ndarray, k: int) -> np.ndarray:
    order = np.lexsort((np.arange(len(mass)), -mass))
    return order[:k]


class PromptPrior(CachePolicy):
    """Each request: the top experts of its own prompt routing, kept for the whole request."""

    name = "prompt_prior"

    def begin_request(self, prompt_mass: np.ndarray) -> int:
        return self._set_resident(top_by_mass(prompt_mass, self.slots))[0]


class LRU(CachePolicy):
    """Promote every miss, evict the least recently routed expert the step does not route."""

    name = "lru"

    def __init__(self, slots: int, num_experts: int, initial: np.ndarray | None = None):
        super().__init__(slots, num_experts, initial)
        self.last = np.full(num_experts, -1.0)
        self.clock = 0.0

    def _score(self) -> np.ndarray:
        return self.last

    def _touch(self, routed: np.ndarray, mass: np.ndarray) -> None:
        self.clock += 1.0
        self.last[routed] = self.clock

    def access(self, routed: np.ndarray, mass: np.ndarray) -> StepResult:
        hits = self.resident[routed].copy()
        self._touch(routed, mass)
        promoted = 0
        if self.slots:
            for e in routed[~hits]:
                if self.resident.sum() >= self.slots:
                    candidates = np.flatnonzero(self.resident & ~np.isin(np.arange(self.num_experts), routed))
                    if candidates.size == 0:
                        break
                    victim = candidates[np.argmin(self._score()[candidates])]
                    self.resident[victim] = False
                self.resident[e] = True
                promoted += 1
        return StepResult(hits, promoted, 0)


class LFRU(LRU):
    """Promote every miss; evict the lowest decayed routing frequency (frequency with recency).

    With ``cap`` set this is the device policy of ``server_ext/cache/online_cache.py``, rule for rule:
    at most ``cap`` promotions per step; candidates are the step's misses by score (highest
    first, ties to the lower id), victims are free slots first, then residents the step does
    not route and ``protected`` does not hold, by score (lowest first, ties to the lower id);
    pair i is taken while ``cand > victim + hysteresis`` (``None``: always, as uncapped LFRU).
    ``dtype=np.float32`` makes the scores round exactly as the device's do.
    """

    name = "lfru"

    def __init__(
        self,
        slots: int,
        num_experts: int,
        initial: np.ndarray | None = None,
        decay: float = 0.9,
        cap: int | None = None,
        hysteresis: float | None = None,
        protected: np.ndarray | None = None,
        dtype: type = np.float64,
    ):
        super().__init__(slots, num_experts, initial)
        self.count = np.zeros(num_experts, dtype=dtype)
        self.decay = dtype(decay)
        self.cap, self.hysteresis = cap, hysteresis
        self.protected = np.zeros(num_experts, dtype=bool)
        if protected is not None:
            self.protected[np.asarray(protected, dtype=np.int64)] = True

    def _score(self) -> np.ndarray:
        return self.count

    def _touch(self, routed: np.ndarray, mass: np.ndarray) -> None:
        self.count *= self.decay
        self.count[routed] += self.count.dtype.type(1.0)

    def access(self, routed: np.ndarray, mass: np.ndarray, exclude: np.ndarray | None = None) -> StepResult:
        """``exclude`` (capped only): experts never candidates this step (composed mode: the CPU computes them)."""
        if self.cap is None:
            return super().access(routed, mass)
        hits = self.resident[routed].copy()
        self._touch(routed, mass)
        in_step = np.zeros(self.num_experts, dtype=bool)
        in_step[routed] = True
        wanted = in_step & ~self.resident
        if exclude is not None:
            wanted[np.asarray(exclude, dtype=np.int64)] = False
        cand = np.flatnonzero(wanted)
        cand = cand[np.argsort(-self.count[cand], kind="stable")][: self.cap]
        free = self.slots - int(self.resident.sum())
        victims = np.flatnonzero(self.resident & ~in_step & ~self.protected)
        victims = victims[np.argsort(self.count[victims], kind="stable")]
        promoted = evicted = 0
        h = self.count.dtype.type(-np.inf if self.hysteresis is None else self.hysteresis)
        for i, e in enumerate(cand):
            if i < free:
                self.resident[e] = True
                promoted += 1
                continue
            j = i - free
            if j >= victims.size or not self.count[e] > self.count[victims[j]] + h:
                break
            self.resident[victims[j]] = False
            self.resident[e] = True
            promoted += 1
            evicted += 1
        return StepResult(hits, promoted, 0, evicted)


class DecayedCounters(CachePolicy):
    """Strata's adaptive-tier rule: a non-resident expert is a candidate once its decayed count
    reaches ``threshold``; candidates fill free slots, then replace the coldest resident only
    while ``count >= victim + hysteresis``; at most ``cap`` promotions per step; counts decay
    every step. Misses that do not qualify are served over the link (optional admission)."""

    name = "decayed_counters"

    def __init__(
        self,
        slots: int,
        num_experts: int,
        initial: np.ndarray | None = None,
        decay: float = 0.9,
        threshold: float = 2.0,
        hysteresis: float = 1.0,
        cap: int = 2,
    ):
        super().__init__(slots, num_experts, initial)
        self.count = np.zeros(num_experts)
        self.decay, self.threshold, self.hysteresis, self.cap = decay, threshold, hysteresis, cap

    def access(self, routed: np.ndarray, mass: np.ndarray) -> StepResult:
        hits = self.resident[routed].copy()
        self.count[routed] += 1.0
        promoted = unrouted = 0
        if self.slots:
            cand = np.flatnonzero(~self.resident & (self.count >= self.threshold))
            cand = cand[np.argsort(-self.count[cand], kind="stable")]
            routed_mask = np.zeros(self.num_experts, dtype=bool)
            routed_mask[routed] = True
            for e in cand[: self.cap]:
                if self.resident.sum() >= self.slots:
                    res = np.flatnonzero(self.resident & ~routed_mask)
                    if res.size == 0:
                        break
                    victim = res[np.argmin(self.count[res])]
                    if self.count[e] < self.count[victim] + self.hysteresis:
                        break
                    self.resident[victim] = False
                self.resident[e] = True
                promoted += 1
                unrouted += int(not routed_mask[e])
        self.count *= self.decay
        return StepResult(hits, promoted, unrouted)


class PriorDecayedCounters(DecayedCounters):
    """Decayed counters whose state each request starts from the prompt prior, blended at
    ``prior_weight`` of the counters' steady-state mass (top_k / (1 - decay)), so the
    conversation overrides it within a few dozen tokens; the prior's top experts are installed."""

    name = "prior_decayed"

    def __init__(self, slots: int, num_experts: int, initial: np.ndarray | None = None, top_k: int = 8, prior_weight: float = 1.0, **kw: float):
        super().__init__(slots, num_experts, initial, **kw)  # type: ignore[arg-type]
        self.top_k, self.prior_weight = top_k, prior_weight

    def begin_request(self, prompt_mass: np.ndarray) -> int:
        total = prompt_mass.sum()
        if total <= 0:
            return 0
        steady = self.top_k / (1.0 - self.decay)
        self.count = 0.5 * self.count + self.prior_weight * steady * prompt_mass / total
        return self._set_resident(top_by_mass(self.count, self.slots))[0]


def belady_hits(steps: list[np.ndarray], num_experts: int, slots: int) -> tuple[list[np.ndarray], int]:
    """Optimal replacement with optional admission (a miss may bypass the cache): per step,
    hits as routed, and the number of admissions. On a miss, admit the expert only if its next
    use comes before the furthest next use among resident experts the step does not route."""
    never = len(steps) + 1
    next_use = np.full(num_experts, never, dtype=np.int64)
    nexts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * len(steps)
    for t in range(len(steps) - 1, -1, -1):
        nexts[t] = next_use.copy()  # next use strictly after step t
        next_use[steps[t]] = t
    resident = np.zeros(num_experts, dtype=bool)
    out, admitted = [], 0
    for t, routed in enumerate(steps):
        hits = resident[routed].copy()
        out.append(hits)
        nu = nexts[t]
        in_step = np.zeros(num_experts, dtype=bool)
        in_step[routed] = True
        for e in sorted(routed[~hits], key=lambda x: nu[x]):
            if nu[e] >= never:
                continue
            if resident.sum() < slots:
                resident[e] = True
                admitted += 1
                continue
            res = np.flatnonzero(resident & ~in_step)
            if res.size == 0:
                break
            victim = res[np.argmax(nu[res])]
            if nu[e] < nu[victim]:
                resident[victim] = False
                resident[e] = True
                admitted += 1
    return out, admitted
