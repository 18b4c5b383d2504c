"""GPU check of the routing kernels and the accounting engine (run on a CUDA machine).

Triton on CUDA against the torch reference on CPU, on the same inputs:
remap + capture at batch sizes 1..8192, accumulate over 24 layers, and a
whole accounting flow (steps, finishes, slot pressure, flush) whose ledger
must equal the CPU run's. Also times the remap kernel inside a CUDA graph.
Prints one JSON object; exit status 1 on any mismatch.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from reap_swap.server_ext.step.accounting import RoutingAccounting
from reap_swap.server_ext.step.arena import new_arena
from reap_swap.server_ext.step.capture import StepLayout
from reap_swap.server_ext.step.misses import ALL_REQUESTS, MissLedger
from reap_swap.server_ext.step import routing_kernels as rk


def remap_cases() -> dict[str, bool]:
    out = {}
    e, k, h = 128, 8, 40
    for n in (1, 2, 8, 100, 8192):
        for dt in (torch.int32, torch.int64):
            g = torch.Generator().manual_seed(n)
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(dt)
            w = torch.rand(n, k, generator=g)
            pm = (h + torch.arange(e)).to(torch.int32)
            pm[torch.randperm(e, generator=g)[:38]] = torch.randperm(38, generator=g).to(torch.int32)
            c1, w1 = torch.zeros(8192, k, dtype=torch.int32), torch.zeros(8192, k)
            o1 = rk.remap_and_capture_reference(ids, w, pm, h, c1, w1)
            c2, w2 = c1.new_zeros(c1.shape).cuda(), w1.new_zeros(w1.shape).cuda()
            o2 = rk.remap_and_capture(ids.cuda(), w.cuda(), pm.cuda(), h, c2, w2)
            out[f"remap n={n} {dt}"] = bool(torch.equal(o1, o2.cpu()) and torch.equal(c1, c2.cpu()) and torch.equal(w1, w2.cpu()))
    return out


def accumulate_case() -> bool:
    layers, rows, k, e, slots = 24, 600, 8, 128, 16
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(0, e, (layers, 1024, k), generator=g, dtype=torch.int32)
    codes = torch.where(torch.rand(codes.shape, generator=g) < 0.6, -1 - codes, codes)
    w = torch.rand(codes.shape, generator=g)
    rows_idx = torch.arange(0, layers, 2, dtype=torch.int32)
    row_slot = torch.randint(0, slots, (1024,), generator=g, dtype=torch.int32)
    a = torch.zeros(slots, layers, rk.COMPONENTS, e)
    rk.accumulate_step_reference(codes, w, rows_idx, row_slot, rows, a)
    b = torch.zeros_like(a).cuda()
    rk.accumulate_step(codes.cuda(), w.cuda(), rows_idx.cuda(), row_slot.cuda(), rows, b)
    return bool(torch.allclose(a, b.cpu(), rtol=1e-5, atol=1e-4))


def accounting_flow(device: str) -> dict[str, np.ndarray]:
    layers, banked, k, e = 6, [1, 2, 4, 5], 8, 128
    arena = new_arena(layers, 256, k, e, 4, device=torch.device(device))
    ledger = MissLedger(banked, e)
    acct = RoutingAccounting(arena, banked, ledger)
    g = torch.Generator().manual_seed(11)
    steps = [[("a", 40), ("b", 9)], [("a", 1), ("b", 1), ("c", 30)], [("c", 1), ("d", 1), ("e", 7), ("f", 3)], [("a", 1), ("f", 1)]]
    finished = {1: ["b"], 3: ["c"]}
    for s, step in enumerate(steps):
        t = sum(n for _, n in step)
        for layer in banked:
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
            w = torch.rand(t, k, generator=g)
            pm = torch.where(torch.rand(e, generator=g) < 0.3, torch.arange(e), 200 + torch.arange(e)).to(torch.int32)
            rk.remap_and_capture(ids.to(device), w.to(device), pm.to(device), 200, arena.codes[layer], arena.weights[layer])
        acct.record_step(StepLayout([r for r, _ in step], [n for _, n in step]))
        acct.finish(finished.get(s, []))
        acct.poll()
    acct.flush()
    out = {}
    for rid in ["a", "b", "c", "d", "e", "f", ALL_REQUESTS]:
        m = ledger.collect(rid)
        out[rid] = np.concatenate([m.hits.ravel(), m.miss_hits.ravel(), m.expert_mass.ravel(), m.observed, m.inactive, [m.tokens]])
    return out


def graph_timing() -> dict[str, float]:
    """Remap kernel alone, 24 launches replayed in a CUDA graph (a decode step's worth at batch 1)."""
    e, k, h = 128, 8, 128
    ids = torch.randint(0, e, (1, k), device="cuda", dtype=torch.int32)
    w = torch.rand(1, k, device="cuda")
    pm = torch.arange(e, device="cuda", dtype=torch.int32)
    codes, cw = torch.zeros(24, 8192, k, dtype=torch.int32, device="cuda"), torch.zeros(24, 8192, k, device="cuda")
    for i in range(24):
        rk.remap_and_capture(ids, w, pm, h, codes[i], cw[i])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(24):
            rk.remap_and_capture(ids, w, pm, h, codes[i], cw[i])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        graph.replay()
    end.record()
    end.synchronize()
    return {"remap_24_layers_in_graph_us": start.elapsed_time(end) * 1e3 / 200}


def main() -> int:
    res: dict[str, object] = {"gpu": torch.cuda.get_device_name()}
    res.update(remap_cases())
    res["accumulate 24 layers x 600 rows"] = accumulate_case()
    cpu, gpu = accounting_flow("cpu"), accounting_flow("cuda")
    res["accounting flow ledger equal"] = all(np.allclose(cpu[r], gpu[r], rtol=1e-5, atol=1e-4) for r in cpu)
    res.update(graph_timing())
    print(json.dumps(res, indent=1))
    ok = all(v for v in res.values() if isinstance(v, bool))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
