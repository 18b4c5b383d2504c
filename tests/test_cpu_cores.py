"""Issue 31 point 5: per-local-rank CPU sets for the CPU expert team, and a second process's team on
claimed cores refused. Parsing on its own, then real processes each starting the real native team
(``team.process_team``) on this host's cores."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reap_swap.server_ext.cpu_experts.cores import CoreClaim, CpuSetError, parse_rank_lists, rank_cpus
from reap_swap.server_ext.cpu_experts.kernel import CpuThreads, native_library

CHILD = textwrap.dedent("""
    import os, sys
    from reap_swap.server_ext.cpu_experts.cores import CpuSetError
    from reap_swap.server_ext.cpu_experts.kernel import CpuThreads
    from reap_swap.server_ext.cpu_experts.team import PlainStaging, process_team
    threads = CpuThreads.from_env(local_rank=int(os.environ["LOCAL_RANK"]), local_world=int(os.environ["LOCAL_WORLD_SIZE"]))
    try:
        team = process_team(threads, PlainStaging())
    except CpuSetError as exc:
        print("REFUSED", exc, flush=True)
        sys.exit(3)
    print("STARTED", ",".join(map(str, threads.cpus)), os.getpid(), flush=True)
    sys.stdin.read()  # hold the team until the test closes stdin
    team.stop()
    print("STOPPED", flush=True)
""")


def test_one_list_per_local_rank_or_one_list_split_by_rank() -> None:
    assert rank_cpus("2-7;8-13", 0, 2) == (2, 3, 4, 5, 6, 7) and rank_cpus("2-7;8-13", 1, 2) == (8, 9, 10, 11, 12, 13)
    assert rank_cpus("2-13", 1, 2) == (8, 9, 10, 11, 12, 13)  # one list, two ranks: halves
    assert rank_cpus("2-8", 1, 2) == (5, 6, 7)  # the odd core left over stays unused
    assert rank_cpus("2-7", 0, 1) == (2, 3, 4, 5, 6, 7) and rank_cpus("", 0, 1) == ()  # one rank: as before
    assert rank_cpus("", 1, 2, available=(0, 1, 2, 3)) == (2, 3)  # unset, two ranks: the affinity mask split
    assert rank_cpus("4,5;6,7;", 1, 2) == (6, 7)  # a trailing ';' is fine


@pytest.mark.parametrize("spec,rank,world,msg", [
    ("2-7;8-13", 0, 3, "gives 2 core lists for 3 local ranks"),
    ("2-7;6-13", 0, 2, "core 6 is in the lists of local ranks 0 and 1"),
    ("2-7;;8", 0, 3, "local rank(s) [1] is empty"),
    ("2-x", 0, 1, "'2-x' is not a core number"),
    ("7-2", 0, 1, "not a range"),
    ("2,2", 0, 1, "names a core twice"),
    ("2", 0, 2, "has 1 cores for 2 local ranks"),
])
def test_bad_core_lists_are_refused_naming_the_variable(spec: str, rank: int, world: int, msg: str) -> None:
    with pytest.raises(CpuSetError, match="REAP_CPU_EXPERT_CPUS") as err:
        rank_cpus(spec, rank, world)
    assert msg in str(err.value)


def test_threads_follow_the_rank_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REAP_CPU_EXPERT_CPUS", "0-3;4-7")
    monkeypatch.delenv("REAP_CPU_EXPERT_THREADS", raising=False)
    assert CpuThreads.from_env(local_rank=1, local_world=2) == CpuThreads(4, (4, 5, 6, 7))
    assert parse_rank_lists("0-3;4-7") == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_a_claim_is_exclusive_and_dropped_on_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REAP_CPU_EXPERT_LOCK_DIR", str(tmp_path))
    first = CoreClaim((0, 1), "test")
    with pytest.raises(CpuSetError, match=rf"core 0 \(pid {os.getpid()}: test\)"):
        CoreClaim((1, 0), "second")  # flock: a second open file description conflicts, even in one process
    first.release()
    CoreClaim((0, 1), "again").release()


def _spawn(tmp_path: Path, cpus: str, rank: int, world: int) -> subprocess.Popen[str]:
    env = {**os.environ, "REAP_CPU_EXPERT_CPUS": cpus, "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
           "REAP_CPU_EXPERT_LOCK_DIR": str(tmp_path / "locks"), "REAP_CPU_EXPERT_SPIN_US": "0", "REAP_CPU_EXPERT_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _first_line(p: subprocess.Popen[str]) -> str:
    assert p.stdout is not None
    return p.stdout.readline().strip()


def _finish(p: subprocess.Popen[str]) -> str:
    out, _ = p.communicate(input="", timeout=60)
    return out


@pytest.fixture()
def native() -> None:
    if native_library() is None:
        pytest.skip("the native kernel did not build")
    if len(os.sched_getaffinity(0)) < 2 or not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs cores 0 and 1")


def test_two_ranks_of_one_host_get_their_own_cores_and_run_together(tmp_path: Path, native: None) -> None:
    for spec in ("0-1", "0;1"):  # one list split by rank, and one list per rank
        a, b = _spawn(tmp_path, spec, 0, 2), _spawn(tmp_path, spec, 1, 2)
        try:
            la, lb = _first_line(a), _first_line(b)
            assert la.startswith("STARTED 0 ") and lb.startswith("STARTED 1 "), (spec, la, lb)
        finally:
            assert "STOPPED" in _finish(a) and "STOPPED" in _finish(b)


def test_a_second_process_on_claimed_cores_is_refused_until_the_first_exits(tmp_path: Path, native: None) -> None:
    first = _spawn(tmp_path, "0", 0, 1)
    try:
        line = _first_line(first)
        assert line.startswith("STARTED 0 "), line
        pid = line.split()[2]
        second = _spawn(tmp_path, "0", 0, 1)  # what two TP ranks inheriting one list did before
        out = _finish(second)
        assert second.returncode == 3 and "REFUSED" in out and f"core 0 (pid {pid}" in out, out
        assert "REAP_CPU_EXPERT_CPUS='2-7;8-13'" in out
    finally:
        assert "STOPPED" in _finish(first)
    third = _spawn(tmp_path, "0", 0, 1)  # the first process is gone: its flock with it
    assert _first_line(third).startswith("STARTED 0 ")
    assert "STOPPED" in _finish(third)
