"""H200 check: do the host link and the CPU expert kernel share one memory bus? (issue 16, no vLLM)

The CPU expert path assumes two pipes behind a miss: the GPU reading host rows over the link and
the CPU reading them from its own DRAM. Both read the same host DRAM, so their sum may be capped
by the memory controllers rather than add up. Measured here, each over ~1 s:

* ``cpu_alone``: the native CPU step at batch 1 (``n`` distinct experts per call, cycling over a
  bank far larger than the LLC), weight GB/s, per call size n = 1, 2, 4, 8;
* ``link_alone``: a GPU kernel reading mapped pinned host rows (what a missed expert costs);
* ``copy_alone``: the copy engine (H2D ``copy_`` from pinned memory);
* ``cpu_with_link`` / ``cpu_with_copy``: both at once, each side's own rate and their sum.

Usage: python scripts/gpu_host_bus_check.py OUT.json   (REAP_CPU_EXPERT_CPUS picks the cores)
"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from reap_swap.server_ext.cpu_experts.bench_cpu_kernel import memcpy_rates
from reap_swap.server_ext.cpu_experts.cuda_host import MappedStaging
from reap_swap.server_ext.cpu_experts.kernel import CpuThreads
from reap_swap.server_ext.cpu_experts.step import BankRows, CpuStep

E, H, I = 96, 2048, 768
WINDOW_S = 1.0


def cpu_loop(step: CpuStep, n: int, seconds: float, out: dict) -> None:
    """Calls of n distinct experts each, cycling through the bank, for ``seconds``."""
    x = torch.randn(1, H).to(torch.bfloat16)
    w = torch.ones(1, n)
    mask = torch.ones(1, n, dtype=torch.bool)
    before = step.stats()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        ids = ((torch.arange(n) + calls * n) % E).to(torch.int32).view(1, n)
        step.stage(x, ids, w, mask)
        step.run(1)
        calls += 1
    el = time.perf_counter() - start
    st = {k: v - before[k] for k, v in step.stats().items()}
    out.update(calls=calls, seconds=el, GBps=calls * n * step.bank.expert_bytes / el / 1e9, us_per_call=el / calls * 1e6,
               team_us_per_call=st["ns"] / 1e3 / max(1, st["steps_with_work"]), team_GBps=st["bytes"] / max(1, st["ns"]))


def gpu_read_loop(dev_rows: torch.Tensor, seconds: float, stream: torch.cuda.Stream, kind: str, out: dict) -> None:
    """Reads of one expert row after another over the link (kernel) or by the copy engine, for ``seconds``."""
    dst = torch.empty_like(dev_rows[0], device="cuda") if kind == "copy" else None
    per = dev_rows[0].numel() * dev_rows.element_size()
    with torch.cuda.stream(stream):
        sink = torch.zeros((), device="cuda")
        start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n, t0 = 0, time.perf_counter()
        start_ev.record()
        while time.perf_counter() - t0 < seconds:
            for _ in range(16):
                row = dev_rows[n % dev_rows.shape[0]]
                if dst is None:
                    sink += row.sum(dtype=torch.float32)
                else:
                    dst.copy_(row, non_blocking=True)
                n += 1
            stream.synchronize()
        end_ev.record()
        end_ev.synchronize()
    s = start_ev.elapsed_time(end_ev) / 1e3
    out.update(rows=n, seconds=s, GBps=n * per / s / 1e9)


def main(out_path: str) -> int:
    dev = torch.device("cuda", 0)
    staging = MappedStaging(dev)
    w13_h, w13_d = staging.alloc((E, 2 * I, H), torch.bfloat16)
    w2_h, w2_d = staging.alloc((E, H, I), torch.bfloat16)
    w13_d.normal_(0, H ** -0.5)
    w2_d.normal_(0, I ** -0.5)
    torch.cuda.synchronize()
    bank = BankRows(w13_h, w2_h, 0, E)
    threads = CpuThreads.from_env()
    steps = {n: CpuStep(bank, 1, n, threads) for n in (1, 2, 4, 8)}
    res: dict = {"threads": {"n": threads.n, "cpus": list(threads.cpus)}, "expert_MB": bank.expert_bytes / 1e6, "bank_GB": E * bank.expert_bytes / 1e9}

    def on_thread(fn, *args) -> threading.Thread:
        th = threading.Thread(target=fn, args=args)
        th.start()
        return th

    cpu_alone = {}
    for n, step in steps.items():
        r: dict = {}
        on_thread(cpu_loop, step, n, 0.2, {}).join()  # warm-up
        on_thread(cpu_loop, step, n, WINDOW_S, r).join()
        cpu_alone[f"n{n}"] = r
    res["cpu_alone"] = cpu_alone
    stream = torch.cuda.Stream()
    rows = w13_d.view(E, -1)
    for kind in ("link", "copy"):
        gpu_read_loop(rows, 0.2, stream, kind, {})
        alone: dict = {}
        gpu_read_loop(rows, WINDOW_S, stream, kind, alone)
        res[f"{kind}_alone"] = alone
        for n in (4, 8):
            c: dict = {}
            g: dict = {}
            th = on_thread(cpu_loop, steps[n], n, WINDOW_S, c)
            gpu_read_loop(rows, WINDOW_S, stream, kind, g)
            th.join()
            res[f"cpu_n{n}_with_{kind}"] = {"cpu_GBps": c["GBps"], f"{kind}_GBps": g["GBps"], "sum_GBps": c["GBps"] + g["GBps"],
                                            "cpu_us_per_call": c["us_per_call"], "team_us_per_call": c["team_us_per_call"],
                                            "team_GBps": c["team_GBps"]}
    res["host_memcpy"] = {k: v["GBps"] for k, v in memcpy_rates(1024, 3).items()}
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
