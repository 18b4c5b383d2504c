"""The in-flight wishes' summed normalized scores, kept incrementally (pure, numpy).

``ResidencyPolicy.decide`` needs, per layer, the sum over in-flight wishes of
each wish's normalized scores. Recomputing it per decision costs O(wishes x
layers x experts) in the event loop (478 ms at 256 wishes, 48 x 128); these
sums are instead updated when a wish is admitted (added) and released
(subtracted), so a decision costs O(layers x experts) whatever the number of
wishes.

Exactness: each normalized score is rounded once to a fixed-point integer
(``QUANTUM`` = 2**-40) and the sums are int64, so adding and subtracting is
exact and the sums depend only on the set of wishes in flight, never on the
history of admits and releases (no float drift, ever). Bound: a layer's sums
total at most ``len(wishes)`` (each wish's normalized scores sum to 1), far
below int64's range for any realistic number of wishes (< 2**22).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from reap_swap.plan import Plan

QUANTUM_BITS = 40
SCALE = float(1 << QUANTUM_BITS)


def quantized(scores: Sequence[float] | None, n: int, width: int) -> np.ndarray:
    """One layer's scores, clipped at 0, normalized to sum 1 (uniform when all are 0 or missing), as
    fixed-point int64 padded to ``width``; the normalization is the pure-Python one of the seed
    (sequential sum, then one division per score), so equal inputs give equal integers."""
    out = np.zeros(width, dtype=np.int64)
    if n == 0:
        return out
    if scores is None:
        x = np.zeros(n)
    else:
        x = np.asarray(scores, dtype=np.float64).reshape(-1)
        if x.shape[0] > n:
            raise ValueError(f"{x.shape[0]} scores for {n} entries")
    x = np.maximum(x, 0.0)
    total = float(np.cumsum(x)[-1]) if x.size else 0.0  # sequential, as sum() over a list
    norm = x / total if total > 0 else np.full(x.shape[0], 1.0 / max(x.shape[0], 1))
    out[: norm.shape[0]] = np.rint(norm * SCALE).astype(np.int64)
    return out


@dataclass
class WishArrays:
    """One wish as the sums hold it: slice scores [L, S] and, when it has them, expert scores [L, E]."""

    slices: np.ndarray
    experts: np.ndarray | None
    admitted_at: float


class WishSums:
    """Per-layer sums over the wishes in flight, keyed by request id; bounded in size and age (the
    oldest wish goes first, as the ``TTLCache`` this replaces did), so a request that never ends
    cannot bias the union policy forever."""

    def __init__(self, plan: Plan, max_wishes: int = 4096, ttl_s: float = float("inf"), clock: Callable[[], float] = time.monotonic):
        self.plan = plan
        self.layer_ids = list(plan.layers)
        self.num_slices = [len(plan.layers[l].slices) for l in self.layer_ids]
        self.num_experts = [plan.layers[l].num_experts for l in self.layer_ids]
        self.width_s = max(max(self.num_slices, default=0), 1)
        self.width_e = max(self.num_experts, default=0)
        self.max_wishes = max_wishes
        self.ttl_s = ttl_s
        self.clock = clock
        self._entries: OrderedDict[str, WishArrays] = OrderedDict()
        self.slice_sum = np.zeros((len(self.layer_ids), self.width_s), dtype=np.int64)
        self.expert_sum = np.zeros((len(self.layer_ids), self.width_e), dtype=np.int64)
        self.without_experts = 0
        """Wishes in flight that carry no expert scores: while any is, the policy ranks slices."""

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def latest(self) -> WishArrays | None:
        return next(reversed(self._entries.values()), None)

    def arrays(self, wish: "WishLike") -> WishArrays:
        slices = np.stack([quantized(wish.scores.get(l), n, self.width_s) for l, n in zip(self.layer_ids, self.num_slices)]) \
            if self.layer_ids else self.slice_sum.copy()
        experts = None
        if wish.expert_scores:
            experts = np.stack([quantized(wish.expert_scores.get(l), n, self.width_e) for l, n in zip(self.layer_ids, self.num_experts)])
        return WishArrays(slices, experts, self.clock())

    def add(self, key: str, wish: "WishLike") -> None:
        """Admit (or replace) one request's wish; the conversion happens before any state changes."""
        arrays = self.arrays(wish)
        self.discard(key)
        self._entries[key] = arrays
        self.slice_sum += arrays.slices
        if arrays.experts is None:
            self.without_experts += 1
        else:
            self.expert_sum += arrays.experts
        self.expire()
        while len(self._entries) > self.max_wishes:
            self.discard(next(iter(self._entries)))

    def discard(self, key: str) -> bool:
        """Release one request's wish (no-op if it is not in flight)."""
        arrays = self._entries.pop(key, None)
        if arrays is None:
            return False
        self.slice_sum -= arrays.slices
        if arrays.experts is None:
            self.without_experts -= 1
        else:
            self.expert_sum -= arrays.experts
        return True

    def expire(self) -> int:
        """Drop wishes older than ``ttl_s``; returns how many."""
        cutoff = self.clock() - self.ttl_s
        n = 0
        while self._entries:
            key, first = next(iter(self._entries.items()))
            if first.admitted_at > cutoff:
                break
            self.discard(key)
            n += 1
        return n

    def recompute(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The sums from scratch over the wishes in flight (a check: equal to the kept ones, exactly)."""
        s = np.zeros_like(self.slice_sum)
        e = np.zeros_like(self.expert_sum)
        without = 0
        for a in self._entries.values():
            s += a.slices
            if a.experts is None:
                without += 1
            else:
                e += a.experts
        return s, e, without


class WishLike(Protocol):
    """The shape of ``policy.Wish`` (typing only: no import cycle)."""

    scores: Mapping[int, Sequence[float]]
    expert_scores: Mapping[int, Sequence[float]]
