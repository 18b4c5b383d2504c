"""The worker's ``reap_cpu_path_stats`` RPC: the read and the reset bench-gpu calls between timed passes."""

from __future__ import annotations

from types import SimpleNamespace

from reap_swap.server_ext.cpu_experts.rates import CpuRateCheck, CpuRateTracker, TeamCounts
from reap_swap.server_ext.worker_ext import ReapWorkerExtension


class CountingPath:
    """What the RPC reads of a layer's CPU path when it resets: the reset itself (summaries need the real path)."""

    def __init__(self) -> None:
        self.resets = 0

    def reset_stats(self) -> None:
        self.resets += 1


def test_reset_clears_every_layers_counters(monkeypatch) -> None:
    # On 2026-12-06 the reset named an undefined variable: every CPU-path arm of bench-gpu died at its first reset.
    import reap_swap.server_ext.worker_ext as we

    paths = {0: CountingPath(), 3: CountingPath()}
    seen: list[list[object]] = []
    monkeypatch.setattr(we, "cpu_path_summary", lambda ps: seen.append(list(ps)) or {"enabled": True, "device_seq_in_step": True})
    ext = object.__new__(ReapWorkerExtension)
    rates = CpuRateCheck(list(paths.values()), CpuRateTracker(window_jobs=8))
    rates.tracker.observe(TeamCounts(100, 10**6, 10**8))  # a window under way
    ext.reap_runtime = SimpleNamespace(cpu_paths=paths, cpu_rates=rates)
    assert ext.reap_cpu_path_stats(reset=False)["enabled"] is True and all(p.resets == 0 for p in paths.values())
    assert rates.tracker.observe(TeamCounts(104, 2 * 10**6, 2 * 10**8)) is None  # still the same window: 4 of its 8 jobs
    ext.reap_cpu_path_stats(reset=True)
    assert all(p.resets == 1 for p in paths.values()) and seen[-1] == list(paths.values())
    # the reset restarted the re-rating's window: counts after it never complete a window begun before it
    assert rates.tracker.observe(TeamCounts(106, 3 * 10**6, 3 * 10**8)) is None and rates.tracker.observe(TeamCounts(113, 4 * 10**6, 4 * 10**8)) is None
    ext.reap_runtime = SimpleNamespace(cpu_paths=paths, cpu_rates=None)  # a rate the user set: nothing to restart
    ext.reap_cpu_path_stats(reset=True)
