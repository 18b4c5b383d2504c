"""Routing traces: what a model routed, token by token, for a set of requests (pure numpy).

One ``.npz`` file (``numpy.savez_compressed``), arrays:

    offsets   [R + 1] int64    request r owns token rows offsets[r] : offsets[r + 1]
    phase     [T] uint8         0 = prefill (prompt token), 1 = decode (generated token fed back)
    ids       [T, L, K] uint8 (E <= 256) or uint16   top-k expert ids per MoE layer, router order
    weights   [T, L, K] float16 gate weights (after top-k renormalisation when the model does it)
    meta      0-d str           JSON: format, model, moe_layers, num_experts, top_k, expert_bytes,
                                decoding (temperature, max_new_tokens), and per request: id,
                                source, tags, split

Rows of one request are in the order the model consumed them: the prompt,
then each generated token that was fed back. Policy simulators replay rows in
that order (``RoutingTrace.requests``); the CPU tests and ``reap-swap simulate``
read these files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

FORMAT = "reap-swap-routing-trace/1"
PREFILL, DECODE = 0, 1


class TraceError(ValueError):
    pass


@dataclass
class RequestRoute:
    request_id: str
    phase: np.ndarray  # [T] uint8
    ids: np.ndarray  # [T, L, K]
    weights: np.ndarray  # [T, L, K] float32
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.phase.shape[0])


@dataclass
class RoutingTrace:
    meta: dict[str, Any]
    offsets: np.ndarray
    phase: np.ndarray
    ids: np.ndarray
    weights: np.ndarray

    @property
    def num_requests(self) -> int:
        return int(self.offsets.shape[0] - 1)

    @property
    def num_layers(self) -> int:
        return int(self.ids.shape[1])

    @property
    def num_experts(self) -> int:
        return int(self.meta["num_experts"])

    @property
    def top_k(self) -> int:
        return int(self.ids.shape[2])

    def request(self, r: int) -> RequestRoute:
        a, b = int(self.offsets[r]), int(self.offsets[r + 1])
        info = self.meta.get("requests", [{}] * self.num_requests)[r]
        return RequestRoute(str(info.get("id", r)), self.phase[a:b], self.ids[a:b], self.weights[a:b].astype(np.float32), info)

    def requests(self, split: str | None = None) -> Iterator[RequestRoute]:
        for r in range(self.num_requests):
            req = self.request(r)
            if split is None or req.info.get("split") == split:
                yield req

    def validate(self) -> None:
        t = self.phase.shape[0]
        if self.meta.get("format") != FORMAT:
            raise TraceError(f"not a routing trace of format {FORMAT!r}: {self.meta.get('format')!r}")
        if self.offsets.ndim != 1 or self.offsets[0] != 0 or self.offsets[-1] != t or np.any(np.diff(self.offsets) < 0):
            raise TraceError("offsets must start at 0, end at the token count and never decrease")
        if self.ids.shape[0] != t or self.weights.shape != self.ids.shape or self.ids.ndim != 3:
            raise TraceError(f"ids {self.ids.shape} / weights {self.weights.shape} do not match {t} token rows")
        if self.ids.size and int(self.ids.max()) >= self.num_experts:
            raise TraceError(f"expert id {int(self.ids.max())} >= num_experts {self.num_experts}")
        if not np.isin(self.phase, (PREFILL, DECODE)).all():
            raise TraceError("phase holds values other than 0 (prefill) and 1 (decode)")
        if len(self.meta.get("moe_layers", [])) != self.num_layers:
            raise TraceError(f"meta lists {len(self.meta.get('moe_layers', []))} MoE layers, ids hold {self.num_layers}")
        if len(self.meta.get("requests", [])) != self.num_requests:
            raise TraceError("meta.requests must describe every request")


def build(meta: dict[str, Any], requests: list[RequestRoute]) -> RoutingTrace:
    """A trace from per-request routes (meta gets ``format`` and ``requests``)."""
    if not requests:
        raise TraceError("a trace needs at least one request")
    experts = int(meta["num_experts"])
    id_dtype = np.uint8 if experts <= 256 else np.uint16
    offsets = np.zeros(len(requests) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([r.num_tokens for r in requests])
    meta = {**meta, "format": FORMAT, "requests": [{"id": r.request_id, **r.info} for r in requests]}
    trace = RoutingTrace(
        meta=meta,
        offsets=offsets,
        phase=np.concatenate([r.phase for r in requests]).astype(np.uint8),
        ids=np.concatenate([r.ids for r in requests]).astype(id_dtype),
        weights=np.concatenate([r.weights for r in requests]).astype(np.float16),
    )
    trace.validate()
    return trace


def concat(parts: list[RoutingTrace]) -> tuple[RoutingTrace, list[int]]:
    """One trace holding every part's requests in order, and each part's first request index in it.

    Why: one engine replays one routing table (its device tensors are captured in the
    CUDA graphs), so an arm that runs two workloads (``bench-gpu --also-trace``) replays
    their concatenation, request ``i`` of part ``p`` being request ``offsets[p] + i``.
    The parts must route alike: same layer count, experts and top-k.
    """
    if not parts:
        raise TraceError("concat needs at least one trace")
    first = parts[0]
    for i, t in enumerate(parts[1:], 1):
        if (t.num_layers, t.num_experts, t.top_k) != (first.num_layers, first.num_experts, first.top_k):
            raise TraceError(f"trace {i} routes top-{t.top_k} of {t.num_experts} over {t.num_layers} layers; "
                             f"trace 0 top-{first.top_k} of {first.num_experts} over {first.num_layers}")
    starts = [int(x) for x in np.cumsum([0] + [t.num_requests for t in parts[:-1]])]
    row_starts = np.cumsum([0] + [int(t.offsets[-1]) for t in parts[:-1]])
    rows = [t.offsets[1:] + int(r) for t, r in zip(parts, row_starts)]
    id_dtype = np.result_type(*(t.ids.dtype for t in parts))
    meta = {**first.meta, "requests": [r for t in parts for r in t.meta.get("requests", [])],
            "concat_of": [{k: t.meta.get(k) for k in ("model", "decoding")} | {"requests": t.num_requests} for t in parts]}
    trace = RoutingTrace(
        meta=meta,
        offsets=np.concatenate([np.zeros(1, dtype=np.int64), *rows]).astype(np.int64),
        phase=np.concatenate([t.phase for t in parts]),
        ids=np.concatenate([t.ids.astype(id_dtype) for t in parts]),
        weights=np.concatenate([t.weights for t in parts]),
    )
    trace.validate()
    return trace, starts


def save(trace: RoutingTrace, path: str | Path) -> Path:
    trace.validate()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(tmp, offsets=trace.offsets, phase=trace.phase, ids=trace.ids, weights=trace.weights, meta=np.array(json.dumps(trace.meta)))
    tmp.replace(path)
    return path


def load(path: str | Path) -> RoutingTrace:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            trace = RoutingTrace(json.loads(str(z["meta"])), z["offsets"], z["phase"], z["ids"], z["weights"])
    except (OSError, KeyError, ValueError) as exc:
        raise TraceError(f"{path} is not a readable routing trace: {exc}") from None
    trace.validate()
    return trace
