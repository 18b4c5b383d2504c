"""GPU check of FP8 experts through the slot bank (issue 27; vLLM 0.26+, CUDA, H200).

The 30B-A3B shape (24 layers, vLLM dummy weights) with FP8 experts, in fresh processes (bench-gpu's
arms): stock vLLM all on the GPU (the reference ids), then reap-swap at 38 slots per layer -- after a
calibration swap (``reap_30``), with the online cache (``reap_30_cache``) and in RAM-complement mode
(``reap_30_ram``). Every reap arm must load (the bank within vLLM's 992 physical rows: 168 here, the
scales beside it) and generate greedy ids identical to stock FP8's, batch 1 and batch 8. Last, stock
``cpu_offload_gb`` at the same GPU expert bytes (``stock_offload``, on by default): recorded under the
JSON's ``observed`` (FP8 quantized at load failed there with "Cannot copy out of meta tensor" on vLLM 0.26;
the fp8-block config served), never a failure of the check.

    python scripts/gpu_fp8_check.py --quantization fp8 --out benchmarks/results/gpu_fp8_check.json
    python scripts/gpu_fp8_check.py --quantization fp8-block --out benchmarks/results/gpu_fp8_block_check.json

Prints one line per arm and ``FP8 CHECK PASSED`` or ``FP8 CHECK FAILED: ...`` (exit 1); the JSON holds
every arm's raw result (ids, the MoE kernel vLLM chose, the bank's rows and side tensors, memory).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from reap_swap.benchmarks.quant_check import ARMS, MAX_ROWS, Raw, add_common_args, arm_problems, run_check

__all__ = ["ARMS", "main", "problems"]


def problems(raw: Raw, slots: int, side: bool = True) -> list[str]:
    """What failed, per arm (empty: the check passed). Pure: the unit test feeds it made-up results."""

    def bank_problem(bank: dict[str, Any]) -> str | None:
        if bank["slots"] != slots or bank["physical_rows"] > MAX_ROWS or bool(bank["side"]) != side:
            return f"want {slots} slots, <= {MAX_ROWS} rows, {'scales as' if side else 'no'} side tensors"
        return None

    return arm_problems(raw, bank_problem)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", choices=["fp8", "fp8-block", "none"], default="fp8",
                    help="none: the same arms unquantized (a CPU smoke run of this script: --device cpu --shape tiny --slots 6)")
    add_common_args(ap, "benchmarks/results/gpu_fp8_check.json")
    a = ap.parse_args(argv)
    quant = [] if a.quantization == "none" else ["--quantization", a.quantization]
    return run_check(ap, a, label="FP8", bench_flags=quant,
                     problems=lambda raw: problems(raw, a.slots, side=a.quantization != "none"),
                     kernel_keys=("quant_method", "fp8_backend", "fused_experts"))


if __name__ == "__main__":
    sys.exit(main())
