"""The online cache's counters per workload of one engine (``bench-gpu --also-trace`` runs two on one engine)."""

from __future__ import annotations

from typing import Any

CACHE_COUNTERS = ("promotions", "evictions", "promotion_link_bytes")
"""The online cache's counters that grow over the engine's life; an arm reports them per workload."""


def cache_states(llm: Any) -> list[dict[str, Any]]:
    """Each rank's online-cache report (``reap_state``), without its per-layer detail."""
    return [{k: v for k, v in (s.get("online_cache") or {}).items() if k != "by_layer"} for s in llm.collective_rpc("reap_state")]


def cache_since(end: dict[str, Any], start: dict[str, Any]) -> dict[str, Any]:
    """``end``'s report with its counters counted from ``start``: the second workload of an engine (``--also-trace``)
    does not report the first's promotions as its own."""
    return {**{k: v - start.get(k, 0) if k in CACHE_COUNTERS and v is not None else v for k, v in end.items()},
            "counters_from": "this workload's start (its warm-up and accounting passes included)"}
