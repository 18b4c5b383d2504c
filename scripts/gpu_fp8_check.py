"""GPU check of FP8 experts through the slot bank (issue 27; vLLM 0.26+, CUDA, H200).

The 30B-A3B shape (24 layers, vLLM dummy weights) with FP8 experts, in fresh processes (bench-gpu's
arms): stock vLLM all on the GPU (the reference ids), then reap-swap at 38 slots per layer -- after a
calibration swap (``reap_30``), with the online cache (``reap_30_cache``) and in RAM-complement mode
(``reap_30_ram``). Every reap arm must load (the bank within vLLM's 992 physical rows: 168 here, the
scales beside it) and generate greedy ids identical to stock FP8's, batch 1 and batch 8.

    python scripts/gpu_fp8_check.py --quantization fp8 --out benchmarks/results/gpu_fp8_check.json
    python scripts/gpu_fp8_check.py --quantization fp8-block --out benchmarks/results/gpu_fp8_block_check.json

Prints one line per arm and ``FP8 CHECK PASSED`` or ``FP8 CHECK FAILED: ...`` (exit 1); the JSON holds
every arm's raw result (ids, the MoE kernel vLLM chose, the bank's rows and side tensors, memory).
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


def problems(raw: dict[str, dict[str, Any]], slots: int, side: bool = True) -> list[str]:
    """What failed, per arm (empty: the check passed). Pure: the unit test feeds it made-up results."""
    out: list[str] = []
    stock = raw.get("stock_gpu") or {}
    if stock.get("error") or not stock.get("tokens_bs1"):
        out.append(f"stock_gpu: no reference ids ({stock.get('error') or 'no tokens_bs1'})")
    for name, r in raw.items():
        if name == "stock_gpu":
            continue
        if r.get("error"):
            out.append(f"{name}: {r['error']}")
            continue
        bank = (r.get("moe_kernel") or {}).get("bank")
        if not bank:
            out.append(f"{name}: no residency bank on the MoE layer (moe_kernel={r.get('moe_kernel')})")
        elif bank["slots"] != slots or bank["physical_rows"] > 992 or bool(bank["side"]) != side:
            out.append(f"{name}: unexpected bank {bank} (want {slots} slots, <= 992 rows, {'scales as' if side else 'no'} side tensors)")
        for key in ("identical_ids", "identical_ids_bs8"):
            if r.get(key) is not True:
                out.append(f"{name}: {key}={r.get(key)} (first diff at {r.get('first_diff')})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantization", choices=["fp8", "fp8-block", "none"], default="fp8",
                    help="none: the same arms unquantized (a CPU smoke run of this script: --device cpu --shape tiny --slots 6)")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)} (stock_gpu first)")
    ap.add_argument("--shape", default="30b-a3b-24l")
    ap.add_argument("--slots", type=int, default=38, help="resident experts per layer")
    ap.add_argument("--deadline-s", type=float, default=560.0)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_fp8_check.json"))
    a = ap.parse_args(argv)
    from reap_swap.benchmarks import gpu_bench
    from reap_swap.benchmarks.shapes import SHAPES, write_model_dir
    from reap_swap.paths import bundled_model_dir

    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not arms or arms[0] != "stock_gpu" or any(x not in ARMS for x in arms):
        ap.error(f"--arms must start with stock_gpu and name only {', '.join(ARMS)}")
    shape = SHAPES[a.shape]
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix="gpu-fp8-"))
    workdir.mkdir(parents=True, exist_ok=True)
    quant = [] if a.quantization == "none" else ["--quantization", a.quantization]
    args = gpu_bench.parse_args(["--shape", a.shape, "--device", a.device, "--arms", "stock_gpu,reap_30", *quant, "--no-sweep",
                                 "--profile-steps", "0", "--gen", "32", "--gen-bs8", "16", "--reps", "1",
                                 "--slots-fraction", str(a.slots / shape.experts), "--deadline-s", str(a.deadline_s)])
    model_dir = write_model_dir(shape, bundled_model_dir(), workdir / "model", "bfloat16" if a.device == "cuda" else "float32")
    stock, reap = gpu_bench.build_specs(args, model_dir)
    specs = [stock] + [{**reap, "name": n, "env": EXTRA_ENV.get(n, {})} for n in arms[1:]]
    raw = gpu_bench.run_arms(specs, workdir, args)
    bad = problems(raw, a.slots, side=a.quantization != "none")
    for name, r in raw.items():
        mk = r.get("moe_kernel") or {}
        print(f"{name}: error={r.get('error')} identical_ids={r.get('identical_ids')} identical_ids_bs8={r.get('identical_ids_bs8')} "
              f"kernel={mk.get('quant_method')}/{mk.get('fp8_backend')}/{mk.get('fused_experts')} bank={mk.get('bank')}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"quantization": a.quantization, "shape": a.shape, "slots": a.slots, "passed": not bad, "problems": bad,
                                 "raw": raw}, indent=1))
    print(f"wrote {a.out} (arm logs: {workdir / 'arms.log'})")
    if bad:
        print("FP8 CHECK FAILED: " + "; ".join(bad), file=sys.stderr)
        return 1
    print("FP8 CHECK PASSED")
    return 0


if __name__ == "__main__":
    sys.exit(main())
