"""The residency control plane in vLLM's API process (transport-free).

It owns what the API process must know: the plan and its identity, the
resident set the workers report, per-request forensics and refresh budgets,
and swap counters. Every change goes to the workers through one RPC
callable, serialized by a lock (one swap in flight), and the resident state
it keeps is always the one the workers answered with.

When a swap fails inside a worker, ranks answer with different resident
sets, or a rank reports a layer whose bookkeeping is broken (its answers'
``problems``: lost spare rows, a routing table not re-published), the view is
marked inconsistent: every rank's resident set is re-read, broken layers are
repaired (``reap_repair``), ranks that disagree are brought to one set, and
resident-state routes answer 503 until all ranks agree and none is broken.
Nothing here is unbounded: swap forensics are kept as JSON bytes in an LRU
bounded by their total size (``REAP_FORENSICS_MAX_BYTES``), refresh budgets and
rejection logs in LRUs bounded by count, and bytes copied are metered by a token
bucket (a fresh request id buys nothing). ``/metrics`` reads the workers at most
once per ``METRICS_MAX_AGE_S``, and every scrape that misses that cache waits on
the one read in flight (single flight), so a scrape storm costs one RPC of each kind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Mapping

from cachetools import LRUCache

from reap_swap.plan import LayerPlan, Plan, PlanError, check_plan_fits_model

from .active_set import PayloadError, ResidentSets, SwapRequest, compute_delta, parse_swap_request, signature
from .cartridges import CartridgeStore, check_id
from ..config import ResidencyConfig
from .errors import HTTPError
from .metrics import exposition
from ..step.misses import ALL_REQUESTS
from .ratelimit import TokenBucket

Rpc = Callable[..., Awaitable[list[Any]]]
logger = logging.getLogger("reap_swap.server_ext")
MAX_FORENSICS = 4096  # request ids whose refresh budget is remembered (an int each)
MAX_REJECTION_IDS = 1024
MAX_REJECTIONS_PER_ID = 8
MAX_SWAPS_PER_RECORD = 8


METRICS_MAX_AGE_S = 5.0  # scrapes within this share one read of the workers


@dataclass
class Counters:
    swaps: int = 0
    noops: int = 0
    rejected: int = 0
    rate_limited: int = 0
    failed: int = 0
    resyncs: int = 0
    bytes_copied: int = 0
    experts_loaded: int = 0
    swap_ms_total: float = 0.0


Forensics = tuple[bytes, ...]
"""A request's last swap results, each as its JSON encoding (the bytes the size bound counts)."""


def forensics_bytes(swaps: Forensics) -> int:
    return sum(len(b) for b in swaps)


def synthetic_plan(layers: list[int], num_experts: int, slots: Mapping[int, int], expert_bytes: int) -> Plan:
    """A core-less plan for servers started with --resident-experts-per-layer alone."""
    layer_plans = {i: LayerPlan(i, num_experts, (), (), slots[i]) for i in layers}
    return Plan(raw={"mode": "synthetic"}, sha256="", layers=layer_plans, per_expert_bytes=expert_bytes, max_refreshes_per_request=1 << 30)


def parse_resident(resident: Mapping[str, list[int]]) -> ResidentSets:
    return {int(str(k).removeprefix("layer_")): tuple(sorted(int(e) for e in v)) for k, v in resident.items()}


def layer_payload(resident: ResidentSets) -> dict[str, list[int]]:
    """Every layer of a resident state (a per-layer no-op costs the workers nothing)."""
    return {f"layer_{i}": list(v) for i, v in sorted(resident.items())}


