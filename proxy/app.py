"""The OpenAI-compatible routing proxy (starlette, pure ASGI; no BaseHTTPMiddleware).

Per completion request: read and check the body, take or make a request id,
classify the prompt in a worker thread, ask the residency coordinator to
install a set covering it (bounded wait), forward the untouched body to the
backend and relay the response as it streams, then fetch the backend's
router misses for the request and record everything for ``/forensics``,
``/stats`` and ``/metrics``. Residency problems are recorded, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from reap_swap.plan import load_plan
from reap_swap.server_ext.errors import HTTPError, error_body

from .backend import BackendClient, forward_headers
from .policy import ResidencyPolicy, Wish
from .prompts import prompt_from_body
from .relay import Relay
from .residency import ResidencyCoordinator, SwapOutcome
from .stats import ProxyStats

logger = logging.getLogger("reap_swap.proxy")
PROXY_KEY_HEADER = "x-reap-proxy-key"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True)
class ProxyConfig:
    backend: str
    plan: Path
    classifier: Path | None
    control_token: str | None = None
    proxy_key: str | None = None
    max_body_bytes: int = 8 << 20
    backend_timeout_s: float = 600.0
    swap_wait_s: float = 2.0
    hysteresis: float = 0.05
    policy: str = "union"
    classify_threads: int = 0  # 0 = half the cores (the backend's workers busy-poll a core each)


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


class ReapProxy:
    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.plan = load_plan(cfg.plan)
        self.stats = ProxyStats()
        self.classifier: Any = None
        self.backend: BackendClient | None = None
        self.coordinator: ResidencyCoordinator | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # One dedicated thread for the embedder: OpenMP keeps one thread team per calling
        # thread, so spreading calls over the default pool's threads oversubscribes the CPU.
        self._classify_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reap-classify")
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.passthrough_get, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/forensics/{request_id:path}", self.forensics, methods=["GET"]),
                Route("/stats", self.stats_route, methods=["GET"]),
                Route("/metrics", self.metrics, methods=["GET"]),
            ],
            exception_handlers={404: self._not_found, 405: self._not_allowed},
            lifespan=self.lifespan,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        from reap_swap.classifier.model import SliceClassifier

        self.backend = BackendClient(self.cfg.backend, self.cfg.control_token, self.cfg.backend_timeout_s)
        prior: dict[int, Any] = {}
        if self.cfg.classifier is not None:
            import os

            import torch

            # An OpenMP team that shares cores with vLLM's busy-polling workers stalls at its
            # barriers (100+ ms per prompt measured on 2 cores); a small team does not.
            torch.set_num_threads(self.cfg.classify_threads or max(1, min(4, (os.cpu_count() or 2) // 2)))
            loop = asyncio.get_running_loop()
            self.classifier = await loop.run_in_executor(self._classify_pool, SliceClassifier.load, self.cfg.classifier, self.plan)
            prior = {layer: self.classifier.expert_prior[i] for i, layer in enumerate(self.classifier.layout.layer_ids)}
            await loop.run_in_executor(self._classify_pool, self.classifier.select, "warm up the embedder")
        self.coordinator = ResidencyCoordinator(self.backend, ResidencyPolicy(self.plan, self.cfg.hysteresis, self.cfg.policy), prior, self.cfg.swap_wait_s)
        try:
            await self.coordinator.sync()
        except Exception as exc:  # noqa: BLE001 - the backend may start after the proxy
            logger.warning("backend residency state not readable yet (%s); will retry per request", exc)
        yield
        for task in list(self._tasks):
            task.cancel()
        await self.backend.aclose()
        self._classify_pool.shutdown(wait=False, cancel_futures=True)

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return _error(404, f"no route {request.method} {request.url.path}", "not_found")

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return _error(405, f"method {request.method} not allowed on {request.url.path}", "method_not_allowed")

    def _check_key(self, request: Request) -> None:
        if self.cfg.proxy_key and not hmac.compare_digest(request.headers.get(PROXY_KEY_HEADER, "").encode(), self.cfg.proxy_key.encode()):
            raise HTTPError(401, f"missing or wrong {PROXY_KEY_HEADER} header", "invalid_proxy_key")

    async def _read_json(self, request: Request) -> tuple[bytes, dict[str, Any]]:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.cfg.max_body_bytes:
            raise HTTPError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", "body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.cfg.max_body_bytes:
                raise HTTPError(413, f"request body exceeds {self.cfg.max_body_bytes} bytes", "body_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise HTTPError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(body, dict):
            raise HTTPError(400, "request body must be a JSON object", "invalid_body")
        return raw, body

    def _request_id(self, request: Request) -> str:
        rid = request.headers.get("x-request-id")
        if rid is None:
            return f"reap-{uuid.uuid4().hex[:20]}"
        if not _REQUEST_ID.match(rid):
            raise HTTPError(400, "X-Request-Id must be 1-128 characters of [A-Za-z0-9._:-]", "invalid_request_id")
        return rid

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _select(self, body: dict[str, Any], route: str) -> tuple[Wish, dict[str, Any]]:
        text = prompt_from_body(route, body)
        info: dict[str, Any] = {"prompt_chars": len(text or ""), "classified": False}
        if text and self.classifier is not None:
            try:
                sel = await asyncio.get_running_loop().run_in_executor(self._classify_pool, self.classifier.select, text)
                info.update(classified=True, embed_ms=sel.embed_ms, predict_ms=sel.predict_ms,
                            chosen_slices={f"layer_{k}": v for k, v in sorted(sel.slices.items())},
                            slice_scores={f"layer_{k}": [round(x, 5) for x in v] for k, v in sorted(sel.scores.items())})
                return Wish(sel.scores), info
            except Exception as exc:  # noqa: BLE001 - fall back to the static choice
                info["classify_error"] = f"{type(exc).__name__}: {exc}"
        # No usable text (token-id prompts) or no classifier: the training set's average wish.
        prior = self.classifier.expert_prior if self.classifier is not None else None
        scores = {}
        for li, (layer, lp) in enumerate(sorted(self.plan.layers.items())):
            scores[layer] = [float(prior[li][list(s.experts)].sum()) if prior is not None else 1.0 for s in lp.slices]
        return Wish(scores), info

    async def completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            self._check_key(request)
            rid = self._request_id(request)
            raw, body = await self._read_json(request)
        except HTTPError as exc:
            self.stats.responses_by_status[exc.status] += 1
            return JSONResponse(exc.body(), status_code=exc.status)
        route = request.url.path
        record: dict[str, Any] = {"request_id": rid, "route": route, "stream": bool(body.get("stream")), "received_at": time.time()}
        t1 = time.perf_counter()
        wish, info = await self._select(body, route)
        t2 = time.perf_counter()
        record["prompt"] = {k: v for k, v in info.items() if k not in ("chosen_slices", "slice_scores")}
        record["chosen_slices"] = info.get("chosen_slices", {})
        record["slice_scores"] = info.get("slice_scores", {})
        assert self.coordinator is not None and self.backend is not None
        try:
            if not self.coordinator.synced:
                await self.coordinator.sync()
            outcome = await self.coordinator.admit(rid, wish)
        except Exception as exc:  # noqa: BLE001 - residency never fails a request
            outcome = SwapOutcome("failed", "", f"{type(exc).__name__}: {exc}")
        t3 = time.perf_counter()
        record["swap"] = outcome.__dict__
        headers = forward_headers(dict(request.headers), rid)
        try:
            upstream = await self.backend.open_stream("POST", route, headers, raw, params=request.query_params)
        except httpx.TimeoutException as exc:
            return self._fail(rid, record, 504, f"backend timed out: {type(exc).__name__}", "backend_timeout")
        except httpx.HTTPError as exc:
            return self._fail(rid, record, 502, f"backend unreachable: {type(exc).__name__}: {exc}", "backend_unavailable")
        t4 = time.perf_counter()
        classify_ms, swap_ms = (t2 - t1) * 1e3, (t3 - t2) * 1e3
        overhead_ms = (t4 - t0) * 1e3 - classify_ms - swap_ms - (t4 - t3) * 1e3
        record["timings"] = {"classify_ms": classify_ms, "swap_wait_ms": swap_ms, "overhead_ms": overhead_ms,
                             "backend_headers_ms": (t4 - t3) * 1e3}
        extra = {"X-Request-Id": rid, "X-Reap-Overhead-Ms": f"{overhead_ms:.3f}", "X-Reap-Classify-Ms": f"{classify_ms:.3f}",
                 "X-Reap-Swap-Ms": f"{swap_ms:.3f}", "X-Reap-Active-Set-Signature": outcome.signature}

        async def done(outcome_name: str, sent: int) -> None:
            self.coordinator.release(rid)  # type: ignore[union-attr]
            record["backend"] = {"status": upstream.status_code, "outcome": outcome_name, "bytes": sent}
            record["timings"]["total_ms"] = (time.perf_counter() - t0) * 1e3
            self.stats.responses_by_status[upstream.status_code] += 1
            if outcome_name != "complete":
                self.stats.errors[outcome_name] += 1
            self.stats.count_request(record)
            self.stats.put(record)
            if upstream.status_code == 200:
                self._spawn(self._collect_misses(rid, record))

        return Relay(upstream, extra, done)  # type: ignore[return-value]

    def _fail(self, rid: str, record: dict[str, Any], status: int, message: str, code: str) -> Response:
        assert self.coordinator is not None
        self.coordinator.release(rid)
        record["backend"] = {"status": status, "outcome": code}
        self.stats.responses_by_status[status] += 1
        self.stats.errors[code] += 1
        self.stats.count_request(record)
        self.stats.put(record)
        return _error(status, message, code)

    async def _collect_misses(self, rid: str, record: dict[str, Any]) -> None:
        assert self.backend is not None
        try:
            misses = await self.backend.router_misses(rid)
        except Exception as exc:  # noqa: BLE001
            record["router_misses"] = {"error": f"{type(exc).__name__}: {exc}"}
            return
        if misses is None:
            record["router_misses"] = {"error": "backend recorded no routed tokens for this id"}
            return
        record["router_misses"] = {
            "summary": misses["summary"],
            "by_layer": {k: {"inactive_ratio": v["inactive_ratio"], "observed_mass": v["observed_mass"], "inactive_mass": v["inactive_mass"]}
                         for k, v in misses["by_layer"].items()},
        }
        self.stats.count_misses(misses)

    async def passthrough_get(self, request: Request) -> Response:
        assert self.backend is not None
        try:
            self._check_key(request)
            headers = forward_headers(dict(request.headers), self._request_id(request))
            upstream = await self.backend.open_stream("GET", request.url.path, headers, None)
        except HTTPError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except httpx.TimeoutException:
            return _error(504, "backend timed out", "backend_timeout")
        except httpx.HTTPError as exc:
            return _error(502, f"backend unreachable: {type(exc).__name__}", "backend_unavailable")

        async def done(outcome: str, sent: int) -> None:
            return None

        return Relay(upstream, {}, done)  # type: ignore[return-value]

    async def health(self, request: Request) -> Response:
        assert self.backend is not None
        try:
            r = await self.backend.client.get("/health", timeout=2.0)
            backend = "ok" if r.status_code == 200 else f"HTTP {r.status_code}"
        except httpx.HTTPError as exc:
            backend = f"unreachable ({type(exc).__name__})"
        return JSONResponse({"status": "ok", "backend": backend, "plan_sha256": self.plan.sha256,
                             "classifier": self.classifier is not None})

    async def forensics(self, request: Request) -> Response:
        rec = self.stats.get(request.path_params["request_id"])
        if rec is None:
            return _error(404, f"no record for request {request.path_params['request_id']!r}", "unknown_request", "request_id")
        return JSONResponse(rec)

    async def stats_route(self, request: Request) -> Response:
        return JSONResponse(self.stats.snapshot())

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(self.stats.prometheus(), media_type="text/plain; version=0.0.4")
