"""The physical expert bank of one MoE layer and the swaps that move its bytes.

Layout of every per-expert parameter (w13, w2, biases, scales), one tensor:

    rows [0, S)            slot bank   - device memory (GPU) / plain memory (CPU)
    rows [H, H + E)        host bank   - every expert, pinned host memory on CUDA

``H >= S`` (a backing may pad the slot region to its page size, and rows to a divisor of it:
``bank_layout.py``). Small side tensors (scales, biases) have the same rows but are one plain
device tensor each, outside the paged range (``side_tensors.py``). The routing
table ``phys_map[e]`` is ``slot(e)`` for residents and ``H + e`` otherwise,
or, in RAM-complement mode (``exchange.py``), ``H + host_slot[e]`` over only
``E - S + K`` host rows (non-residents plus ``K`` spares),
so the unmodified fused-MoE kernel computes each (token, expert) pair from
the right tier in one call and sums over k in stock order: outputs are
bit-identical whatever is resident. Only ``Backing`` differs by platform;
the slot logic, copies and publication order below are the same everywhere.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .bank_layout import BankLayout, contiguous_layout, page_layout
from .exchange import ComplementLayer, ExchangeCounters, ExchangeOps
from .host_rows import LayerHostRows, complement_owners
from .side_tensors import side_bytes, side_rows, split_params
from .slots import SlotMove, SlotPlan, SlotTable


class Backing(Protocol):
    """Allocates a [slot rows + host rows, *row_shape] tensor with the right memory per region."""

    name: str

    def layout(self, num_slots: int, host_rows: int, row_bytes: list[int], pad: bool, staging_rows: int = 0) -> BankLayout:
        """``staging_rows``: prefill staging rows between the slot and host rows (0: none)."""
        ...

    def allocate(self, layout: BankLayout, row_stride: int, row_shape: tuple[int, ...], dtype: torch.dtype, staging_key: str = "") -> torch.Tensor:
        """``staging_key``: the parameter's name (what may share a staging region across layers)."""
        ...

    def synchronize(self) -> None: ...

    def free(self, rows: torch.Tensor) -> None:
        """Give back what ``allocate`` took for ``rows`` now (a failed bank's earlier parameters)."""
        ...


class PlainBacking:
    """One ordinary tensor on the model's device (CPU: both tiers are RAM).

    ``page`` lays the rows out as a paged backing would (padded slot region, padded row strides),
    so the CPU runs the same strided banks the CUDA one gets.
    """

    name = "plain"

    def __init__(self, device: torch.device, page: int | None = None):
        self.device = device
        self.page = page

    def layout(self, num_slots: int, host_rows: int, row_bytes: list[int], pad: bool, staging_rows: int = 0) -> BankLayout:
        if self.page is None:
            return contiguous_layout(num_slots, host_rows, row_bytes, staging_rows)
        return page_layout(num_slots, host_rows, row_bytes, self.page, pad, staging_rows=staging_rows)

    def allocate(self, layout: BankLayout, row_stride: int, row_shape: tuple[int, ...], dtype: torch.dtype, staging_key: str = "") -> torch.Tensor:
        """Staging rows are this bank's own here (a CPU bank's rows are all RAM anyway)."""
        return strided_rows(torch.empty(layout.num_rows * row_stride, dtype=torch.uint8, device=self.device), layout.num_rows,
                            row_stride, row_shape, dtype)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def free(self, rows: torch.Tensor) -> None:
        """Nothing to do: torch frees the tensor with its last reference."""


