"""The OpenAI-compatible routing proxy (starlette, pure ASGI; no BaseHTTPMiddleware).

Routes: the two completion routes (``completions.py``: classify, install,
forward, relay, account), ``GET /v1/models`` passed through, and the proxy's
own ``/health``, ``/forensics/{id}``, ``/stats`` and ``/metrics``. When a
proxy key is configured every route but ``/health`` needs it, and it never
travels upstream. Every error, including unexpected ones, is an OpenAI-style
JSON body. The classifier (and its heavy dependencies) is imported only when
``--classifier`` is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from reap_swap.plan import load_plan
from reap_swap.server_ext.control.errors import HTTPError, error_body

from .backend import PROXY_KEY_HEADER, BackendClient, forward_headers
from .classify import Classifier
from .completions import CompletionFlow, error_response
from .disconnect import DisconnectWatch
from .policy import ResidencyPolicy
from .relay import Relay
from .residency import ResidencyCoordinator
from .stats import PROMETHEUS_CONTENT_TYPE, ProxyStats

logger = logging.getLogger("reap_swap.proxy")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


@dataclass(frozen=True)
class ProxyConfig:
    backend: str
    plan: Path
    classifier: Path | None
    control_token: str | None = None
    backend_api_key: str | None = None
    proxy_key: str | None = None
    max_body_bytes: int = 8 << 20
    backend_timeout_s: float = 600.0
    swap_wait_s: float = 2.0
    hysteresis: float = 0.05
    policy: str = "union"
    classify_threads: int = 0  # 0 = half the cores (the backend's workers busy-poll a core each)
    classify_budget_s: float = 0.5
    max_streams: int = 256


def _error(status: int, message: str, code: str | None = None, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogateescape")).digest()


class ReapProxy:
    def __init__(self, cfg: ProxyConfig):
        self.cfg = cfg
        self.plan = load_plan(cfg.plan)
        self.stats = ProxyStats()
        self._key = _digest(cfg.proxy_key) if cfg.proxy_key else None
        self.classifier = Classifier(self.plan, None, cfg.classify_budget_s)
        self.backend: BackendClient | None = None
        self.coordinator: ResidencyCoordinator | None = None
        self.flow: CompletionFlow | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
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
            exception_handlers={404: self._not_found, 405: self._not_allowed, Exception: self._internal_error},
            lifespan=self.lifespan,
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.backend = BackendClient(self.cfg.backend, self.cfg.control_token, self.cfg.backend_timeout_s,
                                     max_streams=self.cfg.max_streams, api_key=self.cfg.backend_api_key)
        prior: dict[int, Any] = {}
        if self.cfg.classifier is not None:
            import torch

            from reap_swap.classifier.model import SliceClassifier

            # An OpenMP team that shares cores with vLLM's busy-polling workers stalls at its
            # barriers (100+ ms per prompt measured on 2 cores); a small team does not.
            torch.set_num_threads(self.cfg.classify_threads or max(1, min(4, (os.cpu_count() or 2) // 2)))
            loop = asyncio.get_running_loop()
            model = await loop.run_in_executor(self.classifier.pool, SliceClassifier.load, self.cfg.classifier, self.plan)
            prior = {layer: model.expert_prior[i] for i, layer in enumerate(model.layout.layer_ids)}
            await loop.run_in_executor(self.classifier.pool, model.select, "warm up the embedder")
            self.classifier.model = model
        policy = ResidencyPolicy(self.plan, self.cfg.hysteresis, self.cfg.policy)
        self.coordinator = ResidencyCoordinator(self.backend, policy, prior, self.cfg.swap_wait_s,
                                                wish_ttl_s=self.cfg.backend_timeout_s + self.cfg.swap_wait_s + 60.0)
        self.flow = CompletionFlow(self.backend, self.coordinator, self.classifier, self.stats, self._read_request, self._spawn)
        try:
            await self.coordinator.sync()
        except Exception as exc:  # noqa: BLE001 - the backend may start after the proxy
            logger.warning("backend residency state not readable yet (%s); will retry per request", exc)
        yield
        for task in list(self._tasks):
            task.cancel()
        await self.backend.aclose()
        self.classifier.close()

    # -- errors ----------------------------------------------------------
    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return _error(404, f"no route {request.method} {request.url.path}", "not_found")

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return _error(405, f"method {request.method} not allowed on {request.url.path}", "method_not_allowed")

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        logger.error("reap-swap proxy: unhandled %s on %s", type(exc).__name__, request.url.path, exc_info=exc)
        self.stats.count_response(500)
        return _error(500, f"internal error: {type(exc).__name__}", "internal_error")

    # -- request checks --------------------------------------------------
    def _check_key(self, request: Request) -> None:
        if self._key is None:
            return
        given = request.headers.get(PROXY_KEY_HEADER)
        if given is None or not hmac.compare_digest(_digest(given), self._key):
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
        except RecursionError:
            raise HTTPError(400, "request body is nested too deeply", "invalid_json") from None
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

    async def _read_request(self, request: Request) -> tuple[str, bytes, dict[str, Any]]:
        self._check_key(request)
        rid = self._request_id(request)
        raw, body = await self._read_json(request)
        return rid, raw, body

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- routes ----------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        assert self.flow is not None
        return await self.flow(request)

    async def passthrough_get(self, request: Request) -> Response:
        assert self.backend is not None
        try:
            self._check_key(request)
            headers = forward_headers(request.scope["headers"], self._request_id(request))
        except HTTPError as exc:
            self.stats.count_response(exc.status)
            return error_response(exc)
        watch = DisconnectWatch(request.receive)
        try:
            upstream = await watch.run(self.backend.open_stream("GET", request.url.path, headers, None, params=request.query_params))
        except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON answer
            watch.close()
            if isinstance(exc, httpx.TimeoutException):
                return _error(504, "backend timed out", "backend_timeout")
            if isinstance(exc, httpx.HTTPError):
                return _error(502, f"backend unreachable: {type(exc).__name__}", "backend_unavailable")
            return Response(status_code=499)  # client gone

        async def done(outcome: str, sent: int) -> None:
            self.stats.count_response(upstream.status_code)

        return Relay(upstream, {}, done, watch)  # type: ignore[return-value]

    async def health(self, request: Request) -> Response:
        """200 when the backend is healthy and serves this proxy's plan; else 503, saying why."""
        assert self.backend is not None and self.coordinator is not None
        backend = await self.backend.health()
        if backend == "ok":
            await self.coordinator.refresh()
        residency = self.coordinator.state()
        ok = backend == "ok" and residency["plan_matches"]
        body = {"status": "ok" if ok else "degraded", "backend": backend, "residency": residency,
                "plan_sha256": self.plan.sha256, "classifier": self.classifier.model is not None}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def forensics(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except HTTPError as exc:
            return error_response(exc)
        rec = self.stats.get(request.path_params["request_id"])
        if rec is None:
            return _error(404, f"no record for request {request.path_params['request_id'][:128]!r}", "unknown_request", "request_id")
        return Response(rec, media_type="application/json")

    async def stats_route(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except HTTPError as exc:
            return error_response(exc)
        snap = self.stats.snapshot()
        if self.coordinator is not None:
            snap["residency"] = self.coordinator.state()
        snap["classifier"] = {"loaded": self.classifier.model is not None, "queued": self.classifier.queued,
                              "timeouts": self.classifier.timeouts, "budget_s": self.classifier.budget_s}
        return JSONResponse(snap)

    async def metrics(self, request: Request) -> Response:
        try:
            self._check_key(request)
        except HTTPError as exc:
            return error_response(exc)
        return Response(self.stats.prometheus(), media_type=PROMETHEUS_CONTENT_TYPE)
