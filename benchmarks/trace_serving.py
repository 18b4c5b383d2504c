"""Trace replay inside a served vLLM's worker (benchmark only): bench-serve's ``--worker-extension-cls`` for stock arms.

vLLM imports a worker extension's module in every worker before it loads the model, and that is
the only hook a stock ``vllm serve`` offers there: importing this module installs
``trace_routing_vllm`` from ``REAP_BENCH_TRACE`` (optionally ``REAP_BENCH_TRACE_LAYERS``, comma
separated) with request ids read for ``trace<N>`` tags, so each served request replays the trace
request its client named in ``X-Request-Id``. Once attached the worker prints
``serve_arms.ATTACHED_MARKER`` and ``describe()`` as JSON to stderr (the server's log), which
bench-serve reads back. Without the variable nothing is installed and the class adds nothing.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Mapping

from .serve_arms import ATTACHED_MARKER, ENV_TRACE, ENV_TRACE_LAYERS


def _announce(describe: dict[str, Any]) -> None:
    print(ATTACHED_MARKER + json.dumps(describe), file=sys.stderr, flush=True)


def install_from_env(env: Mapping[str, str] = os.environ) -> bool:
    """Install the replay the environment names; False when it names none."""
    path = env.get(ENV_TRACE)
    if not path:
        return False
    from reap_swap.planning import traces

    from . import trace_routing_vllm

    raw = env.get(ENV_TRACE_LAYERS, "").strip()
    layers = [int(x) for x in raw.split(",")] if raw else None
    trace_routing_vllm.install(traces.load(path), layers, read_tags=True, announce=_announce)
    return True


class StockTraceExtension:
    """Stock vLLM's worker with nothing added: importing this module is what installs the replay."""


install_from_env()
