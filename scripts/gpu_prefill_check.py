"""GPU check of prefill staging (issue 26): a prefill-size MoE step over a VMM bank of the 30B-A3B
expert shape, 30 % of the experts resident, read from host rows (UVA, re-read per M-block) against
staged (each missed expert copied once into the shared staging rows), outputs compared.

1. ``--layers`` banks (E=128, S=38, 90 staging rows) on ``VmmBacking``: every layer maps one staging
   region (a byte written through layer 0's rows reads back through layer 1's);
2. for each token count (2048, 8192, 32768 by default, top-8 random routing): the step unstaged,
   then staged (``prefill_staging.stage_step`` + the same kernel), through every layer in turn;
   median times over ``--reps``, the staged step's copy time alone, missed experts and link bytes,
   and whether the outputs are bit-identical.

The kernel is vLLM's ``fused_experts`` when it imports (its M-blocks re-read each expert), else a
torch loop over experts (grouped matmuls; it says which). No vLLM engine, no model.

    python scripts/gpu_prefill_check.py --out prefill_check.json           # CUDA (H100/H200)
    python scripts/gpu_prefill_check.py --device cpu --tokens 64,256       # dry run: small shape, plain bank
Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

from reap_swap.server_ext.bank.bank import ExpertBank, PlainBacking
from reap_swap.server_ext.cache.prefill_staging import StagingParams, plan_staging, stage_step

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def torch_kernel(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, phys: torch.Tensor, rows: int) -> torch.Tensor:
    """Per physical row: its tokens' silu(x w1) * (x w3) w2 per (token, k) pair, then the weighted sum over k in
    k order (as vLLM's moe_sum), so the result does not depend on which row holds an expert."""
    t, k = phys.shape
    per_pair = torch.zeros(t * k, x.shape[1], dtype=torch.float32, device=x.device)
    flat = phys.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=rows).tolist()
    start = 0
    for r, n in enumerate(counts):
        if n == 0:
            continue
        pairs = order[start:start + n]
        start += n
        h = x[pairs // k] @ w13[r].t()
        g, u = h.chunk(2, dim=-1)
        per_pair[pairs] = ((torch.nn.functional.silu(g) * u) @ w2[r].t()).float()
    return (per_pair.view(t, k, -1) * weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)


def pick_kernel(device: str) -> tuple[Kernel, str]:
    if device == "cuda":
        try:
            from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts

            def vllm_kernel(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, phys: torch.Tensor, rows: int) -> torch.Tensor:
                return fused_experts(x, w13, w2, weights, phys, global_num_experts=rows)

            return vllm_kernel, "vllm fused_experts"
        except Exception as exc:  # noqa: BLE001 - fall back, and say so
            return torch_kernel, f"torch loop (vllm fused_experts unavailable: {type(exc).__name__}: {exc})"
    return torch_kernel, "torch loop"


def build_banks(layers: int, e: int, s: int, hidden: int, inter: int, staging: int, device: str) -> list[tuple[ExpertBank, torch.Tensor]]:
    banks = []
    for i in range(layers):
        g = torch.Generator().manual_seed(i)
        params = {"w13_weight": torch.nn.Parameter((torch.randn(e, 2 * inter, hidden, generator=g) * 0.05).to(torch.bfloat16), requires_grad=False),
                  "w2_weight": torch.nn.Parameter((torch.randn(e, hidden, inter, generator=g) * 0.05).to(torch.bfloat16), requires_grad=False)}
        if device == "cuda":
            from reap_swap.server_ext.bank.cuda_vmm import VmmBacking

            backing: Any = VmmBacking(torch.device("cuda"))
        else:
            backing = PlainBacking(torch.device("cpu"))
        phys_map = torch.zeros(e, dtype=torch.int32, device=device)
        bank = ExpertBank(i, params, phys_map, s, backing, staging_rows=staging)
        bank.swap(tuple(range(s)))
        banks.append((bank, phys_map))
    return banks


def shared_staging_ok(banks: list[tuple[ExpertBank, torch.Tensor]]) -> bool | None:
    """CUDA: a value written to layer 0's first staging row reads back through the last layer's."""
    if len(banks) < 2 or banks[0][0].params["w2_weight"].device.type != "cuda":
        return None
    a, b = banks[0][0], banks[-1][0]
    ra, rb = a.params["w2_weight"].data[a.staging_offset], b.params["w2_weight"].data[b.staging_offset]
    ra.fill_(3.0)
    torch.cuda.synchronize()
    ok = bool((rb == 3.0).all())
    ra.zero_()
    return ok


def timed(fn: Callable[[], Any], device: str, reps: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(reps + 1):  # the first is a warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), out


def check_tokens(banks: list[tuple[ExpertBank, torch.Tensor]], tokens: int, k: int, params: StagingParams, kernel: Kernel, device: str,
                 reps: int) -> dict[str, Any]:
    bank0 = banks[0][0]
    e, h, hidden = bank0.num_experts, bank0.table.host_row_offset, bank0.params["w2_weight"].shape[1]
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, hidden, generator=g) * 0.5).to(torch.bfloat16).to(device)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]).to(torch.int32).to(device)
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1).to(device)
    rows = bank0.physical_rows

    def run(stage: bool) -> list[torch.Tensor]:
        outs = []
        for bank, phys_map in banks:
            w13, w2 = (bank.params[n].data for n in ("w13_weight", "w2_weight"))
            phys = phys_map.index_select(0, ids.reshape(-1).to(torch.int64)).view(ids.shape).to(ids.dtype)
            if stage:
                phys = stage_step(ids, phys, phys_map, h, bank.staging_offset, [w13, w2], params)
            outs.append(kernel(x, w13, w2, weights, phys, rows))
        return outs

    plain_s, plain = timed(lambda: run(False), device, reps)
    staged_s, staged = timed(lambda: run(True), device, reps)

    def copies_only() -> None:
        for bank, phys_map in banks:
            w = [bank.params[n].data for n in ("w13_weight", "w2_weight")]
            phys = phys_map.index_select(0, ids.reshape(-1).to(torch.int64)).view(ids.shape).to(ids.dtype)
            stage_step(ids, phys, phys_map, h, bank.staging_offset, w, params)

    copy_s, _ = timed(copies_only, device, reps)
    phys0 = banks[0][1].index_select(0, ids.reshape(-1).to(torch.int64)).view(ids.shape)
    plan = plan_staging(ids, phys0, banks[0][1], h, params)
    staged_n = int(plan.valid.sum())
    identical = all(torch.equal(a, b) for a, b in zip(plain, staged))
    return {"tokens": tokens, "layers": len(banks), "unstaged_ms": plain_s * 1e3, "staged_ms": staged_s * 1e3, "staging_copies_ms": copy_s * 1e3,
            "speedup": plain_s / staged_s if staged_s else None, "staged_experts_per_layer": staged_n,
            "missed_experts_per_layer": int((plan_staging(ids, phys0, banks[0][1], h, StagingParams(e, 1, 0)).valid).sum()),
            "staging_link_bytes_per_layer": staged_n * bank0.link_bytes, "identical": identical}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tokens", default="2048,8192,32768", help="prefill step sizes, comma-separated")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--min-expert-tokens", type=int, default=16)
    p.add_argument("--out", help="result JSON (default: stdout only)")
    a = p.parse_args(argv)
    cpu = a.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("no CUDA device: use --device cpu for the dry run", file=sys.stderr)
        return 2
    # 30B-A3B: hidden 2048, moe_intermediate 768, 128 experts, top-8; the CPU dry run a small one of the same structure
    e, k, hidden, inter = (16, 4, 64, 32) if cpu else (128, 8, 2048, 768)
    s = round(0.3 * e)
    tokens = [int(t) for t in a.tokens.split(",") if t.strip()]
    banks = build_banks(a.layers, e, s, hidden, inter, e - s, a.device)
    kernel, kernel_name = pick_kernel(a.device)
    params = StagingParams(e - s, 1, a.min_expert_tokens)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name() if not cpu else "cpu", "kernel": kernel_name,
                              "experts": e, "slots": s, "top_k": k, "staging_rows": e - s, "min_expert_tokens": a.min_expert_tokens,
                              "expert_link_bytes": banks[0][0].link_bytes, "shared_staging": shared_staging_ok(banks),
                              "staging_bytes_per_layer_view": banks[0][0].staging_bytes, "steps": []}
    for t in tokens:
        result["steps"].append(check_tokens(banks, t, k, params, kernel, a.device, a.reps))
        print(json.dumps(result["steps"][-1]), flush=True)
    result["ok"] = all(r["identical"] for r in result["steps"]) and result["shared_staging"] is not False
    text = json.dumps(result, indent=1)
    if a.out:
        with open(a.out, "w") as fh:
            fh.write(text)
    print(text)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
