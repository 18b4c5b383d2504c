"""The residency control plane in vLLM's API process (transport-free).

It owns what the API process must know: the plan and its identity, the
resident set the workers report, per-request forensics and refresh budgets,
and swap counters. Every change goes to the workers through one RPC
callable, serialized by a lock (one swap in flight), and the resident state
it keeps is always the one the workers answered with.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping

from reap_swap.plan import LayerPlan, Plan, PlanError, check_plan_fits_model

from .active_set import PayloadError, SwapRequest, compute_delta, parse_swap_request, signature
from .config import ResidencyConfig
from .errors import HTTPError
from .misses import ALL_REQUESTS

Rpc = Callable[..., Awaitable[list[Any]]]
_CARTRIDGE_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
MAX_FORENSICS = 4096


@dataclass
class Counters:
    swaps: int = 0
    noops: int = 0
    rejected: int = 0
    bytes_copied: int = 0
    experts_loaded: int = 0
    swap_ms_total: float = 0.0


@dataclass
class RequestRecord:
    refreshes_used: int = 0
    swaps: list[dict[str, Any]] = field(default_factory=list)
    rejected: list[dict[str, Any]] = field(default_factory=list)


def synthetic_plan(layers: list[int], num_experts: int, slots: Mapping[int, int], expert_bytes: int) -> Plan:
    """A core-less plan for servers started with --resident-experts-per-layer alone."""
    layer_plans = {i: LayerPlan(i, num_experts, (), (), slots[i]) for i in layers}
    return Plan(raw={"mode": "synthetic"}, sha256="", layers=layer_plans, per_expert_bytes=expert_bytes, max_refreshes_per_request=1 << 30)


class ControlPlane:
    def __init__(self, cfg: ResidencyConfig, rpc: Rpc):
        self.cfg = cfg
        self._rpc = rpc
        self._lock = asyncio.Lock()
        self.plan: Plan | None = None
        self.resident: dict[int, tuple[int, ...]] = {}
        self.capacity: dict[int, int] = {}
        self.worker_info: dict[str, Any] = {}
        self.counters = Counters()
        self.records: OrderedDict[str, RequestRecord] = OrderedDict()
        self.cartridges: OrderedDict[str, dict[str, list[int]]] = OrderedDict()

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
        self._set_resident(info["resident"])

    def _set_resident(self, resident: Mapping[str, list[int]]) -> None:
        self.resident = {int(k.removeprefix("layer_")): tuple(sorted(v)) for k, v in resident.items()}

    @property
    def ready(self) -> bool:
        return self.plan is not None

    def _require_plan(self) -> Plan:
        if self.plan is None:
            raise HTTPError(503, "residency control plane is not ready", "not_ready")
        return self.plan

    def _record(self, request_id: str) -> RequestRecord:
        rec = self.records.get(request_id)
        if rec is None:
            rec = self.records[request_id] = RequestRecord()
        self.records.move_to_end(request_id)
        while len(self.records) > MAX_FORENSICS:
            self.records.popitem(last=False)
        return rec

    def _reject(self, payload: Any, exc: PayloadError) -> HTTPError:
        self.counters.rejected += 1
        rid = payload.get("request_id") if isinstance(payload, Mapping) else None
        if isinstance(rid, str) and rid.strip():
            rec = self._record(rid)
            rec.rejected = (rec.rejected + [{"at": time.time(), "code": exc.code, "message": str(exc)}])[-8:]
        return HTTPError(exc.status, str(exc), exc.code, exc.param)

    async def swap(self, payload: Any, *, warm: bool = False) -> dict[str, Any]:
        plan = self._require_plan()
        t0 = time.perf_counter()
        async with self._lock:
            try:
                req = parse_swap_request(payload, plan, self.resident, self.capacity, warm=warm)
            except PayloadError as exc:
                raise self._reject(payload, exc) from None
            rec = self._record(req.request_id)
            if req.phase == "decode_refresh" and not warm:
                if rec.refreshes_used >= plan.max_refreshes_per_request:
                    raise self._reject(
                        payload,
                        PayloadError(
                            f"refresh budget exhausted: request {req.request_id!r} used "
                            f"{rec.refreshes_used} of {plan.max_refreshes_per_request} decode refreshes",
                            "refresh_budget_exhausted",
                            "phase",
                            status=409,
                        ),
                    )
                rec.refreshes_used += 1
            try:
                return await self._apply(req, rec, plan, t0)
            except BaseException:
                if req.phase == "decode_refresh" and not warm:
                    rec.refreshes_used -= 1  # a swap that did not happen spends no budget
                raise

    async def _apply(self, req: SwapRequest, rec: RequestRecord, plan: Plan, t0: float) -> dict[str, Any]:
        before = signature(self.resident)
        after = signature(req.target)
        delta = compute_delta(self.resident, req.target)
        t_valid = time.perf_counter()
        worker: dict[str, Any] = {"bytes_copied": 0, "experts_loaded": 0, "experts_evicted": 0, "copy_ms": 0.0, "publish_ms": 0.0}
        noop = before == after
        if not noop and not self.cfg.validate_only:
            changed = {f"layer_{i}": list(req.target[i]) for i in delta.layers if delta.layers[i].added or delta.layers[i].removed}
            results = await self._rpc("reap_swap", changed)
            worker = results[0]
            self._set_resident(worker["resident"])
        t_end = time.perf_counter()
        if req.reset_router_stats:
            await self._rpc("reap_reset_router_stats")
        self.counters.swaps += 1
        self.counters.noops += int(noop)
        self.counters.bytes_copied += int(worker["bytes_copied"])
        self.counters.experts_loaded += int(worker["experts_loaded"])
        self.counters.swap_ms_total += (t_end - t0) * 1e3
        result = {
            "status": "ok",
            "request_id": req.request_id,
            "phase": req.phase,
            "warm_start_only": req.warm,
            "noop": noop,
            "validate_only": self.cfg.validate_only,
            "mode": "serialized_single_flight",
            "active_set_signature": after if not self.cfg.validate_only else before,
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
            "refreshes_used": rec.refreshes_used,
            "refreshes_remaining": max(plan.max_refreshes_per_request - rec.refreshes_used, 0),
            "at": time.time(),
        }
        rec.swaps = (rec.swaps + [result])[-8:]
        return result

    async def router_misses(self, request_id: str, reset: bool) -> dict[str, Any]:
        self._require_plan()
        reports = await self._rpc("reap_router_misses", request_id, reset)
        report = reports[0]  # TP ranks route identically; rank 0 answers
        if report is None:
            raise HTTPError(404, f"no routed tokens recorded for request {request_id!r}", "unknown_request", "request_id")
        report["request_id"] = request_id
        report["active_set_signature"] = signature(self.resident)
        return report

    def resident_summary(self) -> dict[str, Any]:
        return {
            "signature": signature(self.resident),
            "by_layer": {f"layer_{i}": list(v) for i, v in sorted(self.resident.items())},
            "resident_experts": sum(len(v) for v in self.resident.values()),
            "slots": {f"layer_{i}": n for i, n in sorted(self.capacity.items())},
        }

    def forensics(self, request_id: str) -> dict[str, Any]:
        plan = self._require_plan()
        rec = self.records.get(request_id)
        if rec is None:
            raise HTTPError(404, f"no swap recorded for request {request_id!r}", "unknown_request", "request_id")
        return {
            "request_id": request_id,
            "last_swap": rec.swaps[-1] if rec.swaps else None,
            "swaps": len(rec.swaps),
            "rejected": rec.rejected,
            "refreshes_used": rec.refreshes_used,
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
            "counters": {
                "swaps": c.swaps,
                "noops": c.noops,
                "rejected": c.rejected,
                "bytes_copied": c.bytes_copied,
                "experts_loaded": c.experts_loaded,
                "swap_ms_total": c.swap_ms_total,
            },
            "validate_only": self.cfg.validate_only,
        }

    def _load_cartridge(self, cartridge_id: str) -> tuple[dict[str, list[int]], bool, list[str]]:
        if cartridge_id in self.cartridges:
            self.cartridges.move_to_end(cartridge_id)
            return self.cartridges[cartridge_id], True, []
        plan = self._require_plan()
        found: Any = None
        section = plan.raw.get("cartridges")
        if isinstance(section, Mapping) and cartridge_id in section:
            found = section[cartridge_id]
        elif self.cfg.cartridge_dir:
            path = Path(self.cfg.cartridge_dir) / f"{cartridge_id}.json"
            if path.is_file():
                try:
                    found = json.loads(path.read_text())
                except json.JSONDecodeError as exc:
                    raise HTTPError(422, f"cartridge {cartridge_id!r} is not valid JSON: {exc}", "invalid_cartridge") from None
        if found is None:
            raise HTTPError(404, f"unknown cartridge {cartridge_id!r}", "unknown_cartridge", "cartridge_id")
        active = found.get("active_set", found) if isinstance(found, Mapping) else None
        if not isinstance(active, Mapping):
            raise HTTPError(422, f"cartridge {cartridge_id!r} has no active_set object", "invalid_cartridge")
        evicted: list[str] = []
        self.cartridges[cartridge_id] = dict(active)
        while len(self.cartridges) > self.cfg.max_loaded_cartridges:
            evicted.append(self.cartridges.popitem(last=False)[0])
        return self.cartridges[cartridge_id], False, evicted

    async def swap_cartridge(self, cartridge_id: str, body: Any) -> dict[str, Any]:
        if not _CARTRIDGE_ID.match(cartridge_id):
            raise HTTPError(400, "cartridge id must match [A-Za-z0-9_.-]{1,128}", "invalid_value", "cartridge_id")
        if body is not None and not isinstance(body, Mapping):
            raise HTTPError(400, "request body must be a JSON object", "invalid_body")
        body = dict(body or {})
        unknown = sorted(set(body) - {"request_id", "phase", "allow_missing_core"})
        if unknown:
            raise HTTPError(400, f"unknown field(s): {', '.join(unknown)}", "unknown_field", unknown[0])
        active, hit, evicted = self._load_cartridge(cartridge_id)
        payload = {"request_id": body.get("request_id", f"cartridge-{cartridge_id}"), "phase": body.get("phase", "prefill"), "active_set": active}
        if "allow_missing_core" in body:
            payload["allow_missing_core"] = body["allow_missing_core"]
        result = await self.swap(payload)
        result["cartridge"] = {"id": cartridge_id, "cache_hit": hit, "evicted": evicted, "loaded": list(self.cartridges)}
        return result

    async def reset_router_stats(self) -> int:
        return int((await self._rpc("reap_reset_router_stats"))[0])


__all__ = ["ControlPlane", "ALL_REQUESTS", "PlanError"]
