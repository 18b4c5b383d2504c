"""The clock against measured runs: calibrate it from a machine's files, replay the bench, compare (pure numpy).

Why: a step-time model is only worth choosing policies by if it predicts the arms we measured.
``calibrate`` builds the ``Clock`` from one machine's committed results (``Machine``: every constant
names its file and key, or says it is an estimate); the only fitted constant is ``base_ms`` (the
non-MoE step), taken from the ``stock_gpu`` arm alone. ``validate`` replays the exact requests
``bench-gpu --trace`` timed (the workload its JSON lists) through every arm's rules (``clock_arms``)
and reports the median simulated step next to the measured median step, arm by arm, at every batch size
the run timed (1 and 8; 32 where it ran ``--extra-batches 32``).
Machines: the H200 runs behind issue 25's table, the H100 run of 2026-12-06 on v1's and v2's traces, and
the H100 run behind ``bench_gpu_fast_h100.json`` (v1's trace, batch 1, 8 and 32).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field as dataclass_field, replace
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .clock_arms import Arm, Batch, CacheRule, Request, SplitRule, offload_fractions, replay
from .step_time import Clock, ClockError, step_ms
from .traces import RoutingTrace

LEARNED = "bench_gpu_learned.json"
LEARNED_CPU = "bench_gpu_learned_cpu.json"
RELAYOUT = "relayout_check_h200.json"
HOST_BUS = "host_bus_h200.json"
SPLIT = "split_kernel_h200.json"
H100_V1 = "bench_gpu_learned_v1_beside_v2.json"
H100_V2 = "bench_gpu_learned_v2.json"
H100_FAST = "bench_gpu_fast_h100.json"
H100_GRAPHS = "bench_gpu_fast_graphs_h100.json"
H100_ONERUN_V1, H100_ONERUN_V2 = "bench_gpu_fast_v1_beside_v2_h100.json", "bench_gpu_fast_v2_h100.json"
H100_ONERUN2_V2 = "bench_gpu_fast_v2_onerun2_h100.json"
H100_ONERUN3_V1, HOST_BUS_ONERUN3 = "bench_gpu_fast_static_cpu_h100.json", "host_bus_h100_onerun3.json"
H100_ONERUN4_V1, HOST_BUS_ONERUN4 = "bench_gpu_fast_onerun4_h100.json", "host_bus_h100_onerun4.json"
TOLERANCE = 0.10
# Issue 25's table (decode tok/s bs1, bs8, H200, same trace and shape). Only the cache + CPU arm has no
# committed run JSON; the others are listed beside the committed runs they repeat.
ISSUE25 = {"stock_gpu": (468.4, 1986.0), "stock_offload": (37.2, 70.3), "reap_cache": (119.6, 163.1),
           "reap_static_cpu": (175.7, 315.4), "reap_cache_cpu": (118.0, 245.3)}
ARMS = ("stock_gpu", "stock_offload", "reap_static", "reap_plan", "reap_classifier", "reap_classifier_complement",
        "reap_cache", "reap_static_cpu", "reap_cache_cpu", "reap_fast", "reap_fast_classifier", "reap_fast_bg",
        "reap_static_cpu_sliced", "reap_fast_sliced")
PREDICTIONS = ("reap_fast", "reap_fast_bg", "reap_static_cpu_sliced", "reap_fast_sliced")
"""Arms validated on every machine even where no run measured them (their rows are predictions). A stock arm a run
lost is a prediction too; a reap arm without its step fails the validation."""
SLICES = 4
"""``*_sliced`` predictions: the arm with each missed expert split into this many slices of its intermediate dimension
(``SplitRule.slices``), so one expert can be computed partly on the CPU and partly over the link. Not built."""


@dataclass(frozen=True)
class Machine:
    """Where one machine's clock inputs live under the results folder: (file, dotted key) per constant.

    ``learned`` holds stock_gpu (the fit), the workload the bench timed and the cache's knobs; ``learned_cpu``
    the static + CPU arm (the CPU team's achieved rate, the split's cost model). A constant nothing measured
    on that machine is an ``estimate`` (value, why), named in the provenance; ``host_dram`` None: no shared
    ceiling was measured, so none applies (link + CPU rate, which never binds)."""

    name: str
    learned: str
    learned_cpu: str
    link: tuple[str, str]
    hbm: tuple[str, str] | None = None
    hbm_estimate: tuple[float, str] | None = None
    host_dram: tuple[str, str] | None = None
    cpu_layer: tuple[str, str] = (SPLIT, "check_chain_24_layers_T1.cpu_never_chosen.median_ms_24_layers")
    cpu_layer_unit: str = "ms_all_layers"
    """``ms_all_layers``: the split + merge chain over every layer (ms); ``us_per_step``: a profile's device µs per step."""
    issue25: Mapping[str, tuple[float, float]] = dataclass_field(default_factory=dict)
    """Issue 25's quoted tok/s, for arms with no committed run JSON (H200 only)."""
    spec_arm: str = "reap_static"
    """The reap arm whose spec names the workload and the trace, and whose profile gives the per-step kernels
    (its split program left out: ``cpu_layer`` prices it)."""
    batches: tuple[int, ...] = (1, 8)
    """The batch sizes the run timed: 1, 8 and any ``--extra-batches`` (its spec's ``extra_batches``)."""
    cache_arm: str = "reap_cache"
    """The arm whose knobs (cap, decay, hysteresis, prior) and policy-program device time give the online cache's: the
    fast arm where a run has no reap_cache arm (same knobs; its program took 13 % longer a step on h100-fast)."""
    own_split: bool = False
    """The fast arms split by their own cost model (``cpu_path_bs1.cost_model``: their probe's rates, or the user's),
    not static + CPU's: a run whose probes disagreed (h100-onerun: the fast arm's read 28.7 GB/s, static + CPU's
    92.1). An arm re-rated mid-run (``rate_updates``, ``server_ext/cpu_experts/rates.py``) is refused: one rate per
    arm cannot replay it."""


