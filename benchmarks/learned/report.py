"""Summary, ratios and markdown of a learned-routing ``bench-gpu --trace`` run (pure).

Link bytes per decoded token = missed (token, expert) pairs per decoded token x
expert bytes (w13 + w2 of one expert: 3 x hidden x moe_intermediate x dtype
bytes): a missed expert's rows are read from pinned host memory once per token
at batch 1. At batch 8 the same count is an upper bound (an expert missed by
several tokens of one step is read once). Stock offload's misses are the pairs
routed to layers whose experts vLLM put on the host (same UVA read path).
"""

from __future__ import annotations

from typing import Any

from .. import tp as tpm
from ..gpu_report import _fmt, _get, _ratio, cut_arms, cut_lines, miss_bytes, quantized_line, run_header
from ..shapes import MoeShape

REAP_ARMS = ("reap_static", "reap_plan", "reap_classifier", "reap_cache", "reap_classifier_complement", "reap_cache_complement",
             "reap_static_cpu", "reap_fast", "reap_fast_classifier")
LINK_FORMULA = ("link bytes/token = missed pairs per decoded token x expert bytes (3 x hidden x moe_intermediate x bytes a weight: the "
                "dtype's, or the --quantization scheme's: reap arms its banked weights, stock offload with its scales); bs8: an upper bound")


def arm_summary(raw: dict[str, Any], shape: MoeShape) -> dict[str, Any]:
    spec = raw.get("spec", {})
    hits = raw.get("hits") or {}

    expert_bytes = miss_bytes(shape, spec)

    def link(key: str) -> float | None:
        missed = _get(hits, key, "missed_pairs_per_token")
        return missed * expert_bytes if missed is not None else None

    def agree(measured: Any, offline: Any) -> bool | None:
        return abs(measured - offline) < 1e-9 if measured is not None and offline is not None else None

    extra = {}
    for e in spec.get("extra_batches") or []:  # --extra-batches: bs32 ... beside bs1 / bs8
        key = e["key"]
        extra.update({f"decode_tok_s_{key}": _get(raw, key, "decode_tok_s"), f"decode_tok_s_{key}_e2e": _get(raw, key, "decode_tok_s_e2e"),
                      f"ttft_ms_{key}": _get(raw, key, "ttft_ms"), f"hit_rate_decode_{key}": _get(hits, key, "hit_rate_decode"),
                      f"hit_rate_decode_{key}_offline": _get(spec, "offline", key, "hit_rate_decode"),
                      f"hit_rate_decode_{key}_predicted": _get(spec, "predicted", key),
                      f"link_bytes_per_token_{key}": link(key), f"identical_ids_{key}": raw.get(f"identical_ids_{key}")})
        if raw.get(f"profile_{key}") is not None:  # the largest extra batch is profiled too
            extra.update({f"{m}_per_decode_step_{key}": _get(raw, f"profile_{key}", m) for m in ("syncs", "blocking_copies", "launches")})
    tp = tpm.tp_of(spec)
    if tp > 1:
        extra["gpu_used_gib_by_rank"] = [r.get("gpu_used_gib") for r in _get(raw, "memory", "by_rank") or []]
        extra["trace_routing_attached_all_ranks"] = _get(raw, "trace_routing", "attached_all_ranks")
        extra["accounting_ranks_agree"] = {k: _get(hits, k, "ranks_agree") for k in hits} if spec.get("kind") == "reap" else None
    return {
        "tensor_parallel_size": tp,
        **extra,
        "kind": spec.get("kind"),
        "quantization": spec.get("quantization"),
        "expert_bytes": expert_bytes,
        "slots": spec.get("slots"),
        "offload_gib": spec.get("offload_gib"),
        "decode_tok_s_bs1": _get(raw, "bs1", "decode_tok_s"),
        "decode_tok_s_bs8": _get(raw, "bs8", "decode_tok_s"),
        "decode_tok_s_bs1_e2e": _get(raw, "bs1", "decode_tok_s_e2e"),
        "decode_tok_s_bs8_e2e": _get(raw, "bs8", "decode_tok_s_e2e"),
        "ttft_ms": _get(raw, "bs1", "ttft_ms"),
        "ttft_ms_with_swap": _get(raw, "bs1", "ttft_ms_with_swap"),
        "ttft_ms_bs8": _get(raw, "bs8", "ttft_ms"),
        "ttft_ms_bs8_with_swap": _get(raw, "bs8", "ttft_ms_with_swap"),
        "swap_ms_bs1": _get(raw, "bs1", "swap_ms_median"),
        "swap_ms_bs8": _get(raw, "bs8", "swap_ms_median"),
        "swap_mb_bs1": _get(raw, "bs1", "swap_mb_mean"),
        "swap_mb_bs8": _get(raw, "bs8", "swap_mb_mean"),
        "hit_rate_decode": _get(hits, "bs1", "hit_rate_decode"),
        "hit_rate_prefill": _get(hits, "bs1", "hit_rate_prefill"),
        "hit_rate_decode_bs8": _get(hits, "bs8", "hit_rate_decode"),
        "hit_rate_source": _get(hits, "bs1", "source"),
        "hit_rate_decode_offline": _get(spec, "offline", "bs1", "hit_rate_decode"),
        "hit_rate_decode_bs8_offline": _get(spec, "offline", "bs8", "hit_rate_decode"),
        "replay_checked": agree(_get(hits, "bs1", "hit_rate_decode"), _get(spec, "offline", "bs1", "hit_rate_decode"))
        and agree(_get(hits, "bs8", "hit_rate_decode"), _get(spec, "offline", "bs8", "hit_rate_decode")),
        "hit_rate_decode_predicted": _get(spec, "predicted", "bs1"),
        "hit_rate_decode_bs8_predicted": _get(spec, "predicted", "bs8"),
        "link_bytes_per_token_bs1": link("bs1"),
        "link_bytes_per_token_bs8": link("bs8"),
        "identical_ids": raw.get("identical_ids"),
        "identical_ids_bs8": raw.get("identical_ids_bs8"),
        "gpu_used_gib": _get(raw, "memory", "gpu_used_gib"),
        "pinned_host_gib": _get(raw, "memory", "pinned_host_gib"),
        "llm_init_s": _get(raw, "memory", "llm_init_s"),
        "online_cache": raw.get("online_cache"),
        "complement": raw.get("complement"),
        "syncs_per_decode_step": _get(raw, "profile", "syncs"),
        "blocking_copies_per_decode_step": _get(raw, "profile", "blocking_copies"),
        "launches_per_decode_step": _get(raw, "profile", "launches"),
        "reap_kernels": _get(raw, "profile", "reap_kernels"),
        "cpu_rates": cpu_rates(raw),
        "host_rss_gib": _get(raw, "host_memory", "rss_gib"),
        "host_peak_rss_gib": _get(raw, "host_memory", "peak_rss_gib"),
        "host_rss_gib_after_load": _get(raw, "host_memory_after_load", "rss_gib"),
        "host_peak_rss_gib_after_install": _get(raw, "host_memory_after_install", "peak_rss_gib"),
        "error": raw.get("error"),
    }


