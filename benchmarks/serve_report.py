"""bench-serve's numbers: repeats joined, ratios between arms, the table (pure).

A concurrency's figures are the median over its repeats of each repeat's figure (output tok/s,
TTFT and inter-token latency percentiles); requests, errors and tokens are totals over the
repeats. Ratios are an arm's figure over a stock arm's at the same concurrency.
"""

from __future__ import annotations

import statistics
from typing import Any, Sequence

METRICS = ("output_tok_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "decode_tok_s_per_request_p50")
TOTALS = ("requests", "errors", "completion_tokens")
RATIO_METRICS = ("output_tok_s", "ttft_ms_p50", "itl_ms_p99")
BASELINES = ("stock_offload", "stock_gpu")
AGGREGATION = "per concurrency: the median over the repeats of each repeat's figure; requests, errors and tokens summed over the repeats"


def _median(values: Sequence[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return statistics.median(xs) if xs else None


def join_repeats(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One concurrency's figures from its repeats (``serve_load.load`` results, texts dropped)."""
    out: dict[str, Any] = {m: _median([r.get(m) for r in repeats]) for m in METRICS}
    out.update({t: sum(int(r.get(t) or 0) for r in repeats) for t in TOTALS})
    out["repeats"] = len(repeats)
    out["error_messages"] = [m for r in repeats for m in r.get("error_messages") or []][:5]
    out["runs"] = [{k: v for k, v in r.items() if k not in ("texts", "error_messages")} for r in repeats]
    return out


def hit_rate(reports: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Routed-pair hit rate over ``/router_misses`` summaries (reap arms), or None without any."""
    routed = sum(int(r.get("routed_pairs") or 0) for r in reports)
    missed = sum(int(r.get("missed_pairs") or 0) for r in reports)
    if not reports or not routed:
        return None
    return {"hit_rate": 1 - missed / routed, "routed_pairs": routed, "missed_pairs": missed, "source": "reap-swap miss accounting, prefill and decode"}


def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{metric: {"<arm>_vs_<stock arm>_c<C>": arm / stock}}`` for every finished arm and concurrency both have."""
    out: dict[str, dict[str, float]] = {m: {} for m in RATIO_METRICS}
    for base in BASELINES:
        ref = (arms.get(base) or {}).get("by_concurrency") or {}
        if not ref or arms[base].get("error"):
            continue
        for name, arm in arms.items():
            if name in BASELINES[: BASELINES.index(base) + 1] or arm.get("error"):  # not itself, nor the inverse of a ratio above
                continue
            for c, row in (arm.get("by_concurrency") or {}).items():
                for m in RATIO_METRICS:
                    a, b = row.get(m), (ref.get(c) or {}).get(m)
                    if a is not None and b:
                        out[m][f"{name}_vs_{base}_c{c}"] = a / b
    return out


def _num(x: Any, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """Arms × concurrencies, then the output tok/s ratios against stock offload."""
    lines = [f"bench-serve {result.get('tag', '')} — {result.get('routing', '')}; {AGGREGATION}", "",
             "| arm | concurrency | output tok/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | requests | errors | hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, arm in result.get("arms", {}).items():
        if arm.get("error"):
            lines.append(f"| {name} | — | {arm['error'][:80]} |  |  |  |  |  |  |  |")
            continue
        for c, row in (arm.get("by_concurrency") or {}).items():
            hit = (row.get("hits") or {}).get("hit_rate")
            lines.append(f"| {name} | {c} | {_num(row.get('output_tok_s'))} | {_num(row.get('ttft_ms_p50'))} | {_num(row.get('ttft_ms_p99'))} | "
                         f"{_num(row.get('itl_ms_p50'), 2)} | {_num(row.get('itl_ms_p99'), 2)} | {row.get('requests')} | {row.get('errors')} | "
                         f"{_num(hit, 3)} |")
    speed = result.get("ratios", {}).get("output_tok_s", {})
    if speed:
        lines += ["", "output tok/s ratios: " + ", ".join(f"{k} {v:.2f}×" for k, v in speed.items())]
    return "\n".join(lines) + "\n"