H200 = Machine("h200-30b-a3b", LEARNED, LEARNED_CPU, link=(RELAYOUT, "vmm_check.read_GBps_host_rows"),
               hbm=(RELAYOUT, "vmm_check.read_GBps_slot_rows"), host_dram=(HOST_BUS, "cpu_n8_with_link.sum_GBps"), issue25=ISSUE25)
_H100_HBM = (3802.5 * 3.35 / 4.8, "not measured on the H100: the H200's measured slot-row read (3802.5 GB/s, relayout_check_h200.json) "
             "scaled by the parts' HBM peaks (3.35 / 4.8 TB/s)")


def _h100(name: str, run: str, **kw: Any) -> Machine:
    return Machine(name, run, run, link=(run, "raw.reap_static_cpu.cpu_path_bs1.measured.link_GBps"), hbm_estimate=_H100_HBM,
                   cpu_layer=(run, "arms.reap_static_cpu.reap_kernels._split_kernel.device_us_per_step"), cpu_layer_unit="us_per_step", **kw)


MACHINES = {"h200": H200, "h100-v1": _h100("h100-30b-a3b-v1", H100_V1), "h100-v2": _h100("h100-30b-a3b-v2", H100_V2),
            "h100-fast": _h100("h100-30b-a3b-fast", H100_FAST, spec_arm="reap_static_cpu", batches=(1, 8, 32)),
            "h100-graphs": _h100("h100-30b-a3b-graphs", H100_GRAPHS, spec_arm="reap_static_cpu", batches=(1, 8, 32),
                          cache_arm="reap_fast"),
            **{f"h100-onerun-{v}": _h100(f"h100-30b-a3b-onerun-{v}", run, spec_arm="reap_static_cpu", batches=(1, 8, 32), cache_arm="reap_fast",
                                         own_split=True) for v, run in (("v1", H100_ONERUN_V1), ("v2", H100_ONERUN_V2))},
            "h100-onerun2-v2": _h100("h100-30b-a3b-onerun2-v2", H100_ONERUN2_V2, spec_arm="reap_static_cpu", batches=(1, 8, 32),
                                     own_split=True),
            "h100-onerun3-v1": _h100("h100-30b-a3b-onerun3-v1", H100_ONERUN3_V1, spec_arm="reap_static_cpu", cache_arm="reap_fast",
                                     own_split=True, host_dram=(HOST_BUS_ONERUN3, "cpu_n8_with_link.sum_GBps")),
            "h100-onerun4-v1": _h100("h100-30b-a3b-onerun4-v1", H100_ONERUN4_V1, spec_arm="reap_static_cpu", batches=(1, 8, 32),
                                     cache_arm="reap_fast", own_split=True, host_dram=(HOST_BUS_ONERUN4, "cpu_n8_with_link.sum_GBps"))}