PROBE_SPREAD = 1.3
"""Arms of one run whose CPU probes differ by more than this factor: the report says so (issue 25, 2026-12-07: 28.7 against 92.1)."""


def cpu_rates(raw: dict[str, Any]) -> dict[str, Any] | None:
    """A CPU-path arm's CPU GB/s at batch 1: its start-up probe, what the split used at the end, what the team achieved,
    and the re-ratings while serving; None without the CPU path."""
    cp = raw.get("cpu_path_bs1") or {}
    if not cp.get("enabled"):
        return None
    return {"probe_GBps": _get(cp, "measured", "cpu_GBps"), "split_GBps": _get(cp, "cost_model", "cpu_GBps"),
            "team_GBps": cp.get("cpu_GBps_achieved"), "rate_updates": cp.get("rate_updates")}


def probe_spread(arms: dict[str, dict[str, Any]]) -> str | None:
    """A warning when the run's CPU-path arms probed the CPU at rates more than ``PROBE_SPREAD`` apart: their splits
    then differ by the probe, not by the mode."""
    probes = {n: r["probe_GBps"] for n, a in arms.items() if (r := a.get("cpu_rates")) and r.get("probe_GBps")}
    if len(probes) < 2 or max(probes.values()) <= PROBE_SPREAD * min(probes.values()):
        return None
    return ("WARNING: the CPU-path arms' start-up probes disagree (" + ", ".join(f"{n} {v:.1f}" for n, v in probes.items())
            + " GB/s): each split followed its own probe, so their gap is partly the probe's")


