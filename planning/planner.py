"""``reap-swap plan``: core experts + co-activation slices under a VRAM budget.

The plan is built from the training samples only (``--split``; held-out
samples stay unseen so the evaluation is honest). Per layer:

* slots: the per-layer split chosen by cross-validated coverage
  (``allocation.choose_split``: even, marginal gain or CV-optimal; never a
  rule that cannot show it beats the even split);
* core = the experts with the largest mean per-sample share of gate mass, a
  fraction of the layer's slots chosen by cross-validated coverage of core +
  predicted experts (``core_size.choose_core``) unless ``--core-fraction`` fixes it;
* slices = the remaining experts in groups that fire together in the same
  samples: experts are compared by the correlation of their per-sample mass
  shares, and groups are grown greedily around the heaviest unassigned expert
  by highest mean correlation to the group. Each slice records its measured
  ``coactivationScore`` (mean pairwise correlation), ``activationMass`` (its
  share of the layer's gate mass), a token-level co-activation lift, and
  priors per source and tag (mean per-sample share among those samples).

The output follows the seed schema and is checked by the server's validator
before it is written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from reap_swap.cli import HelpFormatter
from reap_swap.models.families import MoELayout, layout_for
from reap_swap.plan import PLAN_MODE, PlanError, check_plan_fits_model, parse_plan

from .allocation import RULES, SplitChoice, apply_rule, choose_split
from .budget import Budget, BudgetError, make_budget
from .core_size import CoreChoice, choose_core, core_counts
from .observations import ObservationError, Observations, load_observations
from .splits import SplitError, ids_sha256, split_indices

ALLOCATION_RULES = {
    "even": "even split: total // layers slots each, the remainder to the layers whose next heaviest expert is heaviest",
    "marginal_gain": "greedy marginal gain on the training mean shares (min 1 slot per layer)",
    "cv_dp": "the split maximising inner cross-validated top-k coverage curves (exact dynamic programming)",
}


@dataclass(frozen=True)
class PlanParams:
    core_fraction: float | None = None  # None: chosen by cross-validation
    slices_per_request: int = 2
    slice_size: int | None = None
    rank_by: str = "mass"
    max_refreshes_per_request: int = 1
    split: str = "test"
    allocation: str = "auto"
    folds: int = 5


def expert_correlation(share: np.ndarray) -> np.ndarray:
    """[m, m] Pearson correlation of experts' per-sample mass shares (0 where undefined)."""
    x = share - share.mean(axis=0, keepdims=True)
    norm = np.sqrt((x * x).sum(axis=0))
    denom = np.outer(norm, norm)
    corr = np.divide(x.T @ x, denom, out=np.zeros((share.shape[1], share.shape[1])), where=denom > 0)
    np.fill_diagonal(corr, 1.0)
    return corr


def group_by_coactivation(experts: list[int], corr: np.ndarray, mass: np.ndarray, size: int) -> list[list[int]]:
    """Partition ``experts`` into groups of ``size`` (last may be smaller), most co-active together."""
    pos = {e: i for i, e in enumerate(experts)}
    left = sorted(experts, key=lambda e: (-mass[e], e))
    groups: list[list[int]] = []
    while left:
        group = [left.pop(0)]
        while len(group) < size and left:
            score = [(np.mean([corr[pos[g], pos[c]] for g in group]), mass[c], -c) for c in left]
            best = max(range(len(left)), key=lambda i: score[i])
            group.append(left.pop(best))
        groups.append(sorted(group))
    return groups


def mean_pairwise(group: list[int], corr: np.ndarray, pos: dict[int, int]) -> float:
    pairs = [(a, b) for i, a in enumerate(group) for b in group[i + 1 :]]
    return float(np.mean([corr[pos[a], pos[b]] for a, b in pairs])) if pairs else 0.0


def token_lift(group: list[int], coact: np.ndarray, freq: np.ndarray, tokens: float) -> float:
    """Mean over pairs of observed / expected token co-activations (1.0 = independent)."""
    pairs = [(a, b) for i, a in enumerate(group) for b in group[i + 1 :]]
    lifts = [coact[a, b] * tokens / (freq[a] * freq[b]) for a, b in pairs if freq[a] and freq[b]]
    return float(np.mean(lifts)) if lifts else 0.0


def _priors(share: np.ndarray, experts: list[int], labels: list[tuple[str, ...]]) -> dict[str, float]:
    per_sample = share[:, experts].sum(axis=1)
    out = {"global": float(per_sample.mean())}
    groups: dict[str, list[int]] = {}
    for i, labs in enumerate(labels):
        for lab in labs:
            groups.setdefault(lab, []).append(i)
    for lab, idx in sorted(groups.items()):
        out[lab] = float(per_sample[idx].mean())
    return out


