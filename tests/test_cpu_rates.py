"""The CPU pipe's rate: the load-time probe's window, and re-rating the split from the team's own counters
while serving (issue 25: a probe read 28.7 GB/s, its team then achieved 77.8, and the fast mode ran 25 % slower)."""

from __future__ import annotations

import pytest
import torch

from reap_swap.server_ext.cpu_experts import cpu_path as cp
from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts import rates
from reap_swap.server_ext.cpu_experts.rates import CpuRateTracker, TeamCounts
from reap_swap.server_ext.cpu_experts.split import CostModel
from reap_swap.server_ext.cpu_experts.step import BankRows

from .test_cpu_path import _layer

needs_native = pytest.mark.skipif(K.native_library() is None, reason=f"native CPU kernel unavailable: {K.native_error()}")

B = 9_437_184  # bytes of one 30B-A3B expert (bf16)
ZERO = TeamCounts(0, 0, 0)


def _counts(jobs: int, experts: int, gbps: float) -> TeamCounts:
    """What a team achieving ``gbps`` would have counted."""
    return TeamCounts(jobs, int(experts * B / gbps), experts * B)


def test_a_window_gives_the_achieved_rate_of_its_own_jobs() -> None:
    t = CpuRateTracker(window_jobs=1000)
    assert t.observe(ZERO) is None  # the first read only sets the window's start
    assert t.observe(_counts(999, 1500, 90.0)) is None  # not a full window yet
    first = _counts(1000, 1500, 90.0)
    assert t.observe(first) == pytest.approx(90.0, rel=1e-6)
    more = _counts(1500, 2300, 40.0)  # the next window starts where that one ended: its own jobs only
    assert t.observe(TeamCounts(first.jobs + more.jobs, first.ns + more.ns, first.bytes + more.bytes)) == pytest.approx(40.0, rel=1e-6)


def test_this_runs_counters_rerate_the_misread_arm_only() -> None:
    """The 2026-12-07 run's batch-1 counters: the fast arm's split had 28.7 GB/s from its probe and its team achieved 77.8;
    static + CPU's probe read 92.1 and its team 89.6. Only the misread is re-rated."""
    fast = CpuRateTracker(window_jobs=14943)
    fast.observe(ZERO)
    assert fast.new_rate(28.7, TeamCounts(14943, 1_945_695_443, 151_353_556_992)) == pytest.approx(77.79, abs=0.01)
    static = CpuRateTracker(window_jobs=29280)
    static.observe(ZERO)
    assert static.new_rate(92.06, TeamCounts(29280, 4_532_735_421, 406_242_459_648)) is None


def test_counters_that_went_back_start_a_new_window() -> None:
    t = CpuRateTracker(window_jobs=10)
    t.observe(_counts(50, 50, 80.0))
    assert t.observe(_counts(5, 5, 80.0)) is None  # reset_stats that nobody reported
    assert t.observe(_counts(14, 14, 80.0)) is None  # 9 jobs since the reset
    assert t.observe(_counts(15, 15, 80.0)) == pytest.approx(80.0, rel=1e-6)
    t.observe(_counts(20, 20, 80.0))
    t.restart()  # a reported reset: the next read only starts a window
    assert t.observe(_counts(40, 40, 80.0)) is None and t.observe(_counts(49, 49, 80.0)) is None


def test_a_window_without_bytes_says_nothing() -> None:
    t = CpuRateTracker(window_jobs=10)
    t.observe(ZERO)
    assert t.observe(TeamCounts(10, 0, 0)) is None


def test_new_rate_only_past_the_tolerance() -> None:
    t = CpuRateTracker(window_jobs=10, tolerance=0.3)
    t.observe(ZERO)
    first = _counts(10, 10, 81.4)
    assert t.new_rate(101.2, first) is None  # the graphs run's fast arm: 20 % apart, a difference, not a misread
    then = _counts(10, 10, 90.0)
    assert t.new_rate(28.7, TeamCounts(first.jobs + then.jobs, first.ns + then.ns, first.bytes + then.bytes)) == pytest.approx(90.0, rel=1e-6)
    for bad in ({"window_jobs": 0}, {"tolerance": -0.1}):
        with pytest.raises(ValueError, match="rate tracker"):
            CpuRateTracker(**bad)


