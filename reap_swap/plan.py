"""The REAP plan: the seed's ``dynamic_core_specialist`` JSON, parsed and validated.

Pure logic (no vLLM, no torch): the server, the planner, the classifier and
the proxy all read plans through this module, so a plan that loads here is a
plan every part of the system accepts. Validation collects every problem at
once and names where each one is, so a user fixes a plan in one pass.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

PLAN_MODE = "dynamic_core_specialist"
LAYER_PREFIX = "layer_"


class PlanError(ValueError):
    """A plan file that cannot be used; ``problems`` lists every reason."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        shown = "; ".join(problems[:8]) + (f"; ... ({len(problems) - 8} more)" if len(problems) > 8 else "")
        super().__init__(f"invalid plan {source}: {shown}")


@dataclass(frozen=True)
class Slice:
    slice_id: str
    experts: tuple[int, ...]
    activation_mass: float = 0.0
    coactivation_score: float = 0.0
    task_priors: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LayerPlan:
    layer: int
    num_experts: int
    core: tuple[int, ...]
    slices: tuple[Slice, ...]
    specialist_experts: int
    """How many experts beyond the core this layer's slot bank holds."""

    @property
    def resident_capacity(self) -> int:
        return len(self.core) + self.specialist_experts

    def slice_by_id(self, slice_id: str) -> Slice:
        for s in self.slices:
            if s.slice_id == slice_id:
                return s
        raise KeyError(slice_id)


@dataclass(frozen=True)
class Plan:
    raw: Mapping[str, Any]
    sha256: str
    layers: Mapping[int, LayerPlan]
    per_expert_bytes: int
    max_refreshes_per_request: int
    source: str = "<memory>"

    @property
    def model(self) -> str:
        return str(self.raw.get("model", ""))

    def layer_ids(self) -> list[int]:
        return sorted(self.layers)

    def core_set(self) -> dict[int, tuple[int, ...]]:
        return {i: lp.core for i, lp in self.layers.items()}

    def capacity(self) -> dict[int, int]:
        return {i: lp.resident_capacity for i, lp in self.layers.items()}


