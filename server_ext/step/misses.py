"""Router-miss ledger: gate mass that went to non-resident experts, per request.

Fed with per-request sums the worker accumulated on the device from the real
routing (``accounting.py``), when a request finishes or a report is asked
for; read by ``/router_misses/{id}``. Pure numpy, so the
arithmetic and the request-id matching are tested without vLLM.

Request ids: a client's ``X-Request-Id: abc`` becomes ``cmpl-abc-0-1a2b3c4d``
(completions: prefix, prompt index, engine suffix) or ``chatcmpl-abc-1a2b3c4d``
inside vLLM. ``engine_ids_for`` maps the client's id back to those.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from .request_ids import engine_id_matches_exact

ALL_REQUESTS = "__all__"
_ENGINE_PREFIXES = ("cmpl-", "chatcmpl-", "resp-", "generate-tokens-")
_SUFFIX = re.compile(r"(?:-\d+)?(?:-[0-9a-f]{8})?$")


def client_request_id(engine_id: str) -> str:
    """Best-effort inverse of vLLM's request-id decoration (prefix, index, suffix)."""
    core = engine_id
    for prefix in _ENGINE_PREFIXES:
        if core.startswith(prefix):
            core = core[len(prefix) :]
            break
    return _SUFFIX.sub("", core, count=1) or engine_id


def engine_id_matches(engine_id: str, client_id: str) -> bool:
    """Exact: ``engine_id`` is vLLM's decoration of ``client_id`` and of no longer id (``request_ids``)."""
    return engine_id_matches_exact(engine_id, client_id)


