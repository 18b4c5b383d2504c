"""The proxy's client of the vLLM + server_ext backend (httpx, async).

One pooled ``httpx.AsyncClient`` for everything: the OpenAI routes are
streamed through byte for byte; the residency control calls carry the
backend's control token when one is configured.
"""

from __future__ import annotations

from typing import Any, Mapping

import httpx

CONTROL_TOKEN_HEADER = "X-Reap-Control-Token"
# Hop-by-hop headers never travel through a proxy (RFC 9110 7.6.1), nor does content-length
# (the body is re-framed) or host.
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
}


class BackendError(RuntimeError):
    pass


def forward_headers(headers: Mapping[str, str], request_id: str) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "x-request-id"}
    out["X-Request-Id"] = request_id
    return out


class BackendClient:
    def __init__(self, base_url: str, control_token: str | None = None, timeout_s: float = 600.0, control_timeout_s: float = 30.0):
        self.base_url = base_url.rstrip("/")
        self.control_token = control_token
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.control_timeout = httpx.Timeout(control_timeout_s, connect=5.0)
        self.client = httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout, limits=httpx.Limits(max_connections=256, max_keepalive_connections=64)
        )

    def _control_headers(self) -> dict[str, str]:
        return {CONTROL_TOKEN_HEADER: self.control_token} if self.control_token else {}

    async def control(self, method: str, path: str, json: Any = None) -> dict[str, Any]:
        r = await self.client.request(method, path, json=json, headers=self._control_headers(), timeout=self.control_timeout)
        try:
            body = r.json()
        except ValueError:
            raise BackendError(f"{method} {path}: HTTP {r.status_code}, non-JSON body") from None
        if r.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise BackendError(f"{method} {path}: HTTP {r.status_code}: {err.get('message', body)}")
        return body

    async def status(self) -> dict[str, Any]:
        return await self.control("GET", "/reap/status")

    async def swap(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await self.control("POST", "/swap_active_set", payload)

    async def router_misses(self, request_id: str) -> dict[str, Any] | None:
        try:
            return await self.control("GET", f"/router_misses/{request_id}")
        except BackendError as exc:
            if "HTTP 404" in str(exc):
                return None
            raise

    async def open_stream(self, method: str, path: str, headers: dict[str, str], body: bytes | None, params: Any = None) -> httpx.Response:
        """Send a request and return as soon as the response headers arrived (body streamed)."""
        req = self.client.build_request(method, path, headers=headers, content=body, params=params)
        return await self.client.send(req, stream=True)

    async def aclose(self) -> None:
        await self.client.aclose()
