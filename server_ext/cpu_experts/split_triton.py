"""The CPU expert path's per-step device work as one Triton program (semantics: ``split.plan_split``).

Why: ``plan_split`` in torch ops is ~30 small kernels per MoE layer step; on the H200 24 layers of
them cost ~3.9 ms per decode step (graph replay), more than the CPU path saves at batch 1. This
program does the split, the GPU's ids, the staging of ids / mask / routing weights for the host
and the counters in one launch. Costs are float64 (a [4] device tensor: Python floats would reach
Triton as float32), the same formula as ``plan_split``; ties: fewest CPU experts, then the CPU
takes the experts with the fewest missed pairs, then the lowest id.

Imported only where Triton runs (CUDA, or CPU tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl


def _split_kernel(  # type: ignore[no-untyped-def]
    ids_ptr, phys_ptr, w_ptr, cost_ptr, valid_ptr, gpu_ids_ptr, cpu_pairs_ptr, st_ids_ptr, st_mask_ptr, st_w_ptr, counters_ptr,
    n_pairs, top_k, host_offset, filler, E, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
):
    p = tl.arange(0, BLOCK_P)
    pm = p < n_pairs
    ids = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int32)
    phys = tl.load(phys_ptr + p, mask=pm, other=0)
    real = (p // top_k) < tl.load(valid_ptr)  # rows past the step's real count are graph padding
    missed = (phys >= host_offset) & pm & real
    e = tl.arange(0, BLOCK_E)
    routes = (ids[None, :] == e[:, None]) & pm[None, :]  # [E, P]
    pairs = tl.sum((routes & missed[None, :]).to(tl.int32), axis=1)
    elig = (pairs > 0) & (e < E)
    m = tl.sum(elig.to(tl.int32), axis=0)
    key = tl.where(elig, pairs * E + e, (BLOCK_P + 2) * E + e)
    rank = tl.sum((key[None, :] < key[:, None]).to(tl.int32), axis=1)
    n = tl.arange(0, BLOCK_N)
    prefix = tl.sum(tl.where((rank[None, :] < n[:, None]) & elig[None, :], pairs[None, :], 0), axis=1)
    link_per = tl.load(cost_ptr + 0)
    fixed = tl.load(cost_ptr + 1)
    per_expert = tl.load(cost_ptr + 2)
    per_pair = tl.load(cost_ptr + 3)
    nf = n.to(tl.float64)
    cpu = tl.where(n > 0, fixed, 0.0) + nf * per_expert + prefix.to(tl.float64) * per_pair
    link = tl.maximum(m.to(tl.float64) - nf, 0.0) * link_per
    step = tl.where(n <= m, tl.maximum(cpu, link), float("inf"))
    best = tl.min(tl.where(step == tl.min(step, axis=0), n, BLOCK_N), axis=0)  # first minimum
    cpu_e = elig & (rank < best)
    cpu_pair = (tl.sum((routes & cpu_e[:, None]).to(tl.int32), axis=0) > 0) & missed
    tl.store(gpu_ids_ptr + p, tl.where(cpu_pair, filler, phys).to(gpu_ids_ptr.dtype.element_ty), mask=pm)
    tl.store(cpu_pairs_ptr + p, cpu_pair.to(tl.int1), mask=pm)
    tl.store(st_ids_ptr + p, ids, mask=pm)
    tl.store(st_mask_ptr + p, cpu_pair.to(tl.uint8), mask=pm)
    tl.store(st_w_ptr + p, tl.load(w_ptr + p, mask=pm, other=0.0).to(tl.float32), mask=pm)
    tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + m.to(tl.int64))
    tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + best.to(tl.int64))
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + tl.sum(missed.to(tl.int32), axis=0).to(tl.int64))
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + tl.sum(cpu_pair.to(tl.int32), axis=0).to(tl.int64))


@functools.lru_cache(maxsize=2)
def jitted(interpret: bool) -> Any:
    """Wrapped on first use: Triton decides between compiling and interpreting when it wraps."""
    return triton.jit(_split_kernel)


def split_and_stage(
    topk_ids: torch.Tensor, phys: torch.Tensor, topk_weights: torch.Tensor, cost: torch.Tensor, valid_rows: torch.Tensor,
    host_offset: int, filler: int, num_experts: int, gpu_ids: torch.Tensor, cpu_pairs: torch.Tensor, st_ids: torch.Tensor,
    st_mask: torch.Tensor, st_weights: torch.Tensor, counters: torch.Tensor,
) -> None:
    """One launch: ``gpu_ids`` [T, K], ``cpu_pairs`` [T, K] bool, the host's staged ids / mask / weights, counters += step's.

    ``valid_rows`` [1] int32 on the device: the step's real token rows; padding rows never count as
    misses (the CPU computes nothing for them, the GPU keeps their ids).
    """
    import os

    n_pairs = topk_ids.numel()
    kernel = jitted(os.environ.get("TRITON_INTERPRET") == "1")
    kernel[(1,)](
        topk_ids, phys, topk_weights, cost, valid_rows, gpu_ids, cpu_pairs, st_ids, st_mask, st_weights, counters,
        n_pairs, topk_ids.shape[1], host_offset, filler, num_experts,
        BLOCK_P=triton.next_power_of_2(max(n_pairs, 2)), BLOCK_E=triton.next_power_of_2(max(num_experts, 2)),
        BLOCK_N=triton.next_power_of_2(num_experts + 1),
    )
