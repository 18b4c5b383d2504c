"""Replay of recorded routing traces inside MoE layers (benchmark only; pure torch, no vLLM).

The GPU benchmark runs a dummy-weight model of a real expert shape, whose
random router says nothing about which experts a real workload uses. With
``TraceReplay`` every MoE layer returns, for each token row of a step, the
(weights, ids) a trained model routed for that token of a recorded request
(``planning/traces.py``), so every arm (stock all-GPU, stock offload,
reap-swap residency) moves and computes exactly the experts a real model would.

Device side (``route``) is a fixed-shape gather from per-layer tables at a
persistent ``row_of_token`` buffer: no host sync, CUDA-graph capturable.
Host side maps each step's (request, position) pairs to trace rows and stages
them into that buffer before the forward pass (``rows_for_step`` + ``stage``).
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import torch

from reap_swap.planning.traces import PREFILL, RoutingTrace, TraceError
from reap_swap.server_ext.step.request_ids import engine_id_matches_exact

Entry = tuple[str, int, int]
"""(request id, tokens already computed, tokens scheduled this step), in batch order."""

_RING = 4
TRACE_TAG = re.compile(r"(?:^|[^0-9A-Za-z])trace(\d+)(?![0-9A-Za-z])")
"""A request id carrying ``trace<N>`` (``bench.trace7.c32.0``; vLLM's ``cmpl-`` prefix and suffixes,
and the proxy's ``.<random>``, keep it) replays trace request N: a served client names the routing
of each request it sends (``tagged_request_id``) without any call into the engine."""


def tagged_request_id(trace_request: int, rest: str) -> str:
    """An ``X-Request-Id`` that makes a server whose replay reads ``TRACE_TAG`` replay ``trace_request``."""
    return f"trace{int(trace_request)}.{rest}"


def tag_of(request_id: str) -> int | None:
    """The trace request a ``TRACE_TAG`` id names, else None."""
    m = TRACE_TAG.search(request_id)
    return None if m is None else int(m.group(1))


def prompt_lengths(trace: RoutingTrace) -> list[int]:
    """Prefill rows per trace request: a benchmark prompt this long replays the prompt rows as prompt rows."""
    return [int((trace.phase[a:b] == PREFILL).sum()) for a, b in zip(trace.offsets[:-1], trace.offsets[1:])]


class TraceReplay:
    """Per-layer trace tables on the device plus the host bookkeeping that picks rows per step.

    ``layers`` selects which trace layers feed the model's MoE layers, in model
    order (default: all of them, 1:1; their count must equal ``num_layers``). With
    ``read_tags`` a request id carrying ``TRACE_TAG`` replays the trace request it names
    (one that does not exist, or has no rows, falls back to round-robin).
    """

    def __init__(
        self,
        trace: RoutingTrace,
        num_layers: int,
        num_experts: int,
        top_k: int,
        max_tokens: int,
        device: torch.device | str = "cpu",
        layers: Sequence[int] | None = None,
        read_tags: bool = False,
    ):
        chosen = list(range(trace.num_layers)) if layers is None else [int(i) for i in layers]
        if len(chosen) != num_layers:
            raise TraceError(f"the trace feeds {len(chosen)} MoE layers, the model has {num_layers}")
        if any(not 0 <= i < trace.num_layers for i in chosen):
            raise TraceError(f"trace layers {chosen} out of range 0..{trace.num_layers - 1}")
        if trace.top_k != top_k or trace.num_experts != num_experts:
            raise TraceError(
                f"trace routes top-{trace.top_k} of {trace.num_experts} experts, the model top-{top_k} of {num_experts}"
            )
        if max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        self.device = torch.device(device)
        self.num_layers, self.num_experts, self.top_k, self.max_tokens = num_layers, num_experts, top_k, max_tokens
        self.offsets = np.asarray(trace.offsets, dtype=np.int64)
        self.lengths = np.diff(self.offsets)
        self.request_names = [str(r.get("id", i)) for i, r in enumerate(trace.meta.get("requests", []))]
        self._usable = [r for r in range(trace.num_requests) if self.lengths[r] > 0]
        if not self._usable:
            raise TraceError("every request of the trace is empty")
        sel = np.asarray(chosen, dtype=np.int64)
        # [L, N, K]: one contiguous table per layer, rows = all requests' tokens concatenated.
        ids = np.ascontiguousarray(np.asarray(trace.ids)[:, sel, :].transpose(1, 0, 2), dtype=np.int32)
        weights = np.ascontiguousarray(np.asarray(trace.weights)[:, sel, :].transpose(1, 0, 2), dtype=np.float32)
        self.ids = torch.from_numpy(ids).to(self.device)
        self.weights = torch.from_numpy(weights).to(self.device)
        self.row_of_token = torch.zeros(max_tokens, dtype=torch.int64, device=self.device)
        self._cuda = self.device.type == "cuda"
        self._host = [torch.zeros(max_tokens, dtype=torch.int64, pin_memory=self._cuda) for _ in range(_RING if self._cuda else 1)]
        self._events = [torch.cuda.Event() for _ in self._host] if self._cuda else []
        self._ring = 0
        self._staged = 0  # rows written by the last stage; the tail beyond a shorter step is zeroed
        self._explicit: dict[str, int] = {}
        self._assigned: dict[str, int] = {}
        self._next_auto = 0
        self.read_tags = read_tags
        self.steps_staged = 0

    @property
    def num_requests(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def table_bytes(self) -> int:
        return self.ids.numel() * self.ids.element_size() + self.weights.numel() * self.weights.element_size()

    # ---- host side: which trace request each engine request replays -------------------------

    def _index(self, trace_request: int | str) -> int:
        if isinstance(trace_request, str):
            if trace_request not in self.request_names:
                raise TraceError(f"no trace request named {trace_request!r}")
            r = self.request_names.index(trace_request)
        else:
            r = int(trace_request)
        if not 0 <= r < self.num_requests:
            raise TraceError(f"trace request {r} out of range 0..{self.num_requests - 1}")
        if self.lengths[r] == 0:
            raise TraceError(f"trace request {r} has no token rows")
        return r

    def assign(self, request_id: str, trace_request: int | str) -> None:
        """Replay ``trace_request`` (index or trace id) for ``request_id`` and vLLM's decorations of it

        (``abc`` also covers the engine id ``abc-1a2b3c4d``; see ``server_ext.step.request_ids``).
        """
        r = self._index(trace_request)
        self._explicit[str(request_id)] = r
        self._assigned = {k: v for k, v in self._assigned.items() if not engine_id_matches_exact(k, str(request_id))}

    def trace_request_of(self, request_id: str) -> int:
        """The trace request ``request_id`` replays: assigned, else named by its tag (``read_tags``), else
        the next one round-robin at first sight."""
        r = self._assigned.get(request_id)
        if r is not None:
            return r
        r = self._explicit.get(request_id)
        if r is None:
            keys = [k for k in self._explicit if engine_id_matches_exact(request_id, k)]
            if keys:
                r = self._explicit[max(keys, key=len)]
        if r is None and self.read_tags:
            tag = tag_of(str(request_id))
            if tag is not None and 0 <= tag < self.num_requests and self.lengths[tag] > 0:
                r = tag
        if r is None:
            r = self._usable[self._next_auto % len(self._usable)]
            self._next_auto += 1
        self._assigned[request_id] = r
        return r

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop finished requests' assignments (explicit ones stay)."""
        for rid in request_ids:
            self._assigned.pop(rid, None)

    def rows_for_step(self, entries: Sequence[Entry]) -> np.ndarray:
        """Trace rows for every token row of a step, request after request in batch order.

        A request's token at position p replays its trace request's row p. Positions
        past the trace's end (generating longer than the recorded request) repeat its
        last row: the clamp keeps the routing a real one of that request instead of
        wrapping into another request's rows.
        """
        total = sum(int(n) for _, _, n in entries)
        out = np.empty(total, dtype=np.int64)
        pos = 0
        for rid, computed, n in entries:
            n = int(n)
            r = self.trace_request_of(str(rid))
            idx = np.minimum(int(computed) + np.arange(n, dtype=np.int64), self.lengths[r] - 1)
            out[pos : pos + n] = self.offsets[r] + idx
            pos += n
        return out

    def stage(self, rows: np.ndarray) -> None:
        """Publish a step's rows into ``row_of_token`` (asynchronous on CUDA; padding rows read row 0)."""
        n = int(rows.shape[0])
        if n > self.max_tokens:
            raise ValueError(f"{n} token rows in one step exceed the replay buffer of {self.max_tokens}")
        m = max(n, self._staged)
        i = self._ring = (self._ring + 1) % len(self._host)
        buf = self._host[i]
        if self._cuda and not self._events[i].query():  # issued _RING steps ago: long done
            self._events[i].synchronize()
        buf[:n].copy_(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64)))
        buf[n:m].zero_()
        self.row_of_token[:m].copy_(buf[:m], non_blocking=self._cuda)
        if self._cuda:
            self._events[i].record()
        self._staged = n
        self.steps_staged += 1

    def step(self, entries: Sequence[Entry]) -> np.ndarray:
        rows = self.rows_for_step(entries)
        self.stage(rows)
        return rows

    # ---- device side ------------------------------------------------------------------------

    def route(self, layer: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights float32 [T, K], topk_ids int32 [T, K]) of the staged rows: tensor-only, fixed shape."""
        rows = self.row_of_token[:num_tokens]
        return self.weights[layer].index_select(0, rows), self.ids[layer].index_select(0, rows)
