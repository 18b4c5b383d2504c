"""HTTP control plane: a pure ASGI middleware vLLM loads with ``--middleware``.

Requests to the residency paths are answered here; everything else passes
to vLLM's app untouched (streaming included). On ASGI lifespan start-up,
after vLLM's own start-up completed, it installs residency in the workers
and checks the plan against the model; a failure aborts the server start
with the reason, rather than serving with a plan that does not fit.

Paths (seed-compatible): ``POST /swap_active_set``, ``POST /warm_active_set``,
``GET /router_misses/{request_id}?reset=true``, ``GET /forensics/{request_id}``,
``POST /swap_cartridge/{cartridge_id}``, ``POST /reset_router_stats`` and
``GET /reap/status``. Who may call them is decided in ``auth.py`` (control
token, else vLLM's API key, else loopback callers only); POST bodies must be
declared ``application/json``. A server bound to a non-loopback host with no
credential refuses to start.

``GET /metrics`` is vLLM's own route and stays open: its output passes
through untouched for every caller, and the ``reap_swap_*`` residency
metrics are appended only for callers the same rule admits (a refused
caller costs the workers nothing).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any, Awaitable, Callable

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Match, Route, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import config as reap_config
from .auth import TOKEN_HEADER, ControlAuth, is_loopback
from .control_plane import ControlPlane
from .errors import HTTPError, error_body

logger = logging.getLogger("reap_swap.server_ext")
__all__ = ["ReapControlMiddleware", "TOKEN_HEADER", "read_json_body"]


async def read_json_body(request: Request, limit: int) -> Any:
    """The body as JSON, refusing oversize (413), non-JSON (400) or empty bodies."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HTTPError(413, f"request body exceeds {limit} bytes", "body_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPError(413, f"request body exceeds {limit} bytes", "body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HTTPError(400, f"request body is not valid JSON: {exc}", "invalid_json") from None
    except RecursionError:
        raise HTTPError(400, "request body is nested too deeply", "invalid_json") from None


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(data, status_code=status, headers=headers)


def _api_keys(app: Any) -> list[str]:
    """vLLM's --api-key values (or VLLM_API_KEY), read from the running app's arguments."""
    given = getattr(getattr(getattr(app, "state", None), "args", None), "api_key", None)
    keys = [given] if isinstance(given, str) else list(given or [])
    return [k for k in (keys or [os.environ.get("VLLM_API_KEY", "")]) if k]


METRICS_TIMEOUT_S = 3.0  # a busy engine or a long swap must not hold vLLM's own metrics back


class ReapControlMiddleware:
    """ASGI middleware: residency routes here, the rest to vLLM."""

    def __init__(self, app: ASGIApp, cfg: reap_config.ResidencyConfig | None = None):
        self.app = app
        self.cfg = cfg or reap_config.from_env()
        self.plane: ControlPlane | None = None
        self.auth = ControlAuth.create(self.cfg.control_token)
        self.router = Router(
            routes=[
                Route("/swap_active_set", self._endpoint(self.swap_active_set), methods=["POST"]),
                Route("/warm_active_set", self._endpoint(self.warm_active_set), methods=["POST"]),
                Route("/router_misses/{request_id:path}", self._endpoint(self.router_misses), methods=["GET"]),
                Route("/forensics/{request_id:path}", self._endpoint(self.forensics), methods=["GET"]),
                Route("/swap_cartridge/{cartridge_id}", self._endpoint(self.swap_cartridge), methods=["POST"]),
                Route("/reset_router_stats", self._endpoint(self.reset_router_stats), methods=["POST"]),
                Route("/reap/status", self._endpoint(self.status), methods=["GET"]),
            ]
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(scope, send))
            return
        if scope["type"] == "http" and scope["path"] == "/metrics" and scope["method"] == "GET" and self.plane is not None:
            await self._metrics(scope, receive, send)
            return
        if scope["type"] == "http":
            matches = {r.matches(scope)[0] for r in self.router.routes}
            if Match.FULL in matches:
                await self.router(scope, receive, send)
                return
            if Match.PARTIAL in matches:  # our path, wrong method: answer in OpenAI style
                body = error_body(405, f"method {scope['method']} not allowed on {scope['path']}", "method_not_allowed")
                await _json(body, 405)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _admits(self, scope: Scope) -> bool:
        """Whether the control routes' access rule admits this request (``auth.ControlAuth``)."""
        try:
            self.auth.check(Headers(scope=scope))
        except HTTPError:
            return False
        return True

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's own ``/metrics``, with the residency metrics appended (read at scrape time) for callers
        the control routes' access rule admits; anyone else gets vLLM's response untouched."""
        if not self._admits(scope):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def buffer(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))

        await self.app(scope, receive, buffer)
        if start is None:
            return
        body = b"".join(chunks)
        headers = {k.lower(): v for k, v in start.get("headers", [])}
        plain = b"content-encoding" not in headers and b"openmetrics" not in headers.get(b"content-type", b"")
        if start["status"] == 200 and self.plane is not None and plain:  # text 0.0.4 only: append after it
            try:
                body += await asyncio.wait_for(self.plane.metrics_text(), METRICS_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - vLLM's metrics still go out
                logger.warning("reap-swap: residency metrics unavailable: %r", exc)
                body += f"# reap-swap residency metrics unavailable: {type(exc).__name__}\n".encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**start, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _lifespan_send(self, scope: Scope, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete" and self.plane is None:
                try:
                    await self._start(scope)
                except Exception as exc:  # noqa: BLE001 - the reason goes to the operator
                    logger.error("reap-swap: residency start-up failed: %s", exc)
                    await send({"type": "lifespan.startup.failed", "message": f"reap-swap: {exc}"})
                    return
            await send(message)

        return wrapped

    async def _start(self, scope: Scope) -> None:
        app = scope["app"]
        self.auth = ControlAuth.create(self.cfg.control_token, _api_keys(app))
        host = getattr(getattr(app.state, "args", None), "host", "127.0.0.1")
        if not self.auth.closed and not is_loopback(host) and not getattr(app.state.args, "uds", None):
            raise RuntimeError(
                f"the control routes would be open on {host or 'every interface'}: set REAP_CONTROL_TOKEN "
                "(reap-swap serve --control-token-file) or --api-key, or bind a loopback host"
            )
        engine = app.state.engine_client

        async def rpc(method: str, *args: Any) -> list[Any]:
            return await engine.collective_rpc(method, args=args)

        plane = ControlPlane(self.cfg, rpc)
        await plane.start()
        self.plane = plane
        logger.info("reap-swap: control plane ready (plan %s)", plane.plan.sha256[:12] if plane.plan else "-")

    def _endpoint(self, handler: Callable[[Request, ControlPlane], Awaitable[Any]]) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                self.auth.check(request.headers)
                if self.plane is None:
                    raise HTTPError(503, "residency control plane is not ready", "not_ready")
                result = await handler(request, self.plane)
                return result if isinstance(result, Response) else _json(result)
            except HTTPError as exc:
                return _json(exc.body(), exc.status, exc.headers)
            except Exception as exc:  # noqa: BLE001 - never leak a traceback as HTML
                logger.exception("reap-swap control request failed")
                return _json(error_body(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error"), 500)

        return endpoint

    async def _body(self, request: Request) -> Any:
        # No default: a browser's no-cors POST (text/plain, form types, or none) must never reach a control route.
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise HTTPError(415, f"content-type must be application/json, got {ctype or 'none'!r}", "unsupported_media_type")
        return await read_json_body(request, self.cfg.max_body_bytes)

    async def swap_active_set(self, request: Request, plane: ControlPlane) -> Any:
        return await plane.swap(await self._body(request))

    async def warm_active_set(self, request: Request, plane: ControlPlane) -> Any:
        return await plane.swap(await self._body(request), warm=True)

    async def router_misses(self, request: Request, plane: ControlPlane) -> Any:
        reset = request.query_params.get("reset", "false").lower()
        if reset not in ("true", "false", "1", "0"):
            raise HTTPError(400, "'reset' must be true or false", "invalid_value", "reset")
        return await plane.router_misses(request.path_params["request_id"], reset in ("true", "1"))

    async def forensics(self, request: Request, plane: ControlPlane) -> Any:
        await plane.read_back()
        return plane.forensics(request.path_params["request_id"])

    async def swap_cartridge(self, request: Request, plane: ControlPlane) -> Any:
        return await plane.swap_cartridge(request.path_params["cartridge_id"], await self._body(request))

    async def reset_router_stats(self, request: Request, plane: ControlPlane) -> Any:
        body = await self._body(request)
        if body not in (None, {}):
            raise HTTPError(400, "/reset_router_stats takes no fields", "invalid_body")
        return {"status": "ok", "requests_cleared": await plane.reset_router_stats()}

    async def status(self, request: Request, plane: ControlPlane) -> Any:
        await plane.read_back()
        await plane.read_books()
        return plane.status()
