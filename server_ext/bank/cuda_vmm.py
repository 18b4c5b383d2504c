"""CUDA backing of an expert bank: one virtual range, slot rows in GPU memory,
host rows in pinned host memory (CUDA virtual memory management).

The range is reserved once with ``cuMemAddressReserve``; its first part is
backed by a device allocation (the slot bank), the rest by a host-NUMA
allocation (every expert's host copy), both mapped with read/write access
for the GPU. To the fused-MoE kernel it is one ordinary [rows, ...] tensor:
slot rows read at HBM speed, host rows over the host link, addresses never
move (CUDA graphs stay valid) and swaps are plain row copies inside it.
Allocation granularity is 2 MiB on the H200 (measured, see shared notes), so
the slot region is padded to whole pages with unused rows, and rows of awkward
sizes are padded to a divisor of the page (``bank_layout.py``).

In RAM-complement mode (``exchange.py``) the host region has only ``E - S + K``
rows; an eviction is a D2H row copy into a spare host row of the same range
and a promotion an H2D copy out of one, so no remapping happens at swap time
(its storage test passed on the H200; a served model has not run it on a GPU yet).

Prefill staging rows (``cache/prefill_staging.py``) sit between the slot and host regions, whole
pages; every layer maps the same device allocation there (one per parameter name and size), so
the staging memory is paid once per model, not per layer (checked on an H100 by scripts/gpu_prefill_check.py: a byte written through one layer's staging rows reads back through another's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .bank import strided_rows
from .bank_layout import BankLayout, check_kernel_rows, page_layout

try:  # cuda-bindings >= 12.6 layout, then the older cuda-python one
    from cuda.bindings import driver as cu  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - depends on the CUDA install
    try:
        from cuda import cuda as cu  # type: ignore[import-not-found,no-redef]
    except ImportError:
        cu = None


class VmmError(RuntimeError):
    pass


# (device ordinal, parameter name, bytes) -> the device allocation mapped at every layer's staging rows
_STAGING_HANDLES: dict[tuple[int, str, int], Any] = {}


@dataclass
class VmmAllocation:
    """The driver objects of one ``allocate``: released in reverse (unmap, release, free the range)
    when a later step fails, or by ``VmmBacking.free``; a failed allocation keeps nothing."""

    ptr: int
    size: int
    handles: list[Any] = field(default_factory=list)
    mapped: list[tuple[int, int]] = field(default_factory=list)


def _check(result: Any) -> Any:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise VmmError(f"CUDA driver call failed: {err}")
    return rest[0] if len(rest) == 1 else tuple(rest)


class _CudaArray:
    """Minimal __cuda_array_interface__ owner so torch can wrap the mapped range."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None}


