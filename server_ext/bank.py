"""The physical expert bank of one MoE layer and the swaps that move its bytes.

Layout of every per-expert parameter (w13, w2, biases, scales), one tensor:

    rows [0, S)            slot bank   - device memory (GPU) / plain memory (CPU)
    rows [H, H + E)        host bank   - every expert, pinned host memory on CUDA

``H >= S`` (a backing may pad the slot region to its page size). The routing
table ``phys_map[e]`` is ``slot(e)`` for residents and ``H + e`` otherwise,
so the unmodified fused-MoE kernel computes each (token, expert) pair from
the right tier in one call and sums over k in stock order: outputs are
bit-identical whatever is resident. Only ``Backing`` differs by platform;
the slot logic, copies and publication order below are the same everywhere.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .slots import SlotPlan, SlotTable


class Backing(Protocol):
    """Allocates a [slot rows + host rows, *row_shape] tensor with the right memory per region."""

    name: str

    def host_row_offset(self, num_slots: int, row_bytes: list[int]) -> int: ...

    def allocate(self, num_slots: int, host_offset: int, num_experts: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def synchronize(self) -> None: ...


class PlainBacking:
    """One ordinary tensor on the model's device (CPU: both tiers are RAM)."""

    name = "plain"

    def __init__(self, device: torch.device):
        self.device = device

    def host_row_offset(self, num_slots: int, row_bytes: list[int]) -> int:
        return num_slots

    def allocate(self, num_slots: int, host_offset: int, num_experts: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((host_offset + num_experts, *row_shape), dtype=dtype, device=self.device)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@dataclass
class SwapStats:
    experts_loaded: int = 0
    experts_evicted: int = 0
    bytes_copied: int = 0
    copy_s: float = 0.0
    publish_s: float = 0.0
    layers_changed: list[int] = field(default_factory=list)

    def add(self, other: "SwapStats") -> None:
        self.experts_loaded += other.experts_loaded
        self.experts_evicted += other.experts_evicted
        self.bytes_copied += other.bytes_copied
        self.copy_s += other.copy_s
        self.publish_s += other.publish_s
        self.layers_changed += other.layers_changed


class ExpertBank:
    """Slot bank + host bank of one layer's expert parameters, with its routing table."""

    def __init__(
        self,
        layer_id: int,
        params: dict[str, torch.nn.Parameter],
        phys_map: torch.Tensor,
        num_slots: int,
        backing: Backing,
    ):
        if not params:
            raise ValueError(f"layer {layer_id}: no per-expert parameters found")
        shapes = {name: p.shape[0] for name, p in params.items()}
        num_experts = next(iter(shapes.values()))
        if any(n != num_experts for n in shapes.values()):
            raise ValueError(f"layer {layer_id}: expert dims disagree {shapes}")
        self.layer_id = layer_id
        self.params = params
        self.phys_map = phys_map
        self.backing = backing
        self.row_bytes = {n: p[0].numel() * p.element_size() for n, p in params.items()}
        host_offset = backing.host_row_offset(num_slots, list(self.row_bytes.values()))
        self.table = SlotTable(num_experts, num_slots, host_offset)
        with torch.no_grad():
            for p in params.values():
                phys = backing.allocate(num_slots, host_offset, num_experts, tuple(p.shape[1:]), p.dtype)
                phys[host_offset:].copy_(p.data)
                phys[:host_offset].zero_()
                # Rebind .data (not the Parameter): quant configs keep references to it.
                p.data = phys
        backing.synchronize()
        self._publish()

    @property
    def num_experts(self) -> int:
        return self.table.num_experts

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    @property
    def expert_bytes(self) -> int:
        return sum(self.row_bytes.values())

    @property
    def slot_bytes(self) -> int:
        """Bytes of the slot region (device memory on CUDA), padding rows included."""
        return self.table.host_row_offset * self.expert_bytes

    @property
    def host_bytes(self) -> int:
        """Bytes of the host rows (pinned host memory on CUDA)."""
        return self.num_experts * self.expert_bytes

    def resident(self) -> tuple[int, ...]:
        return self.table.resident()

    def resident_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.num_experts, dtype=torch.bool)
        for e in self.table.resident():
            mask[e] = True
        return mask

    def host_row(self, name: str, expert: int) -> torch.Tensor:
        return self.params[name].data[self.table.host_row_offset + expert]

    def slot_row(self, name: str, slot: int) -> torch.Tensor:
        return self.params[name].data[slot]

    def _publish(self) -> None:
        table = torch.tensor(self.table.physical_map(), dtype=self.phys_map.dtype)
        self.phys_map.copy_(table.to(self.phys_map.device))

    def swap(self, target: tuple[int, ...]) -> SwapStats:
        """Make ``target`` resident: evict, copy, then publish the new map.

        Validation happens in ``table.plan`` before anything changes. Evicted
        experts are routed to their host rows first; loaded experts are routed
        to their slots only after their bytes landed.
        """
        plan: SlotPlan = self.table.plan(target)
        stats = SwapStats()
        if plan.empty:
            return stats
        t0 = time.perf_counter()
        self.table.apply_evictions(plan)
        self._publish()
        t1 = time.perf_counter()
        with torch.no_grad():
            for move in plan.load:
                for name in self.params:
                    self.slot_row(name, move.slot).copy_(self.host_row(name, move.expert), non_blocking=True)
        self.backing.synchronize()
        t2 = time.perf_counter()
        self.table.apply_loads(plan)
        self._publish()
        self.backing.synchronize()
        t3 = time.perf_counter()
        stats.experts_loaded = len(plan.load)
        stats.experts_evicted = len(plan.evict)
        stats.bytes_copied = len(plan.load) * self.expert_bytes
        stats.copy_s = t2 - t1
        stats.publish_s = (t1 - t0) + (t3 - t2)
        stats.layers_changed = [self.layer_id]
        return stats

    def verify(self) -> list[int]:
        """Experts whose slot bytes differ from their host bytes (should be empty)."""
        bad = []
        for e in self.table.resident():
            slot = self.table.slot_of(e)
            for name in self.params:
                if not torch.equal(self.slot_row(name, slot), self.host_row(name, e)):
                    bad.append(e)
                    break
        return bad
