"""The CPU pipe's rate: the load-time probe's window, and re-rating the split from the team's own counters
while serving (issue 25: a probe that read 28.7 GB/s against a team at 78-92 made the fast mode 25 % slower)."""

from __future__ import annotations

import pytest
import torch

from reap_swap.server_ext.cpu_experts import cpu_path as cp
from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts import rates
from reap_swap.server_ext.cpu_experts.rates import CpuRateTracker, TeamCounts
from reap_swap.server_ext.cpu_experts.split import CostModel
from reap_swap.server_ext.cpu_experts.step import BankRows

needs_native = pytest.mark.skipif(K.native_library() is None, reason=f"native CPU kernel unavailable: {K.native_error()}")

B = 9_437_184  # bytes of one 30B-A3B expert (bf16)
ZERO = TeamCounts(0, 0, 0, 0, 0)


def _counts(calls: int, experts: int, pairs: int, gbps: float, fixed_s: float, per_expert_s: float = 0.0, per_pair_s: float = 0.0) -> TeamCounts:
    """What a team at ``gbps`` would have counted under the cost model's overheads."""
    nbytes = experts * B
    ns = (calls * fixed_s + experts * per_expert_s + pairs * per_pair_s) * 1e9 + nbytes / gbps
    return TeamCounts(calls, int(ns), nbytes, experts, pairs)


def test_a_window_inverts_the_cost_model() -> None:
    t = CpuRateTracker(fixed_s=25e-6, per_expert_s=2e-6, per_pair_s=1e-6, window_jobs=1000)
    assert t.observe(ZERO) is None  # the first read only sets the window's start
    assert t.observe(_counts(999, 1500, 1600, 90.0, 25e-6, 2e-6, 1e-6)) is None  # not a full window yet
    assert t.observe(_counts(1000, 1500, 1600, 90.0, 25e-6, 2e-6, 1e-6)) == pytest.approx(90.0, rel=1e-6)
    # the next window starts where that one ended: its own jobs only
    later = _counts(1000, 1500, 1600, 90.0, 25e-6, 2e-6, 1e-6)
    more = _counts(1500, 2300, 2500, 40.0, 25e-6, 2e-6, 1e-6)
    both = TeamCounts(*(a + b for a, b in zip((later.calls, later.ns, later.bytes, later.experts, later.pairs),
                                               (more.calls, more.ns, more.bytes, more.experts, more.pairs))))
    assert t.observe(both) == pytest.approx(40.0, rel=1e-6)


def test_achieved_rate_without_the_overheads_would_understate_the_team() -> None:
    """One-expert jobs spend a fifth of their time in the fixed cost: bytes / ns alone reads ~20 % low, and the split,
    which adds the fixed cost again, would then under-use the CPU."""
    c = _counts(4096, 4096, 4096, 90.0, 25e-6)
    assert c.bytes / c.ns < 0.85 * 90.0
    assert CpuRateTracker(25e-6, window_jobs=4096).observe(ZERO) is None
    t = CpuRateTracker(25e-6, window_jobs=4096)
    t.observe(ZERO)
    assert t.observe(c) == pytest.approx(90.0, rel=1e-6)


def test_counters_that_went_back_start_a_new_window() -> None:
    t = CpuRateTracker(fixed_s=0.0, window_jobs=10)
    t.observe(_counts(50, 50, 50, 80.0, 0.0))
    assert t.observe(_counts(5, 5, 5, 80.0, 0.0)) is None  # reset_stats between a bench's phases
    assert t.observe(_counts(14, 14, 14, 80.0, 0.0)) is None  # 9 jobs since the reset
    assert t.observe(_counts(15, 15, 15, 80.0, 0.0)) == pytest.approx(80.0, rel=1e-6)


def test_a_window_of_overheads_only_says_nothing() -> None:
    t = CpuRateTracker(fixed_s=25e-6, window_jobs=10)
    t.observe(ZERO)
    assert t.observe(TeamCounts(10, 100_000, 10 * B, 10, 10)) is None  # 100 us busy for 250 us of fixed cost


def test_new_rate_only_past_the_tolerance() -> None:
    t = CpuRateTracker(fixed_s=0.0, window_jobs=10, tolerance=0.15)
    t.observe(ZERO)
    assert t.new_rate(85.0, _counts(10, 10, 10, 90.0, 0.0)) is None  # 6 % apart: left as it is
    assert t.new_rate(28.7, _counts(20, 20, 20, 90.0, 0.0)) == pytest.approx(90.0, rel=1e-6)
    for bad in ({"window_jobs": 0}, {"tolerance": -0.1}, {"fixed_s": -1.0}):
        with pytest.raises(ValueError, match="rate tracker"):
            CpuRateTracker(**{"fixed_s": 0.0, **bad})


def test_team_counts_total_sums_layers() -> None:
    stats = [{"calls": 2, "ns": 10, "bytes": 5, "experts": 3, "pairs": 4, "status": 0}, {"calls": 1, "ns": 1, "bytes": 1, "experts": 1, "pairs": 1}]
    assert TeamCounts.total(stats) == TeamCounts(3, 11, 6, 4, 5)


def _layer(e: int = 16, h: int = 64, i: int = 32, slots: int = 4) -> tuple[BankRows, int]:
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(slots + e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(slots + e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    w13[:slots] = 0
    w2[:slots] = 0
    return BankRows(w13, w2, slots, e), slots


def _step(path: cp.LayerCpuPath, off: int, seed: int) -> int:
    """One 2-token step whose every pair misses; the CPU pairs the split chose."""
    g = torch.Generator().manual_seed(seed)
    e, k = path.num_experts, path.top_k
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(2)])
    x = torch.randn(2, path.bank.hidden, generator=g).to(torch.bfloat16)
    path.before_experts(x, ids, torch.full((2, k), 1.0 / k), ids + off, off)
    pairs = int(path.pending_pairs.sum())
    path.abandon()
    return pairs


