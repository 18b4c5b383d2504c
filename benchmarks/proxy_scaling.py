"""``reap-swap bench-proxy-scaling``: the proxy's per-decision cost and the per-request miss read, vs concurrency.

1. Policy: ``ResidencyPolicy`` decision time at N in-flight wishes (default
   1, 64, 256; 48 layers x 128 experts), before (the seed's pure-Python
   decide over every wish x layer x expert, reproduced here as the baseline)
   and after (the incremental ``WishSums`` + vectorized selection), for
   expert-scored and slice-only wishes; plus the admit + release cost.
2. Misses: ``/router_misses/{id}``'s device read at N live requests, before
   (``flush``: every live request's rows) and after (``flush_request``: that
   request's rows), on this machine's device twin (CPU).

Prints a table and writes JSON (``benchmarks/results/proxy_policy_scaling.json``).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from reap_swap.cli import HelpFormatter


def _legacy_decide(plan: Any, wishes: Sequence[Any], current: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]]:
    """The seed's decide (union, no prior), its cost and targets: the benchmark's "before"."""
    from reap_swap.planning.expert_select import select_experts
    from reap_swap.selection import select_layer
    from reap_swap.server_ext.control.active_set import signature

    def norm(scores: Sequence[float]) -> list[float]:
        clipped = [max(float(s), 0.0) for s in scores]
        total = sum(clipped)
        return [s / total for s in clipped] if total > 0 else [1.0 / max(len(clipped), 1)] * len(clipped)

    per_expert = all(w.expert_scores for w in wishes)
    target: dict[int, tuple[int, ...]] = {}
    got = kept = 0.0
    for layer, lp in plan.layers.items():
        n = lp.num_experts if per_expert else len(lp.slices)
        acc = [0.0] * n
        for w in wishes:
            src = w.expert_scores if per_expert else w.scores
            for j, s in enumerate(norm(src.get(layer, [0.0] * n))):
                acc[j] += s
        cur = current.get(layer, lp.core)
        if per_expert:
            chosen = select_experts(lp, acc)
            got += sum(acc[e] for e in chosen)
            kept += sum(acc[e] for e in cur if 0 <= e < n)
        else:
            chosen, _ = select_layer(lp, acc, None)

            def value(experts: Sequence[int]) -> float:
                have = set(experts)
                return sum(sc * len(have & set(s.experts)) / len(s.experts) for s, sc in zip(lp.slices, acc))

            got += value(chosen)
            kept += value(cur)
        target[layer] = tuple(chosen)
    signature(target), signature(current)
    return target


def _times(fn: Callable[[], Any], reps: int) -> dict[str, float]:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(out), "p99_ms": float(np.percentile(out, 99)), "reps": reps}


def policy_scaling(layers: int, experts: int, counts: list[int], reps: int, legacy_reps: int) -> dict[str, Any]:
    from reap_swap.models.tiny import tiny_plan_dict
    from reap_swap.plan import parse_plan
    from reap_swap.proxy.policy import ResidencyPolicy, Wish
    from reap_swap.proxy.wish_sums import WishSums

    plan = parse_plan(tiny_plan_dict(layers=layers, experts=experts, core=16, slice_size=8, specialist=24))
    rng = random.Random(0)

    def wish(with_experts: bool) -> Wish:
        es = {l: [rng.random() ** 4 for _ in range(experts)] for l in plan.layers}
        sc = {l: [sum(es[l][e] for e in s.experts) for s in lp.slices] for l, lp in plan.layers.items()}
        return Wish(sc, expert_scores=es if with_experts else {})

    policy = ResidencyPolicy(plan)
    current = plan.core_set()
    out: dict[str, Any] = {"layers": layers, "experts": experts, "rows": []}
    for kind in ("expert", "slice"):
        for n in counts:
            wishes = [wish(kind == "expert") for _ in range(n)]
            sums = WishSums(plan, max_wishes=max(n, 1) + 1)
            for i, w in enumerate(wishes):
                sums.add(str(i), w)
            new = policy.decide_sums(sums, current)
            assert new.target == _legacy_decide(plan, wishes, current), "the incremental policy must pick the seed's targets"
            extra = wish(kind == "expert")
            row = {"wishes": n, "scores": kind,
                   "before": _times(lambda: _legacy_decide(plan, wishes, current), legacy_reps),
                   "after": _times(lambda: policy.decide_sums(sums, current), reps),
                   "admit_release": _times(lambda: (sums.add("x", extra), sums.discard("x")), reps)}
            out["rows"].append(row)
    return out


def drain_scaling(layers: int, experts: int, live: int, reps: int) -> dict[str, Any]:
    import torch

    from reap_swap.server_ext.step.accounting import RoutingAccounting
    from reap_swap.server_ext.step.arena import new_arena
    from reap_swap.server_ext.step.capture import StepLayout
    from reap_swap.server_ext.step.misses import MissLedger

    torch.manual_seed(0)
    ids = [f"chatcmpl-req{i}-{i:08x}" for i in range(live)]
    res: dict[str, Any] = {"live_requests": live, "layers": layers, "experts": experts, "device": "cpu"}
    for arm in ("before", "after"):
        times = []
        for r in range(reps):
            arena = new_arena(layers, live, 8, experts, live)
            acct = RoutingAccounting(arena, list(range(layers)), MissLedger(list(range(layers)), experts, 4 * live))
            arena.codes.copy_(torch.randint(0, experts, arena.codes.shape, dtype=torch.int32))
            arena.weights.uniform_()
            acct.record_step(StepLayout(ids, [1] * live))
            client = f"req{r % live}"
            t = time.perf_counter()
            acct.flush() if arm == "before" else acct.flush_request(client)
            times.append((time.perf_counter() - t) * 1e3)
            res[f"{arm}_drains_per_read"] = acct.drains
        res[arm] = {"median_ms": statistics.median(times), "p99_ms": float(np.percentile(times, 99)), "reps": reps}
    return res


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap bench-proxy-scaling", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--layers", type=int, default=48, help="MoE layers of the synthetic plan")
    p.add_argument("--experts", type=int, default=128, help="experts per layer")
    p.add_argument("--wishes", default="1,64,256", help="in-flight wish counts, comma-separated")
    p.add_argument("--reps", type=int, default=200, help="timed decisions per row (after)")
    p.add_argument("--legacy-reps", type=int, default=5, help="timed decisions per row (before: the slow path)")
    p.add_argument("--live", type=int, default=64, help="live requests for the miss-read timing")
    p.add_argument("--drain-reps", type=int, default=20, help="timed miss reads per arm")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/proxy_policy_scaling.json"), help="result JSON")
    a = p.parse_args(argv)
    counts = [int(x) for x in a.wishes.split(",") if x.strip()]
    result = {"policy": policy_scaling(a.layers, a.experts, counts, a.reps, a.legacy_reps),
              "router_misses_read": drain_scaling(a.layers, a.experts, a.live, a.drain_reps)}
    print(f"\npolicy decision, {a.layers} layers x {a.experts} experts, ms (median / p99)")
    print(f"{'scores':<8}{'wishes':>7}{'before':>20}{'after':>18}{'admit+release':>16}")
    for r in result["policy"]["rows"]:
        b, f, ar = r["before"], r["after"], r["admit_release"]
        print(f"{r['scores']:<8}{r['wishes']:>7}{b['median_ms']:>11.2f} /{b['p99_ms']:>7.2f}{f['median_ms']:>9.3f} /{f['p99_ms']:>7.3f}"
              f"{ar['median_ms']:>9.3f} /{ar['p99_ms']:>5.2f}")
    d = result["router_misses_read"]
    print(f"\n/router_misses/{{id}} device read at {d['live_requests']} live requests (CPU twin), ms (median / p99)")
    print(f"before (flush every live request, {d['before_drains_per_read']} drains): {d['before']['median_ms']:.3f} / {d['before']['p99_ms']:.3f}")
    print(f"after  (that request only, {d['after_drains_per_read']} drain):       {d['after']['median_ms']:.3f} / {d['after']['p99_ms']:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {a.out}")
    return 0
