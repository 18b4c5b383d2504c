"""Pure ASGI relay of an upstream httpx response, chunk by chunk.

Bytes go to the client as they arrive (server-sent events included). A
client disconnect is watched for concurrently and closes the upstream
response at once, so the backend sees the connection drop and aborts the
generation instead of finishing it for nobody.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

import httpx
from starlette.types import Receive, Scope, Send

from .backend import HOP_BY_HOP

Done = Callable[[str, int], Awaitable[None]]


class Relay:
    def __init__(self, upstream: httpx.Response, extra_headers: dict[str, str], on_done: Done):
        self.upstream = upstream
        self.extra_headers = extra_headers
        self.on_done = on_done

    def _headers(self) -> list[tuple[bytes, bytes]]:
        keep = [(k, v) for k, v in self.upstream.headers.multi_items() if k.lower() not in HOP_BY_HOP and k.lower() not in {e.lower() for e in self.extra_headers}]
        return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in keep] + [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in self.extra_headers.items()
        ]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = 0
        outcome = "complete"

        async def pump() -> None:
            nonlocal sent
            await send({"type": "http.response.start", "status": self.upstream.status_code, "headers": self._headers()})
            async for chunk in self.upstream.aiter_raw():
                sent += len(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return

        pump_task = asyncio.create_task(pump())
        watch_task = asyncio.create_task(watch())
        try:
            done, _ = await asyncio.wait({pump_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
            if pump_task in done:
                exc = pump_task.exception()
                if isinstance(exc, httpx.TimeoutException):
                    outcome = "backend_timeout"
                elif isinstance(exc, httpx.HTTPError):
                    outcome = "backend_error"
                elif exc is not None:
                    outcome = "client_disconnected" if isinstance(exc, OSError) else f"error:{type(exc).__name__}"
            else:
                outcome = "client_disconnected"
                pump_task.cancel()
                try:
                    await pump_task
                except (asyncio.CancelledError, Exception):  # noqa: BLE001
                    pass
        finally:
            watch_task.cancel()
            await self.upstream.aclose()
            await self.on_done(outcome, sent)
