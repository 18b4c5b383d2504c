"""H200 self-check of the CPU expert path's CUDA mechanisms, without vLLM (issue 16).

1. the VMM host rows, granted to the CPU, read back on the CPU equal to what the GPU wrote;
2. an eager layer step (split kernel stages x and posts to the team's mailbox, wait-and-merge kernel)
   equals the all-GPU per-(token, k) reference within bf16 tolerance, at T = 1 and 8, and past
   max_tokens (issue 26: T = 16 and 32 under a pair budget of 24; the CUDA split's CPU pairs equal
   ``plan_split``'s and never exceed the budget; T = 8 on the same path splits as before);
3. the same steps captured in a CUDA graph, replayed on new inputs, still do; and a captured step
   re-rated with ``set_cpu_GBps`` (the serving-time re-rating) splits by the new rate on replay;
4. time per layer step of 24 chained steps in one graph (the path's fixed cost) with and without
   CPU pairs at T = 1, and at T = 32 (256 pairs: the split's largest tables), and the CPU
   kernel's weight GB/s at batch 1 beside the host's memcpy.

Usage: python scripts/gpu_cpu_path_check.py OUT.json   (REAP_CPU_EXPERT_CPUS picks the cores)
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from typing import Any

import torch

from reap_swap.benchmarks.profile_counts import profiled_kernel_times
from reap_swap.server_ext.cpu_experts.bench_cpu_kernel import memcpy_rates
from reap_swap.server_ext.cpu_experts.cuda_host import MappedStaging
from reap_swap.server_ext.cpu_experts.kernel import CpuThreads, silu_and_mul_bf16
from reap_swap.server_ext.cpu_experts.split import CostModel, plan_split
from reap_swap.server_ext.cpu_experts.step import BankRows
from reap_swap.server_ext.cpu_experts.cpu_path import CpuPathSettings, LayerCpuPath
from reap_swap.server_ext.cpu_experts.rates import measure_cpu_GBps, measure_link_GBps
from reap_swap.server_ext.bank.cuda_vmm import VmmBacking

E, H, I, S, K = 32, 2048, 768, 8, 8
BUDGET = 24  # pairs to the CPU in a step past max_tokens (issue 26)


def reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, bank: BankRows) -> torch.Tensor:
    t, k = ids.shape
    rows = (bank.row_offset + ids.reshape(-1)).long()
    xs = x.repeat_interleave(k, 0).float()
    h = torch.einsum("ph,pnh->pn", xs, bank.w13[rows].float()).to(torch.bfloat16)
    a = silu_and_mul_bf16(h)
    y = torch.einsum("pi,phi->ph", a.float(), bank.w2[rows].float()) * w.reshape(-1, 1).float()
    return y.to(torch.bfloat16).view(t, k, -1)


def close(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


def inputs(t: int, g: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, ...]:
    x = torch.randn(t, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)])
    w = torch.softmax(torch.randn(t, K, generator=g), -1)
    return x.to(dev), ids.to(dev), w.to(dev)


def vmm_bank(dev: torch.device) -> tuple[VmmBacking, torch.Tensor, torch.Tensor, int, torch.Generator]:
    """A VMM bank of E experts (S slot rows, the rest host rows the CPU may read) with random weights, and the generator that drew them (the inputs continue from it)."""
    backing = VmmBacking(dev)
    backing.grant_host_access()
    layout = backing.layout(S, E, [2 * I * H * 2, H * I * 2], pad=True)
    off = layout.host_row_offset
    w13 = backing.allocate(layout, layout.row_strides[0], (2 * I, H), torch.bfloat16)
    w2 = backing.allocate(layout, layout.row_strides[1], (H, I), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for t, fan in ((w13, H), (w2, I)):
        t.copy_((torch.randn(t.shape, generator=g) / fan**0.5).to(torch.bfloat16).to(dev))
    torch.cuda.synchronize()
    return backing, w13, w2, off, g


def main(out_path: str) -> int:
    dev = torch.device("cuda", 0)
    res: dict = {}
    backing, w13, w2, off, g = vmm_bank(dev)
    row = w13[off + 3]
    nbytes = row.numel() * 2
    on_cpu = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(row.data_ptr()), dtype=torch.uint8).view(torch.bfloat16).view(row.shape)
    res["host_rows_readable_by_cpu"] = bool(torch.equal(on_cpu, row.cpu()))

    bank = BankRows(w13, w2, off, E)
    settings = CpuPathSettings(enabled=True, max_tokens=8)
    cost = CostModel(link_GBps=50, cpu_GBps=50, max_tokens=8)
    filler = S if off > S else 0  # as the layer picks it: a zero padding row, else slot 0
    path = LayerCpuPath(bank, K, filler, settings, cost, CpuThreads.from_env(), dev, MappedStaging(dev))
    res["link_GBps"] = measure_link_GBps(w13[off:])
    res["cpu_GBps_calibration"] = measure_cpu_GBps(path)
    # issue 26: steps past max_tokens up to 32 tokens, at most BUDGET missed pairs to the CPU
    big_settings = CpuPathSettings(enabled=True, max_tokens=8, max_step_tokens=32, pair_budget=BUDGET)
    big = LayerCpuPath(bank, K, filler, big_settings, big_settings.cost(50.0, 50.0, top_k=K), CpuThreads.from_env(), dev, MappedStaging(dev))

    def layer_step(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, p: LayerCpuPath = path,
                   prio: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        phys = torch.where(ids < S, ids, ids + off)  # experts 0..S-1 resident in slots 0..S-1
        gpu_ids = p.before_experts(x, ids, w, phys, off, priority=prio)
        ref = reference(x, ids, w, bank)
        cpu_pairs = gpu_ids != phys
        gpu_side = torch.where(cpu_pairs[..., None], torch.zeros_like(ref), ref)
        return p.merge(gpu_side), cpu_pairs

    eager = {}
    for t in (1, 8):
        x, ids, w = inputs(t, g, dev)
        merged, cpu_pairs = layer_step(x, ids, w)
        torch.cuda.synchronize()
        eager[f"T{t}"] = {"cpu_pairs": int(cpu_pairs.sum()), "max_rel_err": close(merged, reference(x, ids, w, bank))}
    for t, scored in ((8, False), (16, False), (32, False), (16, True), (32, True)):  # the budgeted path (T = 8: as before)
        x, ids, w = inputs(t, g, dev)
        prio = torch.rand(E, generator=g).mul(4).floor().to(dev) if scored else None  # the composed mode's scores, with ties
        merged, cpu_pairs = layer_step(x, ids, w, big, prio)
        torch.cuda.synchronize()
        want = plan_split(ids.cpu(), (ids < S).logical_not().cpu(), E, bank.expert_bytes, big.cost, priority=None if prio is None else prio.cpu())
        eager[f"budget{BUDGET}_T{t}{'_scored' if scored else ''}"] = {"cpu_pairs": int(cpu_pairs.sum()), "max_rel_err": close(merged, reference(x, ids, w, bank)),
                                         "within_budget": int(cpu_pairs.sum()) <= big.cost.pair_limit(t, K),
                                         "split_equals_plan_split": bool(torch.equal(cpu_pairs.cpu(), want.cpu_pairs))}
    res["eager"] = eager

    graphs = {}
    for label, t, p in (("T1", 1, path), ("T8", 8, path), (f"budget{BUDGET}_T16", 16, big), (f"budget{BUDGET}_T32", 32, big)):
        sx, sids, sw = inputs(t, g, dev)
        layer_step(sx, sids, sw, p)  # warm-up on the side stream too
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            merged, cpu_pairs = layer_step(sx, sids, sw, p)
        errs, most = [], 0
        for _ in range(5):
            x, ids, w = inputs(t, g, dev)
            sx.copy_(x), sids.copy_(ids), sw.copy_(w)
            graph.replay()
            torch.cuda.synchronize()
            errs.append(close(merged, reference(x, ids, w, bank)))
            most = max(most, int(cpu_pairs.sum()))
        graphs[label] = {"replays": 5, "max_rel_err": max(errs), "cpu_pairs_last": int(cpu_pairs.sum()), "cpu_pairs_most": most,
                         "within_budget": most <= p.cost.pair_limit(t, K)}
    graphs["rerated_T8"] = rerated_in_graph(bank, filler, g, dev, layer_step)
    res["graph"] = graphs
    res["step_stats"] = path.stats()
    res["step_stats_budgeted"] = big.stats()
    res["chain_24_layers_T1"] = chain_timing(bank, filler, settings, g, dev, off, 1)
    res["chain_24_layers_T32"] = chain_timing(bank, filler, big_settings, g, dev, off, 32)  # the split at 256 pairs
    res["memcpy"] = {k: v["GBps"] for k, v in memcpy_rates(1024, 3).items()}
    res["threads"] = {"n": path.step_job.threads.n, "cpus": list(path.step_job.threads.cpus)}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    checks = {**eager, **graphs}
    flags = ("within_budget", "split_equals_plan_split", "same_cost_tensor", "misread_rate_gave_the_cpu_nothing", "new_rate_gave_the_cpu_pairs")
    ok = res["host_rows_readable_by_cpu"] and all(v["max_rel_err"] < 2**-5 and all(v.get(f, True) for f in flags) for v in checks.values())
    return 0 if ok else 1


def rerated_in_graph(bank: BankRows, filler: int, g: torch.Generator, dev: torch.device, layer_step: Any) -> dict:
    """A captured graph follows ``set_cpu_GBps`` (rates.py's re-rating while serving): split at a misread CPU rate (the
    CPU gets nothing), re-rate, replay the same inputs: the CPU takes what plan_split gives it at the new rate, the
    cost tensor keeps its address, the outputs stay within tolerance."""
    settings = CpuPathSettings(enabled=True, max_tokens=8)
    p = LayerCpuPath(bank, K, filler, settings, settings.cost(50.0, 0.01, top_k=K), CpuThreads.from_env(), dev, MappedStaging(dev))
    sx, sids, sw = inputs(8, g, dev)
    layer_step(sx, sids, sw, p)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        merged, cpu_pairs = layer_step(sx, sids, sw, p)
    graph.replay()
    torch.cuda.synchronize()
    before, ptr = int(cpu_pairs.sum()), p.cost_tensor.data_ptr()
    p.set_cpu_GBps(1000.0)
    graph.replay()
    torch.cuda.synchronize()
    want = plan_split(sids.cpu(), (sids < S).logical_not().cpu(), E, bank.expert_bytes, p.cost)
    after = int(cpu_pairs.sum())
    return {"cpu_pairs_before": before, "cpu_pairs_after": after, "max_rel_err": close(merged, reference(sx, sids, sw, bank)),
            "same_cost_tensor": p.cost_tensor.data_ptr() == ptr, "misread_rate_gave_the_cpu_nothing": before == 0,
            "new_rate_gave_the_cpu_pairs": after > 0, "split_equals_plan_split": bool(torch.equal(cpu_pairs.cpu(), want.cpu_pairs))}


def chain_timing(bank: BankRows, filler: int, settings: CpuPathSettings, g: torch.Generator, dev: torch.device, off: int, t: int) -> dict:
    """24 chained layer steps of ``t`` tokens in one graph: the CPU path's per-step cost on the critical path."""
    timing = {}
    for label, cpu_gbps in (("cpu_path", 50.0), ("cpu_never_chosen", 1e-3)):
        cost = CostModel(link_GBps=50, cpu_GBps=cpu_gbps, max_tokens=8, max_step_tokens=settings.step_tokens(K), pair_budget=settings.budget(K))
        paths = [LayerCpuPath(bank, K, filler, settings, cost, CpuThreads.from_env(), dev, MappedStaging(dev)) for _ in range(24)]
        sx, sids, sw = inputs(t, g, dev)
        if t == 1:
            sids.copy_(torch.arange(S, S + K, device=dev).view(1, K))  # all 8 missed

        def chain() -> torch.Tensor:
            acc = sx
            for p in paths:
                phys = torch.where(sids < S, sids, sids + off)
                p.before_experts(acc, sids, sw, phys, off)
                acc = p.merge(torch.zeros(t, K, H, dtype=torch.bfloat16, device=dev)).sum(1).to(torch.bfloat16) + sx
            return acc

        chain()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        graph.replay()
        torch.cuda.synchronize()
        samples = []
        for _ in range(10):
            t0 = time.perf_counter()
            graph.replay()
            torch.cuda.synchronize()
            samples.append(time.perf_counter() - t0)
        samples.sort()
        st = [p.stats() for p in paths]
        timing[label] = {"median_ms_24_layers": samples[len(samples) // 2] * 1e3, "cpu_experts_per_layer_step": st[0]["cpu_experts"] / max(1, st[0]["calls"]),
                         "cpu_pairs_per_layer_step": st[0]["host_pairs"] / max(1, st[0]["calls"]),
                         "per_layer_step": profiled_kernel_times(graph.replay, 5, ("_split_kernel", "_wait_merge_kernel"), len(paths))}
    return timing


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
