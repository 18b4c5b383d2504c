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


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


class _Snapshot(Collector):
    """One scrape's values, as metric families (a collector over fixed dicts)."""

    def __init__(self, control: Mapping[str, Any], worker: Mapping[str, Any], misses: Mapping[str, Any] | None):
        self.control, self.worker, self.misses = control, worker, misses

    def collect(self) -> Iterable[Any]:
        yield from self._control()
        yield from self._misses()
        yield from self._worker()

    def _control(self) -> Iterable[Any]:
        c = self.control
        for key, help_ in (
            ("swaps", "control-plane swaps that moved experts"),
            ("noops", "swap requests that changed nothing"),
            ("rejected", "swap requests refused (bad input or policy)"),
            ("rate_limited", "swap requests refused by the byte budget"),
            ("failed", "swaps that failed in a worker"),
            ("resyncs", "resident-state repairs after a failed swap"),
            ("experts_loaded", "experts copied into slots by swaps"),
            ("bytes_copied", "bytes copied into slots by swaps"),
        ):
            v = _num(c.get(key))
            if v is not None:
                yield CounterMetricFamily(f"{PREFIX}_control_{key}", help_, value=v)
        v = _num(c.get("swap_ms_total"))
        if v is not None:
            yield CounterMetricFamily(f"{PREFIX}_control_swap_seconds", "time spent in swaps", value=v / 1e3)

    def _misses(self) -> Iterable[Any]:
        s = (self.misses or {}).get("summary") or {}
        for key, help_ in (
            ("routed_pairs", "routed (token, expert) pairs of the requests held by the miss ledger"),
            ("missed_pairs", "routed pairs whose expert was not resident, as routed (before any promotion)"),
            ("promoted_experts", "online-cache promotions booked to those requests"),
            ("link_bytes", "expert bytes over the host link for the missed pairs, one expert per pair (UVA reads or promotion copies; exact at batch-1 decode, else an upper bound)"),
            ("tokens", "token rows of those requests"),
        ):
            v = _num(s.get(key))
            if v is not None:
                # The ledger holds live and recent requests only (bounded, resettable): a gauge.
                yield GaugeMetricFamily(f"{PREFIX}_ledger_{key}", help_, value=v)

    def _worker(self) -> Iterable[Any]:
        w = self.worker
        mem = w.get("memory") or {}
        for key, name, help_ in (
            ("slot_bank_gib", "slot_bank_bytes", "device bytes of the slot banks"),
            ("host_bank_gib", "host_bank_bytes", "pinned host bytes of the host banks"),
        ):
            v = _num(mem.get(key))
            if v is not None:
                yield GaugeMetricFamily(f"{PREFIX}_{name}", help_, value=v * 2**30)
        oc = w.get("online_cache") or {}
        yield GaugeMetricFamily(f"{PREFIX}_online_cache_enabled", "1 when the online expert cache runs in the forward",
                                value=1.0 if oc.get("enabled") else 0.0)
        if oc.get("enabled"):
            for key, help_ in (("promotions", "experts promoted into slots inside the forward"),
                               ("evictions", "experts evicted from slots by promotions"),
                               ("promotion_link_bytes", "bytes the promotions copied over the host link")):
                v = _num(oc.get(key))
                if v is not None:
                    yield CounterMetricFamily(f"{PREFIX}_online_cache_{key}", help_, value=v)
        comp = w.get("complement") or {}
        yield GaugeMetricFamily(f"{PREFIX}_ram_complement_enabled", "1 in RAM-complement mode", value=1.0 if comp.get("enabled") else 0.0)
        if comp.get("enabled"):
            v = _num(comp.get("spare_gib"))
            if v is not None:
                yield GaugeMetricFamily(f"{PREFIX}_ram_complement_spare_bytes", "host bytes of spare rows", value=v * 2**30)
            for key, v in sorted((comp.get("counters") or {}).items()):
                n = _num(v)
                if n is not None:
                    yield CounterMetricFamily(f"{PREFIX}_ram_complement_{key}", f"RAM-complement exchange counter {key}", value=n)


def exposition(control: Mapping[str, Any], worker: Mapping[str, Any], misses: Mapping[str, Any] | None) -> bytes:
    """Prometheus text for one scrape (``control``: the plane's counters; ``worker``: a worker's describe)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(control, worker, misses))
    return generate_latest(registry)
