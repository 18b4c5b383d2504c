"""The two pipes' rates the CPU split decides by: probed at load, and the CPU's re-derived while serving.

Probes (``measure_link_GBps``, ``measure_cpu_GBps``): once per device, by the first layer with the CPU path.

Re-rating (``CpuRateTracker``: pure logic; ``rerate``): the split gives each pipe its share by the cost
model's rates, and the CPU's came from a short probe at load. On an H100 host that probe once read 28.7 GB/s
while the same run's static + CPU arm probed 92.1, and the fast arm's team then computed its jobs at
77.8 GB/s (``bench_gpu_fast_v1_beside_v2_h100.json``, 2026-12-07). The split gave the CPU 31 % of the missed
experts instead of about 69 %, the link carried and promoted the rest, and the fast mode ran 25 % slower
than static + CPU.

The team counts, per job, its busy nanoseconds, the bytes it read, and the experts and (token, expert)
pairs it computed (``CpuStep.stats``). The cost model says a job costs ``fixed + experts * per_expert +
pairs * per_pair + bytes / rate``; over a window of jobs that model, inverted, gives the rate the split
should use. A window whose rate differs from the cost model's by more than ``tolerance`` re-rates every
layer (``LayerCpuPath.set_cpu_GBps``: one float64 in the split's cost tensor, graph-safe). A rate the
user set is never re-rated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping

import torch

if TYPE_CHECKING:
    from .cpu_path import LayerCpuPath

_NS = 1e-9

RATE_CHECK_STEPS = 64
"""Steps between two reads of the team's counters (a read sums a few ctypes fields per layer)."""


@dataclass(frozen=True)
class TeamCounts:
    """The team's counters summed over layers (monotonic between resets)."""

    calls: int
    ns: int
    bytes: int
    experts: int
    pairs: int

    @classmethod
    def total(cls, stats: Iterable[Mapping[str, int]]) -> "TeamCounts":
        s = list(stats)
        return cls(*(sum(int(x[k]) for x in s) for k in ("calls", "ns", "bytes", "experts", "pairs")))

    def minus(self, base: "TeamCounts") -> "TeamCounts":
        return TeamCounts(self.calls - base.calls, self.ns - base.ns, self.bytes - base.bytes, self.experts - base.experts,
                          self.pairs - base.pairs)


@dataclass
class CpuRateTracker:
    """Windows of the team's jobs -> the CPU's weight GB/s under the cost model's overheads."""

    fixed_s: float
    per_expert_s: float = 0.0
    per_pair_s: float = 0.0
    window_jobs: int = 4096
    """Jobs per estimate (24 layers with CPU work every step: about 170 decode steps)."""
    tolerance: float = 0.15
    """Relative difference from the current rate below which the cost model is left as it is."""
    _base: TeamCounts | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.window_jobs < 1 or self.tolerance < 0 or min(self.fixed_s, self.per_expert_s, self.per_pair_s) < 0:
            raise ValueError(f"rate tracker: window_jobs >= 1, tolerance >= 0 and overheads >= 0, got {self}")

    def observe(self, now: TeamCounts) -> float | None:
        """The rate (GB/s) of the window that ``now`` completes, or None while it holds fewer than
        ``window_jobs`` jobs. Counters that went back (``reset_stats``) start a new window."""
        base = self._base
        if base is None or now.calls < base.calls or now.ns < base.ns or now.bytes < base.bytes:
            self._base = now
            return None
        d = now.minus(base)
        if d.calls < self.window_jobs:
            return None
        self._base = now
        busy_ns = d.ns - (d.calls * self.fixed_s + d.experts * self.per_expert_s + d.pairs * self.per_pair_s) / _NS
        if busy_ns <= 0 or d.bytes <= 0:
            return None  # overheads as large as the work: the window says nothing about the rate
        return d.bytes / busy_ns  # bytes per ns = GB/s

    def new_rate(self, current_GBps: float, now: TeamCounts) -> float | None:
        """The rate the cost model should take, when a completed window differs from ``current_GBps`` by more than
        ``tolerance``; else None."""
        rate = self.observe(now)
        if rate is None or abs(rate / current_GBps - 1.0) <= self.tolerance:
            return None
        return rate


def measure_cpu_GBps(path: LayerCpuPath, repeats: int = 8, min_s: float = 0.05, max_repeats: int = 256) -> float:
    """Weight GB/s of the CPU step at batch 1 on this layer's own host rows, posted from the host: the best of at
    least ``repeats`` timed jobs that together span at least ``min_s`` seconds (at most ``max_repeats``).

    Each job computes ``top_k`` experts not read by the previous one, so the rate is DRAM's, not the
    last-level cache's. Why a time window: three jobs (about 2.5 ms) once all fell in a stall at load and read
    28.7 GB/s on a host whose team ran at 78-101 GB/s (``rates.py``); a stall must now outlast the whole
    window to bias the best job. The serving-time re-rating in ``rates.py`` corrects what is left.
    """
    if repeats < 1 or max_repeats < repeats:
        raise ValueError(f"the CPU probe needs 1 <= repeats <= max_repeats, got {repeats}, {max_repeats}")
    job, e = path.step_job, path.bank.num_experts
    k = min(path.top_k, e)
    device = job.ids.device
    x = torch.zeros(1, path.bank.hidden, dtype=torch.bfloat16, device=device)
    times: list[float] = []
    r = 0
    while r <= repeats or (sum(times) < min_s and r <= max_repeats):  # job 0 warms the team and is not timed
        ids = ((torch.arange(k) + r * k) % e).to(torch.int32).view(1, k).to(device)
        job.stage(x, ids, torch.ones(1, k, device=device), torch.ones(1, k, dtype=torch.bool, device=device))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        t = time.perf_counter()
        job.run(1)
        if r:
            times.append(time.perf_counter() - t)
        r += 1
    job.reset_stats()
    return k * path.bank.expert_bytes / min(times) / 1e9


def measure_link_GBps(host_rows: torch.Tensor, repeats: int = 3) -> float:
    """A device kernel reading host rows over the link (what a miss costs), best of N."""
    rows = host_rows[: min(8, host_rows.shape[0])]
    if rows.element_size() == 1:  # FP8 rows: read them as bf16 pairs (the sum's value is never used, only its bytes)
        rows = rows.view(torch.bfloat16) if rows.shape[-1] % 2 == 0 else rows.view(torch.uint8)
    rows.sum(dtype=torch.float32)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        rows.sum(dtype=torch.float32)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return rows.numel() * rows.element_size() / best / 1e9


def rerate(paths: "list[LayerCpuPath]", tracker: CpuRateTracker) -> float | None:
    """One check between steps: the team's counters over every layer; a new rate goes to every layer's split.
    Host-side reads only (the team's ctypes counters), no device sync."""
    now = TeamCounts.total(p.step_job.stats() for p in paths)
    rate = tracker.new_rate(paths[0].cost.cpu_GBps, now)
    if rate is not None:
        for p in paths:
            p.set_cpu_GBps(rate)
    return rate


def tracker_for(path: "LayerCpuPath") -> CpuRateTracker | None:
    """The worker's tracker, under the cost model's overheads; None when the user set the CPU's rate."""
    if path.settings.cpu_GBps is not None:
        return None
    c = path.cost
    return CpuRateTracker(c.cpu_fixed_s, c.cpu_per_expert_s, c.cpu_per_pair_s)
