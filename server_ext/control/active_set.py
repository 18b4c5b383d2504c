"""Active-set payloads: validation, signatures and deltas (pure logic).

An active set says which experts each MoE layer keeps in its GPU slot bank.
Everything here is checked *before* any byte moves, so a rejected payload
leaves the server exactly as it was. Layers a payload does not name keep
their current residents.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from reap_swap.plan import Plan, layer_index

PHASES = ("prefill", "decode_refresh")
MAX_REQUEST_ID_LEN = 256

ResidentSets = dict[int, tuple[int, ...]]


class PayloadError(ValueError):
    """A payload that must be refused. ``code`` names the rule it broke."""

    def __init__(self, message: str, code: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.code = code
        self.param = param
        self.status = status


@dataclass(frozen=True)
class SwapRequest:
    request_id: str
    phase: str
    target: ResidentSets
    """The full resident state after the swap (every layer, sorted ids)."""
    named_layers: tuple[int, ...]
    budget_bytes: int
    allow_missing_core: bool
    warm: bool = False
    reset_router_stats: bool = False


@dataclass(frozen=True)
class LayerDelta:
    added: tuple[int, ...]
    removed: tuple[int, ...]
    reused: int


@dataclass(frozen=True)
class Delta:
    layers: Mapping[int, LayerDelta] = field(default_factory=dict)

    @property
    def experts_added(self) -> int:
        return sum(len(d.added) for d in self.layers.values())

    @property
    def experts_removed(self) -> int:
        return sum(len(d.removed) for d in self.layers.values())

    def to_json(self) -> dict[str, Any]:
        return {
            f"layer_{i}": {"added": list(d.added), "removed": list(d.removed), "reused": d.reused}
            for i, d in sorted(self.layers.items())
            if d.added or d.removed
        }


def signature(resident: Mapping[int, tuple[int, ...] | list[int]]) -> str:
    """sha256 (16 hex) of the canonical resident state; equal sets, equal signature."""
    canon = {f"layer_{i}": sorted(int(e) for e in resident[i]) for i in sorted(resident)}
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def compute_delta(current: Mapping[int, tuple[int, ...]], target: Mapping[int, tuple[int, ...]]) -> Delta:
    out: dict[int, LayerDelta] = {}
    for layer in sorted(set(current) | set(target)):
        cur, tgt = set(current.get(layer, ())), set(target.get(layer, ()))
        out[layer] = LayerDelta(tuple(sorted(tgt - cur)), tuple(sorted(cur - tgt)), len(cur & tgt))
    return Delta(out)


def _bool_field(payload: Mapping[str, Any], name: str) -> bool:
    value = payload.get(name, False)
    if not isinstance(value, bool):
        raise PayloadError(f"'{name}' must be a boolean", "invalid_type", name)
    return value


def parse_swap_request(
    payload: Any,
    plan: Plan,
    current: Mapping[int, tuple[int, ...]],
    capacity: Mapping[int, int],
    *,
    warm: bool = False,
) -> SwapRequest:
    """Validate a ``/swap_active_set`` (or warm) body against the plan and slot banks."""
    if not isinstance(payload, Mapping):
        raise PayloadError("request body must be a JSON object", "invalid_body")
    known = {"request_id", "phase", "active_set", "budget_bytes", "allow_missing_core", "reset_router_stats"}
    unknown = [str(k)[:64] for k in payload if k not in known][:5]
    if unknown:
        raise PayloadError(f"unknown field(s): {', '.join(sorted(unknown))}", "unknown_field", sorted(unknown)[0])

    request_id = payload.get("request_id")
    if isinstance(request_id, str) and len(request_id) > MAX_REQUEST_ID_LEN:
        raise PayloadError(f"'request_id' longer than {MAX_REQUEST_ID_LEN} characters", "invalid_value", "request_id")
    if not isinstance(request_id, str) or not request_id.strip():
        raise PayloadError("'request_id' is required and must be a non-empty string", "missing_field", "request_id")

    phase = payload.get("phase", "prefill" if warm else None)
    if not isinstance(phase, str) or phase not in PHASES:
        shown = phase if isinstance(phase, str) and len(phase) <= 32 else type(phase).__name__
        raise PayloadError(f"'phase' must be one of {list(PHASES)}, got {shown!r}", "invalid_phase", "phase")

    budget_bytes = payload.get("budget_bytes", 0)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or not 0 <= budget_bytes < 1 << 62:
        raise PayloadError("'budget_bytes' must be an integer >= 0", "invalid_value", "budget_bytes")
    allow_missing_core = _bool_field(payload, "allow_missing_core")
    reset_stats = _bool_field(payload, "reset_router_stats")
    if reset_stats and not warm:
        raise PayloadError("'reset_router_stats' is only accepted by /warm_active_set", "unknown_field", "reset_router_stats")

    active = payload.get("active_set")
    if not isinstance(active, Mapping) or not active:
        raise PayloadError("'active_set' must be a non-empty object of layer -> expert ids", "invalid_active_set", "active_set")
    # Sizes first: every check below is linear in what the plan allows, never in what was sent.
    if len(active) > len(plan.layers):
        raise PayloadError(
            f"'active_set' names {len(active)} layers; this plan has {len(plan.layers)}", "invalid_active_set", "active_set"
        )

    target: dict[int, tuple[int, ...]] = {i: tuple(sorted(v)) for i, v in current.items()}
    named: set[int] = set()
    for key, experts in active.items():
        where = f"active_set.{key}" if len(str(key)) <= 32 else "active_set"
        idx = layer_index(str(key)) if len(str(key)) <= 32 else None
        if idx is None or idx not in plan.layers:
            first, last = plan.layer_ids()[0], plan.layer_ids()[-1]
            shown = str(key) if len(str(key)) <= 32 else str(key)[:32] + "..."
            raise PayloadError(f"unknown layer {shown!r}: this plan has layers {first}..{last}", "unknown_layer", where)
        if idx in named:
            raise PayloadError(f"layer {idx} named twice (as 'layer_{idx}' and '{idx}')", "duplicate_layer", where)
        named.add(idx)
        lp = plan.layers[idx]
        if not isinstance(experts, list):
            raise PayloadError(f"{where} must be a list of expert ids", "invalid_type", where)
        cap = capacity.get(idx, lp.resident_capacity)
        if len(experts) > cap:
            raise PayloadError(f"{where}: {len(experts)} experts exceed this layer's slot bank of {cap}", "over_budget", where)
        ids: list[int] = []
        seen: set[int] = set()
        dups: set[int] = set()
        for e in experts:
            if isinstance(e, bool) or not isinstance(e, int):
                shown = repr(e) if isinstance(e, (int, float)) else type(e).__name__
                raise PayloadError(f"{where}: expert id {shown} is not an integer", "invalid_type", where)
            if not 0 <= e < lp.num_experts:
                raise PayloadError(
                    f"{where}: expert id {e if abs(e) < 10**9 else '(huge)'} out of range [0, {lp.num_experts})",
                    "expert_out_of_range",
                    where,
                )
            if e in seen:
                dups.add(e)
            seen.add(e)
            ids.append(e)
        if dups:
            raise PayloadError(f"{where}: duplicate expert ids {sorted(dups)}", "duplicate_experts", where)
        missing = sorted(set(lp.core) - seen)
        if missing and not allow_missing_core:
            raise PayloadError(
                f"{where}: core experts {missing[:10]}{'...' if len(missing) > 10 else ''} missing; "
                "send 'allow_missing_core': true to drop core experts deliberately",
                "missing_core",
                where,
            )
        target[idx] = tuple(sorted(ids))

    if budget_bytes:
        total = sum(len(v) for v in target.values()) * plan.per_expert_bytes
        if total > budget_bytes:
            raise PayloadError(
                f"resident set needs {total} bytes > budget_bytes {budget_bytes}", "over_budget", "budget_bytes"
            )
    return SwapRequest(
        request_id=request_id,
        phase=phase,
        target=target,
        named_layers=tuple(sorted(named)),
        budget_bytes=budget_bytes,
        allow_missing_core=allow_missing_core,
        warm=warm,
        reset_router_stats=reset_stats,
    )
