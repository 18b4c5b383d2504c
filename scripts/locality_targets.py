"""Issue 24's four locality targets, checked on ``reap-swap locality`` reports; writes locality_v2.json.

Why: the v2 model is accepted on four numbers measured on a diverse decode workload (published
Qwen3-30B-A3B figures, ``../shared/notes/anchors.md``): experts for 90 % of decode gate mass
55-70 of 128, reuse at the next token 0.40-0.50, within 8 tokens >= 0.78, and the last third of
the layers more concentrated than the first third. One file says, per trace, which are met.

    python scripts/locality_targets.py --reports locality_all.json --train-eval eval.json --out locality_v2.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

TARGETS: dict[str, tuple[float, float]] = {
    "experts_for_90pct_mass": (55.0, 70.0),
    "reuse_next_token": (0.40, 0.50),
    "reuse_within_8": (0.78, 1.0),
}


def _mean(xs: list[Any]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def targets_check(rep: dict[str, Any], phase: str = "decode") -> dict[str, Any]:
    """The four numbers of one locality report (mean over layers) and whether each is met.

    ``phase`` "decode" is the issue's measure (the model's own generated tokens); "prefill" reads the
    same numbers off the teacher-forced prompt tokens, real held-out text, which is what an
    undertrained proxy can be judged on (its own samples loop). Expert counts are scaled to 128
    experts when a trace has fewer.
    """
    scale = 128 / rep["num_experts"]
    if phase == "decode":
        el = rep["early_late"]
        m90, early, late = el["mass_90_decode"]["all"], el["mass_90_decode"]["early"], el["mass_90_decode"]["late"]
        reuse, within = el["reuse_next_token"]["all"], el["reuse_within_8"]["all"]
    else:
        per_layer = rep["coverage"]["workload"][phase]["mass"]["90"]
        third = max(1, len(per_layer) // 3)
        m90, early, late = _mean(per_layer), _mean(per_layer[:third]), _mean(per_layer[-third:])
        reuse, within = _mean(rep["reuse"]["next_token"][phase]), _mean(rep["reuse"]["within_8"][phase])
    nums = {
        "experts_for_90pct_mass": None if m90 is None else m90 * scale,
        "reuse_next_token": reuse,
        "reuse_within_8": within,
        f"mass_90_{phase}_first_third": early,
        f"mass_90_{phase}_last_third": late,
    }
    met = {k: (nums[k] is not None and lo <= nums[k] <= hi) for k, (lo, hi) in TARGETS.items()}
    met["late_more_concentrated"] = early is not None and late is not None and late < early
    return {"phase": phase, "values": nums, "met": met, "met_count": sum(met.values())}


def distance(check: dict[str, Any]) -> float:
    """How far from the targets (0 = all met): each band miss in band widths (0.05 for the one-sided
    within-8 target), plus 1 when the layer order is wrong."""
    d = 0.0
    for k, (lo, hi) in TARGETS.items():
        v = check["values"][k]
        if v is None:
            return float("inf")
        width = 0.05 if k == "reuse_within_8" else hi - lo
        d += max(0.0, lo - v, v - hi) / width
    return d + (0.0 if check["met"]["late_more_concentrated"] else 1.0)


def summary(rep: dict[str, Any]) -> dict[str, Any]:
    """The report's headline: trace, requests, tokens, domains, and the target check."""
    doms = rep["coverage"]["by_domain"]
    return {"trace": rep["trace"], "requests": rep["requests"], "tokens": rep["tokens"],
            "domains": {d: v["requests"] for d, v in sorted(doms.items())}, "targets": targets_check(rep),
            "distance_to_targets": round(distance(targets_check(rep)), 3), "prefill_same_numbers": targets_check(rep, "prefill")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reports", type=Path, required=True, help="reap-swap locality --out (one report or {\"reports\": [...]})")
    ap.add_argument("--train-eval", type=Path, help="the model's eval.json (steps, tokens, loss) to quote")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    data = json.loads(args.reports.read_text())
    reports = data["reports"] if "reports" in data else [data]
    ev = json.loads(args.train_eval.read_text()) if args.train_eval and args.train_eval.is_file() else {}
    out = {
        "issue": 24,
        "targets": {**{k: list(v) for k, v in TARGETS.items()},
                    "late_more_concentrated": "the last third of the MoE layers needs fewer experts for 90 % of decode mass than the first third"},
        "measured_on": "the first report: the held-out diverse decode workload (example/realistic/test.jsonl, all 7 domains and chat "
                       "shapes in turn, + example/corpus/test.jsonl; never trained on), T=0.8; then the committed wide traces",
        "summaries": [summary(r) for r in reports],
        "model": {k: ev.get(k) for k in ("steps", "tokens_seen", "train_seconds", "params", "active_params", "moe_impl", "experts_impl",
                                         "batch_size", "finished", "resumed_from_step", "impl_trial_ms_per_step", "error")}
                 | {"heldout_loss": {d: round(v["loss"], 4) for d, v in (ev.get("eval") or {}).items()}},
        "reports": reports,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    for s in out["summaries"]:
        print(f"{s['trace']}: {s['requests']} requests, {s['tokens']['decode']} decode tokens: {json.dumps(s['targets'])}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
