"""The proxy's backend client against a real loopback server that closes connections under requests.

The fault is the keep-alive race that gave one 502 in 10,000 requests in CI: a pooled connection the
backend closes at the moment a request goes out on it. A plain asyncio HTTP/1.1 server makes it happen on
every reuse, so the client's behaviour is checked each time, not once in thousands.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import pytest

from proxy.backend import IDLE_CONNECTION_EXPIRY_S, BackendClient


@dataclass
class ClosingServer:
    """Answers the first ``answered`` requests of each connection with ``status``; closes it under the next one."""

    answered: int = 1
    status: int = 200
    partial: bool = False  # under the next request: the headers and part of the body, then close
    requests: list[tuple[int, str]] = field(default_factory=list)  # (connection number, request line)
    connections: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn, served = self.connections, 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                length = next((int(v) for k, _, v in (line.partition(":") for line in lines[1:]) if k.lower() == "content-length"), 0)
                await reader.readexactly(length)
                self.requests.append((conn, lines[0]))
                if served == self.answered:
                    if self.partial:
                        writer.write(b"HTTP/1.1 200 X\r\ncontent-type: application/json\r\ncontent-length: 50\r\n\r\n{\"connect")
                        await writer.drain()
                    return  # closed under the request
                served += 1
                body = json.dumps({"connection": conn}).encode()
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (self.status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


@asynccontextmanager
async def serving(server: ClosingServer, control_token: str | None = None) -> AsyncIterator[BackendClient]:
    """``server`` on a loopback port and a proxy backend client of it; both closed on the way out."""
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    client = BackendClient(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}", control_token=control_token)
    try:
        yield client
    finally:
        srv.close()
        await srv.wait_closed()


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


async def answer(client: BackendClient, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    """One request through the client's stream pool: its status and JSON body."""
    r = await client.open_stream(method, path, [(b"content-type", b"application/json")], body)
    try:
        await r.aread()
        return r.status_code, r.json()
    finally:
        await r.aclose()


def test_a_completion_whose_pooled_connection_closes_is_sent_again_on_a_new_one() -> None:
    server = ClosingServer(answered=1)

    async def go() -> list[dict]:
        async with serving(server) as client:
            out = []
            for _ in range(3):
                status, body = await answer(client, "POST", "/v1/completions", b'{"prompt": "hi"}')
                assert status == 200
                out.append(body)
            return out

    answers = run(go())
    # Each later request went out on the pooled connection, found it closed, and was answered on a new one.
    assert [a["connection"] for a in answers] == [1, 2, 3]
    assert server.requests == [(1, "POST /v1/completions HTTP/1.1"), (1, "POST /v1/completions HTTP/1.1"),
                               (2, "POST /v1/completions HTTP/1.1"), (2, "POST /v1/completions HTTP/1.1"),
                               (3, "POST /v1/completions HTTP/1.1")]


def test_a_control_call_whose_pooled_connection_closes_is_sent_again() -> None:
    server = ClosingServer(answered=1)

    async def go() -> list[dict]:
        async with serving(server, control_token="t") as client:
            return [await client.status(), await client.swap({"active_set": {}})]

    assert [a["connection"] for a in run(go())] == [1, 2]
    assert [c for c, _ in server.requests] == [1, 1, 2]


def test_an_answer_is_never_sent_twice_nor_a_request_on_a_connection_opened_for_it() -> None:
    """An error status is the backend's answer; a body cut short came from a backend that read the request
    (a swap, a ledger read that clears); a connection opened for the request and closed under it may have
    been read too. Each is sent once and reported."""
    server = ClosingServer(answered=1, status=500)

    async def answered() -> int:
        async with serving(server) as client:
            r = await client.open_stream("POST", "/v1/completions", [], b"{}")
            await r.aclose()
            return r.status_code

    assert run(answered()) == 500 and len(server.requests) == 1
    cut = ClosingServer(answered=1, partial=True)

    async def cut_short() -> None:
        async with serving(cut, control_token="t") as client:
            await client.status()  # answered on connection 1
            await client.swap({"active_set": {}})  # headers and 9 bytes of its body, then closed

    with pytest.raises(httpx.RemoteProtocolError):
        run(cut_short())
    assert [c for c, _ in cut.requests] == [1, 1]  # the swap went out once
    dead = ClosingServer(answered=0)  # closes every connection under its first request

    async def refused() -> None:
        async with serving(dead) as client:
            await client.open_stream("POST", "/v1/completions", [], b"{}")

    with pytest.raises(httpx.RemoteProtocolError):
        run(refused())
    assert len(dead.requests) == 1  # a new connection closed under it: not sent again


def test_idle_connections_are_dropped_before_the_backends_keep_alive_closes_them() -> None:
    """uvicorn (vLLM's server) closes a keep-alive connection after 5 s idle; the pool lets one go first."""
    server = ClosingServer(answered=2)

    async def go() -> list[int]:
        async with serving(server) as client:
            out = []
            for pause in (0.0, IDLE_CONNECTION_EXPIRY_S + 0.5):
                await asyncio.sleep(pause)
                out.append((await answer(client, "GET", "/health"))[1]["connection"])
            return out

    assert IDLE_CONNECTION_EXPIRY_S < 5
    assert run(go()) == [1, 2]  # after the pause a new connection, though the first would still answer
    assert [c for c, _ in server.requests] == [1, 2]