def test_team_counts_total_sums_layers_jobs_with_work() -> None:
    stats = [{"calls": 9, "steps_with_work": 2, "ns": 10, "bytes": 5, "experts": 3, "pairs": 4, "status": 0},
             {"calls": 1, "steps_with_work": 1, "ns": 1, "bytes": 1, "experts": 1, "pairs": 1}]
    assert TeamCounts.total(stats) == TeamCounts(3, 11, 6)


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
    """A slow link (tiny experts) so that the CPU takes part, and a CPU rate a probe got wrong."""
    return cp.LayerCpuPath(bank, 4, 0, settings, settings.cost(0.002, 0.001, top_k=4), K.CpuThreads(2), torch.device("cpu"), fused=False)


@needs_native
def test_the_check_takes_the_teams_rate_into_every_split_in_place(caplog: pytest.LogCaptureFixture) -> None:
    """``CpuRateCheck`` (the worker runs it after every step): a read every RATE_CHECK_STEPS steps, the team's achieved
    rate into every layer's cost tensor in place, logged; none without a CPU path or with a rate the user set."""
    bank, off = _layer()
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2)
    paths = [_path(bank, settings), _path(bank, settings)]
    check = rates.CpuRateCheck.for_paths(paths)
    assert check is not None and rates.CpuRateCheck.for_paths([]) is None
    check.tracker.window_jobs = 4
    ptrs = [p.cost_tensor.data_ptr() for p in paths]
    slow = 0  # the first path's CPU pairs over the first RATE_CHECK_STEPS steps, at the misread rate
    taken = []
    for step in range(2 * rates.RATE_CHECK_STEPS):
        pairs = [_step(p, off, step) for p in paths]
        slow += pairs[0] if step < rates.RATE_CHECK_STEPS else 0
        with caplog.at_level("INFO", logger="reap_swap.server_ext"):
            taken.append(check.after_step())
    assert slow > 0, "the CPU must take some pairs for the team to count anything"
    assert all(r is None for r in taken[:-1])  # the first read (step 64) starts the window, the second (step 128) ends it
    rate = taken[-1]
    assert rate is not None and rate > 0.001 * 1.3
    assert all(p.cost.cpu_GBps == pytest.approx(rate) and p.rate_updates == [pytest.approx(rate)] for p in paths)
    assert [p.cost_tensor.data_ptr() for p in paths] == ptrs  # captured graphs keep reading the same tensors
    assert all(float(p.cost_tensor[2]) == pytest.approx(bank.expert_bytes / (rate * 1e9)) for p in paths)
    assert cp.summarize(paths)["rate_updates"] == [pytest.approx(rate)]
    assert "the split's CPU rate goes from 0.0 to" in caplog.text
    # the split follows the model: at the team's rate the CPU gets more of the same steps' pairs than at the misread one
    assert sum(_step(paths[0], off, s) for s in range(rates.RATE_CHECK_STEPS)) > slow


@needs_native
def test_a_rate_the_user_set_is_never_rerated() -> None:
    bank, _ = _layer()
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2, cpu_GBps=70.0)
    path = cp.LayerCpuPath(bank, 4, 0, settings, settings.cost(50.0, 1.0, top_k=4), K.CpuThreads(1), torch.device("cpu"))
    assert path.cost.cpu_GBps == 70.0 and rates.CpuRateCheck.for_paths([path]) is None
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
def test_a_failed_rerating_leaves_every_layer_on_one_rate_and_turns_itself_off(caplog: pytest.LogCaptureFixture) -> None:
    """A fault while writing the new rate (injected into the second layer: nothing here makes it fail for real) puts the
    first layer back, logs once, and the check says it is off; the split keeps its rates."""
    bank, off = _layer()
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2)
    paths = [_path(bank, settings), _path(bank, settings)]
    check = rates.CpuRateCheck.for_paths(paths)
    assert check is not None and check.describe().startswith("on: every 64 steps, windows of 4096 jobs")
    check.tracker.window_jobs = 4

    def broken(rate: float) -> None:
        raise RuntimeError("injected: the cost tensor's copy failed")

    paths[1].set_cpu_GBps = broken  # type: ignore[method-assign]
    with caplog.at_level("ERROR", logger="reap_swap.server_ext"):
        for step in range(2 * rates.RATE_CHECK_STEPS):
            for p in paths:
                _step(p, off, step)
            assert check.after_step() is None
    assert [p.cost.cpu_GBps for p in paths] == [0.001, 0.001] and paths[0].rate_updates[-1] == 0.001
    assert check.error == "RuntimeError: injected: the cost tensor's copy failed"
    assert check.describe().startswith("off after an error (RuntimeError") and caplog.text.count("re-rating the CPU failed") == 1
    assert rates.describe(None, True) == "off: the user set the CPU's rate" and rates.describe(None, False) == "off: no CPU expert path"
