"""Join the peer runs of issue 28 into one result: llama.cpp ``--n-cpu-moe`` and kt-kernel vs ours (pure).

Inputs are the files ``scripts/gpu_peers.sh`` leaves under $OUT on the GPU machine, plus one of
our bench-gpu results (the ``reap_30_cpu`` arm) measured on the same kind of machine:

* ``llamacpp_bench.json``: llama-bench ``-o json`` rows (``n_prompt``/``n_gen``/``avg_ts``...),
  with ``llamacpp_bench.meta.json`` beside it (command, why that ``--n-cpu-moe``, the GGUF);
* ``kt_vs_ours.json``: ``bench_cpu_kernel --kt`` output: our native kernel and kt-kernel's
  BF16 MoE on the same threads and cores (``backends.native`` / ``kt_kernel_comparison``);
* a bench-gpu JSON (``arms.reap_30_cpu``; the ``ours`` phase of ``gpu_peers.sh`` writes ``bench_gpu_peers_ours.json`` on the same machine).

Every figure is copied from those files, never estimated: a missing one is ``null`` and
``missing[<key>]`` says why. Units: tokens/s for llama.cpp and our decode figures; GB/s = 1e9
bytes of expert weights read per second for the CPU kernels.

    python -m reap_swap.benchmarks.peers --llamacpp out/llamacpp_bench.json \
        --kt out/kt_vs_ours.json --ours-gpu benchmarks/results/bench_gpu_cpu_dummy.json \
        --out benchmarks/results/peers_h200.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

PINNED_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # ggml-org/llama.cpp, as vendored by llama-cpp-python 0.3.36
TG_DEFAULT = 128
OTHER_ARMS = ("stock_offload", "reap_30", "reap_30_fast")
"""Arms of the same bench-gpu run reported beside ``reap_30_cpu`` when present (the composed fast mode among them)."""
LLAMA_FLAGS = ("n_gpu_layers", "n_cpu_moe", "n_threads", "cpu_mask", "cpu_strict", "poll", "flash_attn", "n_batch",
               "n_ubatch", "type_k", "type_v", "no_op_offload", "load_mode", "repack", "model_type", "model_size",
               "model_n_params", "backends", "gpu_info", "cpu_info", "build_commit", "build_number")


def _load(path: str | Path | None) -> Any:
    if not path:
        return None
    p = Path(path)
    return json.loads(p.read_text()) if p.is_file() else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _row(rows: list[dict[str, Any]], n_prompt: int, n_gen: int) -> dict[str, Any] | None:
    for r in rows:
        if int(r.get("n_prompt", -1)) == n_prompt and int(r.get("n_gen", -1)) == n_gen and int(r.get("n_depth", 0) or 0) == 0:
            return r
    return None


def llamacpp_summary(rows: list[dict[str, Any]] | None, meta: dict[str, Any] | None, missing: dict[str, str],
                     prefix: str = "llamacpp", tg: int = TG_DEFAULT, pps: tuple[int, ...] = (256, 512, 2048)) -> dict[str, Any]:
    """Decode (tg at batch 1) and prefill (pp) tokens/s of one llama-bench run, with its flags."""
    out: dict[str, Any] = {"units": "tokens/s", "pinned_commit": PINNED_COMMIT}
    keys = ["decode_tok_s_bs1"] + [f"prefill_tok_s_pp{p}" for p in pps]
    if not rows:
        for k in keys:
            out[k] = None
            missing[f"{prefix}.{k}"] = "no llama-bench JSON (phase bench not run or failed)"
        out["commit"] = None
        return out
    first = rows[0]
    out["commit"] = first.get("build_commit")
    if out["commit"] and not PINNED_COMMIT.startswith(str(out["commit"])):
        missing[f"{prefix}.commit"] = f"llama-bench reports build {out['commit']}, not the pinned {PINNED_COMMIT[:7]}"
    out["flags"] = {k: first.get(k) for k in LLAMA_FLAGS if k in first}
    tg_row = _row(rows, 0, tg)
    out["decode_tok_s_bs1"] = tg_row["avg_ts"] if tg_row else None
    out["decode_tok_s_bs1_stddev"] = tg_row.get("stddev_ts") if tg_row else None
    out["decode_n_gen"] = tg
    if tg_row is None:
        missing[f"{prefix}.decode_tok_s_bs1"] = f"no tg{tg} row (n_prompt 0, n_gen {tg}) in the llama-bench JSON"
    for p in pps:
        r = _row(rows, p, 0)
        out[f"prefill_tok_s_pp{p}"] = r["avg_ts"] if r else None
        if r is None:
            missing[f"{prefix}.prefill_tok_s_pp{p}"] = f"no pp{p} row (n_prompt {p}, n_gen 0) in the llama-bench JSON"
    if meta:
        out["command"] = meta.get("command")
        out["n_cpu_moe_why"] = meta.get("n_cpu_moe_why")
        out["gguf"] = meta.get("gguf")
    return out


def _rate(d: dict[str, Any] | None, batch: int) -> float | None:
    r = (d or {}).get(f"batch{batch}") or {}
    return r.get("GBps")


def kt_summary(kernel: dict[str, Any] | None, missing: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"units": "GB/s of expert weights read (1e9 B/s)", "GBps_bs1": None, "GBps_bs8": None}
    if kernel is None:
        for b in (1, 8):
            missing[f"kt_kernel.GBps_bs{b}"] = "no kt_vs_ours.json (phase kt not run or failed)"
        return out
    cmp_ = kernel.get("kt_kernel_comparison")
    status = kernel.get("kt_kernel") or {}
    out["importable"] = status.get("importable")
    out["variant"] = status.get("variant")
    out["version"] = status.get("version")
    out["thread_cpus"] = ((cmp_ or {}).get("batch1") or {}).get("thread_cpus")
    out["moe_class"] = ((cmp_ or {}).get("batch1") or {}).get("moe_class")
    for b in (1, 8):
        out[f"GBps_bs{b}"] = _rate(cmp_, b)
        if out[f"GBps_bs{b}"] is None:
            if cmp_ is not None:
                why = f"no batch{b} entry"
            elif kernel.get("kt_kernel_comparison_error"):
                why = str(kernel["kt_kernel_comparison_error"])
            else:
                why = "kt-kernel did not import: " + str(status.get("importable"))
            missing[f"kt_kernel.GBps_bs{b}"] = why
    out["threads"] = kernel.get("threads")
    out["note"] = ("kt-kernel's BF16 MoE (moe_class) on a repacked copy of the same experts (8 a call, batch b tokens each), "
                   "timed like ours: medians of >= 5 passes after a warm-up")
    return out


def ours_summary(kernel: dict[str, Any] | None, gpu: dict[str, Any] | None, missing: dict[str, str],
                 kernel_fallback: dict[str, Any] | None = None, arm: str = "reap_30_cpu") -> dict[str, Any]:
    out: dict[str, Any] = {"units": {"cpu_kernel": "GB/s of expert weights read (1e9 B/s)", "decode": "tokens/s"}}
    src, k = "kt_vs_ours.json (same run, threads and cores as kt-kernel)", kernel
    if not ((k or {}).get("backends") or {}).get("native"):
        src, k = "the fallback CPU kernel result (another run, not side by side with kt-kernel)", kernel_fallback
    native = ((k or {}).get("backends") or {}).get("native")
    for b in (1, 8):
        out[f"cpu_kernel_GBps_bs{b}"] = _rate(native, b)
        if out[f"cpu_kernel_GBps_bs{b}"] is None:
            missing[f"ours.cpu_kernel_GBps_bs{b}"] = "no native backend figure in the kernel JSON"
    out["cpu_kernel_source"] = src if native else None
    out["cpu_kernel_threads"] = (k or {}).get("threads")
    out[arm] = gpu_arm_summary(gpu, arm, missing)
    for other in OTHER_ARMS:
        if other in (((gpu or {}).get("arms")) or {}):
            out[other] = gpu_arm_summary(gpu, other, {})
    return out


def gpu_arm_summary(gpu: dict[str, Any] | None, arm: str, missing: dict[str, str]) -> dict[str, Any]:
    """One bench-gpu arm's figures. A several-``--prompt-len`` run (``--ttft-only --prompt-len 256,2048``) gives decode at its
    shortest length and TTFT per length; its 2048-token TTFT becomes ``prefill_tok_s_pp2048`` = 2048 / TTFT."""
    a = ((gpu or {}).get("arms") or {}).get(arm)
    r: dict[str, Any] = {"decode_tok_s_bs1": None, "decode_tok_s_bs8": None, "prefill_tok_s_pp2048": None}
    if a is None:
        missing[f"ours.{arm}.decode_tok_s_bs1"] = f"no bench-gpu JSON with an {arm} arm given"
    else:
        lens = sorted(int(n) for n in (gpu or {}).get("prompt_lens") or [])
        settings = (gpu or {}).get("settings") or {}
        r["prompt_len"] = lens[0] if lens else settings.get("prompt_len")
        suffix = f"_p{lens[0]}" if lens else ""
        r["decode_tok_s_bs1"] = a.get("decode_tok_s_bs1") if a.get("decode_tok_s_bs1") is not None else a.get(f"decode_tok_s_bs1{suffix}")
        r["decode_tok_s_bs8"] = a.get("decode_tok_s_bs8")
        r["ttft_ms_bs1"] = a.get("ttft_ms_bs1") if a.get("ttft_ms_bs1") is not None else a.get(f"ttft_ms{suffix}")
        r["slots"] = a.get("slots")
        r["source"] = {"date": (gpu or {}).get("date"), "command": (gpu or {}).get("command"), "gpu": (gpu or {}).get("gpu")}
        raw = ((gpu or {}).get("raw") or {}).get(arm) or {}
        cpu_path = a.get("cpu_path_bs1") or raw.get("cpu_path_bs1") or raw.get(f"cpu_path_bs1{suffix}") or {}
        r["threads"] = cpu_path.get("threads") if isinstance(cpu_path, dict) else None
        r["prefill_tok_s_pp2048"] = a.get("prefill_tok_s_pp2048")
        if r["prefill_tok_s_pp2048"] is None and a.get("ttft_ms_p2048"):
            r["ttft_ms_p2048"] = a["ttft_ms_p2048"]
            r["prefill_tok_s_pp2048"] = 2048 / (a["ttft_ms_p2048"] / 1e3)
            r["prefill_pp2048_how"] = ("2048 / TTFT of a 2048-token prompt through vLLM (prefill plus the first decode step, "
                                       "scheduler included): a lower bound on prefill tok/s beside llama-bench's bare pp2048")
        if r["ttft_ms_bs1"] and r["prompt_len"]:
            r["prefill_tok_s_from_ttft"] = r["prompt_len"] / (r["ttft_ms_bs1"] / 1e3)
    if r["prefill_tok_s_pp2048"] is None:
        missing[f"ours.{arm}.prefill_tok_s_pp2048"] = (
            "bench-gpu measures no 2048-token prefill: it reports TTFT of a "
            f"{r.get('prompt_len') or '?'}-token prompt (prefill + first step, through vLLM's scheduler); "
            "run it with --ttft-only --prompt-len 256,2048")
    return r


def gpu_expert_share(layers: int, experts: int, n_cpu_moe: int | None, slots: int | None) -> dict[str, Any]:
    """Fraction of all expert bytes on the GPU: llama.cpp keeps whole layers' experts, ours ``slots`` per layer."""
    return {
        "llamacpp": (layers - n_cpu_moe) / layers if n_cpu_moe is not None else None,
        "ours": slots / experts if slots is not None else None,
        "how": "llama.cpp --n-cpu-moe N keeps the experts of the first N layers on the CPU, all experts of the "
               "other layers on the GPU; ours keeps `slots` experts of every layer on the GPU",
    }