"""``simulate --machine``: the H200 runs (issue 25's table), the H100 run of 2026-12-06 on v1's and v2's traces, and the
H100 run of 2026-12-06 evening (another host) at batch 1, 8 and 32 (no reap_static arm: the static + CPU arm's spec), and
the late-evening H100 run with CUDA graphs up to batch 32 (its stock offload arm lost with the machine), and the H100 run of
2026-12-07 with every arm but reap_cache on v2's trace and v1's (one engine per arm, both workloads; each fast arm splits by its
own probe's rates), and the H100 run of 2026-12-07 morning (another host: a faster CPU, a slower link) with every arm on v2's
trace, stock offload cut after batch 8, and the H100 run of 2026-12-07 evening (another host) of stock all-GPU, fast and
static + CPU on v1's trace (stock offload cut), the first H100 host whose shared host-DRAM ceiling was measured (CPU + link
at once, ``host_bus_h100_onerun3.json``), and the H100 run of 2026-12-08 (another host) of every arm but reap_cache on v1's
trace at batch 1, 8 and 32, its host-DRAM ceiling measured beside it (``host_bus_h100_onerun4.json``)."""


def _read(results: Path, name: str) -> dict[str, Any]:
    path = results / name
    if not path.is_file():
        raise ClockError(f"measured file not found: {path}")
    return json.loads(path.read_text())


