"""H200 check of the composed fast mode's mechanism, without vLLM (issue 25): the split first (the CPU takes
the coldest misses by the online cache's scores), then the cache promotes from the link's share.

1. correctness on CUDA: the compiled Triton split (with the scores) gives ``plan_split``'s CPU pairs, and the
   compiled policy program (with the CPU's pairs) leaves the same cache state and ids as the torch core;
2. MoE-layer time per decode step, 24 layers of the 30B-A3B expert shape (128 x 9.44 MB, 38 slots = 30 %)
   replaying a learned trace's decode rows at batch 1, one CUDA graph per step, five modes side by side:
   ``static`` (link only), ``cache``, ``static_cpu``, ``cache_then_cpu`` (the order before issue 25) and
   ``fast`` (split first). The stock fused kernel is stood in for by a gather of every pair's rows
   (what the kernel reads: a resident row from HBM, a missed one over the link); the CPU's pairs read the
   filler row and the merge waits for the team. What it leaves out: attention and the rest of the model,
   and the kernel's arithmetic (both are the same in every mode).

Usage: python scripts/gpu_composed_check.py OUT.json [--trace T] [--requests N] [--layers L]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

import numpy as np
import torch

from reap_swap.planning import traces
from reap_swap.server_ext.bank.cuda_vmm import VmmBacking
from reap_swap.server_ext.cache.online_cache import CacheParams, LayerCache
from reap_swap.server_ext.cpu_experts.cpu_path import CpuPathSettings, LayerCpuPath
from reap_swap.server_ext.cpu_experts.rates import measure_cpu_GBps, measure_link_GBps
from reap_swap.server_ext.cpu_experts.cuda_host import MappedStaging
from reap_swap.server_ext.cpu_experts.kernel import CpuThreads
from reap_swap.server_ext.cpu_experts.split import CostModel, plan_split
from reap_swap.server_ext.cpu_experts.step import BankRows

E, H, I, S, K = 128, 2048, 768, 38, 8
MODES = ("static", "cache", "static_cpu", "cache_then_cpu", "fast")


class Layer:
    """One MoE layer: its own VMM bank, routing table, cache and CPU path."""

    def __init__(self, dev: torch.device, start: list[int], cost: CostModel, cap: int) -> None:
        self.backing = VmmBacking(dev)
        self.backing.grant_host_access()
        layout = self.backing.layout(S, E, [2 * I * H * 2, H * I * 2], pad=True)
        self.off = off = layout.host_row_offset
        self.w13 = self.backing.allocate(layout, layout.row_strides[0], (2 * I, H), torch.bfloat16)
        self.w2 = self.backing.allocate(layout, layout.row_strides[1], (H, I), torch.bfloat16)
        for t in (self.w13, self.w2):
            t.normal_(0, 0.02)
        self.rows = [self.w13, self.w2]
        self.start = start
        self.phys_map = (off + torch.arange(E, dtype=torch.int32)).to(dev)
        self.filler = S if off > S else 0
        self.bank = BankRows(self.w13, self.w2, off, E)
        self.cache = LayerCache(E, S, off, self.phys_map, CacheParams(cap))
        self.path = LayerCpuPath(self.bank, K, self.filler, CpuPathSettings(enabled=True, max_tokens=8), cost, CpuThreads.from_env(), dev,
                                 MappedStaging(dev))
        self.reset(copy_bytes=True)

    def reset(self, copy_bytes: bool = False) -> None:
        """The static start set in slots 0..S-1, the cache's scores from it (bytes copied at build only:
        later resets time the same byte counts whatever the slots hold)."""
        pm = self.off + torch.arange(E, dtype=torch.int32)
        for slot, x in enumerate(self.start):
            pm[x] = slot
            if copy_bytes:
                for t in self.rows:
                    t[slot].copy_(t[self.off + x])
        self.phys_map.copy_(pm.to(self.phys_map.device))
        self.cache.install(self.start, prior=self.start)
        self.cache.reset_counters()
        self.path.reset_stats()

    def step(self, mode: str, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        phys = self.phys_map.index_select(0, ids.view(-1)).view(ids.shape).to(ids.dtype)
        cpu = mode in ("static_cpu", "cache_then_cpu", "fast")
        if mode in ("cache", "cache_then_cpu"):
            phys = self.cache.step(ids, self.rows, valid)
        if mode in ("static_cpu", "cache_then_cpu"):
            phys = self.path.before_experts(x, ids, w, phys, self.off, valid)
        if mode == "fast":
            self.path.before_experts(x, ids, w, phys, self.off, valid, priority=self.cache.score)
            phys = self.cache.step(ids, self.rows, valid, cpu_pairs=self.path.pending_pairs, filler=self.filler)
        flat = phys.view(-1).long()
        read = self.w13.index_select(0, flat).sum(dtype=torch.float32) + self.w2.index_select(0, flat).sum(dtype=torch.float32)
        out = read.to(torch.bfloat16).expand(ids.shape[0], K, H).contiguous()
        if cpu:
            out = self.path.merge(out.view(-1, H)).view(ids.shape[0], K, H)
            self.path.abandon()
        return out.sum(1) + x


def check_kernels(layer: Layer, ids_rows: np.ndarray, dev: torch.device) -> dict:
    """The compiled programs against the torch references on real steps of the trace (layer 0's routing)."""
    ref = LayerCache(E, S, layer.off, layer.phys_map.clone(), CacheParams(layer.cache.params.cap, fused=False))
    ref.install(layer.start, prior=layer.start)
    ref.phys_map.copy_(layer.phys_map)
    valid = torch.ones(1, dtype=torch.int32, device=dev)
    steps = mismatches = cpu_pairs = promotions = 0
    for row in ids_rows[:200]:
        ids = torch.as_tensor(row.astype(np.int64), device=dev).view(1, K)
        x = torch.randn(1, H, device=dev).to(torch.bfloat16)
        w = torch.softmax(torch.randn(1, K, device=dev), -1)
        phys = layer.phys_map.index_select(0, ids.view(-1)).view(1, K)
        score = layer.cache.score.clone()
        layer.path.before_experts(x, ids, w, phys, layer.off, valid, priority=layer.cache.score)
        pairs = layer.path.pending_pairs.clone()
        want = plan_split(ids, phys >= layer.off, E, layer.bank.expert_bytes, layer.path.cost, priority=score)
        out = layer.cache.step(ids, layer.rows, valid, cpu_pairs=pairs, filler=layer.filler)
        layer.path.merge(torch.zeros(K, H, dtype=torch.bfloat16, device=dev))
        layer.path.abandon()
        rows_copy = [torch.empty(S + 2, 1, device=dev), torch.empty(S + 2, 1, device=dev)]  # the reference moves no bytes
        ref_out = ref.step(ids, rows_copy, valid, cpu_pairs=pairs, filler=layer.filler, copy=lambda *a: None)
        same = torch.equal(pairs, want.cpu_pairs) and torch.equal(out, ref_out)
        for name in ("score", "expert_in_slot", "phys_map"):
            same = same and torch.equal(getattr(layer.cache, name), getattr(ref, name))
        mismatches += not same
        steps += 1
        cpu_pairs += int(pairs.sum())
    promotions = int(layer.cache.promotions)
    torch.cuda.synchronize()
    layer.reset()
    return {"steps": steps, "mismatches": mismatches, "cpu_pairs": cpu_pairs, "promotions": promotions}


def timed(fn: Callable[[int], None], n: int) -> list[float]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for i in range(n):
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--trace", default="benchmarks/traces/learned128_t0.8.npz")
    ap.add_argument("--requests", type=int, default=6, help="trace requests replayed (their decode rows, in order)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--cap", type=int, default=4, help="the cache's promotions per layer step (the server's default)")
    args = ap.parse_args(argv)
    dev = torch.device("cuda", 0)
    tr = traces.load(args.trace)
    reqs = [r for r in tr.requests() if int((r.phase == traces.DECODE).sum()) >= 32][: args.requests]
    rows = np.concatenate([r.ids[r.phase == traces.DECODE] for r in reqs])  # [steps, L, K]
    steps = rows.shape[0]
    layers_of = [round(i * (tr.ids.shape[1] - 1) / max(1, args.layers - 1)) for i in range(args.layers)]
    counts = np.zeros((tr.ids.shape[1], E), dtype=np.int64)
    for li in range(tr.ids.shape[1]):
        np.add.at(counts[li], tr.ids[:, li].reshape(-1).astype(np.int64), 1)
    res: dict = {"trace": args.trace, "requests": [r.request_id for r in reqs], "decode_steps": steps, "layers": args.layers,
                 "experts": E, "slots": S, "expert_MB": (2 * I * H + H * I) * 2 / 1e6, "cache_cap": args.cap}
    probe = Layer(dev, [int(x) for x in np.argsort(-counts[0], kind="stable")[:S]], CostModel(link_GBps=50, cpu_GBps=50), args.cap)
    link, cpu_rate = measure_link_GBps(probe.w13[probe.off:]), measure_cpu_GBps(probe.path)
    res["measured"] = {"link_GBps": link, "cpu_GBps": cpu_rate}
    cost = CostModel(link_GBps=link, cpu_GBps=cpu_rate, cpu_fixed_s=25e-6, cpu_per_pair_s=1e-6, max_tokens=8)
    probe.path.cost = cost
    res["kernels_vs_torch"] = check_kernels(probe, rows[:, layers_of[0]], dev)
    layers = [probe] + [Layer(dev, [int(x) for x in np.argsort(-counts[layers_of[i]], kind="stable")[:S]], cost, args.cap)
                        for i in range(1, args.layers)]
    ids_buf = torch.zeros(args.layers, 1, K, dtype=torch.int64, device=dev)
    w_buf = torch.full((args.layers, 1, K), 1.0 / K, device=dev)
    x_buf = torch.randn(1, H, device=dev).to(torch.bfloat16)
    valid = torch.ones(1, dtype=torch.int32, device=dev)
    all_ids = torch.as_tensor(rows[:, layers_of].astype(np.int64), device=dev).view(steps, args.layers, 1, K)
    modes: dict = {}
    for mode in MODES:
        try:
            modes[mode] = run_mode(mode, layers, all_ids, x_buf, w_buf, ids_buf, valid, steps)
        except Exception as exc:  # noqa: BLE001 - one mode's failure must not lose the others' figures
            modes[mode] = {"error": f"{type(exc).__name__}: {exc}"}
        print(mode, json.dumps(modes[mode]), flush=True)
        with open(args.out, "w") as f:
            json.dump({**res, "modes": modes}, f, indent=1)
    res["modes"] = modes
    ok = {m: v for m, v in modes.items() if "error" not in v}
    if "static_cpu" in ok:
        base = ok["static_cpu"]["median_ms_per_step"]
        res["ratios"] = {f"{m}_vs_static_cpu": base / v["median_ms_per_step"] for m, v in ok.items()}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: res.get(k) for k in ("measured", "kernels_vs_torch", "ratios")}, indent=1))
    return 0 if res["kernels_vs_torch"]["mismatches"] == 0 and len(ok) == len(MODES) else 1


