"""/metrics through the middleware and a real ControlPlane over a counting RPC (issue 31, point 1):
one worker read per kind however many scrapes miss the cache at once, a waiter's timeout starts no
second read, and the reap_swap_* part only for callers the control routes' access rule admits.
(The same on the real server: tests/test_books_server.py.)"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import pytest

from reap_swap.server_ext.config import from_env
from reap_swap.server_ext.control import http as reap_http
from reap_swap.server_ext.control.control_plane import ControlPlane

VLLM_TEXT = b"# TYPE vllm:x counter\nvllm:x_total 1.0\n"


async def vllm_metrics(scope: Any, receive: Any, send: Any) -> None:
    """A stand-in for vLLM's own /metrics route."""
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain; version=0.0.4"), (b"content-length", str(len(VLLM_TEXT)).encode())]})
    await send({"type": "http.response.body", "body": VLLM_TEXT})


class CountingRpc:
    """The control plane's RPC callable: counts every worker call and answers after ``delay`` seconds."""

    def __init__(self, delay: float = 0.2) -> None:
        self.delay = delay
        self.calls: Counter[str] = Counter()

    async def __call__(self, method: str, *args: Any) -> list[Any]:
        self.calls[method] += 1
        if method == "reap_install":
            return [{"layers": [0], "num_experts": 8, "slots": {"layer_0": 4}, "expert_bytes": 10, "resident": {"layer_0": [0, 1]}}]
        await asyncio.sleep(self.delay)
        if method == "reap_state":
            return [{"memory": {"slot_bank_gib": 1.0}, "online_cache": {"enabled": False}, "complement": {"enabled": False},
                     "miss_ledger": {"entries": 3, "bytes": 300}}]
        if method == "reap_router_misses":
            return [{"summary": {"routed_pairs": 10, "missed_pairs": 2}}]
        return [None]


def _middleware(rpc: CountingRpc, **env: str) -> reap_http.ReapControlMiddleware:
    cfg = from_env({"REAP_RESIDENT_EXPERTS_PER_LAYER": "4", **env})
    plane = ControlPlane(cfg, rpc)
    asyncio.run(plane.start())
    mw = reap_http.ReapControlMiddleware(vllm_metrics, cfg)
    mw.plane = plane
    return mw


async def _scrape(mw: Any, n: int, host: str = "127.0.0.1", headers: dict[str, str] | None = None) -> list[httpx.Response]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url=f"http://{host}:8000") as c:
        return list(await asyncio.gather(*(c.get("/metrics", headers=headers) for _ in range(n))))


def test_hundred_concurrent_scrapes_issue_one_worker_read_of_each_kind() -> None:
    rpc = CountingRpc()
    mw = _middleware(rpc)
    rs = asyncio.run(_scrape(mw, 100))
    assert all(r.status_code == 200 and r.content.startswith(VLLM_TEXT) and b"reap_swap_ledger_entries 3.0" in r.content for r in rs)
    assert rpc.calls["reap_state"] == 1 and rpc.calls["reap_router_misses"] == 1, rpc.calls
    asyncio.run(_scrape(mw, 10))  # within the cache's age: no read at all
    assert rpc.calls["reap_state"] == 1 and rpc.calls["reap_router_misses"] == 1


def test_a_waiters_timeout_starts_no_second_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scrapes that time out leave the read running; scrapes arriving meanwhile join it, later ones get its result."""
    rpc = CountingRpc(delay=0.3)  # two RPCs: the read takes ~0.6 s
    mw = _middleware(rpc)
    monkeypatch.setattr(reap_http, "METRICS_TIMEOUT_S", 0.05)

    async def waves() -> tuple[list[httpx.Response], list[httpx.Response], list[httpx.Response]]:
        first = await _scrape(mw, 50)
        second = await _scrape(mw, 50)  # ~0.05 s later: the first read is still in flight
        await asyncio.sleep(1.0)
        return first, second, await _scrape(mw, 50)

    first, second, third = asyncio.run(waves())
    assert all(r.status_code == 200 and b"unavailable: TimeoutError" in r.content for r in first + second)
    assert all(b"reap_swap_control_swaps_total" in r.content for r in third)
    assert rpc.calls["reap_state"] == 1 and rpc.calls["reap_router_misses"] == 1, rpc.calls


def test_a_failed_read_is_shared_then_retried_by_the_next_scrape() -> None:
    rpc = CountingRpc(delay=0.05)
    mw = _middleware(rpc)
    good = rpc.__call__

    async def failing(method: str, *args: Any) -> list[Any]:
        rpc.calls[method] += 1
        await asyncio.sleep(0.05)
        raise RuntimeError("engine busy")

    mw.plane._rpc = failing  # type: ignore[union-attr]
    rs = asyncio.run(_scrape(mw, 30))
    assert all(b"unavailable: RuntimeError" in r.content and r.content.startswith(VLLM_TEXT) for r in rs)
    assert rpc.calls["reap_state"] == 1
    mw.plane._rpc = good  # type: ignore[union-attr]
    assert b"reap_swap_" in asyncio.run(_scrape(mw, 1))[0].content and rpc.calls["reap_state"] == 2


def test_residency_metrics_follow_the_control_access_rule() -> None:
    """Loopback without credentials; with a control token only with it; browsers never. vLLM's part always, byte for byte."""
    rpc = CountingRpc(delay=0.0)
    mw = _middleware(rpc)
    for host, headers in (("example.com", None), ("127.0.0.1", {"Origin": "http://evil.example"})):
        (r,) = asyncio.run(_scrape(mw, 1, host, headers))
        assert r.status_code == 200 and r.content == VLLM_TEXT, host
    assert rpc.calls["reap_state"] == 0, "a refused caller costs the workers nothing"
    assert b"reap_swap_" in asyncio.run(_scrape(mw, 1))[0].content

    rpc = CountingRpc(delay=0.0)
    mw = _middleware(rpc, REAP_CONTROL_TOKEN="tok")
    for headers in (None, {"X-Reap-Control-Token": "wrong"}):
        (r,) = asyncio.run(_scrape(mw, 1, headers=headers))
        assert r.content == VLLM_TEXT
    assert rpc.calls["reap_state"] == 0
    (r,) = asyncio.run(_scrape(mw, 1, "10.1.2.3", {"X-Reap-Control-Token": "tok"}))
    assert r.content.startswith(VLLM_TEXT) and b"reap_swap_ledger_bytes 300.0" in r.content
