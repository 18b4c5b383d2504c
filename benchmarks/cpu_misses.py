"""The CPU expert path in ``reap-swap bench-gpu`` (issue 16): arm set-up, counters, the summary file.

Arms with ``"cpu_experts": true`` run reap-swap with ``REAP_CPU_EXPERTS=1``: the CPU expert team
gets ``REAP_CPU_EXPERT_CPUS`` (default: every core but the first two) and the arm process's own
threads (vLLM's) the other cores, so the two never share a core. Counters are read after the
batch-1 and the batch-8 timings (each reset before): share of missed experts / pairs the CPU
computed, the CPU's weight GB/s while busy, and the link's: bytes the GPU read over the link per
decode step / decode step time.

``assemble`` writes ``benchmarks/results/bench_gpu_cpu_misses.json`` from one dummy-routing
``bench-gpu`` result (stock_offload, reap_30, reap_30_cpu), optionally the learned-routing one
(reap_static, reap_static_cpu), the exactness runs and the device check (kernel vs memcpy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from .tp import tp_of

RESERVED_FOR_VLLM = 2


def apply_environment(spec: dict[str, Any]) -> None:
    """In the arm process, before vLLM starts: the CPU path on, cores split between it and vLLM."""
    if not spec.get("cpu_experts"):
        return
    from reap_swap.server_ext.cpu_experts import cpu_path as cp
    from reap_swap.server_ext.cpu_experts.kernel import CpuThreads

    os.environ[cp.ENV_CPU_EXPERTS] = "1"
    cores = sorted(os.sched_getaffinity(0))
    tp = tp_of(spec)
    if tp > 1:  # one core list per rank (server_ext/cpu_experts/cores.py), after RESERVED_PER_RANK x N cores left to vLLM
        from reap_swap.benchmarks import tp as tpm
        from reap_swap.server_ext.cpu_experts.cores import parse_rank_lists

        lists = tpm.rank_core_lists(cores, tp)
        if not os.environ.get("REAP_CPU_EXPERT_CPUS") and lists:
            os.environ["REAP_CPU_EXPERT_CPUS"] = tpm.core_spec(lists)
        ours = {c for cs in parse_rank_lists(os.environ.get("REAP_CPU_EXPERT_CPUS", "")) for c in cs}
    else:
        if not os.environ.get("REAP_CPU_EXPERT_CPUS") and len(cores) > RESERVED_FOR_VLLM + 1:
            os.environ["REAP_CPU_EXPERT_CPUS"] = ",".join(str(c) for c in cores[RESERVED_FOR_VLLM:])
        ours = set(CpuThreads.parse_cpus(os.environ.get("REAP_CPU_EXPERT_CPUS", "")))
    rest = set(cores) - ours
    if ours and rest:
        os.sched_setaffinity(0, rest)  # vLLM's threads (started after this) stay off the team's cores


def stats(llm: Any, reset: bool = True) -> dict[str, Any]:
    """Rank 0's counters; with several ranks every rank's under ``by_rank`` (each rank's team computes its
    shard of the same missed experts: equal counts, its own GB/s)."""
    from reap_swap.benchmarks.tp import by_rank

    return by_rank(llm.collective_rpc("reap_cpu_path_stats", args=(reset,)), same=("missed_experts",))


def with_link(cpu: dict[str, Any], decode_tok_s: float | None, batch: int, expert_bytes: int) -> dict[str, Any]:
    """Adds per-step numbers and the link GB/s achieved (link-side expert bytes per step / step time)."""
    layers = cpu.get("layers") or 0
    steps = cpu.get("calls", 0) / layers if layers else 0
    out = dict(cpu)
    if steps and decode_tok_s:
        step_s = batch / decode_tok_s
        link_experts = (cpu["missed_experts"] - cpu["cpu_experts"]) / steps
        out["decode_steps"] = steps
        out["missed_experts_per_step"] = cpu["missed_experts"] / steps
        out["cpu_experts_per_step"] = cpu["cpu_experts"] / steps
        out["link_experts_per_step"] = link_experts
        out["link_GBps_achieved"] = link_experts * expert_bytes / step_s / 1e9
        out["cpu_GBps_over_step"] = cpu["cpu_experts"] / steps * expert_bytes / step_s / 1e9
    return out


def _arm(result: dict[str, Any], name: str) -> dict[str, Any]:
    arm = (result.get("arms") or {}).get(name)
    if arm is None:
        raise SystemExit(f"cpu_misses: arm {name!r} is not in the bench-gpu result (arms: {sorted(result.get('arms') or {})})")
    return arm


def _rate(result: dict[str, Any], name: str, key: str) -> float | None:
    raw = (result.get("raw") or {}).get(name) or {}
    return (raw.get(key) or {}).get("decode_tok_s")


def _hits(raw: dict[str, Any], key: str) -> float | None:
    """Decode hit rate of an arm: dummy arms save ``hits_bs1``, learned arms ``hits: {bs1: ...}``."""
    h = raw.get(f"hits_{key}") or (raw.get("hits") or {}).get(key) or {}
    return h.get("hit_rate_decode") if isinstance(h, dict) else None


def _pair(result: dict[str, Any], link: str, cpu: str, stock: str | None) -> dict[str, Any]:
    raw = result.get("raw") or {}
    expert_bytes = int(round(float((result.get("model") or {}).get("expert_mb") or 0) * 1e6))
    out: dict[str, Any] = {"arms": {}}
    for name in filter(None, (stock, link, cpu)):
        _arm(result, name)
        r = raw.get(name) or {}
        entry: dict[str, Any] = {"decode_tok_s_bs1": _rate(result, name, "bs1"), "decode_tok_s_bs8": _rate(result, name, "bs8"),
                                 "hits_bs1": _hits(r, "bs1"), "hits_bs8": _hits(r, "bs8"),
                                 "identical_ids_bs1": r.get("identical_ids"), "error": r.get("error")}
        for b, batch in (("bs1", 1), ("bs8", int(r.get("spec", {}).get("batch", 8)))):
            if r.get(f"cpu_path_{b}"):
                entry[f"cpu_path_{b}"] = with_link(r[f"cpu_path_{b}"], entry[f"decode_tok_s_{b}"], batch, expert_bytes)
        out["arms"][name] = entry

    def ratio(a: str | None, b: str | None, key: str) -> float | None:
        if a is None or b is None:
            return None
        x, y = out["arms"][a][key], out["arms"][b][key]
        return x / y if x and y else None

    out["ratios"] = {
        "cpu_path_vs_stock_offload_bs1": ratio(cpu, stock, "decode_tok_s_bs1"),
        "cpu_path_vs_stock_offload_bs8": ratio(cpu, stock, "decode_tok_s_bs8"),
        "cpu_path_vs_link_only_bs1": ratio(cpu, link, "decode_tok_s_bs1"),
        "cpu_path_vs_link_only_bs8": ratio(cpu, link, "decode_tok_s_bs8"),
        "link_only_vs_stock_offload_bs1": ratio(link, stock, "decode_tok_s_bs1"),
    }
    return out


def assemble(args: argparse.Namespace) -> int:
    dummy = json.loads(Path(args.dummy).read_text())
    out: dict[str, Any] = {
        "what": "CPU expert path (issue 16): misses split between the host link and the host CPU; decode tok/s at 30 % of expert bytes on the GPU",
        "dummy_routing": {"command": dummy.get("command"), "date": dummy.get("date"), **_pair(dummy, "reap_30", "reap_30_cpu", "stock_offload")},
    }
    out["ratios"] = dict(out["dummy_routing"]["ratios"])
    if args.learned:
        learned = json.loads(Path(args.learned).read_text())
        stock = "stock_offload" if "stock_offload" in (learned.get("arms") or {}) else None
        out["learned_routing"] = {"command": learned.get("command"), "date": learned.get("date"),
                                  **_pair(learned, "reap_static", "reap_static_cpu", stock)}
        out["ratios"].update({f"learned_{k}": v for k, v in out["learned_routing"]["ratios"].items()})
    if args.check:
        check = json.loads(Path(args.check).read_text())
        out["device_check"] = check
        copied = check["memcpy"]["torch_copy"]
        out["memcpy_GBps"] = 2 * copied
        out["memcpy_copied_GBps"] = copied
        out["read_GBps"] = check["memcpy"].get("torch_read")
        out["memcpy_GBps_note"] = ("memory traffic of a torch copy of 1 GiB: read + write (2 x the bytes copied per second, "
                                   "memcpy_copied_GBps); read_GBps: a read-only pass (torch sum) over the same buffer")
    cpu_bs1 = (out["dummy_routing"]["arms"].get("reap_30_cpu") or {}).get("cpu_path_bs1") or {}
    out["cpu_kernel_GBps"] = cpu_bs1.get("cpu_GBps_achieved")
    out["cpu_kernel_GBps_note"] = "weight bytes / busy time of the CPU step inside the served bs1 decode (reap_30_cpu)"
    if out.get("memcpy_GBps") and out["cpu_kernel_GBps"]:
        out["cpu_kernel_vs_memcpy"] = out["cpu_kernel_GBps"] / out["memcpy_GBps"]
        out["cpu_kernel_vs_read"] = out["cpu_kernel_GBps"] / out["read_GBps"] if out.get("read_GBps") else None
        calib = (cpu_bs1.get("measured") or {}).get("cpu_GBps")
        out["cpu_kernel_GBps_alone"] = calib  # the start-up calibration: batch 1, distinct experts, the GPU idle
        out["cpu_kernel_alone_vs_memcpy"] = calib / out["memcpy_GBps"] if calib else None
    if args.exactness:
        ex = json.loads(Path(args.exactness).read_text())
        out["exactness"] = ex
        models = [m for m in ex["models"].values() if "error" not in m]
        out["max_abs_logit_delta"] = max((m["max_abs_logit_delta"] for m in models), default=None)
        out["greedy_agreement_256"] = min((m["greedy_agreement_256"] for m in models), default=None)
    Path(args.out).write_text(json.dumps(out, indent=1))
    Path(args.out).with_suffix(".md").write_text(markdown(out))
    print(json.dumps({k: v for k, v in out.items() if k not in ("dummy_routing", "learned_routing", "device_check", "exactness")}, indent=1))
    print(f"wrote {args.out}")
    return 0


def _f(v: Any, spec: str = ".1f") -> str:
    return "–" if v is None else format(v, spec)


def markdown(out: dict[str, Any]) -> str:
    """The summary as tables: decode speed and where the misses went, per routing, then the figures the issue asks for."""
    lines = ["# CPU expert path — misses split between the host link and the host CPU", ""]
    for key, title in (("dummy_routing", "dummy routing (vLLM dummy weights, per-layer routers)"), ("learned_routing", "learned routing (trace replay)")):
        sec = out.get(key)
        if not sec:
            continue
        lines += [f"## {title}", "", f"command: `{sec.get('command')}`", "",
                  "| arm | tok/s bs1 | tok/s bs8 | hit bs1 / bs8 | CPU share of missed experts bs1 / bs8 | CPU GB/s busy bs1 / bs8 | link GB/s bs1 / bs8 |",
                  "|---|---|---|---|---|---|---|"]
        for name, a in sec["arms"].items():
            c1, c8 = a.get("cpu_path_bs1") or {}, a.get("cpu_path_bs8") or {}
            lines.append(f"| {name} | {_f(a['decode_tok_s_bs1'])} | {_f(a['decode_tok_s_bs8'])} | {_f(a['hits_bs1'], '.3f')} / {_f(a['hits_bs8'], '.3f')} | "
                         f"{_f(c1.get('cpu_share_of_missed_experts'), '.2f')} / {_f(c8.get('cpu_share_of_missed_experts'), '.2f')} | "
                         f"{_f(c1.get('cpu_GBps_achieved'))} / {_f(c8.get('cpu_GBps_achieved'))} | "
                         f"{_f(c1.get('link_GBps_achieved'))} / {_f(c8.get('link_GBps_achieved'))} |")
        lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {_f(v, '.3f')} |" for k, v in sec["ratios"].items()] + [""]
    lines += ["## figures", "", "| figure | value |", "|---|---|"]
    for k in ("cpu_kernel_GBps", "cpu_kernel_GBps_alone", "memcpy_GBps", "memcpy_copied_GBps", "read_GBps", "cpu_kernel_vs_memcpy",
              "cpu_kernel_vs_read", "cpu_kernel_alone_vs_memcpy", "max_abs_logit_delta", "greedy_agreement_256"):
        lines.append(f"| {k} | {_f(out.get(k), '.3f')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="cpu_misses", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["assemble"])
    p.add_argument("--dummy", required=True, help="bench-gpu result with stock_offload, reap_30, reap_30_cpu")
    p.add_argument("--learned", help="bench-gpu --trace result with reap_static, reap_static_cpu")
    p.add_argument("--check", help="scripts/gpu_cpu_path_check.py output")
    p.add_argument("--exactness", help="cpu_exactness output")
    p.add_argument("--out", default="benchmarks/results/bench_gpu_cpu_misses.json")
    return assemble(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
