"""Issue 31 point 6, the bookkeeping on CPU: a CUDA-VMM allocation that fails at any driver step gives
back every reservation, handle and mapping it took, and so does a bank whose second parameter's
allocation fails after the first succeeded. A driver that fails on demand cannot be had on a CPU box,
so a fake ``cuda.bindings.driver`` (it records every live object) stands in; the H200 half is
``scripts/gpu_vmm_release_check.py``.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import pytest
import torch

from reap_swap.server_ext.bank import cuda_vmm
from reap_swap.server_ext.bank.bank import ExpertBank
from reap_swap.server_ext.bank.cuda_vmm import VmmBacking, VmmError

GRAN = 2 << 20
STEPS = ("cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "wrap")


class FakeDriver:
    """Live reservations, handles and mappings, with the ``n``-th call of ``fail_at`` failing."""

    CUDA_ERROR_OUT_OF_MEMORY = 2

    def __init__(self) -> None:
        self.reserved: dict[int, int] = {}
        self.handles: set[int] = set()
        self.mapped: dict[int, int] = {}
        self.fail_at: str | None = None
        self.fail_nth = 0
        self._ids = itertools.count(1)
        self._va = itertools.count(1)
        self.CUmemAllocationProp = lambda: types.SimpleNamespace(location=types.SimpleNamespace())
        self.CUmemAccessDesc = lambda: types.SimpleNamespace(location=types.SimpleNamespace())
        self.CUmemAllocationType = types.SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
        self.CUmemLocationType = types.SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1, CU_MEM_LOCATION_TYPE_HOST_NUMA=2,
                                                       CU_MEM_LOCATION_TYPE_HOST=3)
        self.CUmemAccess_flags = types.SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
        self.CUmemAllocationGranularity_flags = types.SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)

    def _fails(self, name: str) -> bool:
        if self.fail_at != name:
            return False
        if self.fail_nth > 0:
            self.fail_nth -= 1
            return False
        self.fail_at = None
        return True

    def cuMemGetAllocationGranularity(self, prop: Any, flag: Any) -> tuple[int, int]:
        return 0, GRAN

    def cuMemAddressReserve(self, size: int, align: int, addr: int, flags: int) -> tuple[int, int]:
        if self._fails("cuMemAddressReserve"):
            return self.CUDA_ERROR_OUT_OF_MEMORY, 0
        ptr = next(self._va) << 40
        self.reserved[ptr] = size
        return 0, ptr

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[int, int]:
        if self._fails("cuMemCreate"):
            return self.CUDA_ERROR_OUT_OF_MEMORY, 0
        h = next(self._ids)
        self.handles.add(h)
        return 0, h

    def cuMemMap(self, addr: int, size: int, offset: int, handle: int, flags: int) -> tuple[int]:
        if self._fails("cuMemMap"):
            return (self.CUDA_ERROR_OUT_OF_MEMORY,)
        assert handle in self.handles and any(p <= addr < p + n for p, n in self.reserved.items())
        self.mapped[addr] = size
        return (0,)

    def cuMemSetAccess(self, addr: int, size: int, desc: list[Any], count: int) -> tuple[int]:
        return (self.CUDA_ERROR_OUT_OF_MEMORY,) if self._fails("cuMemSetAccess") else (0,)

    def cuMemUnmap(self, addr: int, size: int) -> tuple[int]:
        assert self.mapped.pop(addr) == size
        return (0,)

    def cuMemRelease(self, handle: int) -> tuple[int]:
        self.handles.remove(handle)
        return (0,)

    def cuMemAddressFree(self, ptr: int, size: int) -> tuple[int]:
        assert not any(ptr <= a < ptr + size for a in self.mapped), "range freed while still mapped"
        assert self.reserved.pop(ptr) == size
        return (0,)

    def live(self) -> tuple[int, int, int]:
        return len(self.reserved), len(self.handles), len(self.mapped)


@pytest.fixture()
def driver(monkeypatch: pytest.MonkeyPatch) -> FakeDriver:
    fake = FakeDriver()
    monkeypatch.setattr(cuda_vmm, "cu", fake)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)

    def wrap(self: VmmBacking, owner: Any) -> torch.Tensor:  # a CPU tensor of the range's size stands in
        if fake._fails("wrap"):
            raise RuntimeError("wrapping the range failed")
        t = torch.zeros(owner.__cuda_array_interface__["shape"][0], dtype=torch.uint8)
        self.fake_ptrs[t.data_ptr()] = owner.__cuda_array_interface__["data"][0]
        return t

    monkeypatch.setattr(VmmBacking, "_wrap", wrap)
    return fake


def backing() -> VmmBacking:
    b = VmmBacking(torch.device("cuda", 0))
    b.fake_ptrs = {}  # type: ignore[attr-defined]
    return b


def allocate(b: VmmBacking, host_rows: int = 6) -> torch.Tensor:
    layout = b.layout(4, host_rows, [4096], pad=True)
    return b.allocate(layout, layout.row_strides[0], (1024,), torch.float32)


@pytest.mark.parametrize("step,nth", [(s, n) for s in STEPS for n in ((0, 1) if s in ("cuMemCreate", "cuMemMap") else (0,))])
def test_a_failed_allocation_releases_everything_it_took(driver: FakeDriver, step: str, nth: int) -> None:
    b = backing()
    driver.fail_at, driver.fail_nth = step, nth
    with pytest.raises((VmmError, RuntimeError)):
        allocate(b)
    assert driver.fail_at is None, "the fault did not fire"
    assert driver.live() == (0, 0, 0), f"left behind after a failure at {step}#{nth}: {driver.live()}"
    assert b.allocations == [] and b._host_ranges == [] and not [k for k in b._keep if isinstance(k, cuda_vmm._CudaArray)]
    allocate(b)  # the next allocation works and is kept
    assert driver.live() == (1, 2, 2) and len(b.allocations) == 1


def test_a_bank_whose_second_parameter_fails_frees_the_first(driver: FakeDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    b = backing()
    monkeypatch.setattr(VmmBacking, "free", lambda self, rows: VmmBacking._free_at(self, self.fake_ptrs[rows.data_ptr()]))
    params = {"w13_weight": torch.nn.Parameter(torch.randn(10, 8, 4), requires_grad=False),
              "w2_weight": torch.nn.Parameter(torch.randn(10, 4, 4), requires_grad=False)}
    before = {k: v.data.clone() for k, v in params.items()}
    driver.fail_at, driver.fail_nth = "cuMemCreate", 2  # the second parameter's slot region
    with pytest.raises(VmmError):
        ExpertBank(0, params, torch.zeros(10, dtype=torch.int32), 4, b)
    assert driver.live() == (0, 0, 0) and b.allocations == []
    assert all(torch.equal(params[k].data, v) for k, v in before.items())  # the loaded weights are untouched


def test_free_of_an_unknown_range_is_refused(driver: FakeDriver) -> None:
    b = backing()
    allocate(b)
    with pytest.raises(VmmError, match="no VMM allocation"):
        b._free_at(12345)
    assert driver.live() == (1, 2, 2)
