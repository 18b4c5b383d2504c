"""Summary, ratios, host-link check and markdown table of a bench-gpu run (pure)."""

from __future__ import annotations

from typing import Any, Sequence

from .dummy_weights import link_expert_bytes, quantized_expert_bytes
from .hostlink import LinkModel, compare
from .shapes import MoeShape
from .tp import tp_of


def first_diff(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first position where two id lists differ (over their common length); None where they agree."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def _get(d: dict[str, Any], *path: str) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def arm_summary(raw: dict[str, Any], shape: MoeShape) -> dict[str, Any]:
    spec = raw.get("spec", {})
    tp = tp_of(spec)
    hits1 = _get(raw, "hits_bs1", "hit_rate_decode")
    missed = _get(raw, "hits_bs1", "missed_pairs_per_token")
    quant = spec.get("quantization")
    expert_bytes = miss_bytes(shape, spec)
    if spec.get("kind") == "stock":
        # Stock decode reads every routed expert of each offloaded layer over the link.
        # (cpu_offload_gb is per GPU and each of the tensor_parallel_size ranks holds 1/N of every expert;
        # link bytes count every rank's link)
        offloaded_layers = (spec.get("offload_gib") or 0.0) * 2**30 / (shape.experts * expert_bytes / tp)
        link_bytes = offloaded_layers * shape.top_k * expert_bytes
    else:
        link_bytes = missed * expert_bytes if missed is not None else None
    return {
        "tensor_parallel_size": tp,
        "kind": spec.get("kind"),
        "quantization": quant,
        "expert_bytes": expert_bytes,
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
        **length_summary(raw),
    }


def miss_bytes(shape: MoeShape, spec: dict[str, Any]) -> int:
    """The bytes one missed expert moves in this arm: a reap arm its banked weights (scales stay beside the bank on
    the GPU), stock offload the whole expert with its scales."""
    quant = spec.get("quantization")
    if spec.get("kind") == "reap":
        return link_expert_bytes(shape.expert_bytes, shape.dtype_bytes, quant)
    return quantized_expert_bytes(shape.expert_bytes, shape.dtype_bytes, quant)


def quantized_line(arms: dict[str, Any]) -> list[str]:
    """The header's word on a ``--quantization`` run: the scheme, the arms that serve it and what a miss moves."""
    quantized = {n: a for n, a in arms.items() if a.get("quantization")}
    if not quantized:
        return []
    schemes = sorted({a["quantization"] for a in quantized.values()})
    sizes = {kind: sorted({a["expert_bytes"] / 1e6 for a in quantized.values() if a.get("kind") == kind and a.get("expert_bytes")})
             for kind in ("reap", "stock")}
    moved = "; ".join(f"{'reap arms' if kind == 'reap' else 'stock'} {' / '.join(f'{mb:.2f}' for mb in mbs)} MB"
                      for kind, mbs in sizes.items() if mbs)
    plain = [n for n in arms if n not in quantized]
    return [f"quantized experts: {', '.join(schemes)} in {', '.join(quantized)} (a missed expert moves: {moved})"
            + (f"; {', '.join(plain)} unquantized" if plain else "")]


def cut_arms(arms: dict[str, Any]) -> dict[str, str]:
    """Arms that ended with an error after their batch-1 timing finished: their rows stay, the error said below."""
    return {n: a["error"] for n, a in arms.items() if a.get("error") and a.get("decode_tok_s_bs1") is not None}


def cut_lines(cut: dict[str, str]) -> list[str]:
    """The note under a table on the arms of ``cut_arms``."""
    return ["", "Ended with an error (their rows show the batches that finished): " + "; ".join(f"{n}: {e}" for n, e in cut.items()) + "."] if cut else []


def length_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """Per-length keys of a several-``--prompt-len`` arm (``bs1_p{N}`` in the raw result); none for a one-length run,
    whose summary keeps its keys."""
    out: dict[str, Any] = {}
    for n in raw.get("spec", {}).get("prompt_lens") or []:
        out[f"ttft_ms_p{n}"] = _get(raw, f"bs1_p{n}", "ttft_ms")
        out[f"decode_tok_s_bs1_p{n}"] = _get(raw, f"bs1_p{n}", "decode_tok_s")
        out[f"identical_ids_p{n}"] = raw.get(f"identical_ids_p{n}")
        if f"staging_bs1_p{n}" in raw:
            out[f"staged_experts_p{n}"] = _get(raw, f"staging_bs1_p{n}", "staged_experts")
    if out:
        out["identical_ids_reference"] = raw.get("spec", {}).get("ref_tokens_from")
        out["max_num_batched_tokens"] = _get(raw, "scheduler", "max_num_batched_tokens")  # the prefill chunk vLLM used
    return out


def prompt_lens(raw: dict[str, dict[str, Any]]) -> list[int]:
    """The prompt lengths a several-``--prompt-len`` run timed (from the arms' specs, so ``--rebuild`` finds them too);
    empty for a one-length run."""
    return sorted({int(n) for r in raw.values() for n in (r.get("spec") or {}).get("prompt_lens") or []})


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


def ratios(arms: dict[str, dict[str, Any]], lens: list[int] | None = None) -> dict[str, float | None]:
    """Speed ratios between arms; with ``lens`` (several prompt lengths) also the TTFT ratios at each length."""
    g = lambda arm, key: (arms.get(arm) or {}).get(key)  # noqa: E731
    out: dict[str, float | None] = {
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
    for n in lens or []:  # time to first token per prompt length, lower is better
        t = f"ttft_ms_p{n}"
        out[f"ttft_stage_vs_stock_offload_p{n}"] = _ratio(g("reap_30_stage", t), g("stock_offload", t))
        out[f"ttft_reap_vs_stock_offload_p{n}"] = _ratio(g("reap_30", t), g("stock_offload", t))
        out[f"ttft_stage_vs_reap_30_p{n}"] = _ratio(g("reap_30_stage", t), g("reap_30", t))
    return out


PREFILL_TARGETS = {"ttft_8k_vs_stock_offload": (8192, 0.8), "ttft_32k_s": (32768, 2.5)}
"""Issue 26's prefill acceptance: the staging arm's TTFT at 8K prompt tokens <= 0.8x stock offload's, at 32K <= 2.5 s."""


def acceptance(arms: dict[str, dict[str, Any]], lens: list[int]) -> dict[str, Any]:
    """Issue 26's prefill targets, checked on ``reap_30_stage`` (reap-swap with prefill staging): each with its value,
    target and ``met`` (None when that length, or an arm it needs, did not run or has no time), and the arm's
    identical-ids check at that length beside it (a fast prefill that changes the output would not count)."""
    stage, stock = arms.get("reap_30_stage") or {}, arms.get("stock_offload") or {}
    n8, max8 = PREFILL_TARGETS["ttft_8k_vs_stock_offload"]
    n32, max32 = PREFILL_TARGETS["ttft_32k_s"]
    r8 = _ratio(stage.get(f"ttft_ms_p{n8}"), stock.get(f"ttft_ms_p{n8}")) if n8 in lens else None
    ms32 = stage.get(f"ttft_ms_p{n32}") if n32 in lens else None
    s32 = ms32 / 1e3 if ms32 is not None else None
    return {
        "arm": "reap_30_stage",
        "ttft_8k_vs_stock_offload": {"prompt_len": n8, "value": r8, "target_max": max8, "met": r8 <= max8 if r8 is not None else None,
                                     "identical_ids": stage.get(f"identical_ids_p{n8}")},
        "ttft_32k_s": {"prompt_len": n32, "value": s32, "target_max": max32, "met": s32 <= max32 if s32 is not None else None,
                       "identical_ids": stage.get(f"identical_ids_p{n32}")},
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
    expert_bytes = link_expert_bytes(shape.expert_bytes, shape.dtype_bytes, _get(raw, "reap_30", "spec", "quantization"))
    model = LinkModel(t_compute_s=1.0 / t_tok, link_gbps=link, layers=shape.layers, expert_bytes=expert_bytes)
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


def _arm_table(result: dict[str, Any]) -> list[str]:
    """One row per arm of a one-length run: decode at batch 1 and 8, TTFT, hits, link bytes, memory, syncs, ids."""
    lines = [
        "| arm | decode tok/s bs1 | decode tok/s bs8 | TTFT bs1 ms | decode hit rate | link MB/token | GPU GiB | pinned host GiB | syncs/step | identical ids bs1 / bs8 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cut = cut_arms(result["arms"])
    for name, a in result["arms"].items():
        if a.get("error") and name not in cut:
            lines.append(f"| {name} | error: {a['error'][:80]} | | | | | | | | |")
            continue
        lb = a.get("link_bytes_per_token_bs1")
        lines.append(
            f"| {name} | {_fmt(a['decode_tok_s_bs1'])} | {_fmt(a['decode_tok_s_bs8'])} | {_fmt(a['ttft_ms_bs1'])} | "
            f"{_fmt(a['hit_rate_decode'], '.3f')} | {_fmt(lb / 1e6 if lb is not None else None, '.0f')} | {_fmt(a['gpu_used_gib'], '.2f')} | "
            f"{_fmt(a['pinned_host_gib'], '.2f')} | {_fmt(a['syncs_per_decode_step'], '.2f')} | {_fmt(a['identical_ids'])} / {_fmt(a.get('identical_ids_bs8'))} |"
        )
    return lines + cut_lines(cut)


def _length_table(result: dict[str, Any], lens: list[int]) -> list[str]:
    """One row per arm of a several-length run (batch 1): a TTFT column per prompt length, then decode, memory,
    staged experts and identical ids, each listed over the lengths in order."""
    per = " / ".join(f"{n:,}" for n in lens)
    head = ["arm", *(f"TTFT {n:,} ms" for n in lens), f"decode tok/s bs1 ({per})", "GPU GiB", "pinned host GiB",
            f"staged experts ({per})", f"identical ids ({per})"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, a in result["arms"].items():
        if a.get("error"):
            lines.append(f"| {name} | error: {a['error'][:80]} |" + " |" * (len(head) - 2))
            continue

        def each(key: str, spec: str = ".1f", a: dict[str, Any] = a) -> str:
            return " / ".join(_fmt(a.get(f"{key}_p{n}"), spec) for n in lens)

        cells = [name, *(_fmt(a.get(f"ttft_ms_p{n}")) for n in lens), each("decode_tok_s_bs1"), _fmt(a.get("gpu_used_gib"), ".2f"),
                 _fmt(a.get("pinned_host_gib"), ".2f"), each("staged_experts", "d"), each("identical_ids")]
        lines.append("| " + " | ".join(cells) + " |")
    ref = next((a.get("identical_ids_reference") for a in result["arms"].values() if a.get("identical_ids_reference")), None)
    if ref:
        lines += ["", f"identical ids: each length's greedy ids against {ref}'s."]
    return lines


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# bench-gpu — {result['date']}",
        "",
        f"{result.get('gpu', '?')}, vLLM {result.get('vllm', '?')}, torch {result.get('torch', '?')}; model {result['model']['shape']} "
        f"({result['model']['layers']} layers x {result['model']['experts']} experts x {result['model']['expert_mb']:.2f} MB, top-{result['model']['top_k']}, dummy weights, per-layer routers)",
        f"command: `{result['command']}`",
        *quantized_line(result["arms"]),
        f"decode tok/s: {result.get('decode_estimator', '')}",
        "",
    ]
    lens = result.get("prompt_lens") or []
    lines += _length_table(result, lens) if lens else _arm_table(result)
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v, '.3f')} |" for k, v in result["ratios"].items()]
    acc = result.get("acceptance")
    if acc:
        lines += ["", f"Acceptance (issue 26, {acc['arm']}):", ""]
        for key, t in acc.items():
            if isinstance(t, dict):
                verdict = "not measured" if t["met"] is None else "met" if t["met"] else "not met"
                lines.append(f"- {key} (prompt {t['prompt_len']:,} tokens): {_fmt(t['value'], '.3f')}, target <= {t['target_max']}: {verdict}; "
                             f"identical ids {_fmt(t.get('identical_ids'))}")
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
