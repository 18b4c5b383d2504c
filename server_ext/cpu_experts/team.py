"""The process's CPU expert team: pinned native threads that take layer steps from one mailbox.

Why a team and a mailbox instead of a host callback: a CUDA host function first wakes the driver's
callback thread, which then forks an OpenMP team; on the H200 host (a KVM guest) that cost
~0.1-0.2 ms per layer step against ~0.09 ms per expert computed. Here the team's threads are
already spinning when the device's split kernel posts a step (a store into pinned host memory),
and the device's merge kernel polls for the team's ``done`` -- no driver call, no stream fork,
graph-capturable. ``native_experts.c`` holds the protocol; this module owns the mailbox memory
and the team's lifetime.

One team per process (the native team is a singleton): ``process_team`` returns it, starting or
restarting it when the requested threads or mailbox kind differ (tests do; a server asks once).
"""

from __future__ import annotations

import atexit
import ctypes
import os
from typing import Protocol

import torch

from .cores import CoreClaim
from .kernel import CpuThreads, native_error, native_library

ENV_SPIN_US = "REAP_CPU_EXPERT_SPIN_US"
MAILBOX_WORDS = 16 + 64  # int64 words of reap_mailbox: seq, pad, done, pad, ring[64]
WAIT_POLLS = 1 << 24  # the merge's polls of ``done`` (each a round trip to host memory, ~1 us; ~17 s on the H200) before it recomputes on the device
_SEQ, _DONE = 0, 8


class Staging(Protocol):
    """Host-readable buffers that device ops can write: (host view, device view) of one allocation."""

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


class PlainStaging:
    """CPU device: host and device views are the same tensor."""

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.zeros(shape, dtype=dtype)
        return t, t


class TeamError(RuntimeError):
    pass


class CpuTeam:
    """A running native team bound to one mailbox (host view for the host, device view for kernels)."""

    def __init__(self, threads: CpuThreads, staging: Staging, spin_us: int):
        self.running = False
        lib = native_library()
        if lib is None:
            raise TeamError(f"the CPU expert path needs the native kernel, which did not build: {native_error()}")
        if int(lib.reap_mailbox_size()) != MAILBOX_WORDS * 8:
            raise TeamError(f"native mailbox is {lib.reap_mailbox_size()} bytes, the Python layout {MAILBOX_WORDS * 8}")
        self.lib = lib
        self.threads = threads
        self.spin_us = spin_us
        self.staging_kind = type(staging).__name__
        self.mailbox_host, self.mailbox = staging.alloc((MAILBOX_WORDS,), torch.int64)
        # pinned cores are claimed across processes first: another rank's team on them is refused (cores.py)
        self.claim = CoreClaim(threads.cpus, f"CPU expert team of {threads.n} threads")
        cpus = (ctypes.c_int * max(1, len(threads.cpus)))(*threads.cpus)
        rc = lib.reap_team_start(self.mailbox_host.data_ptr(), cpus, len(threads.cpus), threads.n, spin_us)
        if rc != 0:
            self.claim.release()
            why = {-1: "bad arguments", -2: "another team is running", -3: "a thread could not start", 1: "already running"}.get(rc, rc)
            raise TeamError(f"cannot start the CPU expert team ({threads.n} threads on cores {list(threads.cpus) or 'any'}): {why}")
        self.running = True
        # the last posted seq, kept on the device: the split posts seq + 1 without reading host memory
        # (a PCIe round trip on the critical path of every layer step); host posts below keep it current
        self.posted_on_device = torch.full((1,), self.posted, dtype=torch.int64, device=self.mailbox.device)
        # the latest step a merge gave up waiting for (split_triton): merges behind it recompute at once
        self.stalled_on_device = torch.zeros(1, dtype=torch.int64, device=self.mailbox.device)

    def run(self, job_address: int, timeout_s: float = 60.0) -> None:
        """Post one job from the host and wait for it (no device step may be in flight)."""
        if not self.running:
            raise TeamError("the CPU expert team was stopped (another team replaced it)")
        self._sync_device()  # a queued device post would reuse the seq this host post takes
        rc = self.lib.reap_team_run(self.mailbox_host.data_ptr(), job_address, int(timeout_s * 1000))
        if rc == -1:
            raise TeamError("the CPU expert team is not running on this mailbox")
        self.posted_on_device.fill_(self.posted)  # posted even if it timed out
        self._sync_device()
        if rc == -2:
            raise TeamError(f"the CPU expert team did not finish a step within {timeout_s} s")

    def _sync_device(self) -> None:
        if self.posted_on_device.device.type == "cuda":
            torch.cuda.synchronize(self.posted_on_device.device)

    def seq_in_step(self) -> bool:
        """The device's copy of the last posted seq equals the mailbox's (call with no device step in
        flight). A stale copy would post a finished seq again and merge old outputs."""
        self._sync_device()
        return int(self.posted_on_device) == self.posted

    @property
    def posted(self) -> int:
        return int(self.mailbox_host[_SEQ])

    @property
    def done(self) -> int:
        return int(self.mailbox_host[_DONE])

    def stop(self) -> None:
        """Finish posted steps and join the threads; the mailbox may be freed only after this."""
        if self.running:
            self.lib.reap_team_stop()
            self.running = False
            self.claim.release()

    def __del__(self) -> None:  # the threads read the mailbox: never free it under them
        self.stop()


_TEAM: dict[str, CpuTeam] = {}  # registry: the process's one team


def spin_us_from_env() -> int:
    raw = os.environ.get(ENV_SPIN_US, "20000")
    try:
        value = int(raw)
    except ValueError:
        raise TeamError(f"{ENV_SPIN_US}={raw!r} is not an integer number of microseconds") from None
    if value < 0:
        raise TeamError(f"{ENV_SPIN_US}={raw!r} must be >= 0")
    return value


def process_team(threads: CpuThreads, staging: Staging) -> CpuTeam:
    """The running team if it has these threads and mailbox kind; else (re)started with them."""
    spin_us = spin_us_from_env()
    team = _TEAM.get("team")
    if team is not None and team.running and (team.threads, team.staging_kind, team.spin_us) == (threads, type(staging).__name__, spin_us):
        return team
    if team is not None:
        team.stop()
    team = CpuTeam(threads, staging, spin_us)
    _TEAM["team"] = team
    return team


@atexit.register
def _stop_process_team() -> None:
    """Before interpreter teardown frees the mailbox tensor, or a spinning thread reads freed memory
    (CI's pytest process crashed at exit this way after all tests passed)."""
    team = _TEAM.pop("team", None)
    if team is not None:
        team.stop()
