"""Tensor parallelism in ``reap-swap bench-gpu --tensor-parallel-size N`` (pure helpers; issue 29).

With TP=N every rank holds 1/N of every expert (vLLM shards w13 / w2 along the intermediate
dimension), so per-GPU figures divide by N while reap's slot counts (experts per layer) do not:

* stock offload's ``cpu_offload_gb`` is counted **per GPU**: each worker builds its own
  ``UVAOffloader`` (``vllm/v1/worker/gpu_model_runner.py``: ``set_offloader(create_offloader(...))``
  in ``load_model``) whose budget is ``int(cpu_offload_gb * 1024**3)`` bytes of that rank's
  parameters (``vllm/model_executor/offloader/uva.py``: ``cpu_offload_bytes += p.data.numel() *
  p.data.element_size()``; ``vllm/config/offload.py``: "The space in GiB to offload to CPU, per
  GPU"). The same expert bytes on each GPU as reap's slots: ``offload_gib_for_slots(slots) / N``.
* the CPU expert path's cores: each rank's team gets a core list of its own
  (``server_ext/cpu_experts/cores.py``: ``;``-separated lists, one per local rank), and the cores
  left over stay with vLLM's processes (the engine core and one worker per rank).
* ratio keys carry ``_tp{N}`` before their batch tag (``fast_vs_stock_offload_tp2_bs1``) so a TP
  result never passes for a one-GPU one.
"""

from __future__ import annotations

import re
from typing import Any, Sequence


def tp_of(spec: Any) -> int:
    """The tensor-parallel size a spec, settings or result dict names (1 when absent or None)."""
    return int((spec or {}).get("tensor_parallel_size") or 1)


RESERVED_PER_RANK = 2
"""Cores kept for vLLM per rank (the one-GPU bench keeps 2: ``cpu_misses.RESERVED_FOR_VLLM``): with
N ranks the engine core's process and N worker processes each have a busy thread (launches, NCCL)."""


def check(shape: Any, tp: int, *, device: str = "cuda", quantization: str | None = None, device_count: int | None = None) -> str | None:
    """Why ``--tensor-parallel-size tp`` cannot serve ``shape`` (None: it can). ``device_count``: GPUs
    visible (``torch.cuda.device_count()``), checked when ``device`` is cuda."""
    flag = "--tensor-parallel-size"
    if tp < 1:
        return f"{flag} must be >= 1, got {tp}"
    if tp == 1:
        return None
    if shape.heads % tp:
        return f"{flag} {tp} does not divide the shape {shape.name}'s {shape.heads} attention heads"
    kv = shape.kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):  # vLLM's QKVParallelLinear: split or replicate KV heads
        return f"{flag} {tp} and the shape {shape.name}'s {kv} KV heads: one must divide the other"
    if shape.moe_intermediate % tp:
        return f"{flag} {tp} does not divide the shape {shape.name}'s expert intermediate size {shape.moe_intermediate}"
    if quantization == "w4a16":  # gpu_arm.fill_int_dummies patches the loader in the arm's process, not in vLLM's workers
        return f"{flag} {tp}: w4a16 arms run on one GPU (their integer dummy weights are filled in the arm's process)"
    if quantization == "fp8-block" and (shape.moe_intermediate // tp) % 128:
        return f"{flag} {tp}: each rank's expert intermediate size {shape.moe_intermediate // tp} is not a multiple of fp8-block's 128"
    if device == "cuda" and device_count is not None and tp > device_count:
        return f"{flag} {tp} needs {tp} GPUs; torch.cuda.device_count() reports {device_count}"
    return None


def offload_gib_per_rank(offload_gib_one_gpu: float, tp: int) -> float:
    """``cpu_offload_gb`` (per GPU) that leaves each rank the expert bytes of the reap arm's slots on that
    rank, from the one-GPU figure (``MoeShape.offload_gib_for_slots``): every rank holds 1/tp of each expert."""
    return offload_gib_one_gpu / tp


def rank_core_lists(cores: Sequence[int], tp: int, reserved_per_rank: int = RESERVED_PER_RANK) -> list[tuple[int, ...]]:
    """The CPU expert teams' cores, one contiguous list per local rank, after the first
    ``reserved_per_rank * tp`` cores (left to vLLM's processes); [] when fewer than one core per rank remains."""
    # the server's own split of one list between ranks; imported here because that package's __init__ imports torch
    from reap_swap.server_ext.cpu_experts.cores import split_by_rank

    rest = tuple(sorted(cores)[reserved_per_rank * tp:])
    if tp < 1 or len(rest) < tp:
        return []
    return [split_by_rank(rest, r, tp, "the cores left after vLLM's") for r in range(tp)]


def _ranges(cores: Sequence[int]) -> str:
    out: list[str] = []
    cores = sorted(cores)
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)


def core_spec(lists: Sequence[Sequence[int]]) -> str:
    """``REAP_CPU_EXPERT_CPUS`` for per-rank lists: ``"4-9;10-15"`` (one list: no ``;``)."""
    return ";".join(_ranges(c) for c in lists)


_BATCH_TAG = re.compile(r"_bs\d+")


def ratio_key(key: str, tp: int) -> str:
    """``fast_vs_stock_offload_bs1`` -> ``fast_vs_stock_offload_tp2_bs1`` (tp 1: unchanged; no batch tag: suffix)."""
    if tp == 1:
        return key
    m = None
    for m in _BATCH_TAG.finditer(key):
        pass
    if m is None:
        return f"{key}_tp{tp}"
    return f"{key[:m.start()]}_tp{tp}{key[m.start():]}"


def tp_ratios(ratios: dict[str, Any], tp: int) -> dict[str, Any]:
    return {ratio_key(k, tp): v for k, v in ratios.items()}


def by_rank(results: Sequence[dict[str, Any]], sums: Sequence[str] = (), same: Sequence[str] = ()) -> dict[str, Any]:
    """Rank 0's dict, ``sums`` keys summed over the ranks (``<key>_all_ranks``), every rank's dict under
    ``by_rank`` and ``ranks_agree`` (the ``same`` keys equal on every rank: routing is replicated)."""
    out = dict(results[0]) if results else {}
    if len(results) <= 1:
        return out
    for k in sums:
        vals = [r.get(k) for r in results]
        out[f"{k}_all_ranks"] = sum(vals) if all(isinstance(v, (int, float)) for v in vals) else None
    out["ranks_agree"] = all(r.get(k) == results[0].get(k) for r in results for k in same)
    out["by_rank"] = list(results)
    return out
