"""bench_cpu_kernel --kt (issue 28): kt-kernel's threads placed on our cores, both timings recorded.

kt-kernel itself is not needed: a stand-in ``kt_kernel_ext`` starts threads named the way kt-kernel
0.6.1's pool names its own ("numa_0_m_0" = compute thread 0, "numa_0_t_<i>"; worker_pool.cpp) plus
one unnamed task-queue thread, and logs submit/sync calls and where its threads may run.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import types

import pytest

from reap_swap.server_ext.cpu_experts import bench_cpu_kernel as B
from reap_swap.server_ext.cpu_experts.kernel import CpuThreads

LINUX_2CPU = hasattr(os, "sched_setaffinity") and os.path.isdir("/proc/self/task") and len(os.sched_getaffinity(0)) >= 2


def test_same_layout_is_our_cores_with_the_dispatcher_on_the_first():
    lay = B.kt_layout("same", 14, list(range(2, 16)))
    assert lay["pool_threads"] == 13
    assert lay["pool_cpus"] == list(range(3, 16))
    assert lay["dispatch_cpus"] == [2]
    assert not lay["shared_dispatch_core"]
    one = B.kt_layout("same", 1, [5])
    assert one["pool_threads"] == 1 and one["pool_cpus"] == [5] and one["shared_dispatch_core"]
    assert B.kt_layout("kt", 14, list(range(2, 16)))["pool_threads"] == 14
    with pytest.raises(ValueError):
        B.kt_layout("nope", 4, [0, 1, 2, 3])


def test_thread_roles_follow_kt_names():
    roles = B.kt_thread_roles({10: "numa_0_t_2", 11: "python3", 12: "numa_0_m_0", 13: "numa_0_t_1"})
    assert roles["pool"] == {0: 12, 1: 13, 2: 10}
    assert roles["dispatch"] == [11]


class _FakeKt:
    """Just enough of kt_kernel_ext for bench_cpu_kernel.kt_rates."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.where: dict[str, set[int]] = {}
        fake = self

        class WorkerPoolConfig:
            subpool_count = 0
            subpool_numa_map: list = []
            subpool_thread_count: list = []

        class CPUInfer:
            def __init__(self, cfg) -> None:
                self.backend_ = object()
                self._stop = threading.Event()
                self._threads = []
                names = ["numa_0_m_0"] + [f"numa_0_t_{i}" for i in range(1, cfg.subpool_thread_count[0])] + [None]
                for name in names:
                    ready = threading.Event()
                    t = threading.Thread(target=self._run, args=(name, ready), daemon=True)
                    t.start()
                    ready.wait(5)
                    self._threads.append((name or "queue", t))

            def _run(self, name, ready) -> None:
                if name:
                    ctypes.CDLL(None).prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME, as pthread_setname_np
                ready.set()
                self._stop.wait()

            def submit(self, task) -> None:
                fake.log.append(("submit", task[0]))

            def sync(self) -> None:
                fake.log.append(("sync",))
                for name, t in self._threads:
                    fake.where[name] = set(os.sched_getaffinity(t.native_id))

            def __del__(self) -> None:
                self._stop.set()

        class MOEConfig:
            def __init__(self, *args) -> None:
                self.args = args

        class AMXBF16_MOE:
            def __init__(self, cfg) -> None:
                self.cfg = cfg

            def load_weights_task(self, p2l):
                return ("load", p2l)

            def forward_task(self, *args):
                return ("forward", args)

        self.ext = types.ModuleType("kt_kernel_ext")
        self.ext.WorkerPoolConfig, self.ext.CPUInfer = WorkerPoolConfig, CPUInfer
        self.moe = types.ModuleType("kt_kernel_ext.moe")
        self.moe.MOEConfig, self.moe.AMXBF16_MOE = MOEConfig, AMXBF16_MOE
        self.ext.moe = self.moe
        self.pkg = types.ModuleType("kt_kernel")
        self.pkg.__version__, self.pkg.__cpu_variant__ = "0.6.1-fake", "fake"


