"""H200 check of issue 31 point 6 (no vLLM): a CUDA-VMM allocation that fails part-way gives back its
address reservation, its handles and its mappings, so the RAM-complement -> full-copy fallback (and
any retry) does not leak device memory or address space.

The real driver is wrapped by a counting proxy (every reserve/create/map and their inverses, with
their return codes); failures are caused for real where the driver produces them (an absurd host
region: ``cuMemCreate`` of the host part fails after the reserve and the device part's create + map)
and injected where it will not on demand (a failing ``cuMemMap`` / ``cuMemSetAccess``, a bank whose
second parameter fails). Each case runs ``--iters`` times; per case the device's free memory
(``cuMemGetInfo``) before and after, and the live driver objects, must be back where they started.
With ``--absurd-tib`` large enough, a leaked reservation per iteration exhausts the virtual address
space, which shows as the failure moving from ``cuMemCreate`` to ``cuMemAddressReserve``.
Uses only ``VmmBacking.allocate`` / ``ExpertBank`` so it also runs (and shows the leak) on code from
before the fix.

Usage: python scripts/gpu_vmm_release_check.py OUT.json [--iters 40] [--slot-gib 1] [--absurd-tib 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

import torch

from reap_swap.server_ext.bank import cuda_vmm
from reap_swap.server_ext.bank.bank import ExpertBank
from reap_swap.server_ext.bank.bank_layout import BankLayout
from reap_swap.server_ext.bank.cuda_vmm import VmmBacking

COUNTED = {"cuMemAddressReserve": "reserved", "cuMemAddressFree": "freed", "cuMemCreate": "created", "cuMemRelease": "released",
           "cuMemMap": "mapped", "cuMemUnmap": "unmapped"}


class CountingDriver:
    """The real ``cuda.bindings.driver`` with successful calls counted and chosen calls failed."""

    def __init__(self, real: Any):
        self._real = real
        self.counts = {v: 0 for v in COUNTED.values()}
        self.fail: dict[str, int] = {}  # name -> calls to let through before failing one
        self.failed: list[str] = []
        self.errors: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._real, name)
        if name not in COUNTED and name != "cuMemSetAccess":
            return attr

        def call(*args: Any) -> Any:
            if name in self.fail:
                if self.fail[name] == 0:
                    del self.fail[name]
                    self.failed.append(f"{name} (injected)")
                    return (self._real.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None) if name in ("cuMemCreate",) else \
                        (self._real.CUresult.CUDA_ERROR_OUT_OF_MEMORY,)
                self.fail[name] -= 1
            out = attr(*args)
            err = out[0] if isinstance(out, tuple) else out
            if int(err) == 0:
                if name in COUNTED:
                    self.counts[COUNTED[name]] += 1
            else:
                self.failed.append(f"{name}: {err}")
            return out

        return call

    def live(self) -> dict[str, int]:
        c = self.counts
        return {"reservations": c["reserved"] - c["freed"], "handles": c["created"] - c["released"], "mappings": c["mapped"] - c["unmapped"]}


def free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def layout(backing: VmmBacking, slot_bytes: int, host_bytes: int) -> tuple[BankLayout, int]:
    """One parameter, one page per row: ``slot_bytes`` of slot rows, ``host_bytes`` of host rows (built
    directly: the kernel's row limit, which ``VmmBacking.layout`` enforces, is not what is tested here)."""
    g = backing.granularity
    slots, host = max(1, slot_bytes // g), max(1, host_bytes // g)
    return BankLayout(slots, (g,), slots + host), g


def run_case(drv: CountingDriver, backing: VmmBacking, name: str, iters: int, attempt: Any, expect: str) -> dict[str, Any]:
    # one attempt before the baseline: the first use of a kernel loads its CUDA module (lazy loading
    # takes device memory once), which is not a leak; a leak grows with the iterations after it
    try:
        attempt()
    except Exception:  # noqa: BLE001 - the warm-up fails like the rest; only the baseline matters here
        pass
    drv.failed.clear()
    before_free, before_live = free_bytes(), drv.live()
    failures: dict[str, int] = {}
    unexpected: list[str] = []
    for _ in range(iters):
        drv.failed.clear()
        try:
            attempt()
            unexpected.append("allocation succeeded")
        except Exception as exc:  # noqa: BLE001 - the failure is the point; which call failed is recorded
            key = drv.failed[0] if drv.failed else f"{type(exc).__name__}: {str(exc)[:120]}"
            failures[key] = failures.get(key, 0) + 1
    after_free, after_live = free_bytes(), drv.live()
    leak = before_free - after_free
    # every iteration must fail at the same, intended call: a leaked reservation would move the
    # absurd case's failure to cuMemAddressReserve once the address space is used up
    ok = after_live == before_live and leak < 64 << 20 and len(failures) == 1 and next(iter(failures)).startswith(expect) and not unexpected
    return {"case": name, "iters": iters, "expected_failure": expect, "failed_at": failures, "unexpected": unexpected[:3],
            "free_bytes_before": before_free, "free_bytes_after": after_free, "device_bytes_leaked": leak,
            "live_before": before_live, "live_after": after_live, "ok": ok}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--slot-gib", type=float, default=1.0, help="device part of each failing allocation")
    ap.add_argument("--absurd-tib", type=float, default=16.0, help="host part that cuMemCreate must refuse")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.init()
    drv = CountingDriver(cuda_vmm.cu)
    cuda_vmm.cu = drv
    backing = VmmBacking(dev)
    slot = int(a.slot_gib * 2**30)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "granularity": backing.granularity,
                           "module": cuda_vmm.__file__, "cases": []}

    def alloc(host_bytes: int, slot_bytes: int = slot) -> None:
        lay, g = layout(backing, slot_bytes, host_bytes)
        backing.allocate(lay, g, (g // 2,), torch.bfloat16)

    def injected(fn_name: str, after: int, host_bytes: int = 64 << 20) -> Any:
        def attempt() -> None:
            drv.fail[fn_name] = after
            try:
                alloc(host_bytes)
            finally:
                drv.fail.pop(fn_name, None)
        return attempt

    def bank_second_param_fails() -> None:
        g = backing.granularity
        params = {"w13_weight": torch.nn.Parameter(torch.zeros(16, g // 2, dtype=torch.bfloat16, device=dev), requires_grad=False),
                  "w2_weight": torch.nn.Parameter(torch.zeros(16, g // 2, dtype=torch.bfloat16, device=dev), requires_grad=False)}
        drv.fail["cuMemCreate"] = 2  # the second parameter's slot region
        try:
            ExpertBank(0, params, torch.zeros(16, dtype=torch.int32, device=dev), 8, backing)
        finally:
            drv.fail.pop("cuMemCreate", None)
            del params
            torch.cuda.empty_cache()

    cases = [
        ("absurd host region: cuMemCreate (host) fails after reserve + device create + map",
         lambda: alloc(int(a.absurd_tib * 2**40)), "cuMemCreate: "),
        ("injected: cuMemMap of the host part fails", injected("cuMemMap", 1), "cuMemMap (injected)"),
        ("injected: cuMemMap of the device part fails", injected("cuMemMap", 0), "cuMemMap (injected)"),
        ("injected: cuMemSetAccess fails after both parts are mapped", injected("cuMemSetAccess", 0), "cuMemSetAccess (injected)"),
        ("bank: the second parameter's allocation fails after the first succeeded", bank_second_param_fails, "cuMemCreate (injected)"),
    ]
    torch.cuda.empty_cache()
    for name, attempt, expect in cases:
        try:
            out["cases"].append(run_case(drv, backing, name, a.iters, attempt, expect))
        except Exception:  # noqa: BLE001 - record and go on
            out["cases"].append({"case": name, "ok": False, "error": traceback.format_exc()[-2000:]})
        print(json.dumps(out["cases"][-1]), flush=True)
    # a good allocation still works and stays (the fix must not release live ranges)
    live0 = drv.live()
    lay, g = layout(backing, slot, 64 << 20)
    t = backing.allocate(lay, g, (g // 2,), torch.bfloat16)
    t.fill_(1)
    torch.cuda.synchronize()
    out["good_allocation"] = {"live_delta": {k: v - live0[k] for k, v in drv.live().items()}, "sum_ok": bool(t[0].float().sum() == g // 2)}
    out["ok"] = all(c.get("ok") for c in out["cases"]) and out["good_allocation"]["sum_ok"]
    print(json.dumps({"ok": out["ok"]}))
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    sys.exit(0 if out["ok"] else 1)


if __name__ == "__main__":
    main()
