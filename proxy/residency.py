"""Installing the policy's resident set on the backend, for concurrent requests.

Every request registers its wish, then asks for an install covering it. One
install runs at a time; it decides with *all* wishes registered so far, so
requests arriving together share one swap (later ones find their generation
already installed: "coalesced"). A request waits for its install at most
``wait_s``; past that it is forwarded anyway and the install finishes in the
background. A failed swap never fails a request: it is recorded.

Wishes are released when their request ends, and expire after ``wish_ttl_s``
whatever happens, so a request that never ends cannot bias the union policy
forever. The backend's plan identity is checked on every sync (and every
swap answer): a backend serving another plan gets no swaps until it serves
this one. When the backend's resident set is not the one this proxy last
installed (an operator, another proxy), the proxy re-reads it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from reap_swap.selection import to_payload
from reap_swap.server_ext.control.active_set import signature

from .backend import BackendClient, BackendError
from .policy import Decision, ResidencyPolicy, Resident, Wish
from .wish_sums import WishSums

logger = logging.getLogger("reap_swap.proxy")
SYNC_RETRY_S = 2.0


@dataclass
class SwapOutcome:
    status: str  # swapped | kept | coalesced | timeout | failed | rate_limited | disabled
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
    def __init__(self, backend: BackendClient, policy: ResidencyPolicy, prior: dict[int, Sequence[float]], wait_s: float = 2.0,
                 wish_ttl_s: float = 900.0, max_wishes: int = 4096):
        self.backend = backend
        self.policy = policy
        self.prior = prior
        self.wait_s = wait_s
        self.plan_sha = policy.plan.sha256
        self.wishes = WishSums(policy.plan, max_wishes, wish_ttl_s)
        """The in-flight wishes' score sums: added on admit, subtracted on release, so a decision costs
        O(layers x experts) in the event loop whatever the number of requests in flight."""
        self.current: Resident = {i: tuple(lp.core) for i, lp in policy.plan.layers.items()}
        self._lock = asyncio.Lock()
        self._generation = 0
        self._installed = 0
        self._last: SwapOutcome | None = None
        self._last_sync_try = -1e9
        self.synced = False
        self.disabled: str | None = None
        """Why no swap is sent (the backend serves another plan); None when residency is on."""
        self.last_error: str | None = None
        self.resyncs = 0
        self.drifts = 0

    def state(self) -> dict[str, Any]:
        return {"synced": self.synced, "plan_sha256": self.plan_sha, "plan_matches": self.synced and self.disabled is None,
                "disabled": self.disabled, "signature": signature(self.current), "wishes_in_flight": len(self.wishes),
                "resyncs": self.resyncs, "drifts": self.drifts, "last_error": self.last_error}

    async def sync(self) -> None:
        """Adopt the backend's resident set and check it serves our plan (start-up, failures, drift)."""
        self._last_sync_try = time.monotonic()
        status = await self.backend.status()
        backend_sha = str((status.get("plan") or {}).get("sha256", ""))
        if backend_sha != self.plan_sha:
            self.disabled = (f"backend serves plan {backend_sha[:16] or '(none)'}, this proxy has {self.plan_sha[:16]}: "
                             "no swaps until they match")
            logger.error("reap-swap proxy: %s", self.disabled)
        else:
            self.disabled = None
        by_layer = status["resident"]["by_layer"]
        self.current = {int(k.removeprefix("layer_")): tuple(v) for k, v in by_layer.items()}
        self.synced = True
        self.resyncs += 1

    async def _maybe_sync(self) -> None:
        if (self.synced and self.disabled is None) or time.monotonic() - self._last_sync_try < SYNC_RETRY_S:
            return
        try:
            await self.sync()
        except Exception as exc:  # noqa: BLE001 - the backend may not be up yet
            self.last_error = f"sync: {type(exc).__name__}: {exc}"

    async def refresh(self) -> None:
        """Re-read the backend (plan identity, resident set) if the last read is older than SYNC_RETRY_S."""
        if self._lock.locked() or time.monotonic() - self._last_sync_try < SYNC_RETRY_S:
            return
        async with self._lock:
            try:
                await self.sync()
            except Exception as exc:  # noqa: BLE001
                self.synced = False
                self.last_error = f"sync: {type(exc).__name__}: {exc}"

    def observe_signature(self, backend_signature: str | None) -> None:
        """A signature the backend reported (e.g. with router misses): schedule a re-read if it is not ours."""
        if backend_signature and backend_signature != signature(self.current) and not self._lock.locked():
            self.synced = False
            self._last_sync_try = -1e9

    async def admit(self, request_id: str, wish: Wish) -> SwapOutcome:
        self.wishes.add(request_id, wish)
        await self._maybe_sync()
        if self.disabled is not None or not self.synced:
            return SwapOutcome("disabled", signature(self.current), self.disabled or f"backend state unknown ({self.last_error})")
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
        self.wishes.discard(request_id)

    async def _install(self, gen: int, request_id: str) -> SwapOutcome:
        async with self._lock:
            if self._installed >= gen and self._last is not None:
                last = self._last
                return SwapOutcome("coalesced", last.signature, f"covered by the install of {last.installed_by}", installed_by=last.installed_by)
            upto = self._generation
            self.wishes.expire()
            decision: Decision = self.policy.decide_sums(self.wishes, self.current, self.prior)
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
        except Exception as exc:  # noqa: BLE001 - a swap never fails the request
            self.last_error = f"swap: {type(exc).__name__}: {exc}"
            status = "rate_limited" if isinstance(exc, BackendError) and exc.status == 429 else "failed"
            if status == "failed":
                try:
                    await self.sync()
                except Exception:  # noqa: BLE001
                    self.synced = False
            return SwapOutcome(status, signature(self.current), f"{type(exc).__name__}: {exc}", installed_by=request_id,
                               backend_ms=(time.perf_counter() - t0) * 1e3)
        if res.get("plan_sha256") != self.plan_sha or res.get("active_set_signature") != decision.signature:
            await self.sync()  # another plan, validate-only, or a state we did not expect: read the truth
        else:
            if res.get("previous_signature") not in (None, signature(self.current)):
                self.drifts += 1  # someone else changed the set; the full target just overwrote it
            self.current = dict(decision.target)
        return SwapOutcome(
            "swapped", res.get("active_set_signature", decision.signature), decision.reason,
            bytes_copied=int(res.get("bytes_copied", 0)), experts_loaded=int(res.get("experts_loaded", 0)),
            backend_ms=(time.perf_counter() - t0) * 1e3, installed_by=request_id, noop=bool(res.get("noop")),
            detail={"delta": res.get("delta"), "timing_ms": res.get("timing_ms")},
        )
