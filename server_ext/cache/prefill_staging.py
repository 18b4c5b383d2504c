"""Prefill staging: a large step's missed experts cross the host link once, not once per M-block.

Why: the fused MoE kernel tiles each expert's tokens into M-blocks and every block reads the whole
expert, so a missed expert with ``n`` tokens is read over the link ``ceil(n / BLOCK_SIZE_M)`` times.
For steps with at least ``min_step_tokens`` token rows, the most-routed missed experts (more than
``min_expert_tokens`` pairs each, at most ``rows`` of them) are copied once into the bank's staging
rows (device memory, after the slot rows) and their pairs are remapped there, so the kernel reads
HBM. Experts not staged keep their host rows. Staging rows hold nothing between steps: every
staged step overwrites them, and the next layer's step reuses them (one stream, stream order).

Everything is fixed-shape tensor ops (``E``, ``P``, ``T x K``): per-expert miss counts by a
scatter-add, the choice by ``topk``, no host synchronization and no branch on a tensor value. The
same functions run on CPU (tests) and on CUDA (the copy is ``promote.copy_rows``' Triton kernel).

Accounting: captured pairs stay as routed (a staged pair is still a missed pair); each staged
expert is booked once per layer step to the request of the first token row that routed it
(``first_row``, like the cache's promotions), so ``staged_experts x expert bytes`` is the link
traffic of the staged experts, moved once each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .promote import copy_rows

CopyFn = Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor, int, torch.Tensor, int], None]
"""``copy_rows(rows, valid, src, src_offset, dst, dst_offset)`` (``promote.py``)."""

DEFAULT_MIN_STEP_TOKENS = 512
DEFAULT_MIN_EXPERT_TOKENS = 16  # vLLM's smallest BLOCK_SIZE_M: above it an expert is read twice or more


@dataclass(frozen=True)
class StagingParams:
    rows: int
    """Staging rows per bank (``P``); 0: off."""
    min_step_tokens: int = DEFAULT_MIN_STEP_TOKENS
    """Steps with fewer token rows are not staged (decode-size steps keep the stock path or the cache's)."""
    min_expert_tokens: int = DEFAULT_MIN_EXPERT_TOKENS
    """A missed expert is staged only with more routed pairs than this in the step."""

    @property
    def enabled(self) -> bool:
        return self.rows > 0

    def applies(self, num_tokens: int) -> bool:
        """Host-side, on the step's shape only (a compiled graph per shape keeps its choice)."""
        return self.rows > 0 and num_tokens >= self.min_step_tokens


@dataclass
class StagingPlan:
    """One layer step's staged experts (all [P])."""

    valid: torch.Tensor  # bool: staging row i holds an expert this step
    expert: torch.Tensor  # int64 logical expert in staging row i (meaningful where valid)
    src: torch.Tensor  # int64 its host row (relative to the host-row offset), 0 where not valid
    tokens: torch.Tensor  # int64 its missed pairs in the step, 0 where not valid
    first_row: torch.Tensor  # int32 first token row that routed it, -1 where not valid


def _clean_ids(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Flat int64 ids with anything outside [0, E) sent to the dummy bucket ``E``."""
    flat = ids.reshape(-1).to(torch.int64)
    return torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)


def _row_mask(ids: torch.Tensor, valid_rows: torch.Tensor | None) -> torch.Tensor:
    """[T * K] bool: pairs of real token rows (rows past ``valid_rows`` are graph padding)."""
    t, k = ids.shape
    rows = torch.arange(t, device=ids.device).repeat_interleave(k)
    if valid_rows is None:
        return torch.ones_like(rows, dtype=torch.bool)
    return rows < valid_rows.reshape(-1)[:1].to(torch.int64)


def expert_miss_counts(ids: torch.Tensor, phys: torch.Tensor, host_row_offset: int, num_experts: int,
                       valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[E] int64: per expert, the step's pairs that read a host row (``phys >= host_row_offset``)."""
    flat = _clean_ids(ids, num_experts)
    missed = (phys.reshape(-1).to(torch.int64) >= host_row_offset) & _row_mask(ids, valid_rows)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, torch.where(missed, flat, num_experts), missed.to(torch.int64))
    return counts[:num_experts]


def first_rows(ids: torch.Tensor, num_experts: int, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[E] int64: the first real token row routing each expert, ``T`` where none does."""
    t, k = ids.shape
    flat = _clean_ids(ids, num_experts)
    real = _row_mask(ids, valid_rows)
    rows = torch.arange(t, device=ids.device).repeat_interleave(k)
    first = torch.full((num_experts + 1,), t, dtype=torch.int64, device=ids.device)
    first.scatter_reduce_(0, torch.where(real, flat, num_experts), torch.where(real, rows, t), reduce="amin")
    return first[:num_experts]


def plan_staging(ids: torch.Tensor, phys: torch.Tensor, phys_map: torch.Tensor, host_row_offset: int, params: StagingParams,
                 valid_rows: torch.Tensor | None = None) -> StagingPlan:
    """The step's staged experts: missed experts with more than ``min_expert_tokens`` missed pairs,
    most pairs first (ties: lower id), at most ``params.rows``. ``phys``: the step's pairs already
    remapped (a pair counts as missed where it reads a host row); ``phys_map``: logical -> physical
    row, which gives a staged expert's host row."""
    num_experts = int(phys_map.shape[0])
    p = min(params.rows, num_experts)
    counts = expert_miss_counts(ids, phys, host_row_offset, num_experts, valid_rows)
    experts = torch.arange(num_experts, device=ids.device, dtype=torch.int64)
    # One int64 key orders by count, then by lower id; -1 marks experts that may not be staged.
    key = torch.where(counts > params.min_expert_tokens, counts * (num_experts + 1) + (num_experts - experts), -1)
    top = torch.topk(key, p, sorted=True)
    valid = top.values >= 0
    expert = top.indices.to(torch.int64)
    src = torch.where(valid, phys_map.index_select(0, expert).to(torch.int64) - host_row_offset, 0)
    tokens = torch.where(valid, counts.index_select(0, expert), 0)
    first = first_rows(ids, num_experts, valid_rows).index_select(0, expert)
    first_row = torch.where(valid, first, -1).to(torch.int32)
    return StagingPlan(valid, expert, src, tokens, first_row)


def remap_staged(ids: torch.Tensor, phys: torch.Tensor, plan: StagingPlan, staging_offset: int, num_experts: int) -> torch.Tensor:
    """``phys`` with every pair of a staged expert sent to its staging row ``staging_offset + i``;
    other pairs (and ids outside [0, E)) unchanged. Same shape and dtype as ``phys``."""
    p = plan.valid.shape[0]
    row_of = torch.full((num_experts + 1,), -1, dtype=torch.int64, device=ids.device)
    rows = staging_offset + torch.arange(p, device=ids.device, dtype=torch.int64)
    row_of.index_put_((torch.where(plan.valid, plan.expert, num_experts),), torch.where(plan.valid, rows, -1))
    r = row_of.index_select(0, _clean_ids(ids, num_experts)).view(ids.shape)
    return torch.where(r >= 0, r.to(phys.dtype), phys)


def stage_step(ids: torch.Tensor, phys: torch.Tensor, phys_map: torch.Tensor, host_row_offset: int, staging_offset: int,
               rows: Sequence[torch.Tensor], params: StagingParams, valid_rows: torch.Tensor | None = None,
               first_row_out: torch.Tensor | None = None, copy: CopyFn = copy_rows) -> torch.Tensor:
    """Plan, copy each staged expert's host row into its staging row (every bank tensor in ``rows``),
    and return ``phys`` remapped. ``first_row_out`` [P] int32 receives the plan's ``first_row`` (accounting)."""
    plan = plan_staging(ids, phys, phys_map, host_row_offset, params, valid_rows)
    dst = torch.arange(plan.valid.shape[0], device=ids.device, dtype=torch.int64)
    copy(rows, plan.valid, plan.src, host_row_offset, dst, staging_offset)
    if first_row_out is not None:
        first_row_out.copy_(plan.first_row)
    return remap_staged(ids, phys, plan, staging_offset, int(phys_map.shape[0]))
