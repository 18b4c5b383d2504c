"""server_ext.control.metrics: residency counters rendered as Prometheus text (pure)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from reap_swap.server_ext.control.metrics import exposition


def _samples(text: bytes) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_every_counter_family_is_rendered_with_its_value() -> None:
    worker = {
        "memory": {"slot_bank_gib": 1.5, "host_bank_gib": 2.0},
        "online_cache": {"enabled": True, "promotions": 7, "evictions": 6, "promotion_link_bytes": 700},
        "complement": {"enabled": True, "spare_gib": 0.25, "counters": {"exchanges": 2, "rotated_blocks": 4, "d2h_bytes": 80}},
        "miss_ledger": {"entries": 2, "bytes": 3264, "bytes_per_entry": 1632, "max_entries": 1024, "evicted": 0},
    }
    misses = {"summary": {"routed_pairs": 100, "missed_pairs": 20, "promoted_experts": 7, "link_bytes": 2000, "tokens": 5}}
    s = _samples(exposition({"swaps": 3, "bytes_copied": 10, "swap_ms_total": 5.0, "failed": 0}, worker, misses))
    assert s["reap_swap_control_swaps_total"] == 3 and s["reap_swap_control_failed_total"] == 0
    assert s["reap_swap_control_swap_seconds_total"] == 0.005
    assert s["reap_swap_ledger_missed_pairs"] == 20 and s["reap_swap_ledger_link_bytes"] == 2000
    assert s["reap_swap_ledger_entries"] == 2 and s["reap_swap_ledger_bytes"] == 3264
    assert s["reap_swap_slot_bank_bytes"] == 1.5 * 2**30 and s["reap_swap_host_bank_bytes"] == 2 * 2**30
    assert s["reap_swap_online_cache_enabled"] == 1 and s["reap_swap_online_cache_promotions_total"] == 7
    assert s["reap_swap_ram_complement_rotated_blocks_total"] == 4 and s["reap_swap_ram_complement_spare_bytes"] == 0.25 * 2**30


def test_disabled_features_and_missing_values_render_without_error() -> None:
    s = _samples(exposition({}, {"online_cache": {"enabled": False}, "complement": {"enabled": False}}, None))
    assert s == {"reap_swap_online_cache_enabled": 0.0, "reap_swap_ram_complement_enabled": 0.0, "reap_swap_cpu_path_enabled": 0.0}


def test_middleware_appends_to_plain_text_only_and_survives_a_slow_plane() -> None:
    """/metrics through the middleware: appended after vLLM's text, left alone when compressed, bounded in time."""
    import asyncio

    import httpx

    from reap_swap.server_ext.control import http as reap_http

    async def vllm_metrics(scope, receive, send):  # noqa: ANN001, ANN202 - a stand-in for vLLM's /metrics route
        import gzip

        headers = [(b"content-type", b"text/plain; version=0.0.4")]
        body = b"vllm 1\n"
        if scope["query_string"] == b"gzip":
            headers.append((b"content-encoding", b"gzip"))
            body = gzip.compress(body)
        await send({"type": "http.response.start", "status": 200, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    class Plane:
        delay = 0.0

        async def metrics_text(self) -> bytes:
            await asyncio.sleep(self.delay)
            return b"reap_swap_x 2\n"

    mw = reap_http.ReapControlMiddleware(vllm_metrics)
    mw.plane = Plane()  # type: ignore[assignment]

    async def get(query: str = "") -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://127.0.0.1") as c:  # loopback: admitted
            return await c.get("/metrics" + (f"?{query}" if query else ""))

    r = asyncio.run(get())
    assert r.content == b"vllm 1\nreap_swap_x 2\n" and r.headers["content-length"] == str(len(r.content))
    assert asyncio.run(get("gzip")).content == b"vllm 1\n"  # decoded by httpx: nothing was appended to the gzip stream
    mw.plane.delay = 1.0
    reap_http.METRICS_TIMEOUT_S, old = 0.05, reap_http.METRICS_TIMEOUT_S
    try:
        r = asyncio.run(get())
    finally:
        reap_http.METRICS_TIMEOUT_S = old
    assert r.status_code == 200 and r.content.startswith(b"vllm 1\n") and b"unavailable: TimeoutError" in r.content
