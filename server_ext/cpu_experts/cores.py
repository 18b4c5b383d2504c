"""Which cores this rank's CPU expert team may use, and a claim on them that other processes see.

Why: with tensor parallelism every rank of a host inherits the same environment, so one
``REAP_CPU_EXPERT_CPUS`` would pin every rank's spinning team to the same cores (each team then
starves the other, and the in-process oversubscription check cannot see it). So:

* ``REAP_CPU_EXPERT_CPUS`` takes one core list per local rank, separated by ``;``
  (``2-7;8-13``: local rank 0 gets 2-7, rank 1 gets 8-13; the lists must not overlap and there
  must be one per local rank), or one list, which is split into equal contiguous parts by local
  rank (``2-13`` with two local ranks: 2-7 and 8-13; cores left over by the division stay unused).
  Unset with several local ranks, the process's affinity mask is split the same way; unset with one,
  the team is not pinned (as before).
* a pinned team takes an exclusive ``flock`` on one file per core under ``REAP_CPU_EXPERT_LOCK_DIR``
  (default ``/dev/shm/reap_swap_cpu_locks``), held until the team stops or the process exits
  (the kernel drops flocks of dead processes: no stale claims). A second process asking for a
  claimed core is **refused** with an error naming the cores and the holder's pid -- two teams
  spinning on one core halve both and can push steps past the merge's wait timeout, so sharing is
  never silent. Unpinned teams claim nothing (they float over the affinity mask).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ..config import ResidencyConfigError

ENV_CPUS = "REAP_CPU_EXPERT_CPUS"
ENV_LOCK_DIR = "REAP_CPU_EXPERT_LOCK_DIR"
DEFAULT_LOCK_DIR = "/dev/shm/reap_swap_cpu_locks"


class CpuSetError(ResidencyConfigError):
    """A core list that cannot be used: malformed, not one per local rank, overlapping, or claimed."""


def parse_core_list(spec: str, var: str = ENV_CPUS) -> tuple[int, ...]:
    """``"8-11,14"`` -> ``(8, 9, 10, 11, 14)``; refuses junk, reversed ranges, negatives and repeats."""
    out: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        lo, dash, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise CpuSetError(f"{var}={spec!r}: {part!r} is not a core number or range like 2-7") from None
        if a < 0 or b < a:
            raise CpuSetError(f"{var}={spec!r}: {part!r} is not a range of core numbers (low-high, low >= 0)")
        out.extend(range(a, b + 1))
    if len(set(out)) != len(out):
        raise CpuSetError(f"{var}={spec!r} names a core twice")
    return tuple(out)


def parse_rank_lists(spec: str, var: str = ENV_CPUS) -> list[tuple[int, ...]]:
    """The ``;``-separated lists of ``spec`` (one entry when there is no ``;``); refuses empty or
    overlapping per-rank lists."""
    parts = [p.strip() for p in spec.split(";")]
    if len(parts) > 1 and parts[-1] == "":
        parts = parts[:-1]  # a trailing ';'
    lists = [parse_core_list(p, var) for p in parts]
    if len(lists) > 1:
        empty = [i for i, c in enumerate(lists) if not c]
        if empty:
            raise CpuSetError(f"{var}={spec!r}: the core list of local rank(s) {empty} is empty")
        seen: dict[int, int] = {}
        for rank, cores in enumerate(lists):
            for c in cores:
                if c in seen:
                    raise CpuSetError(f"{var}={spec!r}: core {c} is in the lists of local ranks {seen[c]} and {rank}; "
                                      "each rank needs its own cores")
                seen[c] = rank
    return lists


def split_by_rank(cores: tuple[int, ...], local_rank: int, local_world: int, what: str) -> tuple[int, ...]:
    """Local rank ``local_rank``'s equal contiguous share of ``cores``."""
    if len(cores) < local_world:
        raise CpuSetError(f"{what} has {len(cores)} cores for {local_world} local ranks; give each rank at least one "
                          f"(or one list per rank: {ENV_CPUS}='2-7;8-13')")
    share = len(cores) // local_world
    return tuple(cores[local_rank * share:(local_rank + 1) * share])


def rank_cpus(spec: str, local_rank: int = 0, local_world: int = 1, available: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The cores of local rank ``local_rank`` of ``local_world`` (see the module docstring); () = unpinned."""
    if local_world < 1 or not 0 <= local_rank < local_world:
        raise CpuSetError(f"local rank {local_rank} of {local_world} local ranks is not a rank")
    lists = parse_rank_lists(spec)
    if len(lists) > 1:
        if len(lists) != local_world:
            raise CpuSetError(f"{ENV_CPUS}={spec!r} gives {len(lists)} core lists for {local_world} local ranks; "
                              "give one list per local rank, or one list to split between them")
        return lists[local_rank]
    cores = lists[0]
    if local_world == 1:
        return cores
    if not cores:
        mask = tuple(sorted(os.sched_getaffinity(0))) if available is None else available
        return split_by_rank(mask, local_rank, local_world, "the process's affinity mask")
    return split_by_rank(cores, local_rank, local_world, f"{ENV_CPUS}={spec!r}")


def lock_dir() -> Path:
    return Path(os.environ.get(ENV_LOCK_DIR) or DEFAULT_LOCK_DIR)


class CoreClaim:
    """Exclusive, process-lifetime claims on cores, one ``flock``-ed file per core."""

    def __init__(self, cores: tuple[int, ...], owner: str):
        self.cores = tuple(cores)
        self.directory = lock_dir()
        self._fds: list[int] = []
        if not self.cores:
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CpuSetError(f"cannot create the core-claim directory {self.directory} ({ENV_LOCK_DIR}): {exc}") from None
        busy: list[str] = []
        try:
            for core in self.cores:
                fd = os.open(self.directory / f"core-{core}.lock", os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
                    os.close(fd)
                    busy.append(f"core {core} ({holder})")
                    continue
                self._fds.append(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()}: {owner}".encode(), 0)
        except OSError as exc:  # an unreadable lock file: give back the cores already claimed
            self.release()
            raise CpuSetError(f"cannot claim cores {list(self.cores)} under {self.directory} ({ENV_LOCK_DIR}): {exc}") from None
        if busy:
            self.release()
            raise CpuSetError(
                f"the CPU expert team cannot pin to cores {list(self.cores)}: already used by another process's team: "
                f"{'; '.join(busy)}. Two spinning teams on one core starve each other; give each rank or server its own "
                f"cores ({ENV_CPUS}='2-7;8-13', or one list split by local rank)")

    def release(self) -> None:
        for fd in self._fds:
            try:
                os.ftruncate(fd, 0)
            finally:
                os.close(fd)  # closing the last descriptor drops the flock
        self._fds = []

    @property
    def held(self) -> bool:
        return bool(self._fds)