class VmmBacking:
    name = "cuda-vmm"

    def __init__(self, device: torch.device, numa_node: int = 0):
        if cu is None:
            raise VmmError("expert residency on CUDA needs the cuda-bindings package (pip install cuda-bindings)")
        self.device = device
        self.ordinal = device.index if device.index is not None else torch.cuda.current_device()
        self.numa_node = numa_node
        torch.cuda.init()
        self._keep: list[Any] = []  # array wrappers live as long as the server
        self.allocations: list[VmmAllocation] = []  # live reservations, their handles and mappings
        self._host_ranges: list[tuple[int, int]] = []  # (address, bytes) of host-backed parts
        self.host_readable = False
        self.granularity = max(self._granularity(self._prop(device=True)), self._granularity(self._prop(device=False)))

    def _prop(self, device: bool) -> Any:
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        if device:
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = self.ordinal
        else:
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA
            prop.location.id = self.numa_node
        return prop

    def _granularity(self, prop: Any) -> int:
        flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(_check(cu.cuMemGetAllocationGranularity(prop, flag)))

    def layout(self, num_slots: int, host_rows: int, row_bytes: list[int], pad: bool, staging_rows: int = 0) -> BankLayout:
        """Host rows (and staging rows) start on a page boundary in every parameter (``bank_layout.page_layout``)."""
        try:
            return check_kernel_rows(page_layout(num_slots, host_rows, row_bytes, self.granularity, pad, staging_rows=staging_rows))
        except ValueError as e:
            raise VmmError(str(e)) from None

    def _staging_handle(self, key: str, size: int) -> Any:
        """The device allocation every layer maps at its staging rows for parameter ``key``: layers run one
        after another on one stream, and each staged step rewrites the rows before its kernel reads them."""
        full = (self.ordinal, key, size)
        handle = _STAGING_HANDLES.get(full)
        if handle is None:
            handle = _STAGING_HANDLES[full] = _check(cu.cuMemCreate(size, self._prop(device=True), 0))
        return handle

    def allocate(self, layout: BankLayout, row_stride: int, row_shape: tuple[int, ...], dtype: torch.dtype, staging_key: str = "") -> torch.Tensor:
        host_offset, num_rows = layout.host_row_offset, layout.num_rows
        dev_bytes = host_offset * row_stride
        stage_bytes = layout.staging_region_rows * row_stride
        host_bytes = layout.host_region_bytes(row_stride, self.granularity)
        if dev_bytes % self.granularity or stage_bytes % self.granularity:
            raise VmmError("slot or staging region is not page aligned")
        total = dev_bytes + host_bytes
        taken = VmmAllocation(int(_check(cu.cuMemAddressReserve(total, self.granularity, 0, 0))), total)
        try:
            offset = 0
            for size, kind in ((dev_bytes - stage_bytes, "device"), (stage_bytes, "staging"), (host_bytes, "host")):
                if size == 0:
                    continue
                if kind == "staging":  # shared, never released by this allocation (the process keeps it)
                    handle = self._staging_handle(staging_key, size)
                else:
                    handle = _check(cu.cuMemCreate(size, self._prop(device=kind == "device"), 0))
                    taken.handles.append(handle)
                _check(cu.cuMemMap(taken.ptr + offset, size, 0, handle, 0))
                taken.mapped.append((taken.ptr + offset, size))
                offset += size
            access = cu.CUmemAccessDesc()
            access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = self.ordinal
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _check(cu.cuMemSetAccess(taken.ptr, total, [access], 1))
            if self.host_readable and host_bytes:
                self._grant(taken.ptr + dev_bytes, host_bytes)
            owner = _CudaArray(taken.ptr, num_rows * row_stride)
            rows = strided_rows(self._wrap(owner), num_rows, row_stride, row_shape, dtype)
        except BaseException as exc:
            problems = self._undo(taken)
            if problems:
                exc.add_note(f"releasing the failed VMM allocation also failed: {'; '.join(problems)}")
            raise
        self.allocations.append(taken)
        if host_bytes:
            self._host_ranges.append((taken.ptr + dev_bytes, host_bytes))
        self._keep.append(owner)
        return rows

    def _wrap(self, owner: _CudaArray) -> torch.Tensor:
        return torch.as_tensor(owner, device=self.device)

    @staticmethod
    def _undo(taken: VmmAllocation) -> list[str]:
        """Unmap, release and free everything ``taken`` holds, in reverse; every step is tried even
        when an earlier one fails. Returns the failures (empty when all went back)."""
        problems = []
        steps = [(f"cuMemUnmap({addr:#x}, {size})", cu.cuMemUnmap, (addr, size)) for addr, size in reversed(taken.mapped)]
        steps += [("cuMemRelease", cu.cuMemRelease, (h,)) for h in reversed(taken.handles)]
        steps.append((f"cuMemAddressFree({taken.ptr:#x}, {taken.size})", cu.cuMemAddressFree, (taken.ptr, taken.size)))
        for name, call, args in steps:
            try:
                _check(call(*args))
            except Exception as exc:  # noqa: BLE001 - keep releasing the rest
                problems.append(f"{name}: {exc}")
        taken.mapped.clear()
        taken.handles.clear()
        return problems

    def free(self, rows: torch.Tensor) -> None:
        """Give back the allocation behind ``rows`` (a bank whose later allocation failed); nothing may
        use ``rows`` afterwards."""
        self._free_at(rows.data_ptr())

    def _free_at(self, ptr: int) -> None:
        match = [a for a in self.allocations if a.ptr == ptr]
        if not match:
            raise VmmError(f"no VMM allocation starts at {ptr:#x}")
        taken = match[0]
        self.allocations.remove(taken)
        self._host_ranges = [(a, n) for a, n in self._host_ranges if not taken.ptr <= a < taken.ptr + taken.size]
        self._keep = [k for k in self._keep if not (isinstance(k, _CudaArray) and k.__cuda_array_interface__["data"][0] == ptr)]
        problems = self._undo(taken)
        if problems:
            raise VmmError(f"releasing the VMM allocation at {ptr:#x} failed: {'; '.join(problems)}")

    def grant_host_access(self) -> None:
        """Let this process's CPU threads read the host rows at their (unified) addresses.

        The CPU expert path computes from the host rows in place; mapped for the device only, a CPU
        load from them faults. Ranges allocated after this call are granted as they come.
        """
        self.host_readable = True
        for addr, size in self._host_ranges:
            self._grant(addr, size)

    def _grant(self, addr: int, size: int) -> None:
        errors = []
        for loc_type, loc_id in ((cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST_NUMA, self.numa_node),
                                 (cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_HOST, 0)):
            access = cu.CUmemAccessDesc()
            access.location.type = loc_type
            access.location.id = loc_id
            access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            err = cu.cuMemSetAccess(addr, size, [access], 1)
            err = err[0] if isinstance(err, tuple) else err
            if int(err) == 0:
                return
            errors.append(f"{loc_type.name}: {err}")
        raise VmmError(f"the host rows cannot be mapped for the CPU ({'; '.join(errors)})")

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)