def join(llama_rows: list[dict[str, Any]] | None, llama_meta: dict[str, Any] | None, kernel: dict[str, Any] | None,
         gpu: dict[str, Any] | None, kernel_fallback: dict[str, Any] | None = None,
         llama_gpu_all_rows: list[dict[str, Any]] | None = None, layers: int = 24, experts: int = 128,
         kt_fallback: dict[str, Any] | None = None) -> dict[str, Any]:
    missing: dict[str, str] = {}
    llama = llamacpp_summary(llama_rows, llama_meta, missing)
    kt_note = None
    if kt_fallback and kt_fallback.get("kt_kernel_comparison") and not (kernel or {}).get("kt_kernel_comparison"):
        kt_note = ("from the AVX2BF16_MOE rerun: the AMXBF16_MOE run gave none ("
                   + str((kernel or {}).get("kt_kernel_comparison_error") or "no figures") + ")")
        kernel = kt_fallback
    result: dict[str, Any] = {
        "what": "issue 28: llama.cpp --n-cpu-moe and kt-kernel vs REAP-swap on one GPU host, 30b-a3b-24l shape, bf16",
        "gpu": (gpu or {}).get("gpu"),
        "llamacpp": llama,
        "kt_kernel": {**kt_summary(kernel, missing), "fallback": kt_note},
        "ours": ours_summary(kernel, gpu, missing, kernel_fallback),
    }
    if llama_gpu_all_rows:
        result["llamacpp_all_gpu"] = llamacpp_summary(llama_gpu_all_rows, None, {}, prefix="llamacpp_all_gpu")
    ours = result["ours"]["reap_30_cpu"]
    ratios = {
        "ours_vs_llamacpp_bs1": _ratio(ours["decode_tok_s_bs1"], llama["decode_tok_s_bs1"]),
        "ours_vs_llamacpp_pp2048": _ratio(ours["prefill_tok_s_pp2048"], llama.get("prefill_tok_s_pp2048")),
        "ours_vs_llamacpp_pp256_ttft": _ratio(ours.get("prefill_tok_s_from_ttft"), llama.get("prefill_tok_s_pp256"))
        if ours.get("prompt_len") == 256 else None,
        "ours_fast_vs_llamacpp_bs1": _ratio((result["ours"].get("reap_30_fast") or {}).get("decode_tok_s_bs1"), llama["decode_tok_s_bs1"]),
        "ours_cpu_kernel_vs_kt_bs1": _ratio(result["ours"]["cpu_kernel_GBps_bs1"], result["kt_kernel"]["GBps_bs1"]),
        "ours_cpu_kernel_vs_kt_bs8": _ratio(result["ours"]["cpu_kernel_GBps_bs8"], result["kt_kernel"]["GBps_bs8"]),
    }
    if ratios["ours_fast_vs_llamacpp_bs1"] is None and "reap_30_fast" not in result["ours"]:
        missing["ours.reap_30_fast.decode_tok_s_bs1"] = "no reap_30_fast arm in the bench-gpu JSON (gpu_peers.sh ours runs it)"
    for k, v in ratios.items():
        if v is None:
            missing.setdefault(f"ratios.{k}", "a figure it divides is missing (see the other entries)")
    result["ratios"] = ratios
    result["ratios_note"] = ("ours / peer; > 1 means ours is faster. pp256_ttft is approximate: ours is "
                             "prompt_len / TTFT through vLLM (prefill plus one decode step), llama.cpp's a bare pp256")
    flags = llama.get("flags") or {}
    result["gpu_expert_share"] = gpu_expert_share(layers, experts, flags.get("n_cpu_moe"), ours.get("slots"))
    result["missing"] = missing
    return result


