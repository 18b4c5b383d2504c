"""CUDA glue of the CPU expert path: mapped staging buffers and the step's host function.

Why these two: inside a captured CUDA graph the CPU's share of a MoE step must be a graph node,
and the only node that runs host code is a host function (``cuLaunchHostFunc``), which may not
call CUDA. So the device writes the step's inputs with ordinary kernels into pinned host memory
mapped into its address space (``cuMemHostAlloc(DEVICEMAP)``), the host function computes
from them, writes its outputs into another mapped buffer, and the device's merge reads them --
no memcpy nodes, no host synchronisation, the same graph on every replay. The host function runs
on a side stream forked from the MoE step's stream, so the GPU reads its own share of the misses
over the link while the CPU computes; the step's stream waits for the side stream only at the
merge, right before vLLM's ``moe_sum``.

Driver entry points come from ``libcuda.so.1`` through ctypes (it is always there next to a
driver; torch does not expose these calls).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ..cuda_vmm import _CudaArray

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
    lib.cuLaunchHostFunc.argtypes = [p, p, p]
    for name in ("cuMemHostAlloc", "cuMemHostGetDevicePointer_v2", "cuLaunchHostFunc"):
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
        torch.cuda.init()
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


class HostFunctionStream:
    """A side stream that runs host functions forked from, and joined back into, the current stream."""

    def __init__(self, device: torch.device):
        self._cu = _driver()
        self.stream = torch.cuda.Stream(device=device)

    def fork(self, function_address: int, argument: int) -> None:
        """After the current stream's work so far, run ``function(argument)`` on the side stream."""
        self.stream.wait_stream(torch.cuda.current_stream())
        handle = ctypes.c_void_p(self.stream.cuda_stream)
        rc = self._cu.cuLaunchHostFunc(handle, ctypes.c_void_p(function_address), ctypes.c_void_p(argument))
        if rc != 0:
            self.join()  # no fork may outlive the step (a capture would end 'unjoined' and hide this error)
            _check(rc, "cuLaunchHostFunc")

    def join(self) -> None:
        """The current stream waits for everything forked so far."""
        torch.cuda.current_stream().wait_stream(self.stream)
