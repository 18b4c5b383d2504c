"""Per-request forensics records and the proxy's aggregate statistics.

``/forensics/{id}`` returns a request's record; ``/stats`` the aggregates as
JSON; ``/metrics`` the same in Prometheus text format.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict, defaultdict
from typing import Any

import numpy as np

MAX_RECORDS = 4096
LATENCY_WINDOW = 2048


class ProxyStats:
    def __init__(self) -> None:
        self.records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.started = time.time()
        self.requests = 0
        self.responses_by_status: Counter[int] = Counter()
        self.errors: Counter[str] = Counter()
        self.swap_status: Counter[str] = Counter()
        self.bytes_copied = 0
        self.experts_loaded = 0
        self.slice_use: Counter[str] = Counter()
        self.observed = defaultdict(float)
        self.inactive = defaultdict(float)
        self.latency: dict[str, list[float]] = defaultdict(list)

    def put(self, record: dict[str, Any]) -> None:
        rid = record["request_id"]
        self.records[rid] = record
        self.records.move_to_end(rid)
        while len(self.records) > MAX_RECORDS:
            self.records.popitem(last=False)

    def get(self, request_id: str) -> dict[str, Any] | None:
        return self.records.get(request_id)

    def observe_latency(self, name: str, ms: float) -> None:
        window = self.latency[name]
        window.append(ms)
        if len(window) > LATENCY_WINDOW:
            del window[: len(window) - LATENCY_WINDOW]

    def count_request(self, record: dict[str, Any]) -> None:
        self.requests += 1
        swap = record.get("swap") or {}
        if swap.get("status"):
            self.swap_status[swap["status"]] += 1
        self.bytes_copied += int(swap.get("bytes_copied", 0))
        self.experts_loaded += int(swap.get("experts_loaded", 0))
        for slices in (record.get("chosen_slices") or {}).values():
            for sid in slices:
                self.slice_use[sid] += 1
        for name in ("overhead_ms", "classify_ms", "swap_wait_ms", "total_ms"):
            if isinstance(record.get("timings", {}).get(name), (int, float)):
                self.observe_latency(name, float(record["timings"][name]))

    def count_misses(self, misses: dict[str, Any]) -> None:
        for layer, row in misses.get("by_layer", {}).items():
            self.observed[layer] += float(row.get("observed_mass", 0.0))
            self.inactive[layer] += float(row.get("inactive_mass", 0.0))

    def snapshot(self) -> dict[str, Any]:
        attempts = sum(self.swap_status.values())
        obs, ina = sum(self.observed.values()), sum(self.inactive.values())
        return {
            "uptime_s": time.time() - self.started,
            "requests": self.requests,
            "responses_by_status": {str(k): v for k, v in sorted(self.responses_by_status.items())},
            "errors": dict(self.errors),
            "swaps": {
                "by_status": dict(self.swap_status),
                "installs": self.swap_status.get("swapped", 0),
                "no_swap_rate": 1 - self.swap_status.get("swapped", 0) / attempts if attempts else 0.0,
                "bytes_copied": self.bytes_copied,
                "experts_loaded": self.experts_loaded,
            },
            "miss_ratio": ina / obs if obs else 0.0,
            "miss_ratio_by_layer": {k: (self.inactive[k] / v if v else 0.0) for k, v in sorted(self.observed.items(), key=lambda kv: int(kv[0].split("_")[1]))},
            "slice_use": dict(self.slice_use.most_common()),
            "latency_ms": {
                name: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)), "n": len(v)}
                for name, v in self.latency.items() if v
            },
        }

    def prometheus(self) -> str:
        s = self.snapshot()
        lines = [
            "# HELP reap_proxy_requests_total Requests handled by the proxy.",
            "# TYPE reap_proxy_requests_total counter",
            f"reap_proxy_requests_total {s['requests']}",
            "# HELP reap_proxy_responses_total Responses by HTTP status.",
            "# TYPE reap_proxy_responses_total counter",
        ]
        lines += [f'reap_proxy_responses_total{{status="{k}"}} {v}' for k, v in s["responses_by_status"].items()]
        lines += ["# HELP reap_proxy_swaps_total Residency installs by outcome.", "# TYPE reap_proxy_swaps_total counter"]
        lines += [f'reap_proxy_swaps_total{{status="{k}"}} {v}' for k, v in s["swaps"]["by_status"].items()]
        lines += [
            "# HELP reap_proxy_swap_bytes_total Expert bytes the backend copied for this proxy's swaps.",
            "# TYPE reap_proxy_swap_bytes_total counter",
            f"reap_proxy_swap_bytes_total {s['swaps']['bytes_copied']}",
            "# HELP reap_proxy_router_miss_ratio Gate mass routed to non-resident experts / all routed gate mass.",
            "# TYPE reap_proxy_router_miss_ratio gauge",
            f"reap_proxy_router_miss_ratio {s['miss_ratio']}",
        ]
        lines += [f'reap_proxy_router_miss_ratio_layer{{layer="{k}"}} {v}' for k, v in s["miss_ratio_by_layer"].items()]
        lines += ["# HELP reap_proxy_latency_ms Proxy-side latency percentiles.", "# TYPE reap_proxy_latency_ms gauge"]
        for name, q in s["latency_ms"].items():
            lines += [f'reap_proxy_latency_ms{{kind="{name}",quantile="0.5"}} {q["p50"]}', f'reap_proxy_latency_ms{{kind="{name}",quantile="0.99"}} {q["p99"]}']
        lines += ["# HELP reap_proxy_errors_total Errors by kind.", "# TYPE reap_proxy_errors_total counter"]
        lines += [f'reap_proxy_errors_total{{kind="{k}"}} {v}' for k, v in s["errors"].items()]
        return "\n".join(lines) + "\n"