def _in_repo(path: str | None) -> str | None:
    """A path under this checkout as a repo-relative one (the JSON is committed), any other as given."""
    if not path:
        return path
    root = Path(__file__).resolve().parents[1]
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llamacpp", help="llama-bench -o json output (--n-cpu-moe run)")
    ap.add_argument("--llamacpp-meta", help="its meta JSON (default: <llamacpp>.meta.json beside it)")
    ap.add_argument("--llamacpp-all-gpu", help="llama-bench JSON of the all-experts-on-GPU run (optional)")
    ap.add_argument("--kt", help="bench_cpu_kernel --kt output (kt-kernel and ours, same threads)")
    ap.add_argument("--kt-fallback", help="the same with KT_MOE_CLASS=AVX2BF16_MOE, used when --kt has no kt figures")
    ap.add_argument("--ours-kernel", help="fallback CPU kernel JSON for ours if --kt has none")
    ap.add_argument("--ours-gpu", help="a bench-gpu result JSON with the reap_30_cpu arm")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    meta_path = args.llamacpp_meta or (str(Path(args.llamacpp).with_suffix("")) + ".meta.json" if args.llamacpp else None)
    res = join(_load(args.llamacpp), _load(meta_path), _load(args.kt), _load(args.ours_gpu), _load(args.ours_kernel),
               _load(args.llamacpp_all_gpu), kt_fallback=_load(args.kt_fallback))
    res["inputs"] = {k: _in_repo(v) for k, v in vars(args).items() if k != "out"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({"ratios": res["ratios"], "missing": sorted(res["missing"])}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
