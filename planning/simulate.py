"""``reap-swap simulate``: replay a routing trace through expert cache policies, equal slots per layer.

Requests are replayed in trace order as one stream (a server at batch 1; the
cache carries over between requests): one step for each request's prefill
(the union of its prompt's routing) and one per decoded token. Reported per
policy: routed-pair hit rate (as routed, before any promotion) for prefill and
decode, gate-mass hit rate, promotions per decoded token and link bytes per
decoded token (missed experts read over the link plus promotions of experts
the step did not route). ``static_topk`` is calibrated on other requests than
the ones scored (the trace's ``train`` split, else the first half), and only
the rest are scored; ``belady`` (optimal replacement with optional admission)
is the upper bound of any online policy. ``lfru_cap`` is the server's online
cache (``server_ext/cache/online_cache.py``) rule for rule, float32 scores included:
at most ``--cap`` promotions per layer per step, ``--hysteresis``, ``--decay``.

With ``--clock`` (a step-time calibration, ``planning/step_time.py``) each policy also gets its
simulated decode step (ms) and tok/s at batch 1, and ``--sweep-cap`` picks ``lfru_cap``'s cap by
that step time rather than by hit rate (with ``--cpu-path`` the two disagree: a promotion turns a
miss the CPU computes beside the link into a copy before the kernel). ``--calibrate`` builds the
clock from the measured H200 files; ``--validate`` replays the GPU bench's timed requests through
every arm and prints measured vs simulated ms/step (``planning/clock_validate.py``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np

from reap_swap.cli import RawDescriptionHelpFormatter

from .cache_policies import LFRU, LRU, CachePolicy, DecayedCounters, PriorDecayedCounters, PromptPrior, belady_hits, top_by_mass
from .clock_arms import SplitRule, split_cpu
from .clock_validate import MACHINES
from .step_time import Clock, ClockError, StepCounts, load_clock, step_ms
from .traces import DECODE, PREFILL, RequestRoute, RoutingTrace, TraceError, load

POLICIES = ("static_topk", "prompt_prior", "lru", "lfru", "lfru_cap", "decayed_counters", "prior_decayed", "belady")
ONLINE = ("lru", "lfru", "lfru_cap", "decayed_counters", "prior_decayed")
# The policy the server ships: ``reap-swap serve --online-cache lfru`` runs ``lfru_cap`` (LFRU won the
# online policies on learned 128-expert traces; the device needs a per-step cap).
SHIPPED_POLICY = "lfru_cap"
# ``lfru_cap`` as the server runs it by default (server_ext/config.py: REAP_ONLINE_CACHE_CAP / _DECAY).
DEFAULT_CAP = 4
DEFAULT_DECAY = 0.95


def split_requests(trace: RoutingTrace) -> tuple[list[RequestRoute], list[RequestRoute], str]:
    reqs = list(trace.requests())
    train = [r for r in reqs if r.info.get("split") == "train"]
    if train and len(train) < len(reqs):
        return train, [r for r in reqs if r.info.get("split") != "train"], "train split"
    half = max(1, len(reqs) // 2)
    if len(reqs) < 2:
        raise TraceError("simulate needs at least two requests (one to calibrate the static set on)")
    return reqs[:half], reqs[half:], "first half"


def layer_steps(reqs: list[RequestRoute], layer: int, num_experts: int) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """(phase, routed experts, their pair counts, their gate mass, the prompt's routing mass or empty)."""
    out = []
    for req in reqs:
        ids, w = req.ids[:, layer].astype(np.int64), req.weights[:, layer]
        pre = req.phase == PREFILL
        prompt_mass = np.bincount(ids[pre].ravel(), weights=w[pre].ravel(), minlength=num_experts)
        if pre.any():
            counts = np.bincount(ids[pre].ravel(), minlength=num_experts)
            routed = np.flatnonzero(counts)
            out.append((PREFILL, routed, counts[routed], prompt_mass[routed], prompt_mass))
        for t in np.flatnonzero(req.phase == DECODE):
            out.append((DECODE, ids[t], np.ones(ids.shape[1], dtype=np.int64), w[t], np.empty(0)))
    return out


def _new_policy(name: str, slots: int, num_experts: int, static_set: np.ndarray, top_k: int, cap: int = DEFAULT_CAP,
                hysteresis: float | None = None, decay: float = DEFAULT_DECAY) -> CachePolicy:
    makers: dict[str, Callable[[], CachePolicy]] = {
        "static_topk": lambda: CachePolicy(slots, num_experts, static_set),
        "prompt_prior": lambda: PromptPrior(slots, num_experts, static_set),
        "lru": lambda: LRU(slots, num_experts, static_set),
        "lfru": lambda: LFRU(slots, num_experts, static_set),
        # The device policy (server_ext/cache/online_cache.py): float32 scores, capped, as the server runs it.
        "lfru_cap": lambda: LFRU(slots, num_experts, static_set, decay, cap, hysteresis, dtype=np.float32),
        "decayed_counters": lambda: DecayedCounters(slots, num_experts, static_set),
        "prior_decayed": lambda: PriorDecayedCounters(slots, num_experts, static_set, top_k=top_k),
    }
    return makers[name]()


SERVER_STEP_TOKENS, SERVER_STEP_PAIRS = 32, 256
"""``cpu_path.DEFAULT_STEP_TOKENS`` / ``MAX_STEP_PAIRS``: the server's default largest step (tests hold them equal)."""


def cpu_rule(clock: Clock, max_tokens: int = 8, top_k: int = 8) -> SplitRule:
    """The server's split rule with the clock's pipe rates (what ``serve --cpu-experts`` measures at start-up),
    its step sizes as ``CpuPathSettings``' defaults (steps past ``max_tokens`` up to ``SERVER_STEP_TOKENS`` join
    under the pair budget)."""
    step = max(max_tokens, min(SERVER_STEP_TOKENS, SERVER_STEP_PAIRS // max(top_k, 1)))
    return SplitRule(clock.link_GBps, clock.cpu_GBps, clock.cpu_fixed_ms * 1e-3, clock.cpu_pair_ms * 1e-3, max_tokens, step,
                     max_tokens * top_k)


def _clocked(clock: Clock, moved: np.ndarray, expert_bytes: int, rule: SplitRule | None, cache: bool, top_k: int) -> dict[str, float]:
    """Mean decode step (ms) of a policy from its per-layer, per-decode-step [hits, misses not promoted, promotions]."""
    layers, steps = moved.shape[1], moved.shape[2]
    total = np.zeros(steps)
    for t in range(steps):
        c = StepCounts.zeros(layers, 1, cache=cache, cpu_path=rule is not None)
        c.resident = moved[0, :, t] + moved[3, :, t]
        c.promoted = moved[2, :, t]
        for l in range(layers):
            m = int(moved[1, l, t])
            n = len(split_cpu(np.ones(m, dtype=np.int64), rule, expert_bytes, 1, top_k=top_k)) if rule is not None else 0
            c.cpu[l], c.cpu_pairs[l], c.link[l] = n, n, m - n
        total[t] = step_ms(clock, c, expert_bytes).total
    mean = float(total.mean()) if steps else float("nan")
    return {"step_ms_decode": mean, "decode_tok_s": 1e3 / mean if steps else float("nan")}


def simulate(trace: RoutingTrace, slots_fraction: float, policies: tuple[str, ...] = POLICIES, cap: int = DEFAULT_CAP,
             hysteresis: float | None = None, decay: float = DEFAULT_DECAY, clock: Clock | None = None,
             cpu_path: bool = False, expert_bytes: int | None = None) -> dict[str, Any]:
    """Hit rates per policy; with ``clock`` also each policy's mean decode step (ms) and tok/s at batch 1.

    With the clock a promoted routed miss is copied into its slot before the step's kernel (the
    server's order) instead of being read over the link; with ``cpu_path`` the remaining misses are
    split between the link and the CPU by the server's rule. ``expert_bytes`` defaults to the clock's
    calibration shape, then to the trace's.
    """
    calib, scored, calibrated_on = split_requests(trace)
    e, k = trace.num_experts, trace.top_k
    slots = max(1, int(round(slots_fraction * e)))
    clock_bytes = expert_bytes or (clock.expert_bytes if clock else 0) or int(trace.meta.get("expert_bytes", 0))
    expert_bytes = int(trace.meta.get("expert_bytes", 0))
    n_decode = sum(int((r.phase == DECODE).sum()) for r in scored)
    # per policy, layer, decode step: hits, misses not promoted, promotions, promoted routed misses
    moved = {p: np.zeros((4, trace.num_layers, n_decode)) for p in policies}
    # pairs, hits (prefill); pairs, hits (decode); mass, hit mass (decode); promotions; promotions of unrouted experts
    totals = {p: np.zeros(8) for p in policies}
    decode_tokens = sum(int((r.phase == DECODE).sum()) for r in scored)
    for layer in range(trace.num_layers):
        calib_mass = np.zeros(e)
        for r in calib:
            calib_mass += np.bincount(r.ids[:, layer].astype(np.int64).ravel(), weights=r.weights[:, layer].ravel(), minlength=e)
        static_set = top_by_mass(calib_mass, slots)
        steps = layer_steps(scored, layer, e)
        for name in policies:
            acc = totals[name]
            if name == "belady":
                hits_per_step, admitted = belady_hits([s[1] for s in steps], e, slots)
                results = [(h, 0, 0) for h in hits_per_step]
                acc[6] += admitted
            else:
                pol = _new_policy(name, slots, e, static_set, k, cap, hysteresis, decay)
                results = []
                for phase, routed, counts, mass, prompt_mass in steps:
                    r = pol.access(routed, mass)
                    results.append((r.hits, r.promoted, r.promoted_unrouted))
                    if phase == PREFILL:
                        # The prompt prior is known once prefill has routed; installing it copies
                        # experts the prefill just read over the link anyway.
                        acc[6] += pol.begin_request(prompt_mass)
            t = 0
            for (phase, routed, counts, mass, _), (hits, promoted, unrouted) in zip(steps, results):
                if phase == DECODE:
                    routed_promoted = min(promoted - unrouted, int((~hits).sum()))
                    moved[name][:, layer, t] = (hits.sum(), (~hits).sum() - routed_promoted, promoted, routed_promoted)
                    t += 1
                base = 0 if phase == PREFILL else 2
                acc[base] += counts.sum()
                acc[base + 1] += counts[hits].sum()
                acc[6] += promoted
                acc[7] += unrouted
                if phase == DECODE:
                    acc[4] += mass.sum()
                    acc[5] += mass[hits].sum()
    out: dict[str, Any] = {}
    for name, a in totals.items():
        missed_decode = a[2] - a[3]
        out[name] = {
            "hit_rate_prefill": a[1] / a[0] if a[0] else None,
            "hit_rate_decode": a[3] / a[2] if a[2] else None,
            "mass_hit_rate_decode": a[5] / a[4] if a[4] else None,
            "promotions_per_token": a[6] / decode_tokens if decode_tokens else None,
            "link_bytes_per_token": (missed_decode + a[7]) * expert_bytes / decode_tokens if decode_tokens else None,
        }
        if clock is not None:
            # Belady's admissions have no per-step schedule: its clock counts them free (a bound, like its hit rate).
            rule = cpu_rule(clock, top_k=k) if cpu_path else None
            out[name].update(_clocked(clock, moved[name], clock_bytes, rule, cache=name in ONLINE, top_k=k))
    best_online = max((p for p in policies if p in ONLINE), key=lambda p: out[p]["hit_rate_decode"] or 0.0, default=None)
    return {
        "trace": trace.meta.get("source_file"),
        "model": trace.meta.get("model"),
        "decoding": trace.meta.get("decoding"),
        "slots_fraction": slots_fraction,
        "slots_per_layer": slots,
        "lfru_cap": {"cap": cap, "hysteresis": hysteresis, "decay": decay},
        "clock": None if clock is None else {"name": clock.name, "expert_bytes": clock_bytes, "cpu_path": cpu_path},
        "num_experts": e,
        "layers": trace.num_layers,
        "calibrated_on": calibrated_on,
        "requests_scored": len(scored),
        "decode_tokens_scored": decode_tokens,
        "policies": out,
        "best_online_policy": best_online,
        "best_online_vs_belady": _vs_belady(out, best_online),
        "shipped_policy": SHIPPED_POLICY,
        "shipped_vs_belady": _vs_belady(out, SHIPPED_POLICY),
    }


def _vs_belady(out: dict[str, dict[str, Any]], name: str | None) -> float | None:
    if not name or name not in out or "belady" not in out or not out["belady"]["hit_rate_decode"]:
        return None
    return (out[name]["hit_rate_decode"] or 0.0) / out["belady"]["hit_rate_decode"]


def table(result: dict[str, Any]) -> str:
    clocked = result.get("clock") is not None
    lines = [
        f"{result['requests_scored']} requests, {result['decode_tokens_scored']} decode tokens scored; {result['slots_per_layer']} of "
        f"{result['num_experts']} experts per layer ({result['slots_fraction']:.0%}); static set calibrated on the {result['calibrated_on']}",
        "",
        "| policy | hit rate decode | hit rate prefill | gate-mass hit decode | promotions / token | link MB / token |"
        + (" step ms (bs1) | tok/s (bs1) |" if clocked else ""),
        "|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if clocked else ""),
    ]
    for name, p in result["policies"].items():
        lb = p["link_bytes_per_token"]
        lines.append(
            f"| {name} | {p['hit_rate_decode']:.3f} | {p['hit_rate_prefill']:.3f} | {p['mass_hit_rate_decode']:.3f} | "
            f"{p['promotions_per_token']:.2f} | {lb / 1e6 if lb is not None else float('nan'):.2f} |"
            + (f" {p['step_ms_decode']:.2f} | {p['decode_tok_s']:.1f} |" if clocked else "")
        )
    return "\n".join(lines) + "\n"


def sweep_cap(trace: RoutingTrace, slots_fraction: float, caps: list[int], clock: Clock, choose_by: str = "step_time",
              cpu_path: bool = False, hysteresis: float | None = None, decay: float = DEFAULT_DECAY,
              expert_bytes: int | None = None) -> dict[str, Any]:
    """The online cache's cap chosen by simulated step time (or by hit rate, to compare); cap 0 is the static set.

    Why: with the CPU path a promotion moves a miss the CPU would have computed beside the link onto
    the link, serialized before the kernel; more promotions raise the hit rate and can still slow the step.
    """
    rows = []
    for c in caps:
        name = "static_topk" if c == 0 else "lfru_cap"
        r = simulate(trace, slots_fraction, (name,), max(c, 1), hysteresis, decay, clock, cpu_path, expert_bytes)["policies"][name]
        rows.append({"cap": c, "hit_rate_decode": r["hit_rate_decode"], "step_ms_decode": r["step_ms_decode"], "decode_tok_s": r["decode_tok_s"]})
    by_step = min(rows, key=lambda r: r["step_ms_decode"])
    by_hits = max(rows, key=lambda r: r["hit_rate_decode"] or 0.0)
    return {"caps": rows, "cpu_path": cpu_path, "choose_by": choose_by, "chosen_by_step_time": by_step["cap"],
            "chosen_by_hit_rate": by_hits["cap"], "chosen": (by_step if choose_by == "step_time" else by_hits)["cap"]}


def sweep_table(sw: dict[str, Any]) -> str:
    lines = [f"cap sweep (0 = static set, no promotions){' with the CPU path' if sw['cpu_path'] else ''}:", "",
             "| cap | hit rate decode | step ms (bs1) | tok/s (bs1) |", "|---:|---:|---:|---:|"]
    for r in sw["caps"]:
        lines.append(f"| {r['cap']} | {r['hit_rate_decode']:.3f} | {r['step_ms_decode']:.2f} | {r['decode_tok_s']:.1f} |")
    lines.append(f"\nchosen by {sw['choose_by']}: cap {sw['chosen']} (by step time: {sw['chosen_by_step_time']}, by hit rate: {sw['chosen_by_hit_rate']})")
    return "\n".join(lines) + "\n"


def _clock_modes(args: argparse.Namespace, trace: RoutingTrace) -> dict[str, Any] | None:
    """``--calibrate`` / ``--validate``: the clock from the measured files, or the clock against them."""
    from .clock_validate import calibrate, choices, table as validate_table, validate

    sets = json.loads(args.sets.read_text())
    machine = MACHINES[args.machine]
    if args.calibrate:
        clock = calibrate(trace, sets, args.calibrate, machine)
        args.clock.parent.mkdir(parents=True, exist_ok=True)
        args.clock.write_text(json.dumps({"clock": clock.to_json()}, indent=1) + "\n")
        print(f"wrote {args.clock} (fitted: {', '.join(clock.fitted)})")
        return None
    clock = load_clock(args.clock)
    report = validate(trace, sets, args.validate, clock, machine=machine)
    report["choices"] = choices(trace, sets, args.validate, clock, machine=machine)
    print(validate_table(report))
    return report


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap simulate", description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, required=True, help="routing trace (.npz) from reap-swap record-traces")
    p.add_argument("--slots-fraction", type=float, default=0.3, help="share of each layer's experts resident")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated subset of {','.join(POLICIES)} (default: all)")
    p.add_argument("--cap", type=int, default=DEFAULT_CAP, help="lfru_cap: promotions per layer per step (>= 1)")
    p.add_argument("--hysteresis", type=float, default=None,
                   help="lfru_cap: promote only while candidate score > victim score + this (default: always, as LFRU)")
    p.add_argument("--decay", type=float, default=DEFAULT_DECAY, help="lfru_cap: score decay per step, in (0, 1)")
    p.add_argument("--clock", type=Path, help="step-time calibration JSON (benchmarks/results/step_time_h200.json): adds each policy's "
                   "simulated decode step ms and tok/s at batch 1; with --calibrate, the file to write")
    p.add_argument("--cpu-path", action="store_true", help="with --clock: misses not promoted are split between the link and the host CPU "
                   "by the server's rule (serve --cpu-experts)")
    p.add_argument("--expert-bytes", type=int, default=None, help="bytes of one expert for the clock (default: the clock's calibration shape, "
                   "then the trace's)")
    p.add_argument("--sweep-cap", default=None, help="with --clock: comma-separated lfru_cap caps to compare (0 = the static set), e.g. 0,1,2,4,8")
    p.add_argument("--choose-by", choices=("step_time", "hit_rate"), default="step_time", help="what --sweep-cap picks the cap by")
    p.add_argument("--sets", type=Path, help="learned sets JSON (reap-swap learned-sets) for --calibrate / --validate")
    p.add_argument("--calibrate", type=Path, metavar="RESULTS_DIR", help="build the clock from one machine's measured files (--machine) in this folder "
                   "(benchmarks/results) and write it to --clock")
    p.add_argument("--validate", type=Path, metavar="RESULTS_DIR", help="replay the requests bench-gpu --trace timed (its JSONs in this folder) "
                   "through every arm with --clock; print measured vs simulated ms/step, write --out")
    p.add_argument("--machine", choices=tuple(MACHINES), default="h200",
                   help="--calibrate / --validate: which runs (clock_validate.MACHINES): the H200 runs of issue 25's table, or the "
                        "H100 run of 2026-12-06 on v1's trace (bench_gpu_learned_v1_beside_v2.json) or v2's (bench_gpu_learned_v2.json), "
                        "or h100-fast: the H100 run at batch 1, 8 and 32 on v1's trace (bench_gpu_fast_h100.json), or h100-graphs: the same "
                        "with CUDA graphs up to batch 32 (bench_gpu_fast_graphs_h100.json), or h100-onerun-v1 / -v2: every arm but "
                        "reap_cache in one run on both traces (bench_gpu_fast_v1_beside_v2_h100.json, bench_gpu_fast_v2_h100.json; each "
                        "fast arm splits by its own probe's rates), or h100-onerun2-v2: every arm on v2's trace on another host "
                        "(bench_gpu_fast_v2_onerun2_h100.json; stock offload cut after batch 8)")
    p.add_argument("--out", type=Path, help="write the result JSON here")
    args = p.parse_args(argv)
    if (args.calibrate or args.validate) and not (args.clock and args.sets):
        p.error("--calibrate and --validate need --clock and --sets")
    if args.machine != "h200" and not (args.calibrate or args.validate):
        p.error("--machine goes with --calibrate or --validate")
    if (args.sweep_cap or args.cpu_path) and not args.clock:
        p.error("--sweep-cap and --cpu-path need --clock")
    try:
        caps = [int(x) for x in args.sweep_cap.split(",") if x.strip()] if args.sweep_cap else []
    except ValueError:
        p.error("--sweep-cap takes integers, e.g. 0,1,2,4,8")
    if any(c < 0 for c in caps):
        p.error("--sweep-cap caps must be >= 0")
    chosen = tuple(x.strip() for x in args.policies.split(",") if x.strip())
    bad = [x for x in chosen if x not in POLICIES]
    if bad or not chosen:
        p.error(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    if not 0 < args.slots_fraction <= 1:
        p.error("--slots-fraction must be in (0, 1]")
    if args.cap < 1:
        p.error("--cap must be >= 1")
    if not 0 < args.decay < 1:
        p.error("--decay must be in (0, 1)")
    try:
        trace = load(args.trace)
        trace.meta["source_file"] = str(args.trace)
        if args.calibrate or args.validate:
            result = _clock_modes(args, trace)
            if result is None:
                return 0
        else:
            clock = load_clock(args.clock) if args.clock else None
            result = simulate(trace, args.slots_fraction, chosen, args.cap, args.hysteresis, args.decay, clock, args.cpu_path, args.expert_bytes)
            print(table(result))
            if caps and clock is not None:
                result["sweep"] = sweep_cap(trace, args.slots_fraction, caps, clock, args.choose_by, args.cpu_path, args.hysteresis,
                                            args.decay, args.expert_bytes)
                print(sweep_table(result["sweep"]))
    except (TraceError, ClockError, OSError, KeyError, ValueError) as exc:
        print(f"reap-swap simulate: error: {exc}", file=sys.stderr)
        return 2
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")
    return 0
