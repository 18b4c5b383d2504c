"""The proxy's client of the vLLM + server_ext backend (httpx, async).

Two connection pools, so 256 open completion streams can never starve the
control calls a swap needs: ``streams`` relays the OpenAI routes byte for
byte; ``control`` carries the residency calls with the backend's control
token. Both retry failed *connects* (httpx transport ``retries=``), which is
safe for any method: nothing was sent. Request headers are forwarded as raw
bytes (a client's non-ASCII ``X-Title`` is passed on, not re-encoded), less
hop-by-hop headers and the proxy's own credentials.

Idle pooled connections: vLLM's uvicorn closes a keep-alive connection after
``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s) idle, httpx's pool keeps one for 5 s,
so a request can go out on a connection the backend is closing just then and
get no answer at all (seen once in 10,000 requests in CI: a 502). The pools
drop idle connections well before the backend does, and a request whose
reused connection closed before any response byte is sent once more.
"""

from __future__ import annotations

from typing import Any, Iterable

import httpx

CONTROL_TOKEN_HEADER = "X-Reap-Control-Token"
PROXY_KEY_HEADER = "x-reap-proxy-key"
# Hop-by-hop headers never travel through a proxy (RFC 9110 7.6.1), nor does content-length
# (the body is re-framed) or host; the proxy's own key and any control token stay here.
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length",
}
NOT_FORWARDED = HOP_BY_HOP | {"x-request-id", PROXY_KEY_HEADER, CONTROL_TOKEN_HEADER.lower()}
RawHeaders = list[tuple[bytes, bytes]]
# Below uvicorn's and vLLM's 5 s keep-alive, with room for a loaded event loop on either side.
IDLE_CONNECTION_EXPIRY_S = 2.0
# What httpx raises when a pooled connection was closed under a request before any response byte:
# the server closed it (RemoteProtocolError: "Server disconnected without sending a response"),
# reset it (ReadError) or was gone while the request was written (WriteError).
CLOSED_UNDER_REQUEST = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class BackendError(RuntimeError):
    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


def forward_headers(raw: Iterable[tuple[bytes, bytes]], request_id: str) -> RawHeaders:
    """The client's headers as bytes, less what must not be forwarded, plus the backend request id."""
    listed = set()
    for k, v in raw:
        if k.lower() == b"connection":  # headers named by Connection are hop-by-hop too
            listed |= {t.strip().lower() for t in v.decode("latin-1").split(",")}
    drop = NOT_FORWARDED | listed
    out = [(k, v) for k, v in raw if k.decode("latin-1").lower() not in drop]
    out.append((b"x-request-id", request_id.encode("ascii")))
    return out


async def send_once_more_if_closed(client: httpx.AsyncClient, request: httpx.Request, stream: bool) -> httpx.Response:
    """Send ``request``; if a *reused* pooled connection closed under it before any response byte,
    send it once more (on a new connection).

    That is the idle-close race: the backend closed the connection while it sat in the pool and
    never read the request. A request that went out on a connection opened for it, or that got any
    byte back (a status line, part of a body), is never sent again: the backend may have acted on it
    (a swap, a ``router_misses`` read that clears the ledger). Left over: a backend that read a
    request from a reused connection and then died is sent it again; that second send fails to
    connect, and the error stands.
    """
    opened: list[str] = []

    async def trace(event: str, info: dict[str, Any]) -> None:
        if "connect_tcp" in event or "connect_unix_socket" in event:
            opened.append(event)

    request.extensions["trace"] = trace
    try:
        response = await client.send(request, stream=True)
    except CLOSED_UNDER_REQUEST as exc:
        nothing_came_back = not isinstance(exc, httpx.RemoteProtocolError) or "without sending a response" in str(exc)
        if opened or not nothing_came_back:
            raise
        response = await client.send(request, stream=True)
    if not stream:  # read here, outside the resend: a body cut short is an error, never a second request
        try:
            await response.aread()
        finally:
            await response.aclose()
    return response


class BackendClient:
    def __init__(
        self,
        base_url: str,
        control_token: str | None = None,
        timeout_s: float = 600.0,
        control_timeout_s: float = 30.0,
        max_streams: int = 256,
        connect_retries: int = 2,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.control_token = control_token
        self.api_key = api_key
        self.timeout = httpx.Timeout(timeout_s, connect=5.0)
        self.control_timeout = httpx.Timeout(control_timeout_s, connect=5.0)
        self.streams = httpx.AsyncClient(
            base_url=self.base_url, timeout=self.timeout,
            transport=httpx.AsyncHTTPTransport(
                retries=connect_retries, limits=httpx.Limits(max_connections=max_streams, max_keepalive_connections=64,
                                                              keepalive_expiry=IDLE_CONNECTION_EXPIRY_S)),
        )
        self.control_client = httpx.AsyncClient(
            base_url=self.base_url, timeout=self.control_timeout,
            transport=httpx.AsyncHTTPTransport(
                retries=connect_retries, limits=httpx.Limits(max_connections=8, max_keepalive_connections=8,
                                                              keepalive_expiry=IDLE_CONNECTION_EXPIRY_S)),
        )

    def _control_headers(self) -> dict[str, str]:
        """The control token when the backend has one, else its API key (which then guards control routes)."""
        if self.control_token:
            return {CONTROL_TOKEN_HEADER: self.control_token}
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def control(self, method: str, path: str, json: Any = None, params: dict[str, str] | None = None) -> dict[str, Any]:
        if method == "POST" and json is None:
            json = {}  # control routes require a declared JSON body
        req = self.control_client.build_request(method, path, json=json, params=params, headers=self._control_headers())
        r = await send_once_more_if_closed(self.control_client, req, stream=False)
        try:
            body = r.json()
        except ValueError:
            raise BackendError(f"{method} {path}: HTTP {r.status_code}, non-JSON body", r.status_code) from None
        if r.status_code >= 400:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            message = err.get("message", body) if isinstance(err, dict) else body
            raise BackendError(f"{method} {path}: HTTP {r.status_code}: {message}", r.status_code)
        if not isinstance(body, dict):
            raise BackendError(f"{method} {path}: HTTP {r.status_code}, body is not a JSON object", r.status_code)
        return body

    async def status(self) -> dict[str, Any]:
        return await self.control("GET", "/reap/status")

    async def swap(self, payload: dict[str, Any]) -> dict[str, Any]:
        return await self.control("POST", "/swap_active_set", payload)

    async def router_misses(self, request_id: str, reset: bool = True) -> dict[str, Any] | None:
        """The backend's misses for ``request_id`` (None if it saw no tokens), cleared there when ``reset``."""
        try:
            return await self.control("GET", f"/router_misses/{request_id}", params={"reset": "true" if reset else "false"})
        except BackendError as exc:
            if exc.status == 404:
                return None
            raise

    async def health(self) -> str:
        """``ok``, ``HTTP <status>`` or ``unreachable (<error>)``."""
        try:
            r = await self.control_client.get("/health", timeout=2.0)
        except httpx.HTTPError as exc:
            return f"unreachable ({type(exc).__name__})"
        return "ok" if r.status_code == 200 else f"HTTP {r.status_code}"

    async def open_stream(self, method: str, path: str, headers: RawHeaders, body: bytes | None, params: Any = None) -> httpx.Response:
        """Send a request and return as soon as the response headers arrived (body streamed)."""
        req = self.streams.build_request(method, path, headers=headers, content=body, params=params)
        return await send_once_more_if_closed(self.streams, req, stream=True)

    async def aclose(self) -> None:
        await self.streams.aclose()
        await self.control_client.aclose()