def plan_layer(obs: Observations, li: int, slots: int, n_core: int, params: PlanParams, per_expert: int) -> dict[str, Any]:
    layer = obs.layer_ids[li]
    E = obs.num_experts
    mass = obs.mass[li]
    total = mass.sum()
    mass_share = mass / total if total > 0 else np.full(E, 1.0 / E)
    mean_share = obs.mass_share()[:, li, :].mean(axis=0)  # what coverage measures: each sample counts once
    rank_signal = {"mass": mean_share, "reap": obs.saliency[li], "freq": obs.freq[li].astype(float)}[params.rank_by]
    order = sorted(range(E), key=lambda e: (-rank_signal[e], -mean_share[e], e))
    specialist = slots - n_core
    core = sorted(order[:n_core])
    rest = sorted(order[n_core:], key=lambda e: (-mass_share[e], e))
    share = obs.mass_share()[:, li, :]
    corr = expert_correlation(share[:, rest]) if rest else np.zeros((0, 0))
    pos = {e: i for i, e in enumerate(rest)}
    size = params.slice_size or max(1, math.ceil(specialist / max(params.slices_per_request, 1)))
    groups = group_by_coactivation(rest, corr, mass_share, size) if rest else []
    freq = obs.freq[li]
    tokens = float(obs.sample_tokens.sum())
    saliency = obs.saliency[li]
    sal_share = saliency / saliency.sum() if saliency.sum() > 0 else saliency
    catalog = []
    for j, group in enumerate(sorted(groups, key=lambda g: -mass_share[g].sum())):
        catalog.append({
            "sliceId": f"layer_{layer}_slice_{j:02d}",
            "experts": group,
            "byteCost": len(group) * per_expert,
            "activationMass": float(mass_share[group].sum()),
            "rawActivationMass": float(mass[group].sum()),
            "reapMass": float(sal_share[group].sum()),
            "expertFrequencyMass": int(freq[group].sum()),
            "coactivationScore": mean_pairwise(group, corr, pos),
            "tokenCoactivationLift": token_lift(group, obs.coact[li], freq, tokens),
            "signalsBySummary": _priors(share, group, [(s,) for s in obs.sources]),
            "taskPriors": _priors(share, group, obs.tags),
        })
    return {
        "rawLayerKey": str(layer),
        "numExperts": E,
        "coreExperts": core,
        "coreActivationMass": float(mass_share[core].sum()),
        "coreRawActivationMass": float(mass[core].sum()),
        "coreReapMass": float(sal_share[core].sum()) if len(core) else 0.0,
        "sliceCatalog": catalog,
        "coreByteCost": len(core) * per_expert,
        "specialistActiveExpertTarget": specialist,
        "specialistBudgetBytes": specialist * per_expert,
        "specialistSliceTarget": math.ceil(specialist / size) if specialist else 0,
        "allocatedSlots": slots,
        "massConcentrationTopK": float(np.sort(mass_share)[::-1][: obs.top_k].sum()),
    }


def choose_layout(obs: Observations, budget: Budget, params: PlanParams, tokenizer_json: Path | None) -> tuple[SplitChoice, CoreChoice]:
    """Per-layer slots and core size, each chosen by cross-validated coverage unless fixed by ``params``."""
    share = obs.mass_share()
    if params.allocation == "auto":
        split = choose_split(share, budget.expert_slots, params.folds)
    elif params.allocation in RULES:
        split = SplitChoice(params.allocation, apply_rule(params.allocation, share, budget.expert_slots, params.folds).tolist(),
                            [{"rule": params.allocation, "note": "fixed by --allocation"}], params.folds)
    else:
        raise PlanError("params", [f"--allocation must be auto or one of {RULES}, got {params.allocation!r}"])
    if params.core_fraction is None:
        core = choose_core(share, obs.prompts, tokenizer_json, split.counts, params.folds)
    else:
        core = CoreChoice(params.core_fraction, [], "fixed by --core-fraction")
    return split, core


