"""CUDA glue of the CPU expert path: pinned host buffers mapped into the device (zero-copy staging).

Why: inside a captured CUDA graph the CPU's share of a MoE step must not need a memcpy node or a
host synchronisation. So the device writes the step's inputs (and posts it to the CPU team's
mailbox) with ordinary kernels into pinned host memory mapped into its address space
(``cuMemHostAlloc(DEVICEMAP)``); the team computes from them and writes its outputs into another
mapped buffer, which the device's merge kernel reads -- the same graph on every replay.

Driver entry points come from ``libcuda.so.1`` through ctypes (it is always there next to a
driver; torch does not expose these calls).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ..bank.cuda_vmm import _CudaArray

_CU_MEMHOSTALLOC_PORTABLE = 0x01
_CU_MEMHOSTALLOC_DEVICEMAP = 0x02


class CudaHostError(RuntimeError):
    pass


def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaHostError(f"the CPU expert path on CUDA needs the driver library libcuda.so.1: {exc}") from None
    p, s = ctypes.c_void_p, ctypes.c_size_t
    lib.cuMemHostAlloc.argtypes = [ctypes.POINTER(p), s, ctypes.c_uint]
    lib.cuMemHostGetDevicePointer_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), p, ctypes.c_uint]
    for name in ("cuMemHostAlloc", "cuMemHostGetDevicePointer_v2"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise CudaHostError(f"{what} failed with CUDA driver error {rc}")


class MappedStaging:
    """Pinned host buffers that the device reads and writes in place (zero-copy, UVA); they live as long as the process."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cu = _driver()
        self._keep: list[Any] = []

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = max(1, itemsize * int(torch.Size(shape).numel()))
        host = ctypes.c_void_p()
        torch.cuda.synchronize(self.device)  # makes the device's primary context current (the driver calls need one)
        _check(self._cu.cuMemHostAlloc(ctypes.byref(host), nbytes, _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP), "cuMemHostAlloc")
        dev = ctypes.c_uint64()
        _check(self._cu.cuMemHostGetDevicePointer_v2(ctypes.byref(dev), host, 0), "cuMemHostGetDevicePointer")
        buf = (ctypes.c_uint8 * nbytes).from_address(int(host.value or 0))
        host_t = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
        owner = _CudaArray(int(dev.value), nbytes)  # torch wraps the mapped buffer as a CUDA tensor
        dev_t = torch.as_tensor(owner, device=self.device).view(dtype).view(shape)
        self._keep.extend([buf, owner])
        host_t.zero_()
        return host_t, dev_t
