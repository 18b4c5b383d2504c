"""The two per-step kernels of expert residency: remap + capture, and accumulate.

``remap_and_capture`` runs inside every MoE layer's forward (so inside CUDA
graphs): it maps logical expert ids to physical bank rows for the stock fused
kernel and, in the same pass, writes each routed (token, k) pair to the
layer's capture rows as a *code*: the expert id when the expert was resident
at that moment, ``-1 - id`` when it was read from the host bank. One launch
per layer, fixed shape, no host synchronization, no dtype round trip.

``accumulate_step`` runs once per step, after the forward, over every layer's
capture rows: it adds each pair to its request slot's accumulators
``acc[slot, layer] = (routed pairs, missed pairs, gate mass, missed mass)``
per expert. One launch per step for all layers.

CUDA uses Triton kernels; CPU uses the torch reference below, which defines
the semantics. The Triton kernels also run on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``), which is how CI checks them against the
reference without a GPU.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch

# Components of the accumulator's third axis.
ROUTED, MISSED, MASS, MISSED_MASS = 0, 1, 2, 3
COMPONENTS = 4
_BLOCK = 1024
_SMALL_BLOCK = 128


def miss_code(ids: torch.Tensor, phys: torch.Tensor, host_row_offset: int) -> torch.Tensor:
    """``id`` for pairs served from a slot row, ``-1 - id`` for pairs read from a host row."""
    return torch.where(phys >= host_row_offset, -1 - ids, ids)


def decode_codes(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids, missed mask) from capture codes."""
    missed = codes < 0
    return torch.where(missed, -1 - codes, codes), missed


# ---------------------------------------------------------------- references (CPU)


def remap_and_capture_reference(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    phys_map: torch.Tensor,
    host_row_offset: int,
    cap_codes: torch.Tensor,
    cap_weights: torch.Tensor,
) -> torch.Tensor:
    n = topk_ids.shape[0]
    phys = torch.index_select(phys_map, 0, topk_ids.reshape(-1)).view(topk_ids.shape)
    cap_codes[:n].copy_(miss_code(topk_ids.to(cap_codes.dtype), phys, host_row_offset))
    cap_weights[:n].copy_(topk_weights)
    return phys.to(topk_ids.dtype)


def accumulate_step_reference(
    cap_codes: torch.Tensor,
    cap_weights: torch.Tensor,
    layer_rows: torch.Tensor,
    row_slot: torch.Tensor,
    num_rows: int,
    acc: torch.Tensor,
) -> None:
    """acc[slot, r] += per-expert sums of the first ``num_rows`` capture rows of arena layer r, r in ``layer_rows``."""
    if num_rows == 0:
        return
    arena_layers, num_experts = acc.shape[1], acc.shape[3]
    rows = layer_rows.to(torch.int64)
    codes = cap_codes.index_select(0, rows)[:, :num_rows]  # [L, T, K]
    w = cap_weights.index_select(0, rows)[:, :num_rows].to(acc.dtype)
    ids, missed = decode_codes(codes.to(torch.int64))
    slot = row_slot[:num_rows].to(torch.int64).view(1, num_rows, 1)
    layer = rows.view(-1, 1, 1)
    base = ((slot * arena_layers + layer) * COMPONENTS) * num_experts + ids  # index of ROUTED
    missed_f = missed.to(acc.dtype)
    ones = torch.ones_like(w)
    index = torch.cat([(base + c * num_experts).reshape(-1) for c in range(COMPONENTS)])
    values = torch.cat([ones.reshape(-1), missed_f.reshape(-1), w.reshape(-1), (w * missed_f).reshape(-1)])
    acc.view(-1).index_add_(0, index, values)


# ---------------------------------------------------------------- Triton (CUDA)


def _kernels() -> tuple[Any, Any]:
    from . import routing_triton

    return routing_triton.jitted(os.environ.get("TRITON_INTERPRET", "0") == "1")


def remap_and_capture_triton(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    phys_map: torch.Tensor,
    host_row_offset: int,
    cap_codes: torch.Tensor,
    cap_weights: torch.Tensor,
) -> torch.Tensor:
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    w = topk_weights if topk_weights.is_contiguous() else topk_weights.contiguous()
    out = torch.empty_like(ids)
    n_elem = ids.numel()
    if n_elem:
        remap, _ = _kernels()
        # Decode steps (a few tokens x top-k) fit one small single-warp program: its latency is the cost.
        block, warps = (_SMALL_BLOCK, 1) if n_elem <= _SMALL_BLOCK else (_BLOCK, 4)
        remap[(-(-n_elem // block),)](ids, w, phys_map, out, cap_codes, cap_weights, n_elem, host_row_offset, BLOCK=block, num_warps=warps)
    return out


def accumulate_step_triton(
    cap_codes: torch.Tensor,
    cap_weights: torch.Tensor,
    layer_rows: torch.Tensor,
    row_slot: torch.Tensor,
    num_rows: int,
    acc: torch.Tensor,
) -> None:
    k = cap_codes.shape[2]
    n_elem = num_rows * k
    if n_elem == 0:
        return
    _, accumulate = _kernels()
    grid = (int(layer_rows.shape[0]), -(-n_elem // _BLOCK))
    accumulate[grid](
        cap_codes, cap_weights, layer_rows, row_slot, acc, n_elem, cap_codes.stride(0), acc.shape[1], acc.shape[3], K=k, BLOCK=_BLOCK
    )


def remap_and_capture(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    phys_map: torch.Tensor,
    host_row_offset: int,
    cap_codes: torch.Tensor,
    cap_weights: torch.Tensor,
) -> torch.Tensor:
    """Physical rows for ``topk_ids`` (same dtype and shape); capture codes and weights as a side effect."""
    fn: Callable[..., torch.Tensor] = remap_and_capture_triton if topk_ids.is_cuda else remap_and_capture_reference
    return fn(topk_ids, topk_weights, phys_map, host_row_offset, cap_codes, cap_weights)


def accumulate_step(
    cap_codes: torch.Tensor,
    cap_weights: torch.Tensor,
    layer_rows: torch.Tensor,
    row_slot: torch.Tensor,
    num_rows: int,
    acc: torch.Tensor,
) -> None:
    """Add one step's captured pairs to ``acc[slot, layer, component, expert]``.

    cap_codes/cap_weights: [arena layers, max_tokens, K]; acc: [slots, arena
    layers, COMPONENTS, experts]; layer_rows: the arena rows of the layers that
    have a bank (the others are skipped); row_slot: [>= num_rows] request slot
    of every token row.
    """
    fn = accumulate_step_triton if acc.is_cuda else accumulate_step_reference
    fn(cap_codes, cap_weights, layer_rows, row_slot, num_rows, acc)