def batch_keys(arms: dict[str, dict[str, Any]]) -> tuple[str, ...]:
    """bs1, bs8 and any --extra-batches key (bs32 ...) an arm reports."""
    extra = sorted({k.removeprefix("decode_tok_s_") for a in arms.values() for k in a
                    if k.startswith("decode_tok_s_bs") and not k.endswith("_e2e") and k not in ("decode_tok_s_bs1", "decode_tok_s_bs8")},
                   key=lambda b: int(b[2:]))
    return ("bs1", "bs8", *extra)


def ratios(arms: dict[str, dict[str, Any]], tp: int = 1) -> dict[str, float | None]:
    """Decode tok/s ratios; with ``tp`` > 1 every key carries ``_tp<N>`` before its batch tag (``tp.ratio_key``)."""
    g = lambda arm, key: (arms.get(arm) or {}).get(key)  # noqa: E731
    out: dict[str, float | None] = {}
    extra = batch_keys(arms)[2:]
    for arm in REAP_ARMS:
        if arm not in arms:
            continue
        for bs in ("bs1", "bs8", *extra):
            out[f"{arm}_vs_stock_offload_{bs}"] = _ratio(g(arm, f"decode_tok_s_{bs}"), g("stock_offload", f"decode_tok_s_{bs}"))
        for bs in ("bs1", "bs8"):
            out[f"{arm}_vs_stock_gpu_{bs}"] = _ratio(g(arm, f"decode_tok_s_{bs}"), g("stock_gpu", f"decode_tok_s_{bs}"))
        out[f"{arm}_vs_stock_offload_bs1_e2e"] = _ratio(g(arm, "decode_tok_s_bs1_e2e"), g("stock_offload", "decode_tok_s_bs1_e2e"))
    if "reap_fast" in arms:  # issue 25's acceptance keys (the composed mode, static prior)
        for bs in ("bs1", "bs8", *extra):
            for est in ("", "_e2e"):
                out[f"fast_vs_stock_offload_{bs}{est}"] = _ratio(g("reap_fast", f"decode_tok_s_{bs}{est}"), g("stock_offload", f"decode_tok_s_{bs}{est}"))
        out["fast_vs_static_cpu_bs1"] = _ratio(g("reap_fast", "decode_tok_s_bs1"), g("reap_static_cpu", "decode_tok_s_bs1"))
        out["fast_vs_static_cpu_bs1_e2e"] = _ratio(g("reap_fast", "decode_tok_s_bs1_e2e"), g("reap_static_cpu", "decode_tok_s_bs1_e2e"))
    quant = (arms.get("reap_fast") or arms.get("stock_offload") or {}).get("quantization")
    if quant and "reap_fast" in arms:  # issue 27's keys: the quantized fast mode against stock offload of the same scheme and bf16's
        q = str(quant).replace("-", "_")
        for bs in ("bs1", "bs8"):
            for est in ("", "_e2e"):
                out[f"{q}_fast_vs_stock_{q}_offload_{bs}{est}"] = _ratio(g("reap_fast", f"decode_tok_s_{bs}{est}"),
                                                                         g("stock_offload", f"decode_tok_s_{bs}{est}"))
                out[f"{q}_fast_vs_bf16_fast_{bs}{est}"] = _ratio(g("reap_fast", f"decode_tok_s_{bs}{est}"), g("bf16_reap_fast", f"decode_tok_s_{bs}{est}"))
    return tpm.tp_ratios(out, tp)


