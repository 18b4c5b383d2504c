"""torch.profiler over decode steps of a built vLLM engine: host syncs, blocking copies and launches per step,
and reap-swap's own kernels' device time (counted by ``profile_counts``).

Why a batch: a claim like "no sync added" must hold where the CPU path's budgeted steps run (batch 32),
not only at batch 1, so the window opens only once every request of the batch decodes.
"""

from __future__ import annotations

from typing import Any

REAP_KERNELS = ("remap_capture_kernel", "accumulate_kernel", "_policy_kernel", "_promote_kernel", "_exchange_kernel", "_promotions_kernel",
                "_split_kernel")
"""reap-swap's own per-step kernels (Triton), timed on the device in a profile."""


def profile_decode(llm: Any, prompts: list[dict[str, list[int]]], steps: int, request_ids: list[str] | None = None) -> dict[str, Any]:
    """torch.profiler over ``steps`` decode steps of ``prompts`` run together: syncs and launches per step.

    Every request is past its prefill (which may take several chunked steps at batch 32) and three more
    decode steps before the window opens, and none finishes inside it, so each profiled step decodes
    the whole batch."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    from reap_swap.benchmarks.profile_counts import PROFILE_MARGIN, kernel_times, per_step_counts

    ids = request_ids or [f"bench-profile.{i}" for i in range(len(prompts))]
    if len(ids) != len(prompts) or not prompts:
        raise ValueError(f"profile: {len(prompts)} prompts, {len(ids)} request ids")
    eng = llm.llm_engine
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=steps + PROFILE_MARGIN, ignore_eos=True))
    first_step: dict[str, int] = {}
    for step in range(256):  # prefill (chunked: several steps at batch 32), then three decode steps outside the window
        for o in eng.step():
            if o.outputs and o.outputs[0].token_ids:
                first_step.setdefault(o.request_id, step)
        if len(first_step) == len(ids) and step >= max(first_step.values()) + 3:
            break
    else:
        raise RuntimeError(f"profile: {len(first_step)} of {len(ids)} requests decoding after 256 steps")
    lead = max(first_step.values()) - min(first_step.values()) + 4  # tokens the earliest request has past the last one's
    if lead >= PROFILE_MARGIN:
        raise RuntimeError(f"profile: the batch's prefill staggered its requests by {lead - 4} steps; the earliest would finish inside "
                           f"the window (PROFILE_MARGIN {PROFILE_MARGIN})")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    finished: list[str] = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            finished += [o.request_id for o in eng.step() if o.finished]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step()
    if finished:
        raise RuntimeError(f"profile: {finished} finished inside the window: its steps did not all decode the whole batch")
    averages = prof.key_averages()
    counts = per_step_counts(((e.key, int(e.count)) for e in averages), steps)
    device_us = (float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)) for e in averages)
    counts["reap_kernels"] = kernel_times(((e.key, int(e.count), us) for e, us in zip(averages, device_us)), REAP_KERNELS, steps)
    counts["steps"] = steps
    counts["batch"] = len(prompts)
    counts["top_cpu_calls"] = [(e.key, int(e.count)) for e in sorted(averages, key=lambda e: -e.count)[:25]]
    return counts
