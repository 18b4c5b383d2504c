"""The policy's selection on summed scores, vectorized over layers (pure, numpy).

Same rules as ``planning.expert_select.select_experts`` (core, then the
highest-scored experts, ties to the lower id) and ``selection.select_layer``
(core, then slices by descending score, whole while they fit, then the
heaviest experts of the next slice by prior mass), run on the int64 sums of
``wish_sums`` for all layers at once: per decision a few array operations
instead of Python loops over every expert of every layer.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from reap_swap.plan import Plan

Resident = dict[int, tuple[int, ...]]
_CACHE = 8


class PlanArrays:
    """The plan as arrays: per layer core mask, slot room, and each expert's slice."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.layer_ids = list(plan.layers)
        lps = [plan.layers[l] for l in self.layer_ids]
        n_l = len(lps)
        self.width_e = max((lp.num_experts for lp in lps), default=0)
        self.width_s = max(max((len(lp.slices) for lp in lps), default=0), 1)
        self.core = np.zeros((n_l, self.width_e), dtype=bool)
        self.pad = np.ones((n_l, self.width_e), dtype=bool)
        self.slice_of = np.full((n_l, self.width_e), -1, dtype=np.int64)
        self.slice_size = np.ones((n_l, self.width_s), dtype=np.float64)
        self.room = np.zeros(n_l, dtype=np.int64)
        for i, lp in enumerate(lps):
            self.pad[i, : lp.num_experts] = False
            self.core[i, list(lp.core)] = True
            self.room[i] = lp.resident_capacity - len(set(lp.core))
            for j, s in enumerate(lp.slices):
                self.slice_of[i, list(s.experts)] = j
                self.slice_size[i, j] = len(s.experts)
        self._current: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _current_arrays(self, current: Mapping[int, tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, cols) of every valid resident expert, duplicates kept (the expert path sums them so),
        and per layer the count of distinct resident experts of each slice; cached per resident set."""
        key = repr(sorted((l, tuple(v)) for l, v in current.items()))
        hit = self._current.get(key)
        if hit is not None:
            return hit
        rows: list[int] = []
        cols: list[int] = []
        counts = np.zeros((len(self.layer_ids), self.width_s), dtype=np.float64)
        for i, layer in enumerate(self.layer_ids):
            lp = self.plan.layers[layer]
            cur = [int(e) for e in current.get(layer, lp.core) if 0 <= int(e) < lp.num_experts]
            rows += [i] * len(cur)
            cols += cur
            of = self.slice_of[i, sorted(set(cur))]
            counts[i] += np.bincount(of[of >= 0], minlength=counts.shape[1])[: counts.shape[1]]
        out = (np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64), counts)
        if len(self._current) >= _CACHE:
            self._current.pop(next(iter(self._current)))
        self._current[key] = out
        return out

    def select_experts(self, scores: np.ndarray, current: Mapping[int, tuple[int, ...]]) -> tuple[Resident, float, float]:
        """Per layer core + the ``room`` best other experts; (target, score it gets, score ``current`` keeps)."""
        key = np.where(self.core, -1, scores)
        key[self.pad] = -2  # after the core: never chosen (room <= the layer's non-core experts)
        order = np.argsort(-key, axis=1, kind="stable")  # stable: equal scores, lower id first
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(order.shape[1])[None, :].repeat(order.shape[0], 0), axis=1)
        chosen = self.core | (rank < self.room[:, None])
        target = {layer: tuple(np.flatnonzero(chosen[i]).tolist()) for i, layer in enumerate(self.layer_ids)}
        got = float(int(scores[chosen].sum()))
        rows, cols, _ = self._current_arrays(current)
        kept = float(int(scores[rows, cols].sum()))
        return target, got, kept

    def select_slices(self, scores: np.ndarray, current: Mapping[int, tuple[int, ...]],
                      prior: Mapping[int, Sequence[float]] | None) -> tuple[Resident, float, float]:
        """Per layer core + slices by descending score (the last one trimmed by prior mass); the scores
        captured count each slice by the fraction of it resident."""
        target: Resident = {}
        counts = np.zeros((len(self.layer_ids), self.width_s), dtype=np.float64)
        for i, layer in enumerate(self.layer_ids):
            lp = self.plan.layers[layer]
            sc = scores[i, : len(lp.slices)]
            chosen = list(lp.core)
            room = int(self.room[i])
            mass = prior.get(layer) if prior else None
            for j in np.argsort(-sc, kind="stable").tolist():
                if room <= 0:
                    break
                experts = list(lp.slices[j].experts)
                if len(experts) > room:
                    experts = sorted(experts, key=lambda e: (-(float(mass[e]) if mass is not None else 0.0), e))[:room]
                chosen += experts
                counts[i, j] = len(experts)
                room -= len(experts)
            target[layer] = tuple(sorted(chosen))
        weights = scores[:, : counts.shape[1]].astype(np.float64) / self.slice_size
        got = float((weights * counts).sum())
        kept = float((weights * self._current_arrays(current)[2]).sum())
        return target, got, kept
