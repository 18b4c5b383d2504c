"""``reap-swap bench-proxy``: proxy overhead and concurrency policies, measured in one run.

Starts one backend (``reap-swap serve``) and, per arm, one proxy in front of it.

1. Overhead: the same requests alternate direct-to-backend and through the
   proxy; per pair, overhead = proxy latency - direct latency - classify time
   - swap wait (both reported by the proxy in response headers). Also the
   proxy's own measured pre-forward overhead and the embed+classify time.
2. Concurrency: mixed-domain clients stream concurrently through proxies
   running the ``union`` policy, the naive ``latest`` policy (each request
   installs its own set), and no classifier (static slices): swaps per
   request, bytes moved, router-miss ratio, throughput, errors.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from reap_swap.cli import HelpFormatter
from reap_swap.plan import load_plan
from reap_swap.procs import ServerProcess, free_port, reap_swap_argv


def _prompts(corpus: Path, n: int) -> list[tuple[str, str]]:
    from reap_swap.planning.corpus import conversation_messages, prompt_text

    out = []
    for line in corpus.read_text().splitlines():
        row = json.loads(line)
        msgs = conversation_messages(row)
        if isinstance(msgs, str):
            continue
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        out.append((row.get("tags", ["?"])[0], prompt_text(msgs[: last_user + 1])))
    # interleave domains so concurrent clients see a mix
    by: dict[str, list[str]] = {}
    for dom, text in out:
        by.setdefault(dom, []).append(text)
    mixed = [(d, by[d][i]) for i in range(max(len(v) for v in by.values())) for d in sorted(by) if i < len(by[d])]
    return mixed[:n]


def _chat(client: httpx.Client, url: str, model: str, text: str, max_tokens: int, rid: str, stream: bool) -> tuple[float, httpx.Headers, int]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    t = time.perf_counter()
    if not stream:
        r = client.post(url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}, timeout=300)
        return time.perf_counter() - t, r.headers, r.status_code
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}, timeout=300) as r:
        for _ in r.iter_bytes():
            pass
        return time.perf_counter() - t, r.headers, r.status_code


def overhead(backend: str, proxy: str, model: str, prompts: list[tuple[str, str]], rounds: int) -> dict[str, Any]:
    diffs, internal, classify, direct_ms, via_ms = [], [], [], [], []
    with httpx.Client() as c:
        for _, text in prompts[:3]:
            _chat(c, proxy, model, text, 1, f"warm-{time.time()}", False)
        for i in range(rounds):
            text = prompts[i % len(prompts)][1]
            d, _, _ = _chat(c, backend, model, text, 1, f"od-{i}", False)
            v, h, code = _chat(c, proxy, model, text, 1, f"ov-{i}", False)
            if code != 200:
                continue
            cl, sw = float(h["x-reap-classify-ms"]), float(h["x-reap-swap-ms"])
            diffs.append(v * 1e3 - d * 1e3 - cl - sw)
            internal.append(float(h["x-reap-overhead-ms"]))
            classify.append(cl)
            direct_ms.append(d * 1e3)
            via_ms.append(v * 1e3)

    def q(x: list[float]) -> dict[str, float]:
        return {"p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)), "mean": float(np.mean(x))}

    return {"pairs": len(diffs), "overhead_ms": q(diffs), "internal_overhead_ms": q(internal), "classify_ms": q(classify),
            "direct_ms": q(direct_ms), "via_proxy_ms": q(via_ms)}


def concurrency(proxy: str, model: str, prompts: list[tuple[str, str]], clients: int, per_client: int, max_tokens: int, tag: str) -> dict[str, Any]:
    def run(ci: int) -> list[int]:
        codes = []
        with httpx.Client() as c:
            for j in range(per_client):
                _, text = prompts[(ci * per_client + j) % len(prompts)]
                codes.append(_chat(c, proxy, model, text, max_tokens, f"{tag}-{ci}-{j}", True)[2])
        return codes

    t = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        codes = [c for cs in pool.map(run, range(clients)) for c in cs]
    wall = time.perf_counter() - t
    time.sleep(1.0)  # let the proxy collect the last requests' router misses
    stats = httpx.get(proxy + "/stats", timeout=30).json()
    n = len(codes)
    return {
        "requests": n, "errors": sum(1 for c in codes if c != 200), "wall_s": wall, "requests_per_s": n / wall,
        "installs": stats["swaps"]["installs"], "installs_per_request": stats["swaps"]["installs"] / n,
        "swap_outcomes": stats["swaps"]["by_status"], "bytes_copied": stats["swaps"]["bytes_copied"],
        "miss_ratio": stats["miss_ratio"], "miss_ratio_by_layer": stats["miss_ratio_by_layer"],
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap bench-proxy", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="model directory to serve")
    p.add_argument("--plan", type=Path, required=True, help="plan JSON (reap-swap plan)")
    p.add_argument("--classifier", type=Path, required=True, help="classifier folder (reap-swap train)")
    p.add_argument("--corpus", type=Path, required=True, help="ai-data-extraction JSONL to draw mixed-domain prompts from")
    p.add_argument("--out", type=Path, default=Path("out/bench-proxy.json"), help="result JSON")
    p.add_argument("--rounds", type=int, default=200, help="direct/proxy request pairs for the overhead")
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients in the policy comparison")
    p.add_argument("--per-client", type=int, default=6, help="requests per client")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--vllm-args", default="--max-model-len 2048", help="extra vLLM server arguments")
    a = p.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    prompts = _prompts(a.corpus, 120)
    logs = a.out.parent
    bport = free_port()
    backend = ServerProcess(reap_swap_argv("serve", "--model", str(a.model), "--plan", str(a.plan), "--port", str(bport), *a.vllm_args.split()),
                            bport, logs / "bench-proxy-backend.log", name="backend")  # serve sets the CPU settings

    def proxy(*extra: str) -> ServerProcess:
        port = free_port()
        return ServerProcess(reap_swap_argv("proxy", "--backend", backend.url, "--plan", str(a.plan), "--port", str(port), *extra),
                             port, logs / f"bench-proxy-{port}.log", name="proxy")

    result: dict[str, Any] = {"model": str(a.model), "plan": str(a.plan)}
    with backend:
        with proxy("--classifier", str(a.classifier)) as px:
            result["overhead"] = overhead(backend.url, px.url, str(a.model), prompts, a.rounds)
        arms = {"union (classifier)": ("--classifier", str(a.classifier)),
                "latest (classifier, naive)": ("--classifier", str(a.classifier), "--policy", "latest"),
                "static (no classifier)": ()}
        result["concurrency"] = {}
        core = {f"layer_{i}": list(lp.core) for i, lp in load_plan(a.plan).layers.items()}
        for name, extra in arms.items():
            # every arm starts from the same backend state: only the core resident
            httpx.post(backend.url + "/swap_active_set", json={"request_id": f"bench-reset-{name.split()[0]}", "phase": "prefill",
                                                              "active_set": core}, timeout=60).raise_for_status()
            with proxy(*extra) as px:
                result["concurrency"][name] = concurrency(px.url, str(a.model), prompts, a.clients, a.per_client, a.max_tokens, name.split()[0])
    o = result["overhead"]
    print(f"\nproxy overhead over {o['pairs']} direct/proxy pairs (1-token chat completions), ms")
    print(f"{'':<34}{'p50':>9}{'p99':>9}")
    for key, label in (("overhead_ms", "overhead (paired, excl. classify+swap)"), ("internal_overhead_ms", "proxy-measured pre-forward overhead"),
                       ("classify_ms", "embed + classify"), ("direct_ms", "direct request"), ("via_proxy_ms", "through proxy")):
        print(f"{label:<34}{o[key]['p50']:>9.2f}{o[key]['p99']:>9.2f}")
    print(f"\nconcurrency: {a.clients} streaming clients x {a.per_client} requests, mixed domains, {a.max_tokens} tokens each")
    print(f"{'policy':<28}{'req/s':>7}{'installs/req':>13}{'MB moved':>10}{'miss ratio':>11}{'errors':>7}")
    for name, r in result["concurrency"].items():
        print(f"{name:<28}{r['requests_per_s']:>7.2f}{r['installs_per_request']:>13.2f}{r['bytes_copied'] / 1e6:>10.2f}{r['miss_ratio']:>11.3f}{r['errors']:>7}")
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    return 0
