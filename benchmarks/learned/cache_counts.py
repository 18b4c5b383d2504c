"""Counters that grow over an engine's life, reported per workload (``bench-gpu --also-trace`` runs two workloads on
one engine, and the second must not report the first's promotions or exchanges as its own)."""

from __future__ import annotations

from typing import Any

CACHE_COUNTERS = ("promotions", "evictions", "promotion_link_bytes")
"""The online cache's counters that grow over the engine's life."""


def cache_states(states: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's online-cache report from its ``reap_state``, without its per-layer detail."""
    return [{k: v for k, v in (s.get("online_cache") or {}).items() if k != "by_layer"} for s in states]


def counted_from(end: dict[str, Any], start: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """``end`` with its counters ``names`` counted from ``start``; None where either side has none or the counter went
    back (a reset in between)."""
    def since(k: str, v: Any) -> Any:
        s = start.get(k, 0)
        return None if v is None or s is None or v < s else v - s

    return {k: since(k, v) if k in names else v for k, v in end.items()}


def cache_since(end: dict[str, Any], start: dict[str, Any]) -> dict[str, Any]:
    """An online-cache report counted from the workload's start; the start's own counters beside it."""
    return {**counted_from(end, start, CACHE_COUNTERS), "counters_at_start": {k: start.get(k, 0) for k in CACHE_COUNTERS},
            "counters_from": "this workload's start (its warm-up, accounting and timed passes; any profiled decode after them)"}


def complement_since(end: dict[str, Any] | None, start: dict[str, Any] | None) -> dict[str, Any] | None:
    """A RAM-complement report whose exchange counters count from the workload's start."""
    if not end or start is None:
        return end
    counters = end.get("counters") or {}
    return {**end, "counters": counted_from(counters, start.get("counters") or {}, tuple(counters)),
            "counters_from": "this workload's start"}
