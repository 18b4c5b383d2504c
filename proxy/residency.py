"""Installing the policy's resident set on the backend, for concurrent requests.

Every request registers its wish, then asks for an install covering it. One
install runs at a time; it decides with *all* wishes registered so far, so
requests arriving together share one swap (later ones find their generation
already installed: "coalesced"). A request waits for its install at most
``wait_s``; past that it is forwarded anyway and the install finishes in the
background. A failed swap never fails a request: it is recorded.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from reap_swap.selection import to_payload
from reap_swap.server_ext.active_set import signature

from .backend import BackendClient, BackendError
from .policy import Decision, ResidencyPolicy, Resident, Wish


@dataclass
class SwapOutcome:
    status: str  # swapped | kept | coalesced | timeout | failed | disabled
    signature: str
    reason: str = ""
    bytes_copied: int = 0
    experts_loaded: int = 0
    backend_ms: float = 0.0
    wait_ms: float = 0.0
    installed_by: str = ""
    noop: bool = False
    detail: dict[str, Any] = field(default_factory=dict)


class ResidencyCoordinator:
    def __init__(self, backend: BackendClient, policy: ResidencyPolicy, prior: dict[int, Sequence[float]], wait_s: float = 2.0):
        self.backend = backend
        self.policy = policy
        self.prior = prior
        self.wait_s = wait_s
        self.wishes: dict[str, Wish] = {}
        self.current: Resident = {i: tuple(lp.core) for i, lp in policy.plan.layers.items()}
        self._lock = asyncio.Lock()
        self._generation = 0
        self._installed = 0
        self._last: SwapOutcome | None = None
        self.synced = False

    async def sync(self) -> None:
        """Adopt the backend's resident set (at start-up and after a failed swap)."""
        status = await self.backend.status()
        by_layer = status["resident"]["by_layer"]
        self.current = {int(k.removeprefix("layer_")): tuple(v) for k, v in by_layer.items()}
        self.synced = True

    async def admit(self, request_id: str, wish: Wish) -> SwapOutcome:
        self.wishes[request_id] = wish
        self._generation += 1
        gen = self._generation
        t0 = time.perf_counter()
        task = asyncio.ensure_future(self._install(gen, request_id))
        try:
            outcome = await asyncio.wait_for(asyncio.shield(task), timeout=self.wait_s)
        except asyncio.TimeoutError:
            return SwapOutcome("timeout", signature(self.current), f"install not done within {self.wait_s:.1f}s; forwarded anyway",
                               wait_ms=(time.perf_counter() - t0) * 1e3)
        outcome.wait_ms = (time.perf_counter() - t0) * 1e3
        return outcome

    def release(self, request_id: str) -> None:
        self.wishes.pop(request_id, None)

    async def _install(self, gen: int, request_id: str) -> SwapOutcome:
        async with self._lock:
            if self._installed >= gen and self._last is not None:
                last = self._last
                return SwapOutcome("coalesced", last.signature, f"covered by the install of {last.installed_by}", installed_by=last.installed_by)
            upto = self._generation
            decision: Decision = self.policy.decide(list(self.wishes.values()), self.current, self.prior)
            if not decision.swap:
                outcome = SwapOutcome("kept", decision.signature, decision.reason, installed_by=request_id)
            else:
                outcome = await self._swap(request_id, decision)
            self._installed = upto
            self._last = outcome
            return outcome

    async def _swap(self, request_id: str, decision: Decision) -> SwapOutcome:
        payload = {"request_id": request_id, "phase": "prefill", "active_set": to_payload(decision.target)}
        t0 = time.perf_counter()
        try:
            res = await self.backend.swap(payload)
        except (BackendError, OSError, Exception) as exc:  # noqa: BLE001 - a swap never fails the request
            try:
                await self.sync()
            except Exception:  # noqa: BLE001
                pass
            return SwapOutcome("failed", signature(self.current), f"{type(exc).__name__}: {exc}", installed_by=request_id,
                               backend_ms=(time.perf_counter() - t0) * 1e3)
        self.current = dict(decision.target)
        return SwapOutcome(
            "swapped", res.get("active_set_signature", decision.signature), decision.reason,
            bytes_copied=int(res.get("bytes_copied", 0)), experts_loaded=int(res.get("experts_loaded", 0)),
            backend_ms=(time.perf_counter() - t0) * 1e3, installed_by=request_id, noop=bool(res.get("noop")),
            detail={"delta": res.get("delta"), "timing_ms": res.get("timing_ms")},
        )
