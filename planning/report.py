"""``reap-swap plan-report``: figures and a text summary of a plan.

* ``allocation.png`` + the seed's ■/· chart in ``summary.txt``: per layer,
  how many experts are core (■), specialist slots (□) and host-only (·);
* ``concentration.png``: per-layer cumulative share of gate mass against the
  number of experts (how concentrated each layer's routing is);
* ``coverage.png``: per layer, the share of each sample's gate mass that lands
  on resident experts, on the samples the plan did not learn from (its
  recorded split) when there are any: core only, core + the slices heaviest
  over training, the static top-k set at the plan's counts, the even split
  of the same total, and the per-sample bounds (best slices, best experts);
* ``summary.txt``: the chart, the coverage tables (training and held-out) and
  the cross-validation tables behind the plan's per-layer split and core size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from reap_swap.cli import HelpFormatter
from reap_swap.plan import Plan, PlanError, load_plan

from . import coverage as cov
from .observations import ObservationError, Observations, load_observations
from .planner import format_choices
from .splits import SplitError, held_mask


def allocation_chart(plan: Plan) -> str:
    lines = ["Layer allocation (■ core, □ specialist slot, · host only)"]
    for layer in plan.layer_ids():
        lp = plan.layers[layer]
        bar = "■" * len(lp.core) + "□" * lp.specialist_experts + "·" * (lp.num_experts - lp.resident_capacity)
        if len(bar) > 64:  # long layers: one glyph per ceil(E/64) experts
            step = -(-lp.num_experts // 64)
            bar = bar[::step]
        lines.append(f"layer {layer:>3}  {bar}  {len(lp.core)} core + {lp.specialist_experts} specialist / {lp.num_experts}")
    return "\n".join(lines)


def coverage_table(plan: Plan, obs: Observations, train_idx: np.ndarray, eval_idx: np.ndarray) -> dict[str, Any]:
    """Coverage on ``eval_idx`` of the strategies fitted on ``train_idx``."""
    share = obs.mass_share()
    layers = obs.layer_ids
    train, held = share[train_idx], share[eval_idx]
    strategies = {
        "core": cov.core_only(plan, layers),
        "core+static_slices": cov.static_best(plan, layers, train),
        "static_topk": cov.static_topk(plan, layers, train),
        "even_split": cov.even_split(plan, layers, train),
        "core+oracle_slices": cov.oracle(plan, layers, held),
        "core+oracle_experts": cov.expert_oracle(plan, layers, held),
    }
    out: dict[str, Any] = {"layers": layers, "samples": int(len(eval_idx)), "strategies": {}}
    for name, strat in strategies.items():
        c = cov.coverage(held, layers, strat)
        out["strategies"][name] = {"per_layer": c.mean(axis=0).tolist(), "mean": float(c.mean())}
    return out


def coverage_tables(plan: Plan, obs: Observations) -> dict[str, Any]:
    """{"training": ..., "held_out": ... (when the plan's split holds samples out)}."""
    training = plan.raw.get("scorerArtifacts", {}).get("training", {})
    try:
        held = held_mask(obs, training.get("split", "none"))
    except SplitError:
        held = np.zeros(obs.num_samples, dtype=bool)
    train_idx, held_idx = np.nonzero(~held)[0], np.nonzero(held)[0]
    if len(train_idx) == 0:
        train_idx, held_idx = held_idx, np.zeros(0, dtype=np.int64)
    out = {"training": coverage_table(plan, obs, train_idx, train_idx), "split": training.get("split")}
    if len(held_idx):
        out["held_out"] = coverage_table(plan, obs, train_idx, held_idx)
    return out


def _figures(plan: Plan, obs: Observations | None, table: dict[str, Any] | None, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    layers = plan.layer_ids()
    core = [len(plan.layers[l].core) for l in layers]
    spec = [plan.layers[l].specialist_experts for l in layers]
    host = [plan.layers[l].num_experts - c - s for l, c, s in zip(layers, core, spec)]
    fig, ax = plt.subplots(figsize=(max(6, 0.3 * len(layers) + 3), 4))
    ax.bar(layers, core, label="core (always resident)", color="#1f5fa6")
    ax.bar(layers, spec, bottom=core, label="specialist slots", color="#7fb0e0")
    ax.bar(layers, host, bottom=np.add(core, spec), label="host memory only", color="#dddddd")
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("experts")
    ax.set_title("Expert placement per layer")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "allocation.png", dpi=120)
    plt.close(fig)
    written.append("allocation.png")
    if obs is not None and table is not None:
        mass = obs.mass
        fig, ax = plt.subplots(figsize=(6, 4))
        for li, layer in enumerate(obs.layer_ids):
            m = np.sort(mass[li])[::-1]
            ax.plot(np.arange(1, len(m) + 1), np.cumsum(m) / m.sum(), alpha=0.8, label=f"layer {layer}" if len(obs.layer_ids) <= 12 else None)
        ax.plot([1, obs.num_experts], [1 / obs.num_experts, 1], "k--", lw=1, label="uniform routing")
        ax.set_xlabel("experts, heaviest first")
        ax.set_ylabel("cumulative share of gate mass")
        ax.set_title("Routing concentration per layer")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "concentration.png", dpi=120)
        plt.close(fig)
        fig, ax = plt.subplots(figsize=(max(6, 0.35 * len(layers) + 3), 4))
        names = list(table["strategies"])
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            ax.bar(np.arange(len(layers)) + i * width, table["strategies"][name]["per_layer"], width,
                   label=f"{name} (mean {table['strategies'][name]['mean']:.2f})")
        ax.set_xticks(np.arange(len(layers)) + 0.4 - width / 2, [str(l) for l in layers])
        ax.set_xlabel("MoE layer")
        ax.set_ylabel("share of gate mass on resident experts")
        ax.set_ylim(0, 1)
        ax.set_title(f"Coverage by placement strategy ({table['samples']} samples)")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        fig.savefig(out / "coverage.png", dpi=120)
        plt.close(fig)
        written += ["concentration.png", "coverage.png"]
    return written


def write_report(plan_path: Path, obs_dir: Path | None, out: Path) -> dict[str, Any]:
    plan = load_plan(plan_path)
    obs = load_observations(obs_dir) if obs_dir else None
    if obs is not None and (set(obs.layer_ids) != set(plan.layer_ids()) or obs.num_experts != plan.layers[obs.layer_ids[0]].num_experts):
        raise ObservationError("the observations do not match the plan's layers and experts")
    out.mkdir(parents=True, exist_ok=True)
    tables = coverage_tables(plan, obs) if obs is not None else None
    table = (tables.get("held_out") or tables["training"]) if tables else None
    figures = _figures(plan, obs, table, out)
    raw_budget = plan.raw.get("budget", {})
    lines = [
        f"Plan {plan_path} (sha256 {plan.sha256[:16]})",
        f"model {plan.model}; {len(plan.layers)} MoE layers; per expert {plan.per_expert_bytes} bytes",
        f"resident experts {sum(lp.resident_capacity for lp in plan.layers.values())} "
        f"(core {sum(len(lp.core) for lp in plan.layers.values())}); budget ratio {raw_budget.get('max_resident_ratio', 'n/a')}",
        "",
        allocation_chart(plan),
    ]
    for kind, t in (tables or {}).items():
        if not isinstance(t, dict):
            continue
        what = "training samples of the plan" if kind == "training" else f"held-out samples (split {tables['split']!r}), fitted on training"
        lines += ["", f"Coverage of gate mass on {t['samples']} {what} (mean over samples), per layer:"]
        lines.append(f"{'strategy':<22}" + "".join(f"{'L' + str(l):>7}" for l in t["layers"]) + f"{'mean':>8}")
        for name, row in t["strategies"].items():
            lines.append(f"{name:<22}" + "".join(f"{v:>7.3f}" for v in row["per_layer"]) + f"{row['mean']:>8.3f}")
    if "allocation" in plan.raw.get("scorerArtifacts", {}):
        lines += ["", format_choices(plan.raw)]
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    summary = {"plan": str(plan_path), "plan_sha256": plan.sha256, "figures": figures, "coverage": table, "coverage_tables": tables}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(text)
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap plan-report", description="Figures and a summary of a plan.", formatter_class=HelpFormatter)
    p.add_argument("plan", type=Path, help="plan JSON (reap-swap plan, or the seed's)")
    p.add_argument("--observations", type=Path, help="observation directory (for concentration and coverage)")
    p.add_argument("--out", type=Path, required=True, help="folder for the figures, summary.txt and summary.json")
    a = p.parse_args(argv)
    try:
        summary = write_report(a.plan, a.observations, a.out)
    except (PlanError, ObservationError) as exc:
        print(f"reap-swap plan-report: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {', '.join(summary['figures'])}, summary.txt and summary.json to {a.out}")
    return 0