def _path(bank: BankRows, settings: cp.CpuPathSettings) -> cp.LayerCpuPath:
    return cp.LayerCpuPath(bank, 4, 0, settings, settings.cost(0.002, 0.001, top_k=4), K.CpuThreads(2), torch.device("cpu"), fused=False)


@needs_native
def test_rerate_takes_the_teams_rate_into_the_split_in_place() -> None:
    bank, off = _layer()
    assert rates.tracker_for(_path(bank, cp.CpuPathSettings(enabled=True, max_tokens=2))).fixed_s == pytest.approx(25e-6)  # the default's
    # tiny experts' jobs take less than the default fixed cost here: a model without overheads, so the rate is bytes / ns
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2, fixed_us=0.0, pair_us=0.0)
    path = _path(bank, settings)  # a slow link (tiny experts) so that the CPU takes part, and a CPU rate a probe got wrong
    tracker = rates.tracker_for(path)
    assert tracker is not None and tracker.fixed_s == 0.0
    tracker.window_jobs = 8
    before_ptr = path.cost_tensor.data_ptr()
    assert rates.rerate([path], tracker) is None  # the window's start
    slow = sum(_step(path, off, s) for s in range(12))
    assert slow > 0, "the CPU must take some pairs for the team to count anything"
    d = TeamCounts.total([path.step_job.stats()])  # the team's own counts, as rerate reads them
    want = d.bytes / d.ns
    rate = rates.rerate([path], tracker)
    assert rate == pytest.approx(want, rel=1e-9)
    assert path.cost.cpu_GBps == pytest.approx(rate) and path.rate_updates == [pytest.approx(rate)]
    assert path.cost_tensor.data_ptr() == before_ptr  # captured graphs keep reading the same tensor
    assert float(path.cost_tensor[2]) == pytest.approx(bank.expert_bytes / (rate * 1e9))
    assert cp.summarize([path])["rate_updates"] == [pytest.approx(rate)]
    # the split follows the model: a faster CPU never gets fewer of the same steps' pairs
    path.reset_stats()
    assert sum(_step(path, off, s) for s in range(12)) >= slow or rate < 0.001


@needs_native
def test_a_rate_the_user_set_is_never_rerated() -> None:
    bank, _ = _layer()
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2, cpu_GBps=70.0)
    path = cp.LayerCpuPath(bank, 4, 0, settings, settings.cost(50.0, 1.0, top_k=4), K.CpuThreads(1), torch.device("cpu"))
    assert path.cost.cpu_GBps == 70.0 and rates.tracker_for(path) is None
    with pytest.raises(ValueError, match="pipe rates must be positive"):
        path.set_cpu_GBps(0.0)
    assert path.cost.cpu_GBps == 70.0 and path.rate_updates == []


@needs_native
def test_the_cpu_probe_spans_its_window_of_distinct_jobs() -> None:
    bank, _ = _layer(e=32)
    path = cp.LayerCpuPath(bank, 4, 0, cp.CpuPathSettings(enabled=True), CostModel(link_GBps=50, cpu_GBps=50), K.CpuThreads(1),
                           torch.device("cpu"))
    job, seen = path.step_job, []
    run = job.run

    def counted(t: int) -> None:
        seen.append(job.ids[0].clone())
        run(t)

    job.run = counted  # the real job, counted
    assert rates.measure_cpu_GBps(path, repeats=3, min_s=0.02, max_repeats=5000) > 0
    assert len(seen) >= 4  # the untimed warm-up job and at least `repeats` timed ones
    assert not torch.equal(seen[0], seen[1])  # each job reads other experts than the last
    assert path.stats()["calls"] == 0  # the probe leaves no counts behind
    seen.clear()
    rates.measure_cpu_GBps(path, repeats=2, min_s=10.0, max_repeats=6)
    assert len(seen) == 7  # a window too long for max_repeats stops there
    with pytest.raises(ValueError, match="repeats"):
        rates.measure_cpu_GBps(path, repeats=0)


@needs_native
def test_the_worker_rerates_every_rate_check_steps(caplog: pytest.LogCaptureFixture) -> None:
    """``WorkerResidency.check_cpu_rate`` (run after every step): a read every RATE_CHECK_STEPS steps, a new rate
    logged and in every layer's split; none without a CPU path."""
    from types import SimpleNamespace

    from reap_swap.server_ext.worker_ext import WorkerResidency

    bank, off = _layer()
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2, fixed_us=0.0, pair_us=0.0)
    paths = {3: _path(bank, settings), 5: _path(bank, settings)}
    tracker = rates.tracker_for(paths[3])
    assert tracker is not None
    tracker.window_jobs = 4
    worker = SimpleNamespace(cpu_paths=paths, cpu_rates=tracker, steps_since_rate_check=0)  # what the check reads
    checks = []
    for step in range(2 * rates.RATE_CHECK_STEPS):
        for p in paths.values():
            _step(p, off, step)
        with caplog.at_level("INFO", logger="reap_swap.server_ext"):
            checks.append(WorkerResidency.check_cpu_rate(worker))
    assert all(c is None for i, c in enumerate(checks) if i != 2 * rates.RATE_CHECK_STEPS - 1)  # the first read starts the window
    rate = checks[-1]
    assert rate is not None and all(p.cost.cpu_GBps == pytest.approx(rate) for p in paths.values())
    assert "the split's CPU rate goes from 0.0 to" in caplog.text
    assert WorkerResidency.check_cpu_rate(SimpleNamespace(cpu_rates=None)) is None