def strided_rows(raw: torch.Tensor, num_rows: int, row_stride: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``[num_rows, *row_shape]`` over the bytes ``raw``, rows ``row_stride`` bytes apart, each row contiguous."""
    size = torch.empty((), dtype=dtype).element_size()
    if row_stride % size or row_stride < math.prod(row_shape) * size or raw.numel() < num_rows * row_stride:
        raise ValueError(f"row stride {row_stride} B does not fit rows of {row_shape} {dtype} in {raw.numel()} B")
    flat = raw[: num_rows * row_stride].view(dtype)
    inner = [math.prod(row_shape[i + 1:]) for i in range(len(row_shape))]
    return flat.as_strided((num_rows, *row_shape), (row_stride // size, *inner))


@dataclass(frozen=True)
class ComplementSpec:
    """RAM-complement mode of one bank: ``spares`` extra host rows, experts resident at start."""

    spares: int
    start: tuple[int, ...]


class _TensorOps:
    """Exchange copies as row copies inside the bank tensors (one VA range per parameter on CUDA)."""

    def __init__(self, bank: "ExpertBank"):
        self.bank = bank

    def to_host(self, slot: int, row: int) -> None:
        off = self.bank.table.host_row_offset
        for p in self.bank.params.values():
            p.data[off + row].copy_(p.data[slot], non_blocking=True)

    def to_slot(self, row: int, slot: int) -> None:
        off = self.bank.table.host_row_offset
        for p in self.bank.params.values():
            p.data[slot].copy_(p.data[off + row], non_blocking=True)

    def wait(self) -> None:
        self.bank.backing.synchronize()

    def publish(self, physical_map: list[int]) -> None:
        self.bank.phys_map.copy_(torch.tensor(physical_map, dtype=self.bank.phys_map.dtype).to(self.bank.phys_map.device))


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
        complement: ComplementSpec | None = None,
        staging_rows: int = 0,
    ):
        """``staging_rows``: device rows for prefill staging between the slots and the host rows
        (``cache/prefill_staging.py``); the routing table never points at them."""
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
        """Bytes of one expert of every parameter, side tensors included (what a swap copies)."""
        self.banked, self.side = split_params(self.row_bytes)
        """Parameter names in the backing's paged range, and the small ones kept whole on the device."""
        self.complement: ComplementLayer | None = None
        self.ops_hook: Callable[[ExchangeOps], ExchangeOps] | None = None
        """Wraps the exchange copies (``swap_repair``'s fault injection on a real server); None in service."""
        if complement is None:
            sources = [list(range(num_experts))]  # host row r holds expert r
            residents: tuple[int, ...] = ()
        else:
            if complement.spares < 1:
                raise ValueError(f"layer {layer_id}: RAM-complement mode needs >= 1 spare host row")
            host_rows = num_experts - num_slots + complement.spares
            residents = _padded_start(complement.start, num_experts, num_slots, num_experts - host_rows)
            owners = complement_owners(num_experts, residents, host_rows)
            sources = [owners]
        host_owner = sources[0]
        # RAM-complement host rows are exchanged as contiguous byte spans: no row padding there
        if staging_rows < 0:
            raise ValueError(f"layer {layer_id}: staging rows must be >= 0, got {staging_rows}")
        sizes = [self.row_bytes[n] for n in self.banked]
        pad = complement is None
        layout = self.layout = backing.layout(num_slots, len(host_owner), sizes, pad, staging_rows=staging_rows)
        host_offset = layout.host_row_offset
        self.table = SlotTable(num_experts, num_slots, host_offset)
        # Allocate every region first: a failed allocation (e.g. pinning) changes nothing.
        phys: dict[str, torch.Tensor] = {}
        try:
            for n, stride in zip(self.banked, layout.row_strides):
                phys[n] = backing.allocate(layout, stride, tuple(params[n].shape[1:]), params[n].dtype, staging_key=n)
        except BaseException:
            for t in phys.values():
                backing.free(t)
            raise
        for n in self.side:
            phys[n] = side_rows(layout.num_rows, params[n].data)
        with torch.no_grad():
            for n, p in params.items():
                dst, src = phys.pop(n), p.data
                dst[:host_offset].zero_()
                for slot, e in enumerate(residents):
                    dst[slot].copy_(src[e])
                for row, e in enumerate(host_owner):  # expert by expert: no staging copy
                    if e >= 0:
                        dst[host_offset + row].copy_(src[e])
                    else:
                        dst[host_offset + row].zero_()
                # Rebind .data (not the Parameter): quant configs keep references to it.
                # The loaded tensor is freed here, before the next parameter is built.
                p.data = dst
                del dst, src
        if complement is not None:
            for slot, e in enumerate(residents):
                self.table.apply_loads(SlotPlan((), (SlotMove(e, slot),)))
            rows = LayerHostRows(layer_id, num_experts, len(host_owner), tuple(self.row_bytes[n] for n in self.banked), host_owner)
            self.complement = ComplementLayer(self.table, rows, host_offset)
        backing.synchronize()
        self._publish()

    @property
    def num_experts(self) -> int:
        return self.table.num_experts

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    @property
    def staging_offset(self) -> int:
        """First staging row (prefill staging); equal to the host-row offset when there are none."""
        return self.layout.staging_offset if self.layout.staging_rows else self.table.host_row_offset

    @property
    def staging_rows(self) -> int:
        return self.layout.staging_rows

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes, side tensors included (what a swap copies)."""
        return sum(self.row_bytes.values())

    @property
    def link_bytes(self) -> int:
        """One expert's bytes in host memory (what a promotion moves over the host link): the banked tensors."""
        return sum(self.row_bytes[n] for n in self.banked)

    @property
    def slot_bytes(self) -> int:
        """Device memory on CUDA: the banked slot region (padding rows and row padding included, staging
        rows not: ``staging_bytes``) plus every side tensor whole (its host rows too)."""
        return (self.table.host_row_offset - self.layout.staging_region_rows) * sum(self.layout.row_strides) + self.side_bytes

    @property
    def staging_bytes(self) -> int:
        """The banked staging region of this layer (padding included); on CUDA one region is mapped for
        every layer (``cuda_vmm.py``), so a model's staging memory is this once, not per layer."""
        return self.layout.staging_region_rows * sum(self.layout.row_strides)

    @property
    def side_bytes(self) -> int:
        """Bytes of the side tensors, all rows (``side_tensors.py``)."""
        return sum(side_bytes(self.layout.num_rows, self.params[n].data) for n in self.side)

    @property
    def host_rows(self) -> int:
        return self.complement.rows.num_rows if self.complement else self.num_experts

    @property
    def physical_rows(self) -> int:
        return self.table.host_row_offset + self.host_rows

    @property
    def host_bytes(self) -> int:
        """Bytes of the banked host rows (pinned host memory on CUDA), row padding included."""
        return self.host_rows * sum(self.layout.row_strides)

    def host_spans(self) -> list[tuple[int, int]]:
        """(address, bytes) of each banked parameter's host rows, rows back to back (complement mode)."""
        off, rows = self.table.host_row_offset, self.host_rows
        return [(self.params[n].data[off].data_ptr(), rows * self.row_bytes[n]) for n in self.banked]

    @property
    def counters(self) -> ExchangeCounters:
        return self.complement.counters if self.complement else ExchangeCounters()

    def resident(self) -> tuple[int, ...]:
        return self.table.resident()

    def resident_mask(self) -> torch.Tensor:
        mask = torch.zeros(self.num_experts, dtype=torch.bool)
        for e in self.table.resident():
            mask[e] = True
        return mask

    def host_row(self, name: str, expert: int) -> torch.Tensor:
        row = self.complement.rows.row_of(expert) if self.complement else expert
        if row < 0:
            raise ValueError(f"layer {self.layer_id}: expert {expert} has no host row (it is resident)")
        return self.params[name].data[self.table.host_row_offset + row]

    def slot_row(self, name: str, slot: int) -> torch.Tensor:
        return self.params[name].data[slot]

    def _publish(self) -> None:
        rows = self.complement.physical_map() if self.complement else self.table.physical_map()
        table = torch.tensor(rows, dtype=self.phys_map.dtype)
        self.phys_map.copy_(table.to(self.phys_map.device))

    def swap(self, target: tuple[int, ...]) -> SwapStats:
        """Make ``target`` resident: evict, copy, then publish the new map.

        Validation happens in ``table.plan`` before anything changes. Evicted
        experts are routed to their host rows first; loaded experts are routed
        to their slots only after their bytes landed.
        """
        if self.complement is not None:
            return self._exchange(target)
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

    def _exchange(self, target: tuple[int, ...]) -> SwapStats:
        """Complement mode: evictions go GPU -> spare host rows, promoted rows become spares."""
        assert self.complement is not None
        t0 = time.perf_counter()
        plan, delta = self.complement.exchange(target, self._ops())
        stats = SwapStats()
        if plan.empty:
            return stats
        stats.experts_loaded = len(plan.load)
        stats.experts_evicted = len(plan.evict)
        stats.bytes_copied = delta.h2d_bytes
        stats.copy_s = time.perf_counter() - t0  # copies and publishes interleave batch by batch
        stats.layers_changed = [self.layer_id]
        return stats

    def _ops(self) -> ExchangeOps:
        ops: ExchangeOps = _TensorOps(self)
        return self.ops_hook(ops) if self.ops_hook is not None else ops

    def check(self) -> list[str]:
        """Bookkeeping invariants, cheap (no bytes compared): in complement mode host-row ownership,
        the spare pool and routing-table damage (``ComplementLayer.check``); empty when all hold."""
        return self.complement.check() if self.complement is not None else []

    def repair(self) -> list[str]:
        """Complement mode: reclaim lost spare rows and re-publish the routing table; the problems left."""
        if self.complement is None:
            return []
        return self.complement.repair(self._ops())

    def verify(self) -> list[int]:
        """Experts whose slot bytes differ from their host bytes (should be empty).

        In complement mode a resident has no host copy: experts whose host-row
        ownership is wrong (resident with a row, or non-resident without) are reported.
        """
        if self.complement is not None:
            rows, table = self.complement.rows, self.table
            return [e for e in range(self.num_experts) if (rows.row_of(e) >= 0) == table.is_resident(e)]
        bad = []
        for e in self.table.resident():
            slot = self.table.slot_of(e)
            for name in self.params:
                if not torch.equal(self.slot_row(name, slot), self.host_row(name, e)):
                    bad.append(e)
                    break
        return bad


def _padded_start(start: tuple[int, ...], num_experts: int, num_slots: int, min_residents: int) -> tuple[int, ...]:
    """Start-up residents plus the lowest other ids until the rest fit the host rows."""
    want = sorted(set(start))
    if len(want) > num_slots or any(not 0 <= e < num_experts for e in want):
        raise ValueError(f"start-up residents {want} do not fit {num_slots} slots of {num_experts} experts")
    extra = [e for e in range(num_experts) if e not in set(want)]
    return tuple(sorted(want + extra[: max(0, min_residents - len(want))]))