def build_plan(obs: Observations, layout: MoELayout, budget: Budget, params: PlanParams, model_ref: str,
               tokenizer_json: Path | None = None) -> dict[str, Any]:
    """The plan, from the training samples of ``obs`` under ``params.split``."""
    if obs.manifest["model"]["config_sha256"] is None or obs.num_experts != layout.num_experts or obs.layer_ids != list(layout.moe_layers):
        raise PlanError("observations", ["observations were made on a model with another MoE layout than --model"])
    if params.core_fraction is not None and not 0 <= params.core_fraction <= 1:
        raise PlanError("params", [f"--core-fraction must be in [0, 1] or auto, got {params.core_fraction}"])
    try:
        train_idx, held_idx = split_indices(obs, params.split, require_heldout=False)
    except SplitError as exc:
        raise PlanError("params", [str(exc)]) from None
    full, obs = obs, obs.subset(train_idx)
    split, core = choose_layout(obs, budget, params, tokenizer_json)
    slots = split.counts
    n_core = core_counts(core.fraction, slots)
    per_layer = {f"layer_{layer}": plan_layer(obs, li, int(slots[li]), n_core[li], params, budget.per_expert_bytes)
                 for li, layer in enumerate(obs.layer_ids)}
    cores = [len(v["coreExperts"]) for v in per_layer.values()]
    specs = [v["specialistActiveExpertTarget"] for v in per_layer.values()]
    resident_pct = [100.0 * (c + s) / obs.num_experts for c, s in zip(cores, specs)]
    tag_counts = Counter(t for tags in obs.tags for t in tags)
    plan = {
        "mode": PLAN_MODE,
        "model": model_ref,
        "signalKey": params.rank_by,
        "selectionStrategy": "classifier_v1",
        "rotationPolicy": "per_request",
        "sourceSummaries": [
            {"label": src, "workflow": obs.sha256[:16], "processedSamples": n,
             "totalTokens": int(sum(t for s, t in zip(obs.sources, obs.sample_tokens) if s == src))}
            for src, n in sorted(Counter(obs.sources).items())
        ],
        "budget": {
            "max_resident_ratio": budget.ratio,
            "max_resident_gib": budget.resident_bytes / (1 << 30),
            "full_bf16_gib": budget.full_bytes / (1 << 30),
            "full_model_bytes": budget.full_bytes,
            "always_resident_bytes": budget.always_resident_bytes,
            "swappable_expert_budget_bytes": budget.expert_budget_bytes,
            "core_budget_bytes": sum(cores) * budget.per_expert_bytes,
            "specialist_budget_bytes": sum(specs) * budget.per_expert_bytes,
            "core_budget_fraction": core.fraction,
            "specialist_budget_fraction": 1 - core.fraction,
            "max_refreshes_per_request": params.max_refreshes_per_request,
            "per_expert_bytes": budget.per_expert_bytes,
            "total_active_expert_capacity": int(sum(cores) + sum(specs)),
            "core_experts_per_layer_target": int(round(float(np.mean(cores)))),
            "specialist_experts_per_layer_target": int(round(float(np.mean(specs)))),
            "model_dtype": layout.dtype,
        },
        "perLayer": per_layer,
        "scorerArtifacts": {
            "planner": "reap-swap plan",
            "params": asdict(params),
            "budgetInputs": budget.to_json(),
            "layerAllocationRule": ALLOCATION_RULES[split.rule],
            "layerBudgetTargets": {k: v["allocatedSlots"] for k, v in per_layer.items()},
            "allocation": split.to_json(),
            "core": core.to_json(),
            "training": {"split": params.split, "samples": len(train_idx), "held_out": len(held_idx),
                         "samples_sha256": ids_sha256([full.sample_ids[i] for i in train_idx])},
            "sliceRule": "greedy grouping by Pearson correlation of per-sample gate-mass shares, seeded at the heaviest unassigned expert",
            "observations": {"sha256": obs.sha256, "samples": obs.num_samples, "tokens": int(obs.sample_tokens.sum()),
                             "model": obs.manifest["model"]},
            "activationCorpus": {"tags": dict(sorted(tag_counts.items())), "sources": dict(sorted(Counter(obs.sources).items()))},
        },
        "summary": {
            "layerCount": len(per_layer),
            "totalCoreExperts": int(sum(cores)),
            "totalSlices": int(sum(len(v["sliceCatalog"]) for v in per_layer.values())),
            "residentFractionPctMin": float(min(resident_pct)),
            "residentFractionPctMax": float(max(resident_pct)),
            "coreActivationMassMean": float(np.mean([v["coreActivationMass"] for v in per_layer.values()])),
        },
    }
    parsed = parse_plan(plan, source="generated plan")  # the server's own validator
    check_plan_fits_model(parsed, layout.moe_layers, layout.num_experts)
    return plan


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap plan", description="Write a dynamic_core_specialist plan from observations.", formatter_class=HelpFormatter)
    p.add_argument("--observations", type=Path, required=True, help="observation directory (reap-swap observe)")
    p.add_argument("--model", type=Path, required=True, help="the observed model's directory (its config sizes the budget)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--budget-ratio", type=float, help="resident share of the full model's bytes (this or --budget-gib)")
    g.add_argument("--budget-gib", type=float, help="resident GiB, non-expert weights included (this or --budget-ratio)")
    d = PlanParams()
    p.add_argument("--core-fraction", default="auto", help="share of each layer's slots for core experts (default auto: cross-validated)")
    p.add_argument("--allocation", default=d.allocation, choices=("auto",) + RULES, help="per-layer split (default auto: cross-validated)")
    p.add_argument("--split", default=d.split, help="samples kept out of the plan: test | file:NAME | tag:TAG | source:A,B | hash[:F] | none")
    p.add_argument("--folds", type=int, default=d.folds, help="cross-validation folds")
    p.add_argument("--slices-per-request", type=int, default=d.slices_per_request, help="slices one request activates per layer")
    p.add_argument("--slice-size", type=int, help="experts per slice (default: specialist slots / slices per request)")
    p.add_argument("--rank-by", choices=["mass", "reap", "freq"], default=d.rank_by, help="signal that picks the core")
    p.add_argument("--max-refreshes-per-request", type=int, default=d.max_refreshes_per_request,
                   help="decode_refresh swaps one request may make (the plan's budget.max_refreshes_per_request)")
    p.add_argument("--out", type=Path, required=True, help="plan JSON to write")
    a = p.parse_args(argv)
    try:
        fraction = None if a.core_fraction == "auto" else float(a.core_fraction)
    except ValueError:
        p.error(f"--core-fraction must be a number in [0, 1] or auto, got {a.core_fraction!r}")
    params = PlanParams(fraction, a.slices_per_request, a.slice_size, a.rank_by, a.max_refreshes_per_request, a.split, a.allocation, a.folds)
    if a.slice_size is not None and a.slice_size < 1:
        p.error("--slice-size must be >= 1")
    if a.folds < 2:
        p.error("--folds must be >= 2")
    try:
        obs = load_observations(a.observations)
        layout = layout_for(a.model)
        budget = make_budget(layout, a.budget_ratio, a.budget_gib)
        plan = build_plan(obs, layout, budget, params, str(a.model), a.model / "tokenizer.json")
    except (ObservationError, BudgetError, PlanError, ValueError) as exc:
        print(f"reap-swap plan: error: {exc}", file=sys.stderr)
        return 2
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(plan, indent=1) + "\n")
    s = plan["summary"]
    print(f"wrote {a.out}: {s['layerCount']} layers, {plan['budget']['total_active_expert_capacity']} resident experts "
          f"({budget.resident_bytes / (1 << 20):.1f} MiB of {budget.full_bytes / (1 << 20):.1f} MiB), {s['totalCoreExperts']} core, "
          f"{s['totalSlices']} slices; core covers {100 * s['coreActivationMassMean']:.1f}% of gate mass on average")
    print(format_choices(plan))
    return 0