def cache_summary(result: dict[str, Any]) -> dict[str, Any] | None:
    """The online-cache arm against stock offload and the static set, from one learned run (None without it)."""
    arms = result.get("arms") or {}
    if "reap_cache" not in arms:
        return None
    keep = ("decode_tok_s_bs1", "decode_tok_s_bs8", "ttft_ms", "ttft_ms_with_swap", "hit_rate_decode", "hit_rate_decode_bs8",
            "hit_rate_prefill", "identical_ids", "identical_ids_bs8", "link_bytes_per_token_bs1", "online_cache", "error")
    g = lambda arm, key: (arms.get(arm) or {}).get(key)  # noqa: E731
    return {
        "date": result.get("date"),
        "gpu": result.get("gpu"),
        "model": result.get("model"),
        "trace": (result.get("context") or {}).get("trace"),
        "source": "the reap_cache arm of this learned-routing bench-gpu run (same process layout, same requests)",
        "arms": {a: {k: g(a, k) for k in keep} for a in ("stock_offload", "reap_static", "reap_cache", "reap_cache_complement") if a in arms},
        "ratios": {
            "cache_vs_stock_offload_bs1": _ratio(g("reap_cache", "decode_tok_s_bs1"), g("stock_offload", "decode_tok_s_bs1")),
            "cache_vs_stock_offload_bs8": _ratio(g("reap_cache", "decode_tok_s_bs8"), g("stock_offload", "decode_tok_s_bs8")),
            "cache_vs_static_bs1": _ratio(g("reap_cache", "decode_tok_s_bs1"), g("reap_static", "decode_tok_s_bs1")),
            "cache_vs_static_bs8": _ratio(g("reap_cache", "decode_tok_s_bs8"), g("reap_static", "decode_tok_s_bs8")),
        },
    }