@pytest.fixture
def fake_kt(monkeypatch):
    f = _FakeKt()
    monkeypatch.setitem(sys.modules, "kt_kernel_ext", f.ext)
    monkeypatch.setitem(sys.modules, "kt_kernel_ext.moe", f.moe)
    monkeypatch.setitem(sys.modules, "kt_kernel", f.pkg)
    monkeypatch.delenv("KT_MOE_CLASS", raising=False)
    return f


@pytest.mark.skipif(not LINUX_2CPU, reason="needs Linux thread affinity and 2 cores")
def test_kt_rates_repins_kt_threads_times_both_ways_and_restores_the_caller(fake_kt):
    c0, c1 = sorted(os.sched_getaffinity(0))[:2]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {c1})  # as our native backend leaves its caller: pinned to one core
    try:
        r = B.kt_rates([1, 8], 16, 5, CpuThreads(n=2, cpus=(c0, c1)), layout="same",
                       home=before, warmup_calls=3)
        assert os.sched_getaffinity(0) == {c1}  # the caller's mask is put back
    finally:
        os.sched_setaffinity(0, before)
    # kt's queue thread off the pool's core (it spins beside the pool), the pool on the other core
    assert fake_kt.where == {"numa_0_m_0": {c1}, "queue": {c0}}
    lay = r["layout"]
    assert lay["pool_threads"] == 1 and lay["pool_thread_cpus"] == [c1] and lay["problems"] == []
    assert lay["caller_cpus"] == [c0]
    for b in (1, 8):
        e = r[f"batch{b}"]
        assert e["timing"] == "per_call_sync" and e["calls_per_pass"] == 2 and e["warmup_calls"] == 3
        assert len(e["samples_s"]) == 5 and e["GBps"] > 0 and e["thread_cpus"] == [c1]
        assert e["queued"]["GBps"] > 0 and len(e["queued"]["samples_s"]) == 5
        assert e["moe_class"] == "AMXBF16_MOE" and e["layout"] == "same"
    # per batch: 3 warm-up calls + (1 + 5) per-call passes of 2 submit+sync, then (1 + 5) queued passes
    # of 2 submits and one sync; the load first
    fwd = [k for k in fake_kt.log if k != ("submit", "load")]
    per_batch = 3 * 2 + 6 * 2 * 2 + 6 * 3
    assert len(fwd) == 2 * per_batch + 1  # + the load's sync
    queued = fwd[1 + 3 * 2 + 6 * 2 * 2:][:3]
    assert queued == [("submit", "forward"), ("submit", "forward"), ("sync",)]


@pytest.mark.skipif(not LINUX_2CPU, reason="needs Linux thread affinity and 2 cores")
def test_main_records_how_kt_was_timed(fake_kt, tmp_path):
    out = tmp_path / "kt.json"
    c0, c1 = sorted(os.sched_getaffinity(0))[:2]
    before = os.sched_getaffinity(0)
    try:
        B.main(["--out", str(out), "--kt", "--backends", "", "--experts", "16", "--copy-mib", "1",
                "--threads", "2", "--cpus", f"{c0},{c1}", "--kt-warmup", "2"])
    finally:
        os.sched_setaffinity(0, before)
    res = json.loads(out.read_text())
    cmp_ = res["kt_kernel_comparison"]
    assert "kt_kernel_comparison_error" not in res
    assert cmp_["timing"]["GBps_is"] == "per_call_sync" and cmp_["timing"]["warmup_calls"] == 2
    assert set(cmp_["timing"]) >= {"per_call_sync", "queued"}
    assert cmp_["layout"]["layout"] == "same" and cmp_["layout_is"] == B.KT_LAYOUTS["same"]
    for b in (1, 8):
        assert cmp_[f"batch{b}"]["GBps"] > 0 and cmp_[f"batch{b}"]["queued"]["vs_memcpy"] > 0
    kt_own = cmp_["other_layouts"]["kt"]
    assert kt_own["layout"]["pool_threads"] == 2 and kt_own["batch1"]["GBps"] > 0
    assert set(kt_own["layout"]["threads"]) and all("#" in k for k in kt_own["layout"]["threads"])


def test_bad_layout_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        B.main(["--out", str(tmp_path / "x.json"), "--kt", "--kt-layouts", "same,bogus", "--backends", ""])
