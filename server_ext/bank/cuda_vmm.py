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
"""

from __future__ import annotations

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
        self._keep: list[Any] = []  # handles and wrappers live as long as the server
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

    def layout(self, num_slots: int, host_rows: int, row_bytes: list[int], pad: bool) -> BankLayout:
        """Host rows start on a page boundary in every parameter (``bank_layout.page_layout``)."""
        try:
            return check_kernel_rows(page_layout(num_slots, host_rows, row_bytes, self.granularity, pad))
        except ValueError as e:
            raise VmmError(str(e)) from None

    def allocate(self, layout: BankLayout, row_stride: int, row_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        host_offset, num_rows = layout.host_row_offset, layout.num_rows
        dev_bytes = host_offset * row_stride
        host_bytes = layout.host_region_bytes(row_stride, self.granularity)
        if dev_bytes % self.granularity:
            raise VmmError("slot region is not page aligned")
        total = dev_bytes + host_bytes
        ptr = int(_check(cu.cuMemAddressReserve(total, self.granularity, 0, 0)))
        offset = 0
        for size, on_device in ((dev_bytes, True), (host_bytes, False)):
            if size == 0:
                continue
            handle = _check(cu.cuMemCreate(size, self._prop(device=on_device), 0))
            _check(cu.cuMemMap(ptr + offset, size, 0, handle, 0))
            self._keep.append(handle)
            if not on_device:
                self._host_ranges.append((ptr + offset, size))
            offset += size
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.ordinal
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(cu.cuMemSetAccess(ptr, total, [access], 1))
        if self.host_readable and host_bytes:
            self._grant(ptr + dev_bytes, host_bytes)
        owner = _CudaArray(ptr, num_rows * row_stride)
        self._keep.append(owner)
        return strided_rows(torch.as_tensor(owner, device=self.device), num_rows, row_stride, row_shape, dtype)

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