class ControlPlane:
    def __init__(self, cfg: ResidencyConfig, rpc: Rpc):
        self.cfg = cfg
        self._rpc = rpc
        self._metrics_cache: tuple[float, bytes] | None = None
        self._metrics_read: asyncio.Task[bytes] | None = None
        """The workers' read in flight for ``/metrics``: every scrape that misses the cache awaits this one."""
        self._lock = asyncio.Lock()
        self.plan: Plan | None = None
        self.resident: ResidentSets = {}
        self.capacity: dict[int, int] = {}
        self.worker_info: dict[str, Any] = {}
        self.counters = Counters()
        self.refreshes: LRUCache[str, int] = LRUCache(MAX_FORENSICS)
        """Decode refreshes used per request id: kept apart from the forensics, so their size bound never resets a budget."""
        self.records: LRUCache[str, Forensics] = LRUCache(cfg.forensics_max_bytes, getsizeof=forensics_bytes)
        self.rejections: LRUCache[str, list[dict[str, Any]]] = LRUCache(MAX_REJECTION_IDS)
        self.cartridges = CartridgeStore(cfg.max_loaded_cartridges, cfg.cartridge_dir)
        self.bucket: TokenBucket | None = None
        self.inconsistent: str | None = None
        """Why the resident view cannot be trusted (None: every rank agrees with it)."""
        self.rank_signatures: list[str] = []
        """Each rank's resident-set signature at the last read of every rank (rank order)."""
        self.last_resync: dict[str, Any] | None = None
        """What the last repair saw and did, read by read: when, each rank's signature, broken ranks; its outcome."""
        self._resync_reads: list[dict[str, Any]] | None = None

    async def start(self) -> None:
        """Install residency in every worker and check the plan fits the served model."""
        infos = await self._rpc("reap_install")
        info = infos[0]
        layers = [int(i) for i in info["layers"]]
        self.capacity = {int(k.removeprefix("layer_")): int(v) for k, v in info["slots"].items()}
        plan = self.cfg.plan()
        if plan is not None:
            check_plan_fits_model(plan, layers, int(info["num_experts"]))
        else:
            plan = synthetic_plan(layers, int(info["num_experts"]), self.capacity, int(info["expert_bytes"]))
        self.plan = plan
        self.worker_info = info
        if self.cfg.swap_bytes_per_s > 0:
            full_bank = sum(self.capacity.values()) * int(info["expert_bytes"])
            self.bucket = TokenBucket(self.cfg.swap_bytes_per_s, max(self.cfg.swap_bytes_per_s, full_bank, 1))
        self._check_ranks(infos, "at start-up")

    @property
    def ready(self) -> bool:
        return self.plan is not None

    def _require_plan(self) -> Plan:
        if self.plan is None:
            raise HTTPError(503, "residency control plane is not ready", "not_ready")
        return self.plan

    def _check_ranks(self, answers: list[Mapping[str, Any]], when: str) -> bool:
        """Adopt the ranks' resident set if they all agree and no rank reports a broken layer (an
        answer's ``problems``: layer -> what ``ExpertBank.check`` found), else mark the view inconsistent."""
        states = [parse_resident(a["resident"]) for a in answers]
        broken = {f"rank {r}": dict(a["problems"]) for r, a in enumerate(answers) if a.get("problems")}
        self.resident = states[0] if states else self.resident
        self.rank_signatures = [signature(s) for s in states]
        if self._resync_reads is not None:
            self._resync_reads.append({"when": when, "rank_signatures": list(self.rank_signatures), "broken_ranks": sorted(broken)})
        if broken:
            self.inconsistent = f"layers inconsistent {when}: {broken}"[:2000]
            return False
        if states and all(s == states[0] for s in states[1:]):
            self.inconsistent = None
            return True
        sigs = [signature(s) for s in states]
        self.inconsistent = f"ranks disagree {when}: resident signatures {sigs}"
        return False

    async def _read_ranks(self) -> list[Mapping[str, Any]]:
        """Every rank's resident sets and broken layers, read from its tables (``swap_repair.RepairingWorkerExtension``)."""
        return list(await self._rpc("reap_resident_sets"))

    async def resync(self) -> bool:
        """Re-read every rank; repair broken layers' bookkeeping, bring disagreeing ranks to rank 0's
        set. True when consistent; until then the view stays inconsistent (swaps answer 503)."""
        self.counters.resyncs += 1
        self._resync_reads = []
        consistent = False
        try:
            consistent = await self._resync()
            return consistent
        finally:
            self.last_resync = {"reads": self._resync_reads, "consistent": consistent, "reason_left": self.inconsistent}
            self._resync_reads = None

    async def _resync(self) -> bool:
        try:
            answers = await self._read_ranks()
            if self._check_ranks(answers, "after re-read"):
                return True
            if any(a.get("problems") for a in answers):
                logger.warning("reap-swap: %s; repairing their bookkeeping", self.inconsistent)
                await self._rpc("reap_repair")
                answers = await self._read_ranks()
                if self._check_ranks(answers, "after a bookkeeping repair"):
                    return True
                if any(a.get("problems") for a in answers):
                    logger.error("reap-swap: %s", self.inconsistent)
                    return False
            logger.warning("reap-swap: %s; repairing to rank 0's set", self.inconsistent)
            await self._rpc("reap_swap", layer_payload(self.resident))
            return self._check_ranks(await self._read_ranks(), "after repair")
        except Exception as exc:  # noqa: BLE001 - stays inconsistent; the next call retries
            self.inconsistent = f"resync failed: {type(exc).__name__}: {exc}"
            logger.error("reap-swap: %s", self.inconsistent)
            return False

    async def refresh_view(self) -> None:
        """With the online cache on, residency changes inside the forward: read every rank's resident
        sets and cache counters back now (before a swap and for reports; never per step)."""
        if not self.cfg.online_cache or self.plan is None:
            return
        views = await self._rpc("reap_cache_view")
        self.worker_info["online_cache"] = views[0]["online_cache"]
        self._check_ranks(views, "after a read-back of the online caches")

    async def read_back(self) -> None:
        """``refresh_view`` for reports, serialized with swaps."""
        if self.cfg.online_cache and self.plan is not None:
            async with self._lock:
                await self.refresh_view()

    async def _ensure_consistent(self) -> None:
        if self.inconsistent is not None and not await self.resync():
            raise HTTPError(503, f"resident state is being repaired ({self.inconsistent}); retry", "resident_state_inconsistent",
                            headers={"Retry-After": "1"})

    def _keep(self, request_id: str, result: dict[str, Any]) -> None:
        """Append a swap result to the request's forensics (its last ``MAX_SWAPS_PER_RECORD``), as JSON
        bytes; the oldest records go when their total passes ``forensics_max_bytes``."""
        blob = json.dumps(result, separators=(",", ":")).encode()
        swaps = (self.records.get(request_id, ()) + (blob,))[-MAX_SWAPS_PER_RECORD:]
        try:
            self.records[request_id] = swaps
        except ValueError:  # one record larger than the whole bound: keep the newest result only, or nothing
            self.records.pop(request_id, None)
            if len(blob) <= self.records.maxsize:
                self.records[request_id] = (blob,)

    def _reject(self, payload: Any, exc: PayloadError) -> HTTPError:
        """Count and log a refused payload; it creates no request record and spends nothing."""
        self.counters.rejected += 1
        rid = payload.get("request_id") if isinstance(payload, Mapping) else None
        if isinstance(rid, str) and rid.strip() and len(rid) <= 256:
            log = self.rejections.get(rid, [])
            self.rejections[rid] = (log + [{"at": time.time(), "code": exc.code, "message": str(exc)[:500]}])[-MAX_REJECTIONS_PER_ID:]
        return HTTPError(exc.status, str(exc), exc.code, exc.param)

    async def swap(self, payload: Any, *, warm: bool = False) -> dict[str, Any]:
        plan = self._require_plan()
        t0 = time.perf_counter()
        async with self._lock:
            await self.refresh_view()
            await self._ensure_consistent()
            try:
                req = parse_swap_request(payload, plan, self.resident, self.capacity, warm=warm)
            except PayloadError as exc:
                raise self._reject(payload, exc) from None
            noop = signature(self.resident) == signature(req.target)
            refresh = req.phase == "decode_refresh" and not warm and not noop
            used = self.refreshes.get(req.request_id, 0)
            if refresh and used >= plan.max_refreshes_per_request:
                raise self._reject(payload, PayloadError(
                    f"refresh budget exhausted: request {req.request_id!r} used {used} of "
                    f"{plan.max_refreshes_per_request} decode refreshes", "refresh_budget_exhausted", "phase", status=409))
            if not noop and not self.cfg.validate_only and self.bucket is not None:
                expert_bytes = int(self.worker_info.get("expert_bytes") or plan.per_expert_bytes)
                cost = compute_delta(self.resident, req.target).experts_added * expert_bytes
                wait = self.bucket.try_take(cost)
                if wait > 0:
                    self.counters.rate_limited += 1
                    raise HTTPError(429, f"swap rate limit: {cost} bytes needed, {self.bucket.available:.0f} available "
                                    f"({self.cfg.swap_bytes_per_s} bytes/s); retry in {wait:.2f}s", "swap_rate_limited",
                                    headers={"Retry-After": str(max(1, int(wait + 0.999)))})
            result = await self._apply(req, plan, t0, noop)
            used += int(refresh)
            self.refreshes[req.request_id] = used
            result["refreshes_used"] = used
            result["refreshes_remaining"] = max(plan.max_refreshes_per_request - used, 0)
            self._keep(req.request_id, result)
            return result

    async def _apply(self, req: SwapRequest, plan: Plan, t0: float, noop: bool) -> dict[str, Any]:
        before = signature(self.resident)
        after = signature(req.target)
        delta = compute_delta(self.resident, req.target)
        t_valid = time.perf_counter()
        worker: dict[str, Any] = {"bytes_copied": 0, "experts_loaded": 0, "experts_evicted": 0, "copy_ms": 0.0, "publish_ms": 0.0}
        if not noop and not self.cfg.validate_only:
            try:
                results = await self._rpc("reap_swap", layer_payload(req.target))
            except Exception as exc:  # noqa: BLE001 - a worker failed part-way: re-read the truth
                self.counters.failed += 1
                self.inconsistent = f"swap failed in a worker: {type(exc).__name__}: {exc}"
                logger.error("reap-swap: %s", self.inconsistent)
                repaired = await self.resync()
                state = f"resident set re-read from every rank (signature {signature(self.resident)})" if repaired else self.inconsistent
                raise HTTPError(503, f"swap failed in a worker ({type(exc).__name__}: {exc}); {state}", "swap_failed",
                                headers={"Retry-After": "1"}) from None
            worker = results[0]
            for key in ("complement", "online_cache"):  # live counters for /reap/status
                if key in worker:
                    self.worker_info[key] = worker[key]
            if not self._check_ranks(results, "after a swap"):
                await self.resync()
                raise HTTPError(503, f"swap left ranks inconsistent; {self.inconsistent or 'repaired'}", "swap_failed",
                                headers={"Retry-After": "1"})
        t_end = time.perf_counter()
        if req.reset_router_stats:
            await self._rpc("reap_reset_router_stats")
        self.counters.swaps += 1
        self.counters.noops += int(noop)
        self.counters.bytes_copied += int(worker["bytes_copied"])
        self.counters.experts_loaded += int(worker["experts_loaded"])
        self.counters.swap_ms_total += (t_end - t0) * 1e3
        return {
            "status": "ok",
            "request_id": req.request_id,
            "phase": req.phase,
            "warm_start_only": req.warm,
            "noop": noop,
            "validate_only": self.cfg.validate_only,
            "mode": "serialized_single_flight",
            "active_set_signature": signature(self.resident),
            "requested_signature": after,
            "previous_signature": before,
            "plan_sha256": plan.sha256,
            "bytes_copied": int(worker["bytes_copied"]),
            "experts_added": delta.experts_added,
            "experts_removed": delta.experts_removed,
            "experts_loaded": int(worker["experts_loaded"]),
            "experts_evicted": int(worker["experts_evicted"]),
            "delta": delta.to_json(),
            "timing_ms": {
                "validate": (t_valid - t0) * 1e3,
                "copy": float(worker["copy_ms"]),
                "publish": float(worker["publish_ms"]),
                "total": (t_end - t0) * 1e3,
            },
            "at": time.time(),
        }

    async def router_misses(self, request_id: str, reset: bool) -> dict[str, Any]:
        self._require_plan()
        if not request_id or len(request_id) > 256:
            raise HTTPError(400, "request id must be 1-256 characters", "invalid_value", "request_id")
        reports = await self._rpc("reap_router_misses", request_id, reset)
        report = reports[0]  # TP ranks route identically; rank 0 answers
        if report is None:
            raise HTTPError(404, f"no routed tokens recorded for request {request_id!r}", "unknown_request", "request_id")
        report["request_id"] = request_id
        report["active_set_signature"] = signature(self.resident)
        return report

    async def metrics_text(self, max_age_s: float = METRICS_MAX_AGE_S) -> bytes:
        """Prometheus text of the residency counters, read from the workers at most every ``max_age_s``
        (the RPCs run between engine steps, never per step). Single flight: scrapes that miss the cache
        all await the one read in flight, shielded, so a waiter's timeout or disconnect cancels only
        that waiter, and the next scrape joins the read instead of starting another."""
        self._require_plan()
        cached = self._metrics_cache
        if cached is not None and time.monotonic() - cached[0] < max_age_s:
            return cached[1]
        if self._metrics_read is None:
            self._metrics_read = asyncio.get_running_loop().create_task(self._read_metrics())
            self._metrics_read.add_done_callback(self._metrics_read_done)
        return await asyncio.shield(self._metrics_read)

    async def _read_metrics(self) -> bytes:
        state = (await self._rpc("reap_state"))[0]  # the workers read their caches' state back themselves: no swap lock here
        misses = (await self._rpc("reap_router_misses", ALL_REQUESTS, False))[0]
        self.worker_info["miss_ledger"] = state.get("miss_ledger", self.worker_info.get("miss_ledger"))
        text = exposition(dict(self.counters.__dict__), state, misses)
        self._metrics_cache = (time.monotonic(), text)
        return text

    def _metrics_read_done(self, task: "asyncio.Task[bytes]") -> None:
        """The read ended (answered, failed or cancelled): the next scrape past the cache starts a new one."""
        if self._metrics_read is task:
            self._metrics_read = None
        if not task.cancelled():
            task.exception()  # retrieved: a failure every waiter has already seen is not logged again as unhandled

    async def read_books(self) -> None:
        """Rank 0's book sizes (miss-ledger entries and bytes) and report reads, into ``worker`` for
        ``/reap/status``; cheap, no swap lock (``reap_books``)."""
        books = (await self._rpc("reap_books"))[0]
        if isinstance(books, Mapping):
            self.worker_info.update({k: books[k] for k in ("miss_ledger", "reads") if k in books})

    def resident_summary(self) -> dict[str, Any]:
        return {
            "signature": signature(self.resident),
            "by_layer": {f"layer_{i}": list(v) for i, v in sorted(self.resident.items())},
            "resident_experts": sum(len(v) for v in self.resident.values()),
            "slots": {f"layer_{i}": n for i, n in sorted(self.capacity.items())},
            "consistent": self.inconsistent is None,
            "inconsistent_reason": self.inconsistent,
            "rank_signatures": list(self.rank_signatures),
            "last_resync": self.last_resync,
        }

    def forensics(self, request_id: str) -> dict[str, Any]:
        plan = self._require_plan()
        swaps = self.records.get(request_id, ())
        rejected = self.rejections.get(request_id, [])
        if not swaps and not rejected and request_id not in self.refreshes:
            raise HTTPError(404, f"no swap recorded for request {request_id!r}", "unknown_request", "request_id")
        return {
            "request_id": request_id,
            "last_swap": json.loads(swaps[-1]) if swaps else None,
            "swaps": len(swaps),
            "rejected": rejected,
            "refreshes_used": self.refreshes.get(request_id, 0),
            "plan": {"sha256": plan.sha256, "source": plan.source, "model": plan.model},
            "resident": self.resident_summary(),
        }

    def status(self) -> dict[str, Any]:
        plan = self._require_plan()
        c = self.counters
        return {
            "plan": {"sha256": plan.sha256, "source": plan.source, "model": plan.model, "layers": len(plan.layers)},
            "worker": {k: v for k, v in self.worker_info.items() if k != "resident"},
            "resident": self.resident_summary(),
            "counters": dict(c.__dict__),
            "limits": {
                "swap_bytes_per_s": self.cfg.swap_bytes_per_s,
                "swap_bytes_available": self.bucket.available if self.bucket else None,
                "records": {"held": len(self.records), "bytes": int(self.records.currsize), "max_bytes": int(self.records.maxsize)},
                "refresh_budgets": {"held": len(self.refreshes), "max": MAX_FORENSICS},
                "rejection_logs": {"held": len(self.rejections), "max": MAX_REJECTION_IDS},
            },
            "validate_only": self.cfg.validate_only,
        }

    async def swap_cartridge(self, cartridge_id: str, body: Any) -> dict[str, Any]:
        check_id(cartridge_id)
        if body is not None and not isinstance(body, Mapping):
            raise HTTPError(400, "request body must be a JSON object", "invalid_body")
        body = dict(body or {})
        unknown = sorted(str(k)[:64] for k in body if k not in {"request_id", "phase", "allow_missing_core"})[:5]
        if unknown:
            raise HTTPError(400, f"unknown field(s): {', '.join(unknown)}", "unknown_field", unknown[0])
        active, hit, evicted = self.cartridges.load(cartridge_id, self._require_plan())
        payload = {"request_id": body.get("request_id", f"cartridge-{cartridge_id}"), "phase": body.get("phase", "prefill"), "active_set": active}
        if "allow_missing_core" in body:
            payload["allow_missing_core"] = body["allow_missing_core"]
        result = await self.swap(payload)
        result["cartridge"] = {"id": cartridge_id, "cache_hit": hit, "evicted": evicted, "loaded": self.cartridges.loaded}
        return result

    async def reset_router_stats(self) -> int:
        return int((await self._rpc("reap_reset_router_stats"))[0])


__all__ = ["ControlPlane", "ALL_REQUESTS", "PlanError"]
