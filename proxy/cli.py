"""``reap-swap proxy``: run the OpenAI-compatible routing proxy with uvicorn."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from reap_swap.cli import HelpFormatter
from reap_swap.plan import PlanError, load_plan


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="reap-swap proxy", description="OpenAI-compatible proxy: classify -> swap -> forward -> misses.", formatter_class=HelpFormatter)
    p.add_argument("--backend", required=True, help="URL of the reap-swap serve backend, e.g. http://127.0.0.1:8000")
    p.add_argument("--plan", type=Path, required=True, help="the backend's plan JSON (the proxy checks the backend serves it)")
    p.add_argument("--classifier", type=Path, help="trained classifier dir (reap-swap train); without it, static slices")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8100, help="port to bind")
    p.add_argument("--control-token", default=os.environ.get("REAP_CONTROL_TOKEN"), help="token for the backend's control endpoints (default: $REAP_CONTROL_TOKEN)")
    p.add_argument("--backend-api-key", default=os.environ.get("REAP_BACKEND_API_KEY"),
                   help="the backend's --api-key, for control calls when it has no control token; clients send their own (default: $REAP_BACKEND_API_KEY)")
    p.add_argument("--control-token-file", type=Path, help="read that token from this file (e.g. the one reap-swap serve generated)")
    p.add_argument("--proxy-key", default=os.environ.get("REAP_PROXY_KEY"), help="require this key in X-Reap-Proxy-Key (default: $REAP_PROXY_KEY, else no key)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="largest request body accepted, in bytes; a larger one is refused with 413 (default: %(default)s = 8 MiB)")
    p.add_argument("--backend-timeout", type=float, default=600.0, help="seconds to wait for the backend")
    p.add_argument("--swap-wait", type=float, default=2.0, help="seconds a request waits for its residency install")
    p.add_argument("--hysteresis", type=float, default=0.05, help="keep the resident set if it captures >= 1-h of the target's score")
    p.add_argument("--policy", choices=["union", "latest"], default="union",
                   help="union: scored union of in-flight requests' sets (default); latest: each request installs its own")
    p.add_argument("--classify-threads", type=int, default=0, help="torch threads for embedding (0: half the cores)")
    p.add_argument("--classify-budget", type=float, default=0.5, help="seconds a prompt may spend in the classifier before the prior is used")
    p.add_argument("--max-streams", type=int, default=256, help="connections to the backend for completions (control calls have their own)")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    return p


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    try:
        load_plan(a.plan)
    except PlanError as exc:
        print(f"reap-swap proxy: error: {exc}", file=sys.stderr)
        return 2
    if a.control_token is None and a.control_token_file is not None:
        try:
            a.control_token = a.control_token_file.read_text().strip() or None
        except OSError as exc:
            print(f"reap-swap proxy: error: cannot read {a.control_token_file}: {exc}", file=sys.stderr)
            return 2
    if a.classify_budget <= 0 or a.max_streams < 1:
        print("reap-swap proxy: error: --classify-budget must be > 0 and --max-streams >= 1", file=sys.stderr)
        return 2
    if a.classifier is not None and not (a.classifier / "classifier.json").is_file():
        print(f"reap-swap proxy: error: {a.classifier} holds no classifier.json (train one with reap-swap train)", file=sys.stderr)
        return 2
    import uvicorn

    from .app import ProxyConfig, ReapProxy

    cfg = ProxyConfig(
        backend=a.backend, plan=a.plan, classifier=a.classifier, control_token=a.control_token, backend_api_key=a.backend_api_key, proxy_key=a.proxy_key,
        max_body_bytes=a.max_body_bytes, backend_timeout_s=a.backend_timeout, swap_wait_s=a.swap_wait, hysteresis=a.hysteresis, policy=a.policy, classify_threads=a.classify_threads,
        classify_budget_s=a.classify_budget, max_streams=a.max_streams,
    )
    uvicorn.run(ReapProxy(cfg).app, host=a.host, port=a.port, log_level=a.log_level, lifespan="on")
    return 0
