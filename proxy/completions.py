"""One completion request through the proxy: check, classify, install, forward, relay, account.

The client's ``X-Request-Id`` (or a generated one) names the request to the
client, in its response headers and in ``/forensics``; the backend sees a
unique key derived from it, so two clients that pick the same id never share
a wish, a swap record or a miss report. From the moment the body is read a
``DisconnectWatch`` owns the client connection: if the client leaves while
its prompt is classified, while it waits for a swap or before the backend
answered, the work is cancelled and the upstream request closed at once.
Whatever happens, the request's wish is released and its outcome recorded;
every error the client sees is OpenAI-style JSON.
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any, Callable

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from reap_swap.server_ext.control.errors import HTTPError, error_body

from .backend import BackendClient, forward_headers
from .classify import Classifier
from .disconnect import ClientGone, DisconnectWatch
from .prompts import prompt_from_body
from .relay import Relay
from .residency import ResidencyCoordinator, SwapOutcome
from .stats import ProxyStats

logger = logging.getLogger("reap_swap.proxy")
CLIENT_CLOSED = 499  # nginx's "client closed request": recorded, never seen by anyone


def error_response(exc: HTTPError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers or None)


class CompletionFlow:
    def __init__(self, backend: BackendClient, coordinator: ResidencyCoordinator, classifier: Classifier, stats: ProxyStats,
                 read_request: Callable[[Request], Any], spawn: Callable[[Any], None]):
        self.backend = backend
        self.coordinator = coordinator
        self.classifier = classifier
        self.stats = stats
        self.read_request = read_request
        self.spawn = spawn

    async def __call__(self, request: Request) -> Response:
        t0 = time.perf_counter()
        route = request.url.path
        try:
            client_rid, raw, body = await self.read_request(request)
            text = prompt_from_body(route, body)
        except HTTPError as exc:
            self.stats.count_response(exc.status)
            return error_response(exc)
        rid = f"{client_rid}.{secrets.token_hex(6)}"  # unique per request, whatever the client sent
        record: dict[str, Any] = {"request_id": client_rid, "backend_request_id": rid, "route": route,
                                  "stream": body.get("stream") is True, "received_at": time.time()}
        watch = DisconnectWatch(request.receive)
        relayed = False
        try:
            t1 = time.perf_counter()
            wish, info = await watch.run(self.classifier.select(text))
            t2 = time.perf_counter()
            record["prompt"] = {k: v for k, v in info.items() if k not in ("chosen_slices", "slice_scores")}
            record["chosen_slices"] = info.get("chosen_slices", {})
            record["slice_scores"] = info.get("slice_scores", {})
            outcome = await watch.run(self._admit(rid, wish))
            t3 = time.perf_counter()
            record["swap"] = outcome.__dict__
            headers = forward_headers(request.scope["headers"], rid)
            upstream = await watch.run(self.backend.open_stream("POST", route, headers, raw, params=request.query_params))
            t4 = time.perf_counter()
            relayed = True
        except ClientGone:
            return self._finish(record, t0, CLIENT_CLOSED, "client_disconnected_early", None)
        except httpx.TimeoutException as exc:
            return self._finish(record, t0, 504, "backend_timeout", f"backend timed out: {type(exc).__name__}")
        except httpx.HTTPError as exc:
            return self._finish(record, t0, 502, "backend_unavailable", f"backend unreachable: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any surprise is a JSON 500, and the wish is still released
            logger.exception("reap-swap proxy: completion request failed")
            return self._finish(record, t0, 500, "internal_error", f"internal error: {type(exc).__name__}")
        finally:
            if not relayed:  # the relay owns the watch from here on; nobody else does
                watch.close()
        classify_ms, swap_ms = (t2 - t1) * 1e3, (t3 - t2) * 1e3
        overhead_ms = (t4 - t0) * 1e3 - classify_ms - swap_ms - (t4 - t3) * 1e3
        record["timings"] = {"classify_ms": classify_ms, "swap_wait_ms": swap_ms, "overhead_ms": overhead_ms,
                             "backend_headers_ms": (t4 - t3) * 1e3}
        extra = {"X-Request-Id": client_rid, "X-Reap-Backend-Request-Id": rid, "X-Reap-Overhead-Ms": f"{overhead_ms:.3f}",
                 "X-Reap-Classify-Ms": f"{classify_ms:.3f}", "X-Reap-Swap-Ms": f"{swap_ms:.3f}",
                 "X-Reap-Active-Set-Signature": outcome.signature}

        async def done(outcome_name: str, sent: int) -> None:
            self.coordinator.release(rid)
            record["backend"] = {"status": upstream.status_code, "outcome": outcome_name, "bytes": sent}
            record["timings"]["total_ms"] = (time.perf_counter() - t0) * 1e3
            self._account(record, upstream.status_code, None if outcome_name == "complete" else outcome_name)
            if upstream.status_code == 200:
                self.spawn(self._collect_misses(rid, record))

        return Relay(upstream, extra, done, watch)  # type: ignore[return-value]

    async def _admit(self, rid: str, wish: Any) -> SwapOutcome:
        try:
            return await self.coordinator.admit(rid, wish)
        except Exception as exc:  # noqa: BLE001 - residency never fails a request
            return SwapOutcome("failed", "", f"{type(exc).__name__}: {exc}")

    def _account(self, record: dict[str, Any], status: int, error: str | None) -> None:
        self.stats.count_response(status)
        if error:
            self.stats.count_error(error)
        self.stats.count_request(record)
        self.stats.put(record)

    def _finish(self, record: dict[str, Any], t0: float, status: int, code: str, message: str | None) -> Response:
        """End a request that never reached the relay: release its wish, record it, answer in JSON."""
        self.coordinator.release(record["backend_request_id"])
        record["backend"] = {"status": status, "outcome": code}
        record.setdefault("timings", {})["total_ms"] = (time.perf_counter() - t0) * 1e3
        self._account(record, status, code)
        if message is None:
            return Response(status_code=status)  # the client is gone: nothing will be read
        return JSONResponse(error_body(status, message, code), status_code=status)

    async def _collect_misses(self, rid: str, record: dict[str, Any]) -> None:
        """Fetch (and clear, on the backend) the request's router misses into its record."""
        try:
            misses = await self.backend.router_misses(rid, reset=True)
        except Exception as exc:  # noqa: BLE001
            record["router_misses"] = {"error": f"{type(exc).__name__}: {exc}"}
            self.stats.put(record)
            return
        if misses is None:
            record["router_misses"] = {"error": "backend recorded no routed tokens for this id"}
            self.stats.put(record)
            return
        record["router_misses"] = {
            "summary": misses["summary"],
            "active_set_signature": misses.get("active_set_signature"),
            "by_layer": {k: {"inactive_ratio": v["inactive_ratio"], "observed_mass": v["observed_mass"],
                             "inactive_mass": v["inactive_mass"], "expert_mass": v.get("expert_mass", [])}
                         for k, v in misses["by_layer"].items()},
        }
        self.stats.count_misses(misses)
        self.stats.put(record)  # re-stored: its size grew
        self.coordinator.observe_signature(misses.get("active_set_signature"))