@dataclass
class RequestMisses:
    """Accumulated routing of one engine request (all its forward steps)."""

    observed: np.ndarray  # [L] summed routed gate mass
    inactive: np.ndarray  # [L] part of it on non-resident experts
    hits: np.ndarray  # [L, E] routed (token, k) pairs per expert
    miss_hits: np.ndarray  # [L, E] of those, pairs that found the expert non-resident
    expert_mass: np.ndarray  # [L, E] gate mass per expert (any resident set's misses follow from it)
    tokens: int = 0
    steps: int = 0
    promoted: np.ndarray = None  # type: ignore[assignment]  # [L] experts the online cache promoted; zeros when not given
    staged: np.ndarray = None  # type: ignore[assignment]  # [L] experts prefill staging copied (once per layer step); zeros when not given

    def __post_init__(self) -> None:
        if self.promoted is None:
            self.promoted = np.zeros(len(self.observed), np.int64)
        if self.staged is None:
            self.staged = np.zeros(len(self.observed), np.int64)

    @classmethod
    def zeros(cls, layers: int, experts: int) -> "RequestMisses":
        return cls(
            np.zeros(layers), np.zeros(layers), np.zeros((layers, experts), np.int64), np.zeros((layers, experts), np.int64),
            np.zeros((layers, experts)),
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (every entry of a ledger has the same shapes)."""
        return sum(a.nbytes for a in (self.observed, self.inactive, self.hits, self.miss_hits, self.expert_mass, self.promoted, self.staged))

    def add(self, other: "RequestMisses") -> None:
        self.observed += other.observed
        self.inactive += other.inactive
        self.hits += other.hits
        self.miss_hits += other.miss_hits
        self.expert_mass += other.expert_mass
        self.tokens += other.tokens
        self.steps += other.steps
        self.promoted = self.promoted + other.promoted
        self.staged = self.staged + other.staged


class MissLedger:
    """Bounded per-request accumulator plus an all-requests total."""

    def __init__(self, layer_ids: list[int], num_experts: int, max_requests: int = 1024, expert_bytes: int = 0):
        self.layer_ids = list(layer_ids)
        self.expert_bytes = expert_bytes  # bytes one promotion copies over the host link
        self.num_experts = num_experts
        self.max_requests = max_requests
        self._requests: OrderedDict[str, RequestMisses] = OrderedDict()
        self._total = RequestMisses.zeros(len(layer_ids), num_experts)
        self._entry_bytes = self._total.nbytes
        self.evicted = 0

    def add(self, request_id: str, misses: RequestMisses) -> None:
        """Book routing accumulated for one engine request (one or more steps)."""
        entry = self._requests.get(request_id)
        if entry is None:
            entry = RequestMisses.zeros(len(self.layer_ids), self.num_experts)
            self._requests[request_id] = entry
        else:
            self._requests.move_to_end(request_id)
        entry.add(misses)
        self._total.add(misses)
        while len(self._requests) > self.max_requests:
            self._requests.popitem(last=False)
            self.evicted += 1

    def record_step(
        self,
        request_ids: list[str],
        tokens: np.ndarray,
        observed: np.ndarray,
        inactive: np.ndarray,
        hits: np.ndarray,
        miss_hits: np.ndarray,
        expert_mass: np.ndarray | None = None,
    ) -> None:
        """One forward step: arrays are [R], [L, R], [L, R], then [L, R, E] each."""
        if expert_mass is None:
            expert_mass = np.zeros(hits.shape)
        for r, rid in enumerate(request_ids):
            self.add(
                rid,
                RequestMisses(
                    observed[:, r].astype(np.float64),
                    inactive[:, r].astype(np.float64),
                    hits[:, r].astype(np.int64),
                    miss_hits[:, r].astype(np.int64),
                    expert_mass[:, r].astype(np.float64),
                    int(tokens[r]),
                    1,
                ),
            )

    def stats(self) -> dict[str, int]:
        """Entries held and the bytes of their arrays (the all-requests total excluded): what the ledger
        costs this worker, for ``/reap/status`` (``worker.miss_ledger``); O(1), no flush."""
        n = len(self._requests)
        return {"entries": n, "bytes": n * self._entry_bytes, "bytes_per_entry": self._entry_bytes,
                "max_entries": self.max_requests, "evicted": self.evicted}

    def engine_ids_for(self, client_id: str) -> list[str]:
        if client_id == ALL_REQUESTS:
            return list(self._requests)
        return [rid for rid in self._requests if engine_id_matches(rid, client_id)]

    def collect(self, client_id: str) -> RequestMisses | None:
        if client_id == ALL_REQUESTS:
            return self._total
        ids = self.engine_ids_for(client_id)
        if not ids:
            return None
        acc = RequestMisses.zeros(len(self.layer_ids), self.num_experts)
        for rid in ids:
            acc.add(self._requests[rid])
        return acc

    def reset(self, client_id: str) -> int:
        if client_id == ALL_REQUESTS:
            n = len(self._requests)
            self._requests.clear()
            self._total = RequestMisses.zeros(len(self.layer_ids), self.num_experts)
            return n
        ids = self.engine_ids_for(client_id)
        for rid in ids:
            del self._requests[rid]
        return len(ids)

    def report(self, client_id: str) -> dict[str, Any] | None:
        acc = self.collect(client_id)
        if acc is None:
            return None
        return summarize(self.layer_ids, acc, self.engine_ids_for(client_id) if client_id != ALL_REQUESTS else [], self.expert_bytes)


def summarize(layer_ids: Iterable[int], acc: RequestMisses, engine_ids: list[str], expert_bytes: int = 0) -> dict[str, Any]:
    """The seed's ``by_layer`` / ``summary`` shape, plus expert-level counts and online-cache promotions
    (hits and misses are as routed, before any promotion)."""
    by_layer: dict[str, Any] = {}
    promoted = acc.promoted
    for i, layer in enumerate(layer_ids):
        obs, ina = float(acc.observed[i]), float(acc.inactive[i])
        missed = np.nonzero(acc.miss_hits[i])[0]
        by_layer[f"layer_{layer}"] = {
            "observed_mass": obs,
            "inactive_mass": ina,
            "inactive_ratio": ina / obs if obs > 0 else 0.0,
            "inactive_experts": [int(e) for e in missed],
            "routed_pairs": int(acc.hits[i].sum()),
            "missed_pairs": int(acc.miss_hits[i].sum()),
            "expert_mass": [round(float(x), 6) for x in acc.expert_mass[i]],
            "promoted_experts": int(promoted[i]),
            "staged_experts": int(acc.staged[i]),
        }
    obs_total, ina_total = float(acc.observed.sum()), float(acc.inactive.sum())
    return {
        "by_layer": by_layer,
        "summary": {
            "observed_mass_total": obs_total,
            "inactive_mass_total": ina_total,
            "inactive_ratio": ina_total / obs_total if obs_total > 0 else 0.0,
            "inactive_expert_total": int(sum(len(v["inactive_experts"]) for v in by_layer.values())),
            "routed_pairs": int(acc.hits.sum()),
            "missed_pairs": int(acc.miss_hits.sum()),
            "pair_miss_ratio": float(acc.miss_hits.sum() / acc.hits.sum()) if acc.hits.sum() else 0.0,
            "promoted_experts": int(promoted.sum()),
            "promotion_link_bytes": int(promoted.sum()) * int(expert_bytes),
            # Prefill staging: each staged expert crossed the link once per layer step (its pairs are still
            # counted in missed_pairs, as routed, and so in link_bytes' upper bound below).
            "staged_experts": int(acc.staged.sum()),
            "staging_link_bytes": int(acc.staged.sum()) * int(expert_bytes),
            # Each missed pair's expert crosses the host link once: read by the kernel over UVA, or
            # copied by its promotion (which replaces that read). Exact for one token per step (batch-1
            # decode); an upper bound when tokens of one step share a missed expert.
            "link_bytes": int(acc.miss_hits.sum()) * int(expert_bytes),
            "tokens": int(acc.tokens),
            "steps": int(acc.steps),
        },
        "engine_request_ids": engine_ids,
    }
