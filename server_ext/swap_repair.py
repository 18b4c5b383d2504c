"""Worker side of swap-failure repair: per-rank resident-set reads and fault injection.

The control plane must be able to re-read *every* rank's resident set after
a swap failed (``collective_rpc`` raises at the first failing rank while the
others may have committed), so ``reap_resident_sets`` answers per rank.

Fault injection exists so that failure path is tested on a real server: when
``REAP_FAULT_FILE`` names a file and that file exists at the next swap, the
worker consumes it (one shot, atomically, so one rank takes it) and fails
*after* applying the first ``after_layers`` layers of the target, exactly
like a swap that broke after evictions were published. The file holds JSON:
``{"point": "mid_swap", "after_layers": 1, "rank": 0}`` (``rank`` optional).
Without the variable nothing is ever read.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable

from .worker_ext import ReapWorkerExtension

logger = logging.getLogger("reap_swap.server_ext")
ENV_FAULT_FILE = "REAP_FAULT_FILE"
Target = dict[str, list[int]]


class InjectedFault(RuntimeError):
    """A failure caused on purpose by ``REAP_FAULT_FILE`` (tests only)."""


def take_fault(rank: int, env: dict[str, str] | None = None) -> dict[str, Any] | None:
    """The armed fault for this rank, consumed; None when nothing is armed."""
    path = (os.environ if env is None else env).get(ENV_FAULT_FILE)
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as fh:
            spec = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(spec, dict) or spec.get("rank", rank) != rank:
        return None
    try:
        os.rename(path, f"{path}.taken-{rank}-{os.getpid()}")  # one shot: the first rank to rename owns it
    except OSError:
        return None
    return spec


def _layer_key(key: str) -> int:
    return int(str(key).removeprefix("layer_"))


def guarded_swap(swap: Callable[[Target], dict[str, Any]], target: Target, rank: int) -> dict[str, Any]:
    """Run ``swap(target)``, or the armed fault: part of the target applied, then a failure."""
    spec = take_fault(rank)
    if spec is None or spec.get("point") != "mid_swap":
        return swap(target)
    n = int(spec.get("after_layers", 1))
    partial = {k: target[k] for k in sorted(target, key=_layer_key)[:n]}
    if partial:
        swap(partial)
    logger.warning("reap-swap: injected fault on rank %d after swapping %s", rank, sorted(partial))
    raise InjectedFault(f"injected fault on rank {rank} after swapping {sorted(partial, key=_layer_key)}")


class RepairingWorkerExtension(ReapWorkerExtension):
    """The worker extension ``reap-swap serve`` installs: the residency RPCs plus the two above."""

    def _reap_rank(self) -> int:
        return int(getattr(self, "rank", 0) or 0)

    def reap_swap(self, target: Target) -> dict[str, Any]:
        return guarded_swap(super().reap_swap, target, self._reap_rank())

    def reap_resident_sets(self) -> dict[str, Any]:
        """This rank's resident experts per layer, read from its slot tables."""
        return {"rank": self._reap_rank(), "resident": self._reap().resident_sets()}
