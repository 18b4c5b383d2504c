"""A stand-in backend for faults a real vLLM server will not produce on demand.

Served by uvicorn on loopback (real HTTP), it speaks just enough of
``reap-swap serve`` for the proxy: ``/health``, ``/reap/status``,
``/swap_active_set``, ``/router_misses/{id}`` and the two completion routes,
whose behaviour ``POST /_fake/config`` sets (``swap_fail``, ``swap_delay``,
``plan_sha`` and ``mode``): ``ok`` answers at once,
``break_stream`` sends two SSE events then drops the connection, ``hang``
holds the request until the client goes away. ``GET /_fake/state`` tells what
it saw (request headers, open and closed hanging requests, swaps).

Run: ``python -m tests.fake_backend PORT PLAN_SHA256``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

import uvicorn
from starlette.types import Receive, Scope, Send

CORE = {f"layer_{i}": [0, 1, 2, 3] for i in range(4)}


class FakeBackend:
    def __init__(self, plan_sha: str):
        self.cfg: dict[str, Any] = {"plan_sha": plan_sha, "mode": "ok", "swap_delay": 0.0, "swap_fail": False}
        self.seen: list[dict[str, str]] = []
        self.open = 0
        self.closed: list[float] = []
        self.swaps = 0
        self.signature = "core"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                while (msg := await receive())["type"] != "lifespan.shutdown":
                    await send({"type": msg["type"] + ".complete"})
                await send({"type": "lifespan.shutdown.complete"})
            return
        path, method = scope["path"], scope["method"]
        body = b""
        more = True
        while more:
            msg = await receive()
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
        if path == "/health":
            return await self._json(send, {})
        if path == "/_fake/config":
            self.cfg.update(json.loads(body))
            return await self._json(send, self.cfg)
        if path == "/_fake/state":
            return await self._json(send, {"seen": self.seen[-50:], "open": self.open, "closed": self.closed, "swaps": self.swaps})
        if path == "/reap/status":
            return await self._json(send, {"plan": {"sha256": self.cfg["plan_sha"]},
                                           "resident": {"by_layer": CORE, "signature": self.signature}})
        if path == "/swap_active_set" and method == "POST":
            await asyncio.sleep(float(self.cfg["swap_delay"]))
            self.swaps += 1
            if self.cfg["swap_fail"]:
                return await self._json(send, {"error": {"message": "failed on purpose", "type": "server_error", "code": "x"}}, 500)
            from reap_swap.server_ext.control.active_set import signature

            active = json.loads(body)["active_set"]
            sig = signature({int(k.removeprefix("layer_")): tuple(v) for k, v in active.items()})
            previous, self.signature = self.signature, sig
            return await self._json(send, {"status": "ok", "plan_sha256": self.cfg["plan_sha"], "active_set_signature": sig,
                                           "previous_signature": previous, "bytes_copied": 0, "experts_loaded": 0, "noop": False})
        if path.startswith("/router_misses/"):
            return await self._json(send, {"error": {"message": "none", "type": "not_found_error", "code": "unknown_request"}}, 404)
        if path.startswith("/v1/"):
            self.seen.append({k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]})
            return await self._completion(receive, send)
        await self._json(send, {"error": {"message": "no route", "type": "not_found_error", "code": None}}, 404)

    async def _completion(self, receive: Receive, send: Send) -> None:
        mode = self.cfg["mode"]
        if mode == "hang":
            self.open += 1
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            finally:
                self.open -= 1
                self.closed.append(time.time())
            return
        if mode == "break_stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            for i in range(2):
                event = {"choices": [{"index": 0, "delta": {"content": f"part{i} "}}], "object": "chat.completion.chunk"}
                await send({"type": "http.response.body", "body": b"data: " + json.dumps(event).encode() + b"\n\n", "more_body": True})
                await asyncio.sleep(0.05)
            raise RuntimeError("backend died mid-stream (on purpose)")
        await self._json(send, {"id": "x", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}]})

    @staticmethod
    async def _json(send: Send, data: Any, status: int = 200) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps(data).encode()})


if __name__ == "__main__":
    uvicorn.run(FakeBackend(sys.argv[2]), host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