def canonical_sha256(data: Any) -> str:
    """sha256 of the canonical JSON form (sorted keys, no spaces): the plan's identity."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def layer_index(key: str) -> int | None:
    """``"layer_7"`` or ``"7"`` -> 7; anything else -> None."""
    text = key[len(LAYER_PREFIX) :] if key.startswith(LAYER_PREFIX) else key
    # ASCII digits only ("²".isdigit() is True, int("²") raises) and a sane length
    # (int() of a 5000-digit string raises too): untrusted keys must never reach int() unchecked.
    if not (0 < len(text) <= 6 and text.isascii() and text.isdigit()):
        return None
    return int(text)


def _int_list(value: Any, where: str, num_experts: int, problems: list[str]) -> tuple[int, ...]:
    if not isinstance(value, list):
        problems.append(f"{where}: expected a list of expert ids, got {type(value).__name__}")
        return ()
    out: list[int] = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int):
            problems.append(f"{where}: expert id {item!r} is not an integer")
        elif not 0 <= item < num_experts:
            problems.append(f"{where}: expert id {item} out of range [0, {num_experts})")
        else:
            out.append(item)
    if len(set(out)) != len(out):
        dups = sorted({x for x in out if out.count(x) > 1})
        problems.append(f"{where}: duplicate expert ids {dups}")
    return tuple(out)


def _specialist_experts(layer: Mapping[str, Any], budget: Mapping[str, Any], per_expert: int) -> int:
    for key in ("specialistActiveExpertTarget",):
        if isinstance(layer.get(key), int):
            return int(layer[key])
    if isinstance(layer.get("specialistBudgetBytes"), int) and per_expert > 0:
        return int(layer["specialistBudgetBytes"]) // per_expert
    return int(budget.get("specialist_experts_per_layer_target", 0) or 0)


def _parse_layer(key: str, layer: Any, budget: Mapping[str, Any], per_expert: int, problems: list[str]) -> LayerPlan | None:
    idx = layer_index(key)
    if idx is None:
        problems.append(f"perLayer key {key!r} is not 'layer_N'")
        return None
    if not isinstance(layer, Mapping):
        problems.append(f"{key}: expected an object")
        return None
    n = layer.get("numExperts")
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        problems.append(f"{key}.numExperts: expected a positive integer, got {n!r}")
        return None
    if "coreExperts" not in layer:
        problems.append(f"{key}: missing coreExperts")
    core = _int_list(layer.get("coreExperts", []), f"{key}.coreExperts", n, problems)
    catalog = layer.get("sliceCatalog")
    if not isinstance(catalog, list):
        problems.append(f"{key}.sliceCatalog: expected a list")
        catalog = []
    slices: list[Slice] = []
    seen_ids: set[str] = set()
    owner: dict[int, str] = {e: "core" for e in core}
    for j, raw in enumerate(catalog):
        where = f"{key}.sliceCatalog[{j}]"
        if not isinstance(raw, Mapping):
            problems.append(f"{where}: expected an object")
            continue
        sid = raw.get("sliceId")
        if not isinstance(sid, str) or not sid:
            problems.append(f"{where}.sliceId: expected a non-empty string")
            continue
        if sid in seen_ids:
            problems.append(f"{where}: duplicate sliceId {sid!r}")
        seen_ids.add(sid)
        experts = _int_list(raw.get("experts"), f"{where}.experts", n, problems)
        if not experts:
            problems.append(f"{where}: slice {sid!r} has no experts")
        for e in experts:
            if e in owner:
                problems.append(f"{where}: expert {e} of {sid!r} is already in {owner[e]}")
            owner[e] = sid
        priors = raw.get("taskPriors") if isinstance(raw.get("taskPriors"), Mapping) else {}
        slices.append(
            Slice(
                slice_id=sid,
                experts=experts,
                activation_mass=float(raw.get("activationMass", 0.0) or 0.0),
                coactivation_score=float(raw.get("coactivationScore", 0.0) or 0.0),
                task_priors={str(k): float(v) for k, v in priors.items() if isinstance(v, (int, float))},
            )
        )
    spec = _specialist_experts(layer, budget, per_expert)
    if spec < 0:
        problems.append(f"{key}: negative specialist capacity")
    if len(core) + spec > n:
        problems.append(f"{key}: core ({len(core)}) + specialist capacity ({spec}) exceeds numExperts ({n})")
    return LayerPlan(layer=idx, num_experts=n, core=core, slices=tuple(slices), specialist_experts=max(spec, 0))


def parse_plan(data: Any, source: str = "<memory>") -> Plan:
    """Validate a decoded plan; raises PlanError listing every problem."""
    problems: list[str] = []
    if not isinstance(data, Mapping):
        raise PlanError(source, ["top level must be a JSON object"])
    if data.get("mode") != PLAN_MODE:
        problems.append(f"mode must be {PLAN_MODE!r}, got {data.get('mode')!r}")
    budget = data.get("budget")
    if not isinstance(budget, Mapping) or not budget:
        problems.append("budget: expected a non-empty object")
        budget = {}
    per_expert = budget.get("per_expert_bytes", 0)
    if isinstance(per_expert, bool) or not isinstance(per_expert, int) or per_expert <= 0:
        problems.append(f"budget.per_expert_bytes: expected a positive integer, got {per_expert!r}")
        per_expert = 0
    refreshes = budget.get("max_refreshes_per_request", 0)
    if isinstance(refreshes, bool) or not isinstance(refreshes, int) or refreshes < 0:
        problems.append(f"budget.max_refreshes_per_request: expected an integer >= 0, got {refreshes!r}")
        refreshes = 0
    per_layer = data.get("perLayer")
    if not isinstance(per_layer, Mapping) or not per_layer:
        problems.append("perLayer: expected a non-empty object")
        per_layer = {}
    layers: dict[int, LayerPlan] = {}
    for key, layer in per_layer.items():
        parsed = _parse_layer(str(key), layer, budget, per_expert, problems)
        if parsed is None:
            continue
        if parsed.layer in layers:
            problems.append(f"{key}: layer {parsed.layer} appears twice")
        layers[parsed.layer] = parsed
    if problems:
        raise PlanError(source, problems)
    return Plan(
        raw=data,
        sha256=canonical_sha256(data),
        layers=layers,
        per_expert_bytes=per_expert,
        max_refreshes_per_request=refreshes,
        source=source,
    )


def load_plan(path: str | Path) -> Plan:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(str(p), [f"cannot read: {exc.strerror or exc}"]) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(str(p), [f"not valid JSON: {exc}"]) from None
    return parse_plan(data, source=str(p))


def check_plan_fits_model(plan: Plan, moe_layers: list[int] | tuple[int, ...], num_experts: int) -> None:
    """A plan for another model must be refused before it reaches the GPU."""
    problems: list[str] = []
    moe = set(moe_layers)
    for idx, lp in sorted(plan.layers.items()):
        if idx not in moe:
            problems.append(f"layer_{idx} is not an MoE layer of this model (MoE layers: {sorted(moe)[:6]}...)")
        if lp.num_experts != num_experts:
            problems.append(f"layer_{idx}.numExperts={lp.num_experts} but the model has {num_experts} experts")
    if problems:
        raise PlanError(plan.source, problems)
