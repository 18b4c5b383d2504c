"""Residency metrics in Prometheus text, appended to vLLM's own ``/metrics`` (pure: dicts in, bytes out).

Why: operators scrape ``/metrics``; the residency counters (swaps, router misses as routed,
online-cache promotions, RAM-complement exchanges, bank sizes) live in the workers and reach
the API process only through RPCs, so they are read at scrape time (never per step) and
rendered here with ``prometheus_client``'s metric families.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "reap_swap"


GIB = 2**30
Row = tuple[str, str, str, float]
"""(key in the source dict, metric name after the prefix, help, scale)."""


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _families(family: type, prefix: str, src: Mapping[str, Any], rows: Iterable[Row]) -> Iterable[Any]:
    """One family per row whose value is a number (missing or non-numeric values are left out)."""
    for key, name, help_, scale in rows:
        v = _num(src.get(key))
        if v is not None:
            yield family(f"{PREFIX}_{prefix}{name}", help_, value=v * scale)


def _feature(prefix: str, help_: str, src: Mapping[str, Any], counters: Iterable[Row]) -> Iterable[Any]:
    """An optional mechanism: its ``<prefix>enabled`` gauge always, its counters only while it runs."""
    yield GaugeMetricFamily(f"{PREFIX}_{prefix}enabled", help_, value=1.0 if src.get("enabled") else 0.0)
    if src.get("enabled"):
        yield from _families(CounterMetricFamily, prefix, src, counters)


class _Snapshot(Collector):
    """One scrape's values, as metric families (a collector over fixed dicts)."""

    def __init__(self, control: Mapping[str, Any], worker: Mapping[str, Any], misses: Mapping[str, Any] | None):
        self.control, self.worker, self.misses = control, worker, misses

    def collect(self) -> Iterable[Any]:
        yield from _families(CounterMetricFamily, "control_", self.control, (
            ("swaps", "swaps", "control-plane swaps that moved experts", 1.0),
            ("noops", "noops", "swap requests that changed nothing", 1.0),
            ("rejected", "rejected", "swap requests refused (bad input or policy)", 1.0),
            ("rate_limited", "rate_limited", "swap requests refused by the byte budget", 1.0),
            ("failed", "failed", "swaps that failed in a worker", 1.0),
            ("resyncs", "resyncs", "resident-state repairs after a failed swap", 1.0),
            ("experts_loaded", "experts_loaded", "experts copied into slots by swaps", 1.0),
            ("bytes_copied", "bytes_copied", "bytes copied into slots by swaps", 1.0),
            ("swap_ms_total", "swap_seconds", "time spent in swaps", 1e-3),
        ))
        # The ledger holds live and recent requests only (bounded, resettable): gauges.
        yield from _families(GaugeMetricFamily, "ledger_", (self.misses or {}).get("summary") or {}, (
            ("routed_pairs", "routed_pairs", "routed (token, expert) pairs of the requests held by the miss ledger", 1.0),
            ("missed_pairs", "missed_pairs", "routed pairs whose expert was not resident, as routed (before any promotion)", 1.0),
            ("promoted_experts", "promoted_experts", "online-cache promotions booked to those requests", 1.0),
            ("link_bytes", "link_bytes", "expert bytes over the host link for the missed pairs, one expert per pair (UVA reads or "
             "promotion copies; exact at batch-1 decode, else an upper bound)", 1.0),
            ("tokens", "tokens", "token rows of those requests", 1.0),
        ))
        yield from self._worker()

    def _worker(self) -> Iterable[Any]:
        w = self.worker
        yield from _families(GaugeMetricFamily, "", w.get("memory") or {}, (
            ("slot_bank_gib", "slot_bank_bytes", "device bytes of the slot banks", GIB),
            ("host_bank_gib", "host_bank_bytes", "pinned host bytes of the host banks", GIB),
        ))
        yield from _families(GaugeMetricFamily, "ledger_", w.get("miss_ledger") or {}, (
            ("entries", "entries", "requests held by the miss ledger (bounded by REAP_MISS_LEDGER_SIZE)", 1.0),
            ("bytes", "bytes", "bytes of the miss ledger's per-request arrays", 1.0),
        ))
        yield from _feature("online_cache_", "1 when the online expert cache runs in the forward", w.get("online_cache") or {}, (
            ("promotions", "promotions", "experts promoted into slots inside the forward", 1.0),
            ("evictions", "evictions", "experts evicted from slots by promotions", 1.0),
            ("promotion_link_bytes", "promotion_link_bytes", "bytes the promotions copied over the host link", 1.0),
        ))
        yield from _feature("cpu_path_", "1 when the CPU expert path computes part of the misses", w.get("cpu_path") or {}, (
            ("wait_timeouts", "wait_timeouts", "CPU pairs whose merge gave up waiting for the CPU team (~17 s of polls); "
             "recomputed on the GPU from the host rows, logged as errors", 1.0),
            ("cpu_pairs", "cpu_pairs", "routed pairs the split gave the CPU", 1.0),
            ("cpu_experts", "cpu_experts", "missed experts the split gave the CPU, per layer step", 1.0),
            ("missed_pairs", "missed_pairs", "routed pairs whose expert was not resident, at the split", 1.0),
            ("missed_experts", "missed_experts", "missed experts per layer step, at the split", 1.0),
        ))
        comp = w.get("complement") or {}
        yield GaugeMetricFamily(f"{PREFIX}_ram_complement_enabled", "1 in RAM-complement mode", value=1.0 if comp.get("enabled") else 0.0)
        if comp.get("enabled"):
            yield from _families(GaugeMetricFamily, "ram_complement_", comp, (("spare_gib", "spare_bytes", "host bytes of spare rows", GIB),))
            counters = comp.get("counters") or {}
            yield from _families(CounterMetricFamily, "ram_complement_", counters,
                                 ((k, k, f"RAM-complement exchange counter {k}", 1.0) for k in sorted(counters)))


def exposition(control: Mapping[str, Any], worker: Mapping[str, Any], misses: Mapping[str, Any] | None) -> bytes:
    """Prometheus text for one scrape (``control``: the plane's counters; ``worker``: a worker's describe)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(control, worker, misses))
    return generate_latest(registry)