def _key(data: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = data
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or part not in cur:
            raise ClockError(f"measured key missing: {dotted}")
        cur = cur[part]
    return cur


class Sources:
    """Measured values read by (file, dotted key), each remembered for the provenance."""

    def __init__(self, results: Path):
        self.results = results
        self.files: dict[str, dict[str, Any]] = {}
        self.used: dict[str, dict[str, Any]] = {}

    def get(self, name: str, dotted: str, field: str | None = None) -> Any:
        if name not in self.files:
            self.files[name] = _read(self.results, name)
        value = _key(self.files[name], dotted)
        if field:
            self.used[field] = {"file": f"benchmarks/results/{name}", "key": dotted, "value": value}
        return value


def workload(src: Sources, trace: RoutingTrace, sets: dict[str, Any], arm: str, bs: int, machine: Machine = H200) -> list[Batch]:
    """The batches ``bench-gpu --trace`` timed for ``arm`` (its JSON's requests), each with the set installed before it."""
    spec = src.get(machine.learned, f"raw.{machine.spec_arm}.spec")
    name = Path(str(spec["trace"])).stem
    static = _sets(sets["sets"]["static_topk"])
    plan = _sets(sets["sets"]["plan"])

    def req(q: Mapping[str, Any]) -> Request:
        return Request(int(q["index"]), int(q["prompt_len"]), int(q["gen"]))

    def chosen(default: dict[int, np.ndarray], key: str) -> dict[int, np.ndarray]:
        if arm.startswith(("reap_classifier", "reap_fast_classifier")):  # bs 1, the run's --batch, or learned-sets --extra-batches
            block = sets["per_request"]["classifier" if bs == 1 else "classifier_bs8" if bs == int(spec.get("batch", 8)) else f"classifier_bs{bs}"]
            return _sets(block.get(name, block)[key])
        return plan if arm == "reap_plan" else default

    if bs == 1:
        return [Batch((req(q),), chosen(static, f"{q['index']}:{q['name']}")) for q in spec["requests_bs1"]]
    groups = {int(spec.get("batch", 8)): spec["groups_bs8"], **{int(e["batch"]): e["groups"] for e in spec.get("extra_batches") or []}}
    if bs not in groups:
        raise ClockError(f"{machine.name}'s run timed no batch of {bs}")
    if bs != int(spec.get("batch", 8)) and arm.startswith(("reap_classifier", "reap_fast_classifier")) and f"classifier_bs{bs}" not in sets["per_request"]:
        raise ClockError(f"{arm}: the sets file has no classifier sets for batch {bs} (reap-swap learned-sets --extra-batches {bs})")
    return [Batch(tuple(req(q) for q in g["requests"]), chosen(static, str(g["group"]))) for g in groups[bs]]


def _sets(block: Mapping[str, Any]) -> dict[int, np.ndarray]:
    return {int(k.removeprefix("layer_")): np.asarray(v, dtype=np.int64) for k, v in block.items()}


def arm_rules(src: Sources, arm: str, expert_bytes: int, layers: int, experts: int, machine: Machine = H200) -> Arm:
    """``arm``'s rules as the run set them (the cache's knobs and the split's cost model from the run JSONs);
    ``<arm>_sliced``: ``<arm>``'s with a split of ``SLICES`` slices per expert."""
    if arm.endswith("_sliced"):
        whole = arm_rules(src, arm.removesuffix("_sliced"), expert_bytes, layers, experts, machine)
        if whole.cpu is None:
            raise ClockError(f"{arm}: {whole.name} has no split to slice")
        return replace(whole, name=arm, cpu=replace(whole.cpu, slices=SLICES))
    oc = src.get(machine.learned, f"arms.{machine.cache_arm}.online_cache")
    cache = CacheRule(int(oc["cap"]), float(oc["decay"]), oc["hysteresis"], float(oc["prior_weight"]))
    cm = src.get(machine.learned_cpu, "raw.reap_static_cpu.cpu_path_bs1.cost_model")
    # runs before issue 26 name no step sizes past max_tokens: their larger steps sent every miss to the link
    cpu = SplitRule(cm["link_GBps"], cm["cpu_GBps"], cm["cpu_fixed_s"], cm["cpu_per_pair_s"], int(cm["max_tokens"]),
                    int(cm.get("max_step_tokens", 0)), int(cm.get("pair_budget", 0)))
    if arm == "stock_gpu":
        return Arm(arm, "stock_gpu")
    if arm == "stock_offload":
        gib = float(src.get(machine.learned, "arms.stock_offload.offload_gib"))
        return Arm(arm, "stock_offload", gpu_fraction=offload_fractions(layers, experts, expert_bytes, gib * 2**30))
    if machine.own_split and arm in ("reap_fast", "reap_fast_classifier"):
        path = src.get(machine.learned, f"raw.{arm}.cpu_path_bs1")
        if path.get("rate_updates"):
            raise ClockError(f"{machine.name}: {arm} was re-rated mid-run (rate_updates); own_split replays one rate per arm")
        own = path["cost_model"]  # what its split used: the probe's or the user's rates
        cpu = replace(cpu, link_GBps=float(own["link_GBps"]), cpu_GBps=float(own["cpu_GBps"]))
    if arm in ("reap_fast", "reap_fast_classifier"):
        return Arm(arm, "fast", cache=cache, cpu=cpu)
    if arm == "reap_fast_bg":
        return Arm(arm, "fast_bg", cache=cache, cpu=cpu)
    if arm in ("reap_cache", "reap_cache_cpu"):
        return Arm(arm, "cache", cache=cache, cpu=cpu if arm == "reap_cache_cpu" else None)
    return Arm(arm, "static", cpu=cpu if arm == "reap_static_cpu" else None)


def calibrate(trace: RoutingTrace, sets: dict[str, Any], results: Path, machine: Machine = H200) -> Clock:
    """The clock from the measured files; ``base_ms`` fitted on ``stock_gpu`` (its step minus its resident reads)."""
    src = Sources(results)
    check_inputs(src, trace, None, machine)
    run, run_cpu = machine.learned, machine.learned_cpu
    eb = int(src.get(run, "raw.stock_gpu.spec.expert_bytes", "expert_bytes"))
    if machine.hbm is not None:
        hbm = float(src.get(*machine.hbm, "hbm_GBps"))
    elif machine.hbm_estimate is not None:
        hbm = machine.hbm_estimate[0]
        src.used["hbm_GBps"] = {"estimate": hbm, "why": machine.hbm_estimate[1]}
    else:
        raise ClockError(f"{machine.name}: no HBM read rate, measured or estimated")
    link = float(src.get(*machine.link, "link_GBps"))
    kernels = {k: v for k, v in src.get(run, f"arms.{machine.spec_arm}.reap_kernels", "reap_step_ms").items() if k != "_split_kernel"}
    src.used["reap_step_ms"]["value"] = kernels  # the split program is priced by cpu_layer_ms
    cache_k = src.get(run, f"arms.{machine.cache_arm}.reap_kernels._policy_kernel.device_us_per_step", "cache_layer_ms")
    cm = src.get(run_cpu, "raw.reap_static_cpu.cpu_path_bs1.cost_model")
    for name, key in (("cpu_fixed_ms", "cpu_fixed_s"), ("cpu_pair_ms", "cpu_per_pair_s")):
        src.get(run_cpu, f"raw.reap_static_cpu.cpu_path_bs1.cost_model.{key}", name)
        src.used[name]["unit"] = "s"
    cpu = float(src.get(run_cpu, "raw.reap_static_cpu.cpu_path_bs1.cpu_GBps_achieved", "cpu_GBps"))
    if machine.host_dram is not None:
        host_dram = float(src.get(*machine.host_dram, "host_dram_GBps"))
    else:
        host_dram = link + cpu
        src.used["host_dram_GBps"] = {"value": host_dram, "why": "no shared host-DRAM ceiling measured on this host: link + CPU rate, "
                                                                 "which never binds (a weighted mean of the two pipes' times)"}
    split = float(src.get(*machine.cpu_layer, "cpu_layer_ms"))
    src.used["cpu_layer_ms"]["unit"] = ("ms over all layers (the split + wait-merge chain)" if machine.cpu_layer_unit == "ms_all_layers"
                                        else "us per step over all layers (the split program's device time only)")
    cpu_layer_ms = split / trace.num_layers if machine.cpu_layer_unit == "ms_all_layers" else split / 1e3 / trace.num_layers
    clock = Clock(
        base_ms=((1, 0.0), (8, 0.0)),
        hbm_GBps=hbm,
        link_GBps=link,
        promote_GBps=link,
        cpu_GBps=cpu,
        host_dram_GBps=host_dram,
        cpu_fixed_ms=cm["cpu_fixed_s"] * 1e3,
        cpu_pair_ms=cm["cpu_per_pair_s"] * 1e3,
        reap_step_ms=sum(float(k["device_us_per_step"]) for k in kernels.values()) / 1e3,
        cache_layer_ms=float(cache_k) / 1e3 / trace.num_layers,
        cpu_layer_ms=cpu_layer_ms,
        expert_bytes=eb,
        name=machine.name,
    )
    src.used["promote_GBps"] = {**src.used["link_GBps"], "note": "the promotion copy (Triton, one program per pair and chunk) reads host rows as the fused kernel does"}
    base = []
    for bs in machine.batches:
        measured = float(src.get(run, f"raw.stock_gpu.bs{bs}.step_ms_median", f"stock_gpu_bs{bs}_ms"))
        rules = arm_rules(src, "stock_gpu", eb, trace.num_layers, trace.num_experts, machine)
        steps = [s for s in replay(trace, workload(src, trace, sets, "stock_gpu", bs, machine), rules, eb, 1) if s.timed]
        resident = float(np.median([s.counts.resident.sum() for s in steps]))
        base.append((bs, measured - resident * eb / 1e6 / hbm))
    promote_us = src.get(run, f"arms.{machine.cache_arm}.reap_kernels._promote_kernel.device_us_per_step")
    prov = {
        "machine": machine.name,
        "measured": src.used,
        "fit": {"base_ms": f"per token count {machine.batches}: stock_gpu's median step minus its replayed resident reads at hbm_GBps; "
                           "fitted on the stock_gpu arm only (its error is 0 by construction); every other arm is a prediction"},
        "server_settings": ["cpu_fixed_ms", "cpu_pair_ms"],
        "notes": [
            "cpu_GBps is the CPU team's own counter (bytes over its busy time) from the reap_static_cpu run: measured, not fitted "
            "to step time, but taken in the run of an arm that is validated",
            "cpu_fixed_ms and cpu_pair_ms are the server's split settings (REAP_CPU_EXPERTS_FIXED_US / _PAIR_US defaults), not measurements",
            "promote_GBps = the host-row read rate; the promotion kernel's profiled device time is in promote_crosscheck",
        ],
        "promote_crosscheck": f"{run} arms.{machine.cache_arm}.reap_kernels._promote_kernel.device_us_per_step = {promote_us:.0f} us over profiled steps",
    }
    return clock.replace(base_ms=tuple(base), fitted=("base_ms",), provenance=prov)


def measured_ms(src: Sources, arm: str, bs: int, machine: Machine = H200) -> tuple[float | None, str]:
    """The arm's measured median decode step (ms) and where it comes from; None: a prediction (no run of it)."""
    if arm == "reap_cache_cpu" and arm in machine.issue25:
        tok = machine.issue25[arm][0 if bs == 1 else 1]
        return bs * 1e3 / tok, f"issue 25 text: {tok} tok/s (its run JSON is not committed)"
    name = machine.learned_cpu if arm == "reap_static_cpu" else machine.learned
    dotted = f"raw.{arm}.bs{bs}.step_ms_median"
    try:
        return float(src.get(name, dotted)), f"benchmarks/results/{name} {dotted}"
    except ClockError:
        return None, f"prediction: benchmarks/results/{name} has no {dotted}"


def arms_of(src: Sources, machine: Machine) -> tuple[str, ...]:
    """The arms to validate on ``machine``: those its runs measured (and issue 25's quoted ones), plus the predictions."""
    ran = set(src.get(machine.learned, "raw")) | set(src.get(machine.learned_cpu, "raw")) | set(machine.issue25)
    return tuple(a for a in ARMS if a in ran or a in PREDICTIONS)


def check_inputs(src: Sources, trace: RoutingTrace, clock: Clock | None, machine: Machine) -> None:
    """The trace is the one the machine's run replayed, and the clock was calibrated on that machine."""
    ran = Path(str(src.get(machine.learned, f"raw.{machine.spec_arm}.spec.trace"))).name
    given = Path(str(trace.meta.get("source_file") or "")).name
    if given and given != ran:
        raise ClockError(f"--trace {given} is not the trace {machine.name}'s run replayed ({ran})")
    if clock is not None and clock.name and clock.name != machine.name:
        raise ClockError(f"--clock was calibrated on {clock.name!r}, not on --machine's {machine.name!r}")


def validate(trace: RoutingTrace, sets: dict[str, Any], results: Path, clock: Clock, arms: tuple[str, ...] | None = None,
             machine: Machine = H200) -> dict[str, Any]:
    """Measured vs simulated median decode step per arm and batch size (see module doc)."""
    src = Sources(results)
    check_inputs(src, trace, clock, machine)
    eb = clock.expert_bytes or int(src.get(machine.learned, "raw.stock_gpu.spec.expert_bytes"))
    slots = int(sets["slots_per_layer"])
    rows = []
    for arm in arms if arms is not None else arms_of(src, machine):
        base_rules = arm_rules(src, arm, eb, trace.num_layers, trace.num_experts, machine)
        for bs in machine.batches:
            rules = base_rules
            if rules.kind == "fast_bg":  # the copy stream may use the link through the step's non-MoE compute too
                rules = Arm(rules.name, rules.kind, rules.cache, rules.cpu, link_idle_ms=clock.base(bs) / trace.num_layers)
            steps = replay(trace, workload(src, trace, sets, arm, bs, machine), rules, eb, slots)
            timed = [s for s in steps if s.timed]
            parts = [step_ms(clock, s.counts, eb) for s in timed]
            sim = float(np.median([p.total for p in parts]))
            meas, source = measured_ms(src, arm, bs, machine)
            dec = [s for s in steps if s.decode]
            issue = machine.issue25.get(arm) if bs in (1, 8) else None  # issue 25's table quotes batch 1 and 8
            mean = lambda f: float(np.mean([f(s.counts) for s in timed]))  # noqa: E731
            rows.append({
                "arm": arm, "batch": bs, "prediction": meas is None and (arm in PREDICTIONS or not arm.startswith("reap")), "measured_ms": meas, "measured_from": source, "simulated_ms": sim,
                "error_pct": 100.0 * (sim - meas) / meas if meas else None,
                "within_10pct": abs(sim - meas) <= TOLERANCE * meas if meas else None,
                "measured_tok_s": bs * 1e3 / meas if meas else None, "simulated_tok_s": bs * 1e3 / sim,
                "issue25_ms": bs * 1e3 / issue[0 if bs == 1 else 1] if issue else None,
                "error_vs_issue25_pct": 100.0 * (sim * issue[0 if bs == 1 else 1] / (bs * 1e3) - 1.0) if issue else None,
                "simulated_hit_rate_decode": 1.0 - sum(s.missed_pairs for s in dec) / sum(s.pairs for s in dec),
                "per_step": {"resident": mean(lambda c: c.resident.sum()), "link": mean(lambda c: c.link.sum()),
                             "cpu": mean(lambda c: c.cpu.sum()), "promoted": mean(lambda c: c.promoted.sum())},
                "breakdown_ms": {k: float(np.mean([p.as_dict()[k] for p in parts])) for k in parts[0].as_dict()},
                "timed_steps": len(timed),
            })
    reap = [r for r in rows if r["arm"].startswith("reap") and not r["prediction"]]  # a measured arm without its step fails
    return {
        "what": "reap-swap simulate --validate: the clock (planning/step_time.py) on the exact requests bench-gpu --trace timed",
        "machine": machine.name,
        "runs": sorted({machine.learned, machine.learned_cpu}),
        "trace": trace.meta.get("source_file"),
        "clock": clock.to_json(),
        "fitted": {"constants": list(clock.fitted), "on_arms": ["stock_gpu"]},
        "tolerance": TOLERANCE,
        "rows": rows,
        "all_reap_within_10pct": all(bool(r["within_10pct"]) for r in reap),
        "worst_reap": max(reap, key=lambda r: abs(r["error_pct"] or float("inf")))["arm"] if reap else None,
    }


def choices(trace: RoutingTrace, sets: dict[str, Any], results: Path, clock: Clock, caps: tuple[int, ...] = (0, 1, 2, 4, 8),
            machine: Machine = H200) -> list[dict[str, Any]]:
    """The online cache's cap (0: the static set) on the bench's workload, chosen by median step vs by hit rate,
    with and without the CPU path, at bs1 and bs8: where the two rules part, the hit rate picks the slower setting."""
    src = Sources(results)
    eb = clock.expert_bytes or int(src.get(machine.learned, "raw.stock_gpu.spec.expert_bytes"))
    base = arm_rules(src, "reap_cache_cpu", eb, trace.num_layers, trace.num_experts, machine)
    out = []
    for bs in machine.batches:
        batches = workload(src, trace, sets, "reap_cache", bs, machine)
        for cpu, fast in ((False, False), (True, False), (True, True)):
            rows = []
            for cap in caps:
                rule = None if cap == 0 or base.cache is None else CacheRule(cap, base.cache.decay, base.cache.hysteresis, base.cache.prior_weight)
                kind = "static" if rule is None else ("fast" if fast else "cache")
                arm = Arm(f"cap{cap}", kind, cache=rule, cpu=base.cpu if cpu else None)
                steps = replay(trace, batches, arm, eb, int(sets["slots_per_layer"]))
                dec = [s for s in steps if s.decode]
                rows.append({"cap": cap, "hit_rate_decode": 1.0 - sum(s.missed_pairs for s in dec) / sum(s.pairs for s in dec),
                             "step_ms": float(np.median([step_ms(clock, s.counts, eb).total for s in steps if s.timed]))})
            by_step, by_hits = min(rows, key=lambda r: r["step_ms"]), max(rows, key=lambda r: r["hit_rate_decode"])
            out.append({"batch": bs, "cpu_path": cpu, **({"order": "fast (split first)"} if fast else {}), "caps": rows, "chosen_by_step_time": by_step["cap"],
                        "chosen_by_hit_rate": by_hits["cap"], "step_time_speedup_over_hit_rate_choice": by_hits["step_ms"] / by_step["step_ms"]})
    return out


def table(report: dict[str, Any]) -> str:
    lines = ["| arm | batch | measured ms/step | simulated ms/step | error % | measured tok/s | simulated tok/s | link / CPU / promoted experts per step |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    fmt: Callable[[Any, str], str] = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
    for r in report["rows"]:
        p = r["per_step"]
        lines.append(f"| {r['arm']}{' (prediction)' if r.get('prediction') else ''} | {r['batch']} | {fmt(r['measured_ms'], '.2f')} | {r['simulated_ms']:.2f} | {fmt(r['error_pct'], '+.1f')} | "
                     f"{fmt(r['measured_tok_s'], '.1f')} | {r['simulated_tok_s']:.1f} | {p['link']:.1f} / {p['cpu']:.1f} / {p['promoted']:.1f} |")
    for c in report.get("choices", []):
        caps = ", ".join(f"{r['cap']}: {r['step_ms']:.2f} ms / hit {r['hit_rate_decode']:.3f}" for r in c["caps"])
        lines.append(f"\ncap (0 = static) at bs{c['batch']}{' + CPU path' if c['cpu_path'] else ''}{', ' + c['order'] if c.get('order') else ''}: {caps}; by step time {c['chosen_by_step_time']}, "
                     f"by hit rate {c['chosen_by_hit_rate']} ({c['step_time_speedup_over_hit_rate_choice']:.2f}x)")
    verdict = "every reap arm within 10 %" if report["all_reap_within_10pct"] else f"NOT every reap arm within 10 % (worst: {report['worst_reap']})"
    return "\n".join(lines) + f"\n\n{verdict}; fitted: {', '.join(report['fitted']['constants'])} on {', '.join(report['fitted']['on_arms'])}\n"
