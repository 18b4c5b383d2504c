"""GPU check of the online expert cache (run on a CUDA machine; on CPU with TRITON_INTERPRET=1 it
checks itself without the timing).

1. The fused Triton step and the torch-op step on the device against the torch core on CPU,
   step by step on random skewed routing (decode and prefill-sized steps, padding rows):
   scores, slot owners, routing table, counters, trigger rows, remapped ids and the bank bytes
   must be bit-identical.
2. Both device variants for 48 layers (E=128, S=38, top-8, C=4, one decode token) captured in
   one CUDA graph: replays keep matching the CPU core, and the time per replayed step.
Prints one JSON object; exit status 1 on any mismatch.

    python scripts/gpu_online_cache_check.py [--device cuda] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import numpy as np
import torch

from reap_swap.server_ext.cache.online_cache import CacheParams, LayerCache


class Bank:
    """phys_map + two bank tensors ([H + E, ...], host rows hold distinct bytes) + the cache, on one device."""

    def __init__(self, e: int, s: int, cap: int, device: str, fused: bool, row: int = 256, seed: int = 0):
        self.e, self.s, self.h = e, s, s + 2
        g = torch.Generator().manual_seed(seed)
        start = torch.randperm(e, generator=g)[: s // 2].tolist()
        self.rows = []
        for shape, dtype in (((row, 3), torch.bfloat16), ((row,), torch.float32)):
            bank = torch.zeros((self.h + e, *shape), dtype=dtype)
            bank[self.h :] = torch.randn((e, *shape), generator=g).to(dtype)
            for slot, x in enumerate(start):
                bank[slot] = bank[self.h + x]
            self.rows.append(bank.to(device))
        pm = self.h + torch.arange(e, dtype=torch.int32)
        pm[torch.tensor(start)] = torch.arange(len(start), dtype=torch.int32)
        self.phys_map = pm.to(device)
        self.cache = LayerCache(e, s, self.h, self.phys_map, CacheParams(cap, 0.95, None, fused=fused))
        self.cache.fused = fused  # on CPU too (interpreted), to check the script itself
        self.cache.install(start + [-1] * (s - len(start)), prior=start, protected=start[:2])

    def state(self) -> list[torch.Tensor]:
        c = self.cache
        return [t.detach().cpu() for t in (c.score, c.expert_in_slot, c.phys_map, c.counts, *self.rows)]


def routing(rng: np.random.Generator, e: int, k: int, t: int) -> torch.Tensor:
    hot = rng.permutation(e)[: max(k + 4, e // 4)]
    return torch.tensor(np.stack([rng.permutation(hot)[:k] for _ in range(t)]), dtype=torch.int32)


def compare_steps(device: str, fused: bool, steps: int, e: int = 128, s: int = 38, k: int = 8, cap: int = 4) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    ref, dev = Bank(e, s, cap, "cpu", fused=False), Bank(e, s, cap, device, fused=fused)
    for n in range(steps):
        t = int(rng.choice([1, 1, 1, 4, 33, 700]))
        ids = routing(rng, e, k, t)
        valid = torch.tensor([max(1, t - int(rng.integers(0, 3)))], dtype=torch.int32)
        tr, td = torch.full((cap,), 9, dtype=torch.int32), torch.full((cap,), 9, dtype=torch.int32, device=device)
        o1 = ref.cache.step(ids, ref.rows, valid, tr)
        o2 = dev.cache.step(ids.to(device), dev.rows, valid.to(device), td)
        same = torch.equal(o1, o2.cpu()) and torch.equal(tr, td.cpu()) and all(torch.equal(a, b) for a, b in zip(ref.state(), dev.state()))
        if not same:
            return {"ok": False, "first_mismatch_step": n, "tokens": t}
    return {"ok": True, "steps": steps, "promotions": int(dev.cache.counts[0])}


def graph_timing(fused: bool, layers: int = 48, replays: int = 200) -> dict[str, Any]:
    e, s, k, cap = 128, 38, 8, 4
    banks = [Bank(e, s, cap, "cuda", fused=fused, row=4096, seed=i) for i in range(layers)]
    refs = [Bank(e, s, cap, "cpu", fused=False, row=4096, seed=i) for i in range(layers)]
    ids = torch.zeros(1, k, dtype=torch.int32, device="cuda")
    valid = torch.ones(1, dtype=torch.int32, device="cuda")

    def step() -> None:
        for b in banks:
            b.cache.step(ids, b.rows, valid, None)

    rng = np.random.default_rng(2)
    warm = routing(rng, e, k, 1)
    ids.copy_(warm)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up compiles the kernels (and is a real step: the CPU references take it too)
    torch.cuda.current_stream().wait_stream(stream)
    for r in refs:
        r.cache.step(warm, r.rows, torch.ones(1, dtype=torch.int32), None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ok = True
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for n in range(replays):
        x = routing(rng, e, k, 1)
        ids.copy_(x)
        graph.replay()
        for r in refs:
            r.cache.step(x, r.rows, torch.ones(1, dtype=torch.int32), None)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ok = all(all(torch.equal(a, b) for a, b in zip(r.state(), d.state())) for r, d in zip(refs, banks))
    t1 = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return {"ok": ok, "layers": layers, "us_per_step_replay_only": (time.perf_counter() - t1) / replays * 1e6,
            "wall_s_with_cpu_reference": wall, "promotions": int(sum(int(b.cache.counts[0]) for b in banks))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    out: dict[str, Any] = {"device": args.device}
    out["fused_vs_core"] = compare_steps(args.device, True, args.steps)
    if args.device != "cpu":
        out["torch_ops_vs_core"] = compare_steps(args.device, False, args.steps)
        for name, fused in (("graph_fused", True), ("graph_torch_ops", False)):
            try:
                out[name] = graph_timing(fused)
            except Exception as exc:  # noqa: BLE001 - e.g. an op that cannot be captured: report it
                out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out, indent=1))
    return 0 if all(v.get("ok", True) for v in out.values() if isinstance(v, dict)) else 1


if __name__ == "__main__":
    sys.exit(main())
