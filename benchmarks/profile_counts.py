"""Per-step counts of host synchronizations and launches from a torch.profiler trace (pure), and
``profiled_kernel_times``, which takes such a trace of a replayed CUDA graph (imports torch lazily).

Names are the CUDA runtime / driver API calls the profiler records on the CPU side.
"""

from __future__ import annotations

from typing import Callable, Iterable

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize", "cuCtxSynchronize")
# A plain cudaMemcpy (not ...Async) blocks the host until the copy is done.
BLOCKING_COPIES = ("cudaMemcpy", "cudaMemcpy2D", "cudaMemset")
# Decode tokens a profiled request may take past the window: the warm-up steps, and at batch 32 the
# steps its batch's chunked prefill staggers the requests by (none may finish inside the window).
PROFILE_MARGIN = 32
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def per_step_counts(events: Iterable[tuple[str, int]], steps: int) -> dict[str, float]:
    """``events``: (name, count) pairs from ``prof.key_averages()``; returns counts per step."""
    totals = {"syncs": 0, "blocking_copies": 0, "launches": 0, "graph_launches": 0}
    by_name: dict[str, int] = {}
    for name, count in events:
        if name in SYNC_CALLS:
            totals["syncs"] += count
            by_name[name] = by_name.get(name, 0) + count
        elif name in BLOCKING_COPIES:
            totals["blocking_copies"] += count
            by_name[name] = by_name.get(name, 0) + count
        elif name in LAUNCHES:
            totals["launches"] += count
            if name == "cudaGraphLaunch":
                totals["graph_launches"] += count
    out: dict[str, float] = {k: v / steps for k, v in totals.items()}
    out.update({f"{k}_per_step": v / steps for k, v in sorted(by_name.items())})
    return out


def kernel_times(events: Iterable[tuple[str, int, float]], names: Iterable[str], steps: int) -> dict[str, dict[str, float]]:
    """``events``: (name, count, device microseconds) from ``prof.key_averages()``; the kernels whose
    name contains one of ``names``, with launches and device time per step."""
    wanted = tuple(names)
    return {name: {"count_per_step": count / steps, "device_us_per_step": device_us / steps}
            for name, count, device_us in events if any(k in name for k in wanted)}


def profiled_kernel_times(replay: Callable[[], None], replays: int, names: Iterable[str], steps_per_replay: int) -> dict[str, dict[str, float]]:
    """``kernel_times`` of ``replays`` calls of ``replay`` (a CUDA graph's), per step of ``steps_per_replay``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    events = ((e.key, int(e.count), float(e.device_time_total)) for e in prof.key_averages())
    return kernel_times(events, names, replays * steps_per_replay)