def _complement_pair(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    comp = on.get("complement") or {}
    ex = comp.get("counters") or {}
    return {
        "host_gib_full_copy": off.get("pinned_host_gib"),
        "host_gib_complement": on.get("pinned_host_gib"),
        "host_gib_saved_fraction": (1 - on["pinned_host_gib"] / off["pinned_host_gib"]) if on.get("pinned_host_gib") and off.get("pinned_host_gib") else None,
        "process_rss_gib_full_copy": off.get("host_rss_gib"),
        "process_rss_gib_complement": on.get("host_rss_gib"),
        "peak_host_gib_at_load": {"full_copy": off.get("host_peak_rss_gib_after_install"), "complement": on.get("host_peak_rss_gib_after_install")},
        "rss_after_model_load_gib": {"full_copy": off.get("host_rss_gib_after_load"), "complement": on.get("host_rss_gib_after_load")},
        "host_bank_gib": {"full_copy": (off.get("complement") or {}).get("host_bank_gib"), "complement": comp.get("host_bank_gib")},
        "exchanges": ex.get("exchanges"),
        "rotated_exchanges": ex.get("rotated_blocks"),
        "memcpy_bytes_avoided": ex.get("memcpy_bytes_avoided"),
        "complement_counters": comp,
        "decode_tok_s_off": off.get("decode_tok_s_bs1"),
        "decode_tok_s_on": on.get("decode_tok_s_bs1"),
        "decode_tok_s_bs8_off": off.get("decode_tok_s_bs8"),
        "decode_tok_s_bs8_on": on.get("decode_tok_s_bs8"),
        "identical_ids": bool(off.get("identical_ids") and on.get("identical_ids") and off.get("identical_ids_bs8") and on.get("identical_ids_bs8")),
        "hit_rate_decode": {"off": off.get("hit_rate_decode"), "on": on.get("hit_rate_decode")},
        "errors": {"off": off.get("error"), "on": on.get("error")},
    }


def complement_summary(result: dict[str, Any]) -> dict[str, Any] | None:
    """RAM-complement off/on from one run: ``reap_classifier`` vs ``reap_classifier_complement`` (control-plane
    swaps) and/or ``reap_cache`` vs ``reap_cache_complement`` (the online cache's exchanges); None without a pair."""
    arms = result.get("arms") or {}
    pairs = {"swaps": ("reap_classifier", "reap_classifier_complement"), "online_cache": ("reap_cache", "reap_cache_complement")}
    found = {k: _complement_pair(arms[a], arms[b]) for k, (a, b) in pairs.items() if arms.get(a) and arms.get(b)}
    if not found:
        return None
    first = found.get("swaps") or found["online_cache"]
    return {
        "date": result.get("date"),
        "gpu": result.get("gpu"),
        "model": result.get("model"),
        "trace": (result.get("context") or {}).get("trace"),
        "source": "full host copy vs RAM complement, arm pairs of this learned-routing bench-gpu run: swaps = reap_classifier vs "
                  "reap_classifier_complement (the classifier's set swapped in before every request / batch), online_cache = "
                  "reap_cache vs reap_cache_complement (promotions inside the forward); top-level fields: the first pair present",
        **first,
        "pairs": found,
    }


def summarize(raw: dict[str, dict[str, Any]], shape: MoeShape, date: str, command: str, settings: dict[str, Any], context: dict[str, Any]) -> dict[str, Any]:
    arms = {name: arm_summary(r, shape) for name, r in raw.items()}
    tp = tpm.tp_of(settings)
    return {
        "mode": "learned",
        **run_header(raw, shape, date, command, settings),
        "tensor_parallel_size": tp,
        "context": context,
        "decode_estimator": "batch / median duration of full-batch decode steps (every request past its first token, none finished; "
                            "the first such step of each run left out); *_e2e: decoded tokens / (wall - time to the last first token)",
        "hit_rate_estimators": {
            "measured": "reap arms: reap-swap's miss accounting, decode pairs = a full run's minus a prefill-only run's of the same requests",
            "stock": "where vLLM put each layer's expert weights (loaded parameters) x the trace rows of the requests run",
            "offline": "the sets and the trace rows of the requests run (must equal measured: same routing; replay_checked says it does)",
            "predicted": "the sets file's scores over every request of the trace (reap-swap learned-sets)",
        },
        "link_formula": LINK_FORMULA,
        "arms": arms,
        "ratios": ratios(arms, tp),
        "raw": raw,
    }


def _pair(a: Any, b: Any, spec: str = ".1f") -> str:
    return f"{_fmt(a, spec)} / {_fmt(b, spec)}"


def markdown(result: dict[str, Any]) -> str:
    m, ctx = result["model"], result.get("context", {})
    wl = ctx.get("workload", {})
    lines = [
        f"# bench-gpu, learned routing — {result['date']}",
        "",
        f"{result.get('gpu', '?')}, vLLM {result.get('vllm', '?')}, torch {result.get('torch', '?')}; model {m['shape']} "
        f"({m['layers']} layers x {m['experts']} experts x {m['expert_mb']:.2f} MB, top-{m['top_k']}, dummy weights) routing as trace "
        f"`{ctx.get('trace', '?')}` replays (trace layers {ctx.get('trace_layers', '?')}); sets `{ctx.get('sets', '?')}`, "
        f"{ctx.get('slots_per_layer', '?')} slots per layer",
        f"workload: bs1 {len(wl.get('bs1', []))} trace requests one at a time (gen {wl.get('gen', '?')}), bs8 groups "
        f"{wl.get('groups_bs8', '?')} (gen {wl.get('gen_bs8', '?')}), each prompt the trace request's prompt length",
        f"command: `{result['command']}`",
        *quantized_line(result["arms"]),
        f"decode tok/s: {result['decode_estimator']}",
        f"{result['link_formula']}",
        "",
        "| arm | decode tok/s bs1 / bs8 | TTFT bs1 ms (with swap) | TTFT bs8 ms (with swap) | swap ms bs1 / bs8 | decode hit rate bs1 / bs8 "
        "| offline (requests run) bs1 / bs8 | predicted (sets file) bs1 / bs8 | link MB/token bs1 / bs8 | GPU GiB | pinned host GiB | identical ids bs1 / bs8 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cut = cut_arms(result["arms"])
    for name, a in result["arms"].items():
        if a.get("error") and name not in cut:
            lines.append(f"| {name} | error: {a['error'][:100]} |" + " |" * 11)
            continue
        mb = lambda x: x / 1e6 if x is not None else None  # noqa: E731
        lines.append(
            f"| {name} | {_pair(a['decode_tok_s_bs1'], a['decode_tok_s_bs8'])} | {_fmt(a['ttft_ms'])} ({_fmt(a['ttft_ms_with_swap'])}) | "
            f"{_fmt(a['ttft_ms_bs8'])} ({_fmt(a['ttft_ms_bs8_with_swap'])}) | {_pair(a['swap_ms_bs1'], a['swap_ms_bs8'])} | "
            f"{_pair(a['hit_rate_decode'], a['hit_rate_decode_bs8'], '.3f')} | {_pair(a['hit_rate_decode_offline'], a['hit_rate_decode_bs8_offline'], '.3f')} | "
            f"{_pair(a['hit_rate_decode_predicted'], a['hit_rate_decode_bs8_predicted'], '.3f')} | "
            f"{_pair(mb(a['link_bytes_per_token_bs1']), mb(a['link_bytes_per_token_bs8']), '.0f')} | {_fmt(a['gpu_used_gib'], '.2f')} | "
            f"{_fmt(a['pinned_host_gib'], '.2f')} | {_fmt(a['identical_ids'])} / {_fmt(a['identical_ids_bs8'])} |"
        )
    lines += cut_lines(cut)
    extra = batch_keys(result["arms"])[2:]
    if extra:
        lines += ["", "| arm | " + " | ".join(f"decode tok/s {b} | hit rate {b} | identical ids {b}" for b in extra) + " |",
                  "|---|" + "---|---|---|" * len(extra)]
        for name, a in result["arms"].items():
            lines.append(f"| {name} | " + " | ".join(f"{_fmt(a.get(f'decode_tok_s_{b}'))} | {_fmt(a.get(f'hit_rate_decode_{b}'), '.3f')} | "
                                                     f"{_fmt(a.get(f'identical_ids_{b}'))}" for b in extra) + " |")
    if tpm.tp_of(result) > 1:
        lines += ["", f"tensor_parallel_size {result['tensor_parallel_size']}: stock offload's cpu_offload_gb is per GPU (each rank holds "
                  "1/N of every expert); link MB/token counts every rank's link; GPU GiB is the fullest rank's."]
    lines += ["", "| ratio (decode tok/s) | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v, '.3f')} |" for k, v in result["ratios"].items()]
    checked = {n: a.get("replay_checked") for n, a in result["arms"].items() if a.get("replay_checked") is not None}
    if checked:
        lines += ["", "Trace replay checked (measured decode hit rate = offline, bs1 and bs8): "
                  + ", ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in checked.items()) + "."]
    rated = {n: a["cpu_rates"] for n, a in result["arms"].items() if a.get("cpu_rates")}
    if rated:
        lines += ["", "CPU path at batch 1, GB/s (start-up probe / the split's rate at the end / the team's achieved): " + "; ".join(
            f"{n} {_fmt(r['probe_GBps'])} / {_fmt(r['split_GBps'])} / {_fmt(r['team_GBps'])}" for n, r in rated.items()) + "."]
        if (warning := probe_spread(result["arms"])) is not None:
            lines += ["", warning + "."]
    profiled = [("", "batch 1 (torch.profiler)")] + [(f"_{b}", f"batch {b[2:]} (torch.profiler, one group decoding together)")
                                                     for b in batch_keys(result["arms"])[2:]]
    for sfx, label in profiled:
        prof = {n: a for n, a in result["arms"].items() if a.get(f"syncs_per_decode_step{sfx}") is not None}
        if prof:
            lines += ["", f"Per decode step at {label}: " + "; ".join(
                f"{n} {_fmt(a[f'syncs_per_decode_step{sfx}'], '.2f')} syncs, {_fmt(a[f'blocking_copies_per_decode_step{sfx}'], '.2f')} blocking copies, "
                f"{_fmt(a[f'launches_per_decode_step{sfx}'], '.1f')} launches" for n, a in prof.items()) + "."]
    comp = complement_summary(result)
    for name, c in ((comp or {}).get("pairs") or {}).items():
        lines += ["", f"RAM complement off / on ({name}): pinned host {_pair(c['host_gib_full_copy'], c['host_gib_complement'], '.2f')} GiB, "
                  f"process RSS {_pair(c['process_rss_gib_full_copy'], c['process_rss_gib_complement'], '.2f')} GiB, exchanges "
                  f"{_fmt(c['exchanges'])}, rotated {_fmt(c['rotated_exchanges'])}, memcpy bytes avoided {_fmt(c['memcpy_bytes_avoided'])}, "
                  f"decode tok/s bs1 {_pair(c['decode_tok_s_off'], c['decode_tok_s_on'])}, bs8 {_pair(c['decode_tok_s_bs8_off'], c['decode_tok_s_bs8_on'])}, "
                  f"identical ids {c['identical_ids']}."]
    lines += ["", "Hit rates: " + "; ".join(f"{k}: {v}" for k, v in result["hit_rate_estimators"].items()) + "."]
    return "\n".join(lines) + "\n"
