"""The two pipes' rates the CPU split decides by: probed at load, and the CPU's re-derived while serving.

Probes (``measure_link_GBps``, ``measure_cpu_GBps``): once per device, by the first layer with the CPU path.

Re-rating (``CpuRateTracker``: pure logic; ``CpuRateCheck``: the worker's hook): the split gives each
pipe its share by the cost model's rates, and the CPU's came from a short probe at load. On an H100 host that
probe once read 28.7 GB/s while the same run's static + CPU arm probed 92.1, and the fast arm's team then
computed its jobs at 77.8 GB/s (``bench_gpu_fast_v1_beside_v2_h100.json``, 2026-12-07). The split gave the
CPU 31 % of the missed experts instead of about 69 %, the link carried and promoted the rest, and the fast
mode ran 25 % slower than static + CPU.

The team counts, over the jobs it had work in, its busy nanoseconds and the bytes it read (``CpuStep.stats``;
the busy time runs from thread 0's pickup to the last thread's finish). Bytes over busy time is the rate it
achieved, its per-job grouping and tail included. So on the one- or two-expert jobs of batch 1 it reads below
a probe of eight-expert jobs: 76.8-90.9 against that host's probe of 92.1 (at batch 8 static + CPU's team
reached 94.3, above it). A window of jobs whose achieved rate differs from the cost model's by more than
``tolerance`` (30 %: a misread, not that difference) re-rates every layer (``LayerCpuPath.set_cpu_GBps``:
one float64 in the split's cost tensor, graph-safe). A rate the user set is never re-rated. Not subtracted:
the cost model's fixed cost per job, which is mostly the post and the merge's poll, outside the busy time.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping

import torch

if TYPE_CHECKING:
    from .cpu_path import LayerCpuPath

logger = logging.getLogger("reap_swap.server_ext")

RATE_CHECK_STEPS = 64
"""Steps between two reads of the team's counters (a read sums a few ctypes fields per layer)."""


@dataclass(frozen=True)
class TeamCounts:
    """The team's counters summed over layers (monotonic between resets): jobs it had work in, busy ns, bytes read."""

    jobs: int
    ns: int
    bytes: int

    @classmethod
    def total(cls, stats: Iterable[Mapping[str, int]]) -> "TeamCounts":
        s = list(stats)
        return cls(*(sum(int(x[k]) for x in s) for k in ("steps_with_work", "ns", "bytes")))


@dataclass
class CpuRateTracker:
    """Windows of the team's jobs -> the CPU's achieved weight GB/s."""

    window_jobs: int = 4096
    """Jobs with work per estimate (24 layers with CPU work every step: about 170 decode steps)."""
    tolerance: float = 0.3
    """Relative difference from the current rate below which the cost model is left as it is."""
    _base: TeamCounts | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.window_jobs < 1 or self.tolerance < 0:
            raise ValueError(f"rate tracker: window_jobs >= 1 and tolerance >= 0, got {self.window_jobs}, {self.tolerance}")

    def restart(self) -> None:
        """The counters were reset (``reset_stats``): the next read starts a new window."""
        self._base = None

    def observe(self, now: TeamCounts) -> float | None:
        """The achieved rate (GB/s) of the window that ``now`` completes, or None while it holds fewer than
        ``window_jobs`` jobs. Counters below the window's start (a reset nobody reported) start a new one."""
        base = self._base
        if base is None or now.jobs < base.jobs or now.ns < base.ns or now.bytes < base.bytes:
            self._base = now
            return None
        jobs, ns, nbytes = now.jobs - base.jobs, now.ns - base.ns, now.bytes - base.bytes
        if jobs < self.window_jobs:
            return None
        self._base = now
        if ns <= 0 or nbytes <= 0:
            return None
        return nbytes / ns  # bytes per ns = GB/s

    def new_rate(self, current_GBps: float, now: TeamCounts) -> float | None:
        """The rate the cost model should take, when a completed window differs from ``current_GBps`` by more than
        ``tolerance``; else None."""
        rate = self.observe(now)
        if rate is None or abs(rate / current_GBps - 1.0) <= self.tolerance:
            return None
        return rate


class CpuRateCheck:
    """The worker's re-rating: every ``RATE_CHECK_STEPS`` steps, the team's counters over every layer, and a
    new rate into every layer's split. Host-side reads only (ctypes counters), no device sync. A failure is
    logged once and turns the re-rating off (the split keeps its rates); ``describe`` says so."""

    def __init__(self, paths: "list[LayerCpuPath]", tracker: CpuRateTracker | None = None):
        self.paths = paths
        self.tracker = tracker or CpuRateTracker()
        self.steps = 0
        self.error: str | None = None

    @classmethod
    def for_paths(cls, paths: "list[LayerCpuPath]") -> "CpuRateCheck | None":
        """None without a CPU path, or when the user set the CPU's rate."""
        if not paths or paths[0].settings.cpu_GBps is not None:
            return None
        return cls(paths)

    def after_step(self) -> float | None:
        """Count a step; on every ``RATE_CHECK_STEPS``-th, the new rate if one was taken."""
        if self.error is not None:
            return None
        self.steps += 1
        if self.steps % RATE_CHECK_STEPS:
            return None
        try:
            return self._check()
        except Exception as exc:  # report-side: never break the step, never leave layers on different rates
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("reap-swap CPU expert path: re-rating the CPU failed; the split keeps its rates and re-rating is off")
            return None

    def _check(self) -> float | None:
        before = self.paths[0].cost.cpu_GBps
        rate = self.tracker.new_rate(before, TeamCounts.total(p.step_job.stats() for p in self.paths))
        if rate is None:
            return None
        try:
            for p in self.paths:
                p.set_cpu_GBps(rate)
        except Exception:
            for p in self.paths:
                if p.cost.cpu_GBps != before:
                    p.set_cpu_GBps(before)
            raise
        logger.info("reap-swap CPU expert path: the team achieved %.1f GB/s over its last window of jobs; the split's CPU "
                    "rate goes from %.1f to %.1f GB/s", rate, before, rate)
        return rate

    def restart(self) -> None:
        self.tracker.restart()

    def describe(self) -> str:
        if self.error is not None:
            return f"off after an error ({self.error}): the split keeps its rates"
        t = self.tracker
        return f"on: every {RATE_CHECK_STEPS} steps, windows of {t.window_jobs} jobs with work, a change past {t.tolerance:.0%}"


def describe(check: CpuRateCheck | None, has_cpu_path: bool) -> str:
    """What ``/reap/status`` and bench-gpu's stats say of the re-rating."""
    if check is not None:
        return check.describe()
    return "off: the user set the CPU's rate" if has_cpu_path else "off: no CPU expert path"


def measure_cpu_GBps(path: LayerCpuPath, repeats: int = 8, min_s: float = 0.05, max_repeats: int = 256) -> float:
    """Weight GB/s of the CPU step at batch 1 on this layer's own host rows, posted from the host: the best of at
    least ``repeats`` timed jobs that together span at least ``min_s`` seconds (at most ``max_repeats``).

    Each job computes ``top_k`` experts not read by the previous one, so the rate is DRAM's, not the
    last-level cache's. Why a time window: three jobs (about 2.5 ms) once read 28.7 GB/s at load on a host whose
    team then achieved 77.8 GB/s (module doc; what slowed them was not diagnosed). Whatever it was must now
    outlast the whole window to bias the best job, and ``CpuRateCheck`` corrects what is left while serving.
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
