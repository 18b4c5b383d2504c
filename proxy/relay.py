"""Pure ASGI relay of an upstream httpx response, chunk by chunk.

Bytes go to the client as they arrive. Server-sent events are relayed whole
(cut at event boundaries), so that if the upstream fails in the middle of a
stream the client gets a well-formed ``data: {"error": ...}`` event, the
form vLLM and the OpenAI SDK use, instead of a torn line. A client
disconnect (seen by the request's ``DisconnectWatch``) closes the upstream
response at once, so the backend aborts the generation.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Awaitable, Callable

import httpx
from starlette.types import Receive, Scope, Send

from reap_swap.server_ext.control.errors import error_body

from .backend import HOP_BY_HOP
from .disconnect import DisconnectWatch

Done = Callable[[str, int], Awaitable[None]]
logger = logging.getLogger("reap_swap.proxy")
MAX_PENDING_EVENT = 1 << 20  # an event longer than this is passed on in pieces


def sse_error(status: int, message: str, code: str) -> bytes:
    return b"data: " + json.dumps(error_body(status, message, code)).encode() + b"\n\ndata: [DONE]\n\n"


class Relay:
    def __init__(self, upstream: httpx.Response, extra_headers: dict[str, str], on_done: Done, watch: DisconnectWatch):
        self.upstream = upstream
        self.extra_headers = extra_headers
        self.on_done = on_done
        self.watch = watch
        self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")

    def _headers(self) -> list[tuple[bytes, bytes]]:
        ours = {k.lower() for k in self.extra_headers}
        keep = [(k, v) for k, v in self.upstream.headers.raw if k.decode("latin-1").lower() not in HOP_BY_HOP | ours]
        return keep + [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.extra_headers.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = 0
        outcome = "complete"
        started = False

        async def body(chunk: bytes) -> None:
            nonlocal sent
            sent += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async def pump() -> None:
            nonlocal started
            await send({"type": "http.response.start", "status": self.upstream.status_code, "headers": self._headers()})
            started = True
            pending = b""
            async for chunk in self.upstream.aiter_raw():
                if not self.sse:
                    await body(chunk)
                    continue
                pending += chunk
                cut = pending.rfind(b"\n\n")
                if cut >= 0:
                    await body(pending[: cut + 2])
                    pending = pending[cut + 2 :]
                if len(pending) > MAX_PENDING_EVENT:
                    await body(pending)
                    pending = b""
            if pending:
                await body(pending)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        pump_task = asyncio.ensure_future(pump())
        gone = asyncio.ensure_future(self.watch.gone.wait())
        try:
            await asyncio.wait({pump_task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if pump_task.done():
                exc = pump_task.exception()
                if isinstance(exc, httpx.TimeoutException):
                    outcome = "backend_timeout"
                elif isinstance(exc, httpx.HTTPError):
                    outcome = "backend_error"
                elif exc is not None:
                    outcome = "client_disconnected" if isinstance(exc, OSError) else f"error:{type(exc).__name__}"
                    if not isinstance(exc, OSError):
                        logger.error("relay failed", exc_info=exc)
                if exc is not None and started and outcome.startswith("backend"):
                    await self._end_with_error(send, outcome)
            else:
                outcome = "client_disconnected"
                pump_task.cancel()
                try:
                    await pump_task
                except BaseException:  # noqa: BLE001 - the client is gone; nothing to report to it
                    pass
        finally:
            gone.cancel()
            self.watch.close()
            await self.upstream.aclose()
            await self.on_done(outcome, sent)

    async def _end_with_error(self, send: Send, outcome: str) -> None:
        """The upstream broke after headers went out.

        SSE: a final error event, then a clean end. Anything else: the body is
        left incomplete, so the server drops the connection and the client sees
        a truncated transfer rather than a short body that looks complete.
        """
        if not self.sse:
            return
        message = "backend timed out mid-response" if outcome == "backend_timeout" else "backend connection failed mid-response"
        try:
            await send({"type": "http.response.body", "body": sse_error(502, message, outcome), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # noqa: BLE001 - the client may be gone as well
            pass
