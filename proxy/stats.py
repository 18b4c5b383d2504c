"""Per-request forensics records and the proxy's aggregate statistics.

``/metrics`` is ``prometheus_client``'s exposition of one registry per proxy
(counters, and latency histograms with ``_sum``/``_count``/buckets, HELP and
TYPE on every family); ``/stats`` is a JSON view read back from that same
registry, plus latency percentiles over a bounded window. ``/forensics/{id}``
records are kept as JSON bytes in an LRU cache bounded by their total size,
so a flood of requests can neither grow memory past the bound nor keep old
records forever.
"""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

import numpy as np
from cachetools import LRUCache
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE

LATENCY_WINDOW = 2048
MAX_RECORD_BYTES = 64 << 20
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 120.0)
__all__ = ["ProxyStats", "PROMETHEUS_CONTENT_TYPE"]


class ProxyStats:
    def __init__(self, max_record_bytes: int = MAX_RECORD_BYTES) -> None:
        self.started = time.time()
        self.records: LRUCache[str, bytes] = LRUCache(max_record_bytes, getsizeof=len)
        self.windows: dict[str, deque[float]] = {}
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._requests = Counter("reap_proxy_requests", "Completion requests the proxy forwarded or failed.", registry=r)
        self._responses = Counter("reap_proxy_responses", "Responses by HTTP status (every route).", ["status"], registry=r)
        self._errors = Counter("reap_proxy_errors", "Requests that failed or were cut short, by kind.", ["kind"], registry=r)
        self._swaps = Counter("reap_proxy_swaps", "Residency install attempts by outcome.", ["status"], registry=r)
        self._swap_bytes = Counter("reap_proxy_swap_bytes", "Expert bytes the backend copied for this proxy's swaps.", registry=r)
        self._experts_loaded = Counter("reap_proxy_experts_loaded", "Experts the backend loaded for this proxy's swaps.", registry=r)
        self._slice_use = Counter("reap_proxy_slice_selected", "Times a plan slice was chosen for a request.", ["slice"], registry=r)
        self._observed = Counter("reap_proxy_routed_gate_mass", "Routed gate mass measured by the backend, per layer.", ["layer"], registry=r)
        self._inactive = Counter("reap_proxy_inactive_gate_mass", "Part of the routed gate mass on non-resident experts, per layer.",
                                 ["layer"], registry=r)
        self._latency = Histogram("reap_proxy_latency_seconds", "Proxy-side latencies by kind.", ["kind"], buckets=LATENCY_BUCKETS_S, registry=r)
        ratio = Gauge("reap_proxy_router_miss_ratio", "Inactive / routed gate mass over every request so far.", registry=r)
        ratio.set_function(lambda: self._ratio()[0])
        records = Gauge("reap_proxy_forensics_records", "Forensics records held (bounded by size).", registry=r)
        records.set_function(lambda: len(self.records))

    # -- records ---------------------------------------------------------
    def put(self, record: dict[str, Any]) -> None:
        """Store (or re-store after it grew) a request's record; the oldest go when the size bound is hit."""
        blob = json.dumps(record, default=str).encode()
        try:
            self.records[record["request_id"]] = blob
        except ValueError:  # a single record larger than the whole bound: keep a stub
            self.records[record["request_id"]] = json.dumps({"request_id": record["request_id"], "truncated": True}).encode()

    def get(self, request_id: str) -> bytes | None:
        """The record as JSON bytes (what ``/forensics`` sends)."""
        return self.records.get(request_id)

    # -- counting --------------------------------------------------------
    def count_response(self, status: int) -> None:
        self._responses.labels(str(status)).inc()

    def count_error(self, kind: str) -> None:
        self._errors.labels(kind[:64]).inc()

    def observe_latency(self, name: str, ms: float) -> None:
        self._latency.labels(name).observe(ms / 1e3)
        self.windows.setdefault(name, deque(maxlen=LATENCY_WINDOW)).append(ms)

    def count_request(self, record: dict[str, Any]) -> None:
        self._requests.inc()
        swap = record.get("swap") or {}
        if swap.get("status"):
            self._swaps.labels(swap["status"]).inc()
        self._swap_bytes.inc(int(swap.get("bytes_copied", 0)))
        self._experts_loaded.inc(int(swap.get("experts_loaded", 0)))
        for slices in (record.get("chosen_slices") or {}).values():
            for sid in slices:
                self._slice_use.labels(str(sid)[:128]).inc()
        for name in ("overhead_ms", "classify_ms", "swap_wait_ms", "total_ms"):
            value = (record.get("timings") or {}).get(name)
            if isinstance(value, (int, float)):
                self.observe_latency(name, float(value))

    def count_misses(self, misses: dict[str, Any]) -> None:
        for layer, row in misses.get("by_layer", {}).items():
            self._observed.labels(layer).inc(max(float(row.get("observed_mass", 0.0)), 0.0))
            self._inactive.labels(layer).inc(max(float(row.get("inactive_mass", 0.0)), 0.0))

    # -- reading back ----------------------------------------------------
    @staticmethod
    def _values(metric: Counter, label: str | None = None) -> dict[str, float]:
        """A counter's totals by one label ("" when unlabelled), read from its own samples."""
        out: dict[str, float] = {}
        for family in metric.collect():
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels.get(label, "") if label else ""] = s.value
        return out

    def _ratio(self) -> tuple[float, dict[str, float]]:
        obs, ina = self._values(self._observed, "layer"), self._values(self._inactive, "layer")
        total_obs = sum(obs.values())
        by_layer = {k: (ina.get(k, 0.0) / v if v else 0.0) for k, v in sorted(obs.items(), key=lambda kv: int(kv[0].split("_")[-1]))}
        return (sum(ina.values()) / total_obs if total_obs else 0.0), by_layer

    def snapshot(self) -> dict[str, Any]:
        swaps = {k: int(v) for k, v in self._values(self._swaps, "status").items()}
        attempts = sum(swaps.values())
        ratio, by_layer = self._ratio()
        slice_use = {k: int(v) for k, v in self._values(self._slice_use, "slice").items()}
        return {
            "uptime_s": time.time() - self.started,
            "requests": int(self._values(self._requests).get("", 0)),
            "responses_by_status": {k: int(v) for k, v in sorted(self._values(self._responses, "status").items())},
            "errors": {k: int(v) for k, v in self._values(self._errors, "kind").items()},
            "swaps": {
                "by_status": swaps,
                "installs": swaps.get("swapped", 0),
                "no_swap_rate": 1 - swaps.get("swapped", 0) / attempts if attempts else 0.0,
                "bytes_copied": int(self._values(self._swap_bytes).get("", 0)),
                "experts_loaded": int(self._values(self._experts_loaded).get("", 0)),
            },
            "miss_ratio": ratio,
            "miss_ratio_by_layer": by_layer,
            "slice_use": dict(sorted(slice_use.items(), key=lambda kv: -kv[1])),
            "latency_ms": {
                name: {"p50": float(np.percentile(w, 50)), "p99": float(np.percentile(w, 99)), "n": len(w)}
                for name, w in self.windows.items() if w
            },
            "forensics_records": len(self.records),
        }

    def prometheus(self) -> bytes:
        return generate_latest(self.registry)
