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

``{"point": "exchange", "op": "to_host", "after": 2, "times": 1, "layer": 0}`` fails inside a
RAM-complement exchange instead: the ``after``-th call (0-based) of ``op`` (``to_host``, ``to_slot``,
``wait`` or ``publish``) on that layer's exchange copies raises, and so do the next ``times - 1`` calls
of it (a failed publish followed by a failed re-publish, a failed repair ...); the hook stays on the
bank until it has fired ``times`` times, across swaps and repairs.
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


EXCHANGE_OPS = ("to_host", "to_slot", "wait", "publish")


class ExchangeFault:
    """One armed exchange fault: fires at the ``after``-th call of ``op``, then ``times - 1`` more times,
    on every exchange of the bank (swaps and repairs alike); unhooks itself once spent."""

    def __init__(self, bank: Any, op: str, after: int, times: int):
        if op not in EXCHANGE_OPS:
            raise InjectedFault(f"{ENV_FAULT_FILE}: exchange fault op {op!r} is not one of {EXCHANGE_OPS}")
        self.bank, self.op, self.after, self.left = bank, op, after, times

    def __call__(self, inner: Any) -> "FaultyOps":
        return FaultyOps(inner, self)

    def fires(self, name: str) -> bool:
        if name != self.op or self.left <= 0:
            return False
        if self.after > 0:
            self.after -= 1
            return False
        self.left -= 1
        if self.left == 0:
            self.bank.ops_hook = None
        return True


class FaultyOps:
    """The bank's exchange copies, with ``ExchangeFault`` deciding which call raises."""

    def __init__(self, inner: Any, fault: ExchangeFault):
        self.inner, self.fault = inner, fault

    def _call(self, name: str, *args: Any) -> None:
        if self.fault.fires(name):
            raise InjectedFault(f"injected fault in exchange {name} of layer {self.fault.bank.layer_id}")
        getattr(self.inner, name)(*args)

    def to_host(self, slot: int, row: int) -> None:
        self._call("to_host", slot, row)

    def to_slot(self, row: int, slot: int) -> None:
        self._call("to_slot", row, slot)

    def wait(self) -> None:
        self._call("wait")

    def publish(self, physical_map: list[int]) -> None:
        self._call("publish", physical_map)


def guarded_swap(swap: Callable[[Target], dict[str, Any]], target: Target, rank: int,
                 banks: dict[int, Any] | None = None) -> dict[str, Any]:
    """Run ``swap(target)``, or the armed fault: part of the target applied, then a failure; or a
    failure inside one layer's exchange copies (``point: exchange``, complement banks)."""
    spec = take_fault(rank)
    if spec is not None and spec.get("point") == "exchange" and banks is not None:
        layer = int(spec.get("layer", min(_layer_key(k) for k in target)))
        if layer not in banks or banks[layer].complement is None:
            raise InjectedFault(f"{ENV_FAULT_FILE}: layer {layer} has no RAM-complement bank to fault")
        bank = banks[layer]
        bank.ops_hook = ExchangeFault(bank, str(spec.get("op", "to_host")), int(spec.get("after", 0)), int(spec.get("times", 1)))
        logger.warning("reap-swap: injected exchange fault armed on rank %d layer %d: %s", rank, layer, spec)
        return swap(target)
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
        return guarded_swap(super().reap_swap, target, self._reap_rank(), self._reap().banks)

    def reap_resident_sets(self) -> dict[str, Any]:
        """This rank's resident experts per layer, read from its slot tables."""
        rt = self._reap()
        return {"rank": self._reap_rank(), "resident": rt.resident_sets(), "problems": rt.problems()}

    def reap_repair(self) -> dict[str, Any]:
        """Repair this rank's broken layers (``WorkerResidency.repair``); the problems left, by layer."""
        rt = self._reap()
        return {"rank": self._reap_rank(), "problems": rt.repair(), "resident": rt.resident_sets()}
