"""What bench-serve sends: token-id prompts, request ids, and with a trace which trace request each replays (pure).

Prompts are token ids, so a prompt's length is exact and the same in every arm. With a trace,
request k of a load replays ``pool[k % len(pool)]`` (trace requests with a prompt and at least
``max_tokens`` decode rows, in trace order): its prompt has that request's prompt length, so the
trace's prompt rows are replayed as prefill and its decode rows as decode, and its id carries
the ``trace<N>`` tag the servers' replay reads. Every repeat and arm sends the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from reap_swap.planning.traces import RoutingTrace

from .learned.inputs import Target, TraceRequest, membership, pair_hits, request_rows
from .trace_routing import prompt_lengths, tagged_request_id


@dataclass(frozen=True)
class Load:
    """One closed-loop load's requests, in sending order."""

    prompts: list[list[int]]
    request_ids: list[str]
    trace_requests: list[TraceRequest] | None = None


def requests_at(concurrency: int, per_stream: int, minimum: int) -> int:
    """Requests of one load: ``per_stream`` per stream, at least ``minimum``."""
    return max(concurrency * per_stream, minimum)


def trace_pool(trace: RoutingTrace, max_tokens: int) -> list[TraceRequest]:
    """Trace requests that can be replayed whole: a prompt and at least ``max_tokens`` decode rows."""
    prompts = prompt_lengths(trace)
    lengths = np.diff(trace.offsets)
    names = [str(r.get("id", i)) for i, r in enumerate(trace.meta.get("requests", []))]
    pool = []
    for r in range(trace.num_requests):
        decode = int(lengths[r]) - prompts[r]
        if prompts[r] > 0 and decode >= max_tokens:
            pool.append(TraceRequest(r, names[r] if r < len(names) else str(r), prompts[r], decode, max_tokens))
    return pool


def _ids(vocab: int, length: int, *seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(list(seed)).integers(3, vocab, length)]


def build_load(n: int, label: str, vocab: int, seed: int, prompt_tokens: int, pool: Sequence[TraceRequest] | None = None,
               start: int = 0) -> Load:
    """``n`` requests labelled ``label`` (in their ids); prompts depend on ``seed`` and the request, never on the arm.
    With a pool, request k replays ``pool[(start + k) % len(pool)]``: a warm-up taken from the pool's end does not
    replay the timed loads' first requests to the online cache before they are timed."""
    if pool:
        reqs = [pool[(start + k) % len(pool)] for k in range(n)]
        return Load([_ids(vocab, q.prompt_len, seed, q.index) for q in reqs],
                    [tagged_request_id(q.index, f"{label}.{k}") for k, q in enumerate(reqs)], reqs)
    return Load([_ids(vocab, prompt_tokens, seed, k) for k in range(n)], [f"bench.{label}.{k}" for k in range(n)])


def longest_request(prompt_tokens: int, max_tokens: int, pool: Sequence[TraceRequest] | None = None) -> int:
    """Tokens of the longest request sent (prompt + generation)."""
    return (max(q.prompt_len for q in pool) if pool else prompt_tokens) + max_tokens


def expected_hits(trace: RoutingTrace, trace_layers: Sequence[int], reqs: Sequence[TraceRequest], target: Target,
                  num_experts: int) -> dict[str, Any]:
    """The hit rate a fixed resident set must show over the rows ``reqs`` replay (prompt, then every generated
    token fed back): what the reap arms' miss accounting measures when routing is the trace's."""
    resident = membership(target, num_experts)
    hits = routed = 0.0
    for q in reqs:
        pre, dec = request_rows(trace, q)
        h, p = pair_hits(trace, np.concatenate([pre, dec]), trace_layers, resident)
        hits, routed = hits + h, routed + p
    return {"hit_rate": hits / routed if routed else None, "routed_pairs": int(routed), "missed_pairs": int(routed - hits),
            "source": "offline replay of the trace rows through the start set"}