def format_choices(plan: dict[str, Any]) -> str:
    """The cross-validation tables behind the per-layer split and the core size."""
    art = plan["scorerArtifacts"]
    tr = art["training"]
    lines = [f"built from {tr['samples']} training samples (split {tr['split']!r}, {tr['held_out']} held out)",
             f"per-layer split: {art['allocation']['rule']} {art['allocation']['counts']} "
             f"({art['allocation']['folds']}-fold CV of static top-k coverage on the training samples)"]
    for r in art["allocation"]["candidates"]:
        if "cv_coverage" in r:
            lines.append(f"  {r['rule']:<14} {str(r['counts']):<28} train {r['train_coverage']:.4f}  CV {r['cv_coverage']:.4f}  "
                         f"CV gain vs even {r['cv_gain_vs_even']:+.4f} (se {r['cv_gain_se']:.4f})")
    core = art["core"]
    if core["candidates"]:
        lines.append(f"core fraction: {core['fraction']}, chosen as the {core.get('selection', 'cross-validated best')}")
        for r in core["candidates"]:
            lines.append(f"  {r['fraction']:<5} core {str(r['core_per_layer']):<24} CV coverage (core + reference prediction) {r['cv_coverage']:.4f}")
        if core.get("note"):
            lines.append(f"  note: {core['note']}")
    else:
        lines.append(f"core fraction: {core['fraction']}" + (f" ({core['note']})" if core.get("note") else ""))
    return "\n".join(lines)
