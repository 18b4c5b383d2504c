"""``reap-swap bench-gpu --trace T --sets S``: the arms on learned routing, side by side (specs for ``learned.arm``).

Every arm's MoE layers replay trace T (a trained model's routing), so the
dummy-weight model moves and computes exactly the experts a real workload
would. At the sets file's slot count (30 % of each layer's experts):

* ``stock_gpu``        stock vLLM, every weight on the GPU (reference output ids)
* ``stock_offload``    stock vLLM, ``cpu_offload_gb`` of experts: the same expert bytes on the GPU as the slots
* ``reap_static``      reap-swap, the static top-k by observed gate mass (``sets.static_topk``)
* ``reap_plan``        reap-swap, the plan's core + static slices (``sets.plan``)
* ``reap_classifier``  reap-swap, the classifier's per-request set swapped in before each request
                       (bs1), the group's union set before each batch of 8 (bs8) and, with ``--extra-batches B``,
                       before each group of B (the sets file's ``classifier_bs<B>``: learned-sets --extra-batches B)
* ``reap_cache``       reap-swap with the online expert cache (``REAP_ONLINE_CACHE=lfru``, server
                       defaults), starting from the static top-k set: promote on miss inside the forward
* ``reap_classifier_complement``  ``reap_classifier`` in RAM-complement mode (``REAP_RAM_COMPLEMENT=1``): host
                       rows only for non-resident experts plus spares, every swap an exchange (issue 13's on/off)
* ``reap_cache_complement``  ``reap_cache`` in RAM-complement mode: every promotion that evicts writes the victim
                       to a spare host row inside the forward (the cache composed with the complement)
* ``reap_static_cpu``  ``reap_static`` with the CPU expert path (``REAP_CPU_EXPERTS``)
* ``reap_fast``        the composed fast mode (``serve --fast``): ``reap_cache`` with the CPU path, the split first
* ``reap_fast_classifier``  ``reap_fast`` whose cache starts each request (batch) from the classifier's set
                       instead of the static one: what the prediction adds to the composed mode

GPU run (H200; vLLM 0.26 staged per ../shared/gpu/README.md, whose setup script also sets
VLLM_USE_FLASHINFER_SAMPLER=0 and VLLM_ENABLE_V1_MULTIPROCESSING=0). About 1.5 min per reap arm and
3.5 min for stock offload, so the run spans several device calls under the 10-min limit: each call
passes ``--resume`` with the same ``--workdir`` (finished arms are reused, stock_gpu's ids stay the
reference) and starts an arm only when the slowest finished arm would still fit its deadline;
``scripts/gpu_learned_session.sh bench $OUT`` is that call (measured 2026-12-01:
``benchmarks/results/bench_gpu_learned.json``)::

    source /tmp/stage/setup_on_device.sh
    DEADLINE=430 bash scripts/gpu_learned_session.sh bench $OUT   # the first call also pays the setup
    bash scripts/gpu_learned_session.sh bench $OUT                # again until every arm is in

Defaults: 8 trace requests at batch 1 (gen 64) and 2 groups at batch 8 (gen 32), each spread evenly over the trace; 3 timed reps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

from reap_swap.planning import traces

from .. import tp as tpm
from .inputs import (
    SetsError,
    Target,
    classifier_set,
    default_trace_layers,
    groups_bs8,
    load_sets,
    membership,
    model_target,
    offline_rates,
    predicted,
    select_bs1,
)
from ..dummy_weights import quantized_expert_bytes, weight_scale
from ..profile_counts import PROFILE_MARGIN
from ..shapes import MoeShape

ARMS = ("stock_gpu", "stock_offload", "reap_static", "reap_plan", "reap_classifier", "reap_cache", "reap_classifier_complement",
        "reap_cache_complement", "reap_static_cpu", "reap_fast", "reap_fast_classifier", "bf16_reap_fast")
CUDA_ONLY = ("reap_static_cpu", "reap_fast", "reap_fast_classifier", "bf16_reap_fast")
"""Arms that run the CPU expert path (CUDA only): not in the default list, asked for by name."""
UNQUANTIZED = ("bf16_reap_fast",)
"""Arms of a ``--quantization`` run that serve the unquantized model (the same workload): the bf16
baseline of ``ratios.<q>_fast_vs_bf16_fast_*`` (issue 27), measured beside the quantized arms."""
PROFILED = ("stock_gpu", "stock_offload", "reap_static", "reap_cache", "reap_cache_complement", "reap_static_cpu", "reap_fast")
"""Arms profiled after their timing (syncs and launches per decode step, batch 1)."""
RUNNER = "reap_swap.benchmarks.learned.arm"


def build_specs(args: argparse.Namespace, model_dir: Path, shape: MoeShape) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One spec per arm in ``args.arms`` plus the run's context (trace, sets, workload) for the report."""
    trace = traces.load(args.trace)
    name = Path(args.trace).name.removesuffix(".npz")
    sets = load_sets(args.sets, name)
    trace_layers = args.trace_layers if args.trace_layers is not None else default_trace_layers(trace.num_layers, shape.layers)
    if len(trace_layers) != shape.layers:
        raise SetsError(f"{len(trace_layers)} trace layers for a {shape.layers}-layer model")
    if (trace.num_experts, trace.top_k) != (shape.experts, shape.top_k) or sets.num_experts != shape.experts:
        raise SetsError(f"trace top-{trace.top_k} of {trace.num_experts} / sets of {sets.num_experts} experts; shape {shape.name} is top-{shape.top_k} of {shape.experts}")
    # The workload must not depend on which arms a call runs (--resume joins calls): requests need a
    # classifier set whenever the sets file has any.
    classifier = bool(sets.classifier) or any("classifier" in a for a in args.arms)
    bs1 = select_bs1(trace, args.requests, args.gen, keep=lambda q: not classifier or classifier_set(sets, q) is not None)
    bs8 = groups_bs8(trace, args.batch, args.groups, args.gen_bs8, keep=lambda g: not classifier or str(g) in sets.classifier_bs8)
    groups = [{"group": reqs[0].index // args.batch, "requests": [q.as_dict() for q in reqs]} for reqs in bs8]
    extra_batches = getattr(args, "extra_batches", None) or []
    missing = [b for b in extra_batches if b not in sets.classifier_extra]
    if 8 in missing and args.batch != 8 and any("classifier" in a for a in args.arms):  # classifier_bs8 is --batch's groups
        raise SetsError(f"{args.sets}: classifier_bs8 holds the groups of the sets' --batch, not extra groups of 8: run the classifier "
                        f"arms with --batch 8 instead of --extra-batches 8")
    if missing and any("classifier" in a for a in args.arms):
        raise SetsError(f"{args.sets} has no classifier sets for groups of {', '.join(map(str, missing))} (the classifier arms at "
                        f"--extra-batches): make them with reap-swap learned-sets ... --extra-batches {','.join(map(str, extra_batches))}")
    # groups with a classifier set where the file has them (the workload does not depend on the arms a call runs)
    extra = {b: extra_groups(trace, b, args.groups, args.gen_bs8, keep=(lambda g, b=b: str(g) in sets.classifier_extra[b])
                             if b in sets.classifier_extra else (lambda g: True)) for b in extra_batches}
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    longest = max(q.prompt_len + q.gen for q in bs1 + [q for reqs in bs8 for q in reqs] + [q for gs in extra.values() for reqs in gs for q in reqs])
    # what the profiled arms profile (arm.run_workload), each set decoding together: bs1's first request, and
    # the largest extra batch's first group (bs32: the CPU path's budgeted steps)
    profiled = {"profile": bs1[:1]}
    if extra and extra[max(extra)]:
        profiled[f"profile_bs{max(extra)}"] = extra[max(extra)][0]
    profiled_prompt = max((q.prompt_len for reqs in profiled.values() for q in reqs), default=0)
    tp = int(getattr(args, "tensor_parallel_size", 1) or 1)
    quant = getattr(args, "quantization", None)
    scale = weight_scale(quant, shape.dtype_bytes)  # stock offload's GiB under the scheme (scales included)
    base = {
        "runner": RUNNER,
        "model": str(model_dir),
        "device": args.device,
        "dtype": "bfloat16" if args.device == "cuda" else "float32",
        "layers": shape.layers,
        "experts": shape.experts,
        "top_k": shape.top_k,
        "expert_bytes": quantized_expert_bytes(shape.expert_bytes, shape.dtype_bytes, quant),
        "vocab": vocab,
        "max_model_len": max(longest, profiled_prompt + args.profile_steps + PROFILE_MARGIN if args.profile_steps else 0) + 16,
        "kv_cache_gib": args.kv_cache_gib,
        "batch": args.batch,
        "gen": args.gen,
        "gen_bs8": args.gen_bs8,
        "reps": args.reps,
        "gate_seed": 1000,  # no longer routes (the trace does); kept so every arm pays the same
        "gate_scale": 1e-3,
        "trace": str(args.trace),  # as given: --resume compares specs across calls
        "trace_layers": list(trace_layers),
        "requests_bs1": [q.as_dict() for q in bs1],
        "groups_bs8": groups,
        "prompt_seed": 0,
        "tensor_parallel_size": tp,
        "profiled": {name: [q.index for q in reqs] for name, reqs in profiled.items() if reqs},
    }
    if quant:
        base["quantization"] = quant
    if extra:  # --extra-batches: timed like bs8, keys bs<B>; the engine takes the largest batch
        base["extra_batches"] = [{"batch": b, "key": f"bs{b}", "groups": [{"group": reqs[0].index // b, "requests": [q.as_dict() for q in reqs]}
                                                                         for reqs in gs]} for b, gs in extra.items()]
        base["max_num_seqs"] = max([args.batch, *extra])
    fixed = {"reap_static": model_target(sets.static, trace, trace_layers), "reap_plan": model_target(sets.plan, trace, trace_layers)}
    per_request = per_group = None
    per_group_extra: dict[str, dict[str, Target]] = {}  # bs<B> -> group -> the classifier's set (the arm's per_group_extra)
    if classifier:
        per_request = {str(q.index): model_target(classifier_set(sets, q) or {}, trace, trace_layers) for q in bs1}
        per_group = {str(g["group"]): model_target(sets.classifier_bs8[str(g["group"])], trace, trace_layers) for g in groups}
        per_group_extra = {f"bs{b}": {g: model_target(sets.classifier_extra[b][g], trace, trace_layers) for g in (str(reqs[0].index // b) for reqs in gs)}
                           for b, gs in extra.items() if b in sets.classifier_extra}

    def reap(arm: str, score: str, score_bs8: str) -> dict[str, Any]:
        spec: dict[str, Any] = {**base, "name": arm, "kind": "reap", "slots": sets.slots}
        if arm == "reap_classifier":
            assert per_request is not None and per_group is not None
            spec.update(start=per_request[str(bs1[0].index)], per_request=per_request, per_group=per_group)
            runs1 = [([q], membership(per_request[str(q.index)], shape.experts)) for q in bs1]
            runs8 = [(reqs, membership(per_group[str(reqs[0].index // args.batch)], shape.experts)) for reqs in bs8]
            if extra:  # each group of B swaps to its own classifier set first
                spec["per_group_extra"] = per_group_extra
        else:
            spec["start"] = fixed[arm]
            runs1 = [(bs1, membership(fixed[arm], shape.experts))]
            runs8 = [(reqs, membership(fixed[arm], shape.experts)) for reqs in bs8]
        spec["offline"] = {"bs1": offline_rates(trace, trace_layers, runs1), "bs8": offline_rates(trace, trace_layers, runs8)}
        spec["predicted"] = {"bs1": predicted(sets.scores, score), "bs8": predicted(sets.scores, score_bs8)}
        for b, gs in extra.items():
            target = (lambda reqs, b=b: per_group_extra[f"bs{b}"][str(reqs[0].index // b)]) if arm == "reap_classifier" else (lambda reqs: fixed[arm])
            spec["offline"][f"bs{b}"] = offline_rates(trace, trace_layers, [(reqs, membership(target(reqs), shape.experts)) for reqs in gs])
            spec["predicted"][f"bs{b}"] = predicted(sets.scores, f"classifier_bs{b}" if arm == "reap_classifier" else score_bs8)
        return spec

    def fast_classifier_arm() -> dict[str, Any]:
        # the classifier's per-request (per-group) sets become the cache's prior at each request's start
        spec = reap("reap_classifier", "classifier", "classifier_bs8")
        return {**spec, "name": "reap_fast_classifier", "online_cache": "lfru", "cpu_experts": True, "offline": None, "predicted": None}

    def cache_arm(spec: dict[str, Any]) -> dict[str, Any]:
        # The static set is installed before each request (batch) as the proxy installs a prompt
        # prior; the cache then promotes on miss. The resident set moves as the requests run, so no
        # offline replay of a fixed set applies (``reap-swap simulate --policies lfru_cap`` is the
        # rule's offline estimate over one stream).
        prior = fixed["reap_static"]
        out = {**spec, "name": "reap_cache", "online_cache": "lfru", "offline": None, "predicted": None,
               "per_request": {str(q.index): prior for q in bs1}, "per_group": {str(g["group"]): prior for g in groups}}
        if extra:
            out["per_group_extra"] = {f"bs{b}": {str(reqs[0].index // b): prior for reqs in gs} for b, gs in extra.items()}
        return out

    builders = {
        "stock_gpu": lambda: {**base, "name": "stock_gpu", "kind": "stock"},
        # cpu_offload_gb is per GPU: with TP each rank holds 1/N of every expert (benchmarks/tp.py)
        "stock_offload": lambda: {**base, "name": "stock_offload", "kind": "stock",
                                  "offload_gib": tpm.offload_gib_per_rank(shape.offload_gib_for_slots(sets.slots), tp) * scale},
        "reap_static": lambda: reap("reap_static", "static_topk", "static_topk"),
        "reap_plan": lambda: reap("reap_plan", "plan", "plan"),
        "reap_classifier": lambda: reap("reap_classifier", "classifier", "classifier_bs8"),
        "reap_cache": lambda: cache_arm(reap("reap_static", "static_topk", "static_topk")),
        "reap_classifier_complement": lambda: {**reap("reap_classifier", "classifier", "classifier_bs8"),
                                               "name": "reap_classifier_complement", "ram_complement": True},
        "reap_cache_complement": lambda: {**cache_arm(reap("reap_static", "static_topk", "static_topk")),
                                          "name": "reap_cache_complement", "ram_complement": True},
        "reap_static_cpu": lambda: {**reap("reap_static", "static_topk", "static_topk"), "name": "reap_static_cpu", "cpu_experts": True},
        "reap_fast": lambda: {**cache_arm(reap("reap_static", "static_topk", "static_topk")), "name": "reap_fast", "cpu_experts": True},
        "reap_fast_classifier": fast_classifier_arm,
        "bf16_reap_fast": lambda: {**{k: v for k, v in cache_arm(reap("reap_static", "static_topk", "static_topk")).items() if k != "quantization"},
                                   "name": "bf16_reap_fast", "cpu_experts": True, "expert_bytes": shape.expert_bytes},
    }
    context = {
        "trace": str(args.trace),
        "trace_name": name,
        "trace_layers": list(trace_layers),
        "sets": str(args.sets),
        "slots_per_layer": sets.slots,
        "scores": {k: {f: v.get(f) for f in ("hit_rate_decode", "hit_rate_prefill", "requests")} if isinstance(v, dict) else v
                   for k, v in sets.scores.items()},
        "workload": {"bs1": [q.index for q in bs1], "groups_bs8": [g["group"] for g in groups], "gen": args.gen, "gen_bs8": args.gen_bs8,
                     "reps": args.reps, "prompt_lens_bs1": [q.prompt_len for q in bs1],
                     **{f"groups_bs{b}": [reqs[0].index // b for reqs in gs] for b, gs in extra.items()}},
        "tensor_parallel_size": tp,
    }
    specs = [builders[a]() for a in args.arms]
    for spec in specs:
        if spec["name"] in PROFILED and args.profile_steps and tp == 1:  # with TP the forward runs in worker processes
            spec["profile_steps"] = args.profile_steps
    return specs, context


ENGINE_KEYS = ("max_model_len", "max_num_seqs")
"""Spec keys that size the engine: one engine serves both workloads of a pair, so they take the larger value."""
ALSO_PREFIX = "also."
"""Request-id prefix of the second workload: ids stay unique within one engine."""


def pair_specs(first: list[dict[str, Any]], second: list[dict[str, Any]], also_dir: Path) -> list[dict[str, Any]]:
    """Each arm of ``first`` carries the same arm of ``second`` under ``also``: one engine build, two
    workloads (``bench-gpu --also-trace``). The arm writes the second workload's results to
    ``also_dir/<arm>.json``. Why: an engine build costs 0.5-1.5 min of a scarce device, a workload less."""
    by_name = {s["name"]: s for s in second}
    out = []
    for spec in first:
        other = by_name[spec["name"]]
        if spec.get("slots") != other.get("slots"):
            raise SetsError(f"arm {spec['name']}: {spec.get('slots')} slots on the first trace, {other.get('slots')} on --also-trace "
                            "(one engine serves both: the sets files must use the same slot count)")
        if spec["trace_layers"] != other["trace_layers"]:
            raise SetsError(f"trace layers {spec['trace_layers']} vs {other['trace_layers']} on --also-trace (one replay serves both)")
        engine = {k: v for k in ENGINE_KEYS if (v := max(int(spec.get(k) or 0), int(other.get(k) or 0)))}
        also = {**other, **engine, "tag_prefix": ALSO_PREFIX, "out": str(also_dir / f"{spec['name']}.json")}
        out.append({**spec, **engine, "also": also})
    return out


def extra_groups(trace: Any, batch: int, groups: int, gen: int, keep: Callable[[int], bool] = lambda g: True) -> list[list[Any]]:
    """Up to ``groups`` groups of ``batch`` consecutive decodable trace requests (as many as the trace holds, at least one)
    among those ``keep`` (by group index) accepts."""
    for count in range(max(1, groups), 0, -1):
        try:
            return groups_bs8(trace, batch, count, gen, keep=keep)
        except SetsError:
            continue
    raise SetsError(f"the trace holds no complete group of {batch} decodable requests (--extra-batches {batch}) that the sets file "
                    f"accepts (with classifier_bs{batch} sets: only the groups it has a set for)")
