"""H200 micro-benchmark of the CPU path's split-and-post program (issue 16), without vLLM.

Why: in a bs1 decode step the split runs on the critical path of every MoE layer (the CPU team
starts only when it posts). This times 24 chained launches in one CUDA graph, per launch: device
time (torch.profiler) and replay wall time, for launch shapes and post variants -- the mailbox's
seq read from host memory or kept on the device, with and without the system fence, and without a
post -- at the 30B-A3B routing shape (E=128, top-8, H=2048), T = 1 and 8, and the budgeted steps
past max_tokens (issue 26: T = 16 and 32, i.e. up to 256 pairs, a budget of 64 pairs), where the
[pairs, pairs] tables are 16x larger: the pair-space program beside the expert-space one (one sort over
[E] keys, what steps past 64 pairs launch), each plain and with the cache's scores. Optionally a variant
file of the kernel (``--baseline path.py``, e.g. the previous commit's) is timed beside it.

Usage: python scripts/gpu_split_bench.py OUT.json [--baseline old_split_triton.py] [--team]
  e.g. git show b0df3c6:server_ext/cpu_experts/split_triton.py > /tmp/old_split_triton.py (the
  expert-space program measured beside this one in benchmarks/results/split_kernel_h200.json)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from reap_swap.benchmarks.profile_counts import profiled_kernel_times
from reap_swap.server_ext.cpu_experts import split_triton
from reap_swap.server_ext.cpu_experts.cuda_host import MappedStaging
from reap_swap.server_ext.cpu_experts.split_triton import MAILBOX_WORDS, Post

E, K, H, LAYERS = 128, 8, 2048, 24
BUDGET = 64  # the default pair budget at top-8 (max_tokens 8 x top-8)


def wall_us(graph: torch.cuda.CUDAGraph, n: int = 30) -> float:
    """Median replay wall time per launch: what the chain costs with the gaps between launches."""
    samples = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / LAYERS)
    return statistics.median(samples)


def run_variant(launch: Callable[[int], None], kernel_name: str) -> dict[str, float]:
    """``LAYERS`` launches (one per layer's buffers) captured in one graph, timed both ways."""
    for i in range(LAYERS):
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAYERS):
            launch(i)
    graph.replay()
    torch.cuda.synchronize()
    times = profiled_kernel_times(graph.replay, 20, (kernel_name,), LAYERS)
    return {"device_us": sum(v["device_us_per_step"] for v in times.values()), "wall_us_per_launch": wall_us(graph)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--baseline", help="a split_triton.py variant to time beside this one (same launch signature as its own)")
    ap.add_argument("--team", action="store_true", help="a CPU team spins on the mailbox (posts carry no job: it only acknowledges)")
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    staging = MappedStaging(dev)
    mailbox_host, mailbox = staging.alloc((MAILBOX_WORDS,), torch.int64)
    team = None
    if args.team:
        from reap_swap.server_ext.cpu_experts.kernel import CpuThreads
        from reap_swap.server_ext.cpu_experts.team import CpuTeam

        class _Mailbox:  # hands the team the mailbox allocated above
            def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
                return mailbox_host, mailbox

        team = CpuTeam(CpuThreads.from_env(), _Mailbox(), 20000)
    g = torch.Generator().manual_seed(0)
    res: dict[str, Any] = {"shape": {"E": E, "top_k": K, "H": H, "launches_per_graph": LAYERS}, "team_spinning": bool(team), "variants": {}}
    host_offset = 1 << 20
    # cost: the CPU is cheap, so every step posts (the post's cost is what is measured)
    cost = torch.tensor([1e-3, 1e-6, 1e-6, 0.0], dtype=torch.float64, device=dev)
    for t in (1, 8, 16, 32):
        limit = None if t <= 8 else BUDGET  # steps past max_tokens: the pair budget (CostModel.pair_limit)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(dev)
        phys = torch.where(ids < 38, ids, ids + host_offset)
        w = torch.rand(t, K, generator=g).to(dev)
        x = torch.randn(t, H, generator=g).to(torch.bfloat16).to(dev)
        valid = torch.tensor([t], dtype=torch.int32, device=dev)
        bufs = [
            {
                "gpu_ids": torch.empty_like(phys), "cpu_pairs": torch.zeros(t, K, dtype=torch.bool, device=dev),
                "st_ids": staging.alloc((t, K), torch.int32)[1], "st_mask": staging.alloc((t, K), torch.uint8)[1],
                "st_w": staging.alloc((t, K), torch.float32)[1], "st_x": staging.alloc((t, H), torch.bfloat16)[1],
                "counters": torch.zeros(4, dtype=torch.int64, device=dev), "expected": torch.zeros(1, dtype=torch.int64, device=dev),
            }
            for _ in range(LAYERS)
        ]
        posted = torch.full((1,), int(mailbox_host[0]), dtype=torch.int64, device=dev)
        scratch = torch.zeros(split_triton.scratch_words(E), dtype=torch.int64, device=dev)  # the layer's, made once

        def launcher(module: Any, post: bool, seq_on_device: bool, **kw: Any) -> Callable[[int], None]:
            def launch(i: int) -> None:
                b = bufs[i]
                p = module.Post(x, b["st_x"], mailbox, b["expected"], 0, posted if seq_on_device else None) if post else None
                extra = {"pair_limit": limit} if limit is not None else {}
                if module is split_triton and "scratch" not in kw:  # past 64 pairs the default program is expert space
                    extra["scratch"] = scratch
                module.split_and_stage(ids, phys, w, cost, valid, host_offset, 0, E, b["gpu_ids"], b["cpu_pairs"], b["st_ids"], b["st_mask"],
                                       b["st_w"], b["counters"], p, **extra, **kw)
            return launch

        variants: dict[str, Callable[[int], None]] = {}
        for warps in (1, 2, 4, 8) + ((16,) if t > 8 else ()):  # past 64 pairs (t > 8) these run the expert-space program
            variants[f"post_hostseq_w{warps}"] = launcher(split_triton, True, False, num_warps=warps)
            variants[f"post_devseq_w{warps}"] = launcher(split_triton, True, True, num_warps=warps)
        variants["post_devseq_w2_bx4096"] = launcher(split_triton, True, True, num_warps=2, block_x=4096)
        variants["post_devseq_w4_bx4096"] = launcher(split_triton, True, True, num_warps=4, block_x=4096)
        variants["nopost_w2"] = launcher(split_triton, False, False, num_warps=2)
        variants["nopost_w4"] = launcher(split_triton, False, False, num_warps=4)
        variants["post_devseq_default_warps"] = launcher(split_triton, True, True)  # what the layer launches
        # the two programs side by side (issue 26: past 64 pairs the expert-space sort replaced the [P, P] tables),
        # plain and as the composed mode launches them (the cache's scores; a budgeted step orders by pairs first)
        prio = torch.rand(E, generator=g).to(dev)
        for space in (False, True):
            tag = "expert_space" if space else "pair_space"
            warps = 4 if space or t <= 8 else split_triton.BIG_STEP_WARPS
            variants[f"{tag}_w{warps}"] = launcher(split_triton, True, True, num_warps=warps, expert_space=space, scratch=scratch)
            variants[f"{tag}_prio_w{warps}"] = launcher(split_triton, True, True, num_warps=warps, expert_space=space, scratch=scratch,
                                                        priority=prio, pairs_first=t > 8)
        if args.baseline and t <= 8:
            name = "reap_swap.server_ext.cpu_experts._split_baseline"  # its relative imports resolve as the real module's
            spec = importlib.util.spec_from_file_location(name, args.baseline)
            assert spec and spec.loader
            base = importlib.util.module_from_spec(spec)
            sys.modules[name] = base
            spec.loader.exec_module(base)

            def base_launch(post: bool) -> Callable[[int], None]:
                def launch(i: int) -> None:
                    b = bufs[i]
                    p = base.Post(x, b["st_x"], mailbox, b["expected"], 0) if post else None
                    base.split_and_stage(ids, phys, w, cost, valid, host_offset, 0, E, b["gpu_ids"], b["cpu_pairs"], b["st_ids"], b["st_mask"],
                                         b["st_w"], b["counters"], p)
                return launch

            variants["baseline_post"] = base_launch(True)
            variants["baseline_nopost"] = base_launch(False)
        for name, launch in variants.items():
            torch.cuda.synchronize()
            posted.fill_(int(mailbox_host[0]))  # the host-seq variants advanced the mailbox
            r = run_variant(launch, "_split_kernel")
            res["variants"][f"T{t}/{name}"] = r
            print(f"T{t} {name:28s} device {r['device_us']:7.2f} us  wall/launch {r['wall_us_per_launch']:7.2f} us", flush=True)
        assert int(bufs[0]["cpu_pairs"].sum()) > 0, "the cost should have given the CPU pairs"
    if team is not None:
        res["team_done"] = team.done
        team.stop()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
