"""Summary, ratios, host-link check and markdown table of a bench-gpu run (pure)."""

from __future__ import annotations

from typing import Any

from .hostlink import LinkModel, compare
from .shapes import MoeShape


def _get(d: dict[str, Any], *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def arm_summary(raw: dict[str, Any], shape: MoeShape) -> dict[str, Any]:
    spec = raw.get("spec", {})
    hits1 = _get(raw, "hits_bs1", "hit_rate_decode")
    missed = _get(raw, "hits_bs1", "missed_pairs_per_token")
    if spec.get("kind") == "stock":
        # Stock decode reads every routed expert of each offloaded layer over the link.
        # (cpu_offload_gb is per GPU and each of the tensor_parallel_size ranks holds 1/N of every expert;
        # link bytes count every rank's link)
        tp = int(spec.get("tensor_parallel_size") or 1)
        offloaded_layers = (spec.get("offload_gib") or 0.0) * 2**30 / (shape.experts * shape.expert_bytes / tp)
        link_bytes = offloaded_layers * shape.top_k * shape.expert_bytes
    else:
        link_bytes = missed * shape.expert_bytes if missed is not None else None
    return {
        "tensor_parallel_size": int(spec.get("tensor_parallel_size") or 1),
        "decode_tok_s_bs1": _get(raw, "bs1", "decode_tok_s"),
        "decode_tok_s_bs8": _get(raw, "bs8", "decode_tok_s"),
        "decode_tok_s_bs1_e2e": _get(raw, "bs1", "decode_tok_s_e2e"),
        "decode_tok_s_bs8_e2e": _get(raw, "bs8", "decode_tok_s_e2e"),
        "ttft_ms_bs1": _get(raw, "bs1", "ttft_ms"),
        "ttft_ms_bs8": _get(raw, "bs8", "ttft_ms"),
        "hit_rate_decode": hits1 if spec.get("kind") == "reap" else None,
        "hit_rate_decode_bs8": _get(raw, "hits_bs8", "hit_rate_decode"),
        "link_bytes_per_token_bs1": link_bytes,
        "gpu_used_gib": _get(raw, "memory", "gpu_used_gib"),
        "pinned_host_gib": _get(raw, "memory", "pinned_host_gib"),
        "slots": spec.get("slots"),
        "offload_gib": spec.get("offload_gib"),
        "identical_ids": raw.get("identical_ids"),
        "identical_ids_bs8": raw.get("identical_ids_bs8"),
        "decode_tok_s_bs1_accounting_off": _get(raw, "bs1_accounting_off", "decode_tok_s"),
        "syncs_per_decode_step": _get(raw, "profile", "syncs"),
        "blocking_copies_per_decode_step": _get(raw, "profile", "blocking_copies"),
        "launches_per_decode_step": _get(raw, "profile", "launches"),
        "error": raw.get("error"),
    }


def run_header(raw: dict[str, dict[str, Any]], shape: Any, date: str, command: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The fields every bench-gpu result starts with: when, what ran it, on which stack and model shape."""
    versions = next((r["versions"] for r in raw.values() if "versions" in r), {})
    return {
        "date": date,
        "command": command,
        # with tensor parallelism the arm process holds no CUDA context: the GPU's name comes from the workers
        "gpu": versions.get("gpu") or next((r["memory"]["gpu"] for r in raw.values() if (r.get("memory") or {}).get("gpu")), None),
        "vllm": versions.get("vllm"),
        "torch": versions.get("torch"),
        "versions": versions,
        "model": {"shape": shape.name, "layers": shape.layers, "experts": shape.experts, "top_k": shape.top_k, "expert_mb": shape.expert_bytes / 1e6},
        "settings": settings,
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ratios(arms: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    g = lambda arm, key: (arms.get(arm) or {}).get(key)  # noqa: E731
    return {
        "all_resident_vs_stock_bs1": _ratio(g("reap_all", "decode_tok_s_bs1"), g("stock_gpu", "decode_tok_s_bs1")),
        "all_resident_vs_stock_bs8": _ratio(g("reap_all", "decode_tok_s_bs8"), g("stock_gpu", "decode_tok_s_bs8")),
        "slots30_vs_stock_offload_bs1": _ratio(g("reap_30", "decode_tok_s_bs1"), g("stock_offload", "decode_tok_s_bs1")),
        "slots30_vs_stock_offload_bs8": _ratio(g("reap_30", "decode_tok_s_bs8"), g("stock_offload", "decode_tok_s_bs8")),
        "all_resident_accounting_on_vs_off_bs1": _ratio(g("reap_all", "decode_tok_s_bs1"), g("reap_all", "decode_tok_s_bs1_accounting_off")),
        "all_resident_vs_stock_bs1_e2e": _ratio(g("reap_all", "decode_tok_s_bs1_e2e"), g("stock_gpu", "decode_tok_s_bs1_e2e")),
        "all_resident_vs_stock_bs8_e2e": _ratio(g("reap_all", "decode_tok_s_bs8_e2e"), g("stock_gpu", "decode_tok_s_bs8_e2e")),
        "slots30_vs_stock_offload_bs1_e2e": _ratio(g("reap_30", "decode_tok_s_bs1_e2e"), g("stock_offload", "decode_tok_s_bs1_e2e")),
        # prefill staging (issue 26): time to first token, lower is better
        "ttft_stage_vs_stock_offload_bs1": _ratio(g("reap_30_stage", "ttft_ms_bs1"), g("stock_offload", "ttft_ms_bs1")),
        "ttft_stage_vs_reap_30_bs1": _ratio(g("reap_30_stage", "ttft_ms_bs1"), g("reap_30", "ttft_ms_bs1")),
    }


def law_check(raw: dict[str, dict[str, Any]], shape: MoeShape, tolerance: float = 0.10) -> dict[str, Any] | None:
    """The sweep of reap_30 against step = t_compute + missed bytes / link.

    t_compute: the sweep's own all-hit point (same process, same engine), else
    reap_all's batch-1 step; link: the UVA read rate measured in that process.
    """
    sweep = _get(raw, "reap_30", "sweep")
    link = _get(raw, "reap_30", "link", "uva_read_gbps")
    full = [p for p in sweep or [] if p.get("hit_rate") is not None and p["hit_rate"] >= 0.999]
    t_tok, source = (full[-1]["decode_tok_s"], "reap_30 sweep at 100 % hits") if full else (_get(raw, "reap_all", "bs1", "decode_tok_s"), "reap_all bs1")
    if not sweep or not t_tok or not link:
        return None
    model = LinkModel(t_compute_s=1.0 / t_tok, link_gbps=link, layers=shape.layers, expert_bytes=shape.expert_bytes)
    points = [{"hit_rate": p["hit_rate"], "decode_tok_s": p["decode_tok_s"], "factor": p["factor"]} for p in sweep if p.get("hit_rate") is not None]
    checked = compare(model, points, experts_per_layer=shape.top_k, tolerance=tolerance)
    return {
        "t_compute_ms": model.t_compute_s * 1e3,
        "t_compute_from": source,
        "link_gbps": link,
        "tolerance": tolerance,
        "points": checked,
        "all_within_tolerance": all(bool(p["within_tolerance"]) for p in checked),
    }


def _fmt(x: Any, spec: str = ".1f") -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return format(x, spec)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# bench-gpu — {result['date']}",
        "",
        f"{result.get('gpu', '?')}, vLLM {result.get('vllm', '?')}, torch {result.get('torch', '?')}; model {result['model']['shape']} "
        f"({result['model']['layers']} layers x {result['model']['experts']} experts x {result['model']['expert_mb']:.2f} MB, top-{result['model']['top_k']}, dummy weights, per-layer routers)",
        f"command: `{result['command']}`",
        f"decode tok/s: {result.get('decode_estimator', '')}",
        "",
        "| arm | decode tok/s bs1 | decode tok/s bs8 | TTFT bs1 ms | decode hit rate | link MB/token | GPU GiB | pinned host GiB | syncs/step | identical ids bs1 / bs8 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in result["arms"].items():
        if a.get("error"):
            lines.append(f"| {name} | error: {a['error'][:80]} | | | | | | | | |")
            continue
        lb = a.get("link_bytes_per_token_bs1")
        lines.append(
            f"| {name} | {_fmt(a['decode_tok_s_bs1'])} | {_fmt(a['decode_tok_s_bs8'])} | {_fmt(a['ttft_ms_bs1'])} | "
            f"{_fmt(a['hit_rate_decode'], '.3f')} | {_fmt(lb / 1e6 if lb is not None else None, '.0f')} | {_fmt(a['gpu_used_gib'], '.2f')} | "
            f"{_fmt(a['pinned_host_gib'], '.2f')} | {_fmt(a['syncs_per_decode_step'], '.2f')} | {_fmt(a['identical_ids'])} / {_fmt(a.get('identical_ids_bs8'))} |"
        )
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v, '.3f')} |" for k, v in result["ratios"].items()]
    if result.get("syncs_per_decode_step") is not None:
        lines += ["", f"Host synchronizations per decode step (torch.profiler, batch 1): reap_all {result['syncs_per_decode_step']:.2f}, "
                  f"stock {_fmt(result.get('syncs_per_decode_step_stock'), '.2f')}; added by reap-swap: {_fmt(result.get('syncs_added_per_decode_step'), '.2f')}."]
    law = result.get("law")
    if law:
        lines += [
            "",
            f"Hit-rate sweep (reap_30, router rows of the resident experts scaled) vs step = {law['t_compute_ms']:.3f} ms + missed bytes / {law['link_gbps']:.1f} GB/s:",
            "",
            "| factor | decode hit rate | tok/s measured | tok/s law | measured / law |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {p['factor']:.3g} | {p['hit_rate']:.3f} | {p['decode_tok_s']:.1f} | {p['predicted_tok_s']:.1f} | {p['measured_over_predicted']:.3f} |"
            for p in law["points"]
        ]
    return "\n".join(lines) + "\n"
