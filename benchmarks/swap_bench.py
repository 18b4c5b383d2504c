"""``reap-swap bench-swap``: swap latency and decode speed, measured side by side.

Starts a stock vLLM server and a reap-swap server (slot bank = every expert,
the plan's core resident at start) on the same model, then measures, in one
run and interleaved so machine noise hits every arm alike:

* swap latency and bytes/s for 1..N experts per layer (server-side copy time
  and client round trip);
* decode tokens/s at batch 1 for stock vLLM, reap-swap with every expert
  resident, and reap-swap with only the core resident.

Device-agnostic: the same script runs on CPU and on a CUDA machine. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from reap_swap.cli import HelpFormatter
from reap_swap.models.families import layout_for
from reap_swap.plan import load_plan
from reap_swap.procs import ServerProcess, free_port, reap_swap_argv, stock_vllm_argv

IDLE_S = 1.5
PROMPT = "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n"


def _timed_completion(client: httpx.Client, url: str, model: str, tokens: int) -> float:
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    t = time.perf_counter()
    client.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
    return time.perf_counter() - t


def _decode_tps(client: httpx.Client, url: str, model: str, tokens: int) -> float:
    """Tokens per second of a batch-1 greedy generation of ``tokens`` tokens (short prompt, so
    prefill is a negligible share); the median of three requests resists this box's noise.

    vLLM workers busy-poll their queue for 1 s after each step; the pause lets the other
    server's worker go idle so the two arms do not share cores with it."""
    time.sleep(IDLE_S)
    times = sorted(_timed_completion(client, url, model, tokens) for _ in range(3))
    return tokens / times[1]


def _swap(client: httpx.Client, url: str, active: dict[str, list[int]], rid: str, headers: dict[str, str]) -> dict[str, Any]:
    t = time.perf_counter()
    r = client.post(url + "/swap_active_set", json={"request_id": rid, "phase": "prefill", "active_set": active, "allow_missing_core": True}, headers=headers, timeout=600)
    r.raise_for_status()
    out = r.json()
    out["client_ms"] = (time.perf_counter() - t) * 1e3
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = str(args.model)
    layout = layout_for(args.model)
    plan = load_plan(args.plan)
    core = {f"layer_{i}": list(plan.layers[i].core) for i in layout.moe_layers}
    every = {f"layer_{i}": list(range(layout.num_experts)) for i in layout.moe_layers}
    common = [*args.vllm_args.split()]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    logs = Path(args.out).parent
    reap = ServerProcess(
        reap_swap_argv("serve", "--model", model, "--plan", str(args.plan), "--resident-experts-per-layer",
                       str(layout.num_experts), "--port", str(p1 := free_port()), *common),
        p1, logs / "bench-reap.log", env=env, name="reap-swap")
    stock = ServerProcess(stock_vllm_argv(model, "--port", str(p2 := free_port()), *common), p2, logs / "bench-stock.log", env=env, name="stock")
    h: dict[str, str] = {}
    with stock, reap, httpx.Client() as client:
        # Swap latency: from core-only, load n non-core experts per layer, then go back.
        swap_rows = []
        non_core = {k: [e for e in range(layout.num_experts) if e not in set(v)] for k, v in core.items()}
        _swap(client, reap.url, core, "bench-reset", h)
        sizes = [n for n in (1, 2, 4, 8, 16, 32, 64, 128) if n <= min(len(v) for v in non_core.values())]
        for n in sizes:
            samples = []
            for rep in range(args.repeats):
                target = {k: sorted(core[k] + non_core[k][:n]) for k in core}
                res = _swap(client, reap.url, target, f"bench-{n}-{rep}", h)
                samples.append(res)
                _swap(client, reap.url, core, f"bench-back-{n}-{rep}", h)
            copy_ms = statistics.median(s["timing_ms"]["copy"] for s in samples)
            swap_rows.append({
                "experts_per_layer": n,
                "experts_total": n * len(core),
                "bytes": samples[0]["bytes_copied"],
                "copy_ms_median": copy_ms,
                "server_total_ms_median": statistics.median(s["timing_ms"]["total"] for s in samples),
                "client_ms_median": statistics.median(s["client_ms"] for s in samples),
                "gb_per_s": samples[0]["bytes_copied"] / (copy_ms / 1e3) / 1e9 if copy_ms > 0 else float("nan"),
            })
        # Decode speed, interleaved rounds.
        arms: dict[str, list[float]] = {"stock": [], "reap_all_resident": [], "reap_core_only": []}
        _decode_tps(client, stock.url, model, 8)
        _decode_tps(client, reap.url, model, 8)
        for _ in range(args.rounds):
            arms["stock"].append(_decode_tps(client, stock.url, model, args.tokens))
            _swap(client, reap.url, every, "bench-all", h)
            arms["reap_all_resident"].append(_decode_tps(client, reap.url, model, args.tokens))
            _swap(client, reap.url, core, "bench-core", h)
            arms["reap_core_only"].append(_decode_tps(client, reap.url, model, args.tokens))
        miss = client.get(reap.url + "/router_misses/__all__", headers=h, timeout=60).json()["summary"]
        info = client.get(reap.url + "/reap/status", headers=h, timeout=60).json()["worker"]
    decode = {k: {"tok_s_median": statistics.median(v), "tok_s": v} for k, v in arms.items()}
    base = decode["stock"]["tok_s_median"]
    for v in decode.values():
        v["ratio_vs_stock"] = v["tok_s_median"] / base if base else float("nan")
    return {
        "model": model,
        "device": info["device"],
        "backing": info["backing"],
        "expert_bytes": info["expert_bytes"],
        "moe_layers": len(core),
        "experts_per_layer": layout.num_experts,
        "core_per_layer": len(next(iter(core.values()))),
        "swap": swap_rows,
        "decode": decode,
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
        "router_misses_all": miss,
    }


def print_table(res: dict[str, Any]) -> None:
    print(f"\nswap latency ({res['device']}, backing={res['backing']}, {res['moe_layers']} MoE layers, "
          f"{res['expert_bytes']} bytes/expert)")
    print(f"{'experts/layer':>13} {'experts':>8} {'MB':>8} {'copy ms':>9} {'server ms':>10} {'client ms':>10} {'GB/s':>7}")
    for r in res["swap"]:
        print(f"{r['experts_per_layer']:>13} {r['experts_total']:>8} {r['bytes'] / 1e6:>8.2f} {r['copy_ms_median']:>9.3f} "
              f"{r['server_total_ms_median']:>10.3f} {r['client_ms_median']:>10.2f} {r['gb_per_s']:>7.2f}")
    print(f"\ndecode tok/s, batch 1, {res['decode_tokens']} tokens, median of {res['rounds']} interleaved rounds")
    print(f"{'arm':<20} {'tok/s':>9} {'vs stock':>9}")
    for arm, v in res["decode"].items():
        print(f"{arm:<20} {v['tok_s_median']:>9.1f} {v['ratio_vs_stock']:>9.3f}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap bench-swap", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="model directory served by both servers")
    p.add_argument("--plan", type=Path, required=True, help="plan whose core experts define the core-only arm")
    p.add_argument("--out", type=Path, default=Path("out/bench-swap.json"), help="result JSON")
    p.add_argument("--repeats", type=int, default=5, help="swaps per size")
    p.add_argument("--rounds", type=int, default=3, help="interleaved decode rounds")
    p.add_argument("--tokens", type=int, default=128, help="decode tokens per round")
    p.add_argument("--vllm-args", default="--max-model-len 1024 --no-enable-prefix-caching",
                   help="extra vLLM server arguments for both servers")
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    res = run(args)
    print_table(res)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0