def run_mode(mode: str, layers: list[Layer], all_ids: torch.Tensor, x_buf: torch.Tensor, w_buf: torch.Tensor, ids_buf: torch.Tensor,
             valid: torch.Tensor, steps: int) -> dict:
    for lay in layers:
        lay.reset()

    def chain() -> None:
        acc = x_buf
        for li, lay in enumerate(layers):
            acc = lay.step(mode, acc, ids_buf[li], w_buf[li], valid)

    ids_buf.copy_(all_ids[0])
    chain()  # compile / warm up eagerly, then back to the start state
    torch.cuda.synchronize()
    for lay in layers:
        lay.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for lay in layers:  # the capture ran the step once: back to the start state
        lay.reset()
    torch.cuda.synchronize()

    def replay(i: int) -> None:
        ids_buf.copy_(all_ids[i])
        graph.replay()

    t0 = time.perf_counter()
    ms = timed(replay, steps)
    wall = time.perf_counter() - t0
    warm = ms[8:]  # the first steps fill the cache
    cache = [lay.cache.counters() for lay in layers]
    cpu = [lay.path.stats() for lay in layers]
    hits = sum(int((lay.phys_map.index_select(0, all_ids[-1, li].view(-1)) < lay.off).sum()) for li, lay in enumerate(layers))
    return {
        "median_ms_per_step": float(np.median(warm)), "mean_ms_per_step": float(np.mean(warm)), "p90_ms": float(np.percentile(warm, 90)),
        "end_to_end_ms_per_step": wall * 1e3 / steps,
        "promotions_per_step": sum(c["promotions"] for c in cache) / steps if mode in ("cache", "cache_then_cpu", "fast") else 0.0,
        "missed_experts_per_step": sum(c["missed_experts"] for c in cpu) / steps if mode in ("static_cpu", "cache_then_cpu", "fast") else None,
        "cpu_experts_per_step": sum(c["cpu_experts"] for c in cpu) / steps if mode in ("static_cpu", "cache_then_cpu", "fast") else 0.0,
        "wait_timeouts": sum(c["wait_timeouts"] for c in cpu),
        "resident_pairs_of_last_step": hits,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
