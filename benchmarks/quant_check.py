"""The quantized-experts GPU checks' shared harness (``scripts/gpu_fp8_check.py``, ``scripts/gpu_w4_check.py``).

Both run bench-gpu's arms on the 30B-A3B shape with dummy weights: stock vLLM all on the GPU (the
reference ids), then reap-swap at ``slots`` per layer after a calibration swap (``reap_30``), with the
online cache (``reap_30_cache``) and in RAM-complement mode (``reap_30_ram``); every reap arm must load
a bank within vLLM's 992 physical rows and generate greedy ids identical to stock's at batch 1 and 8.
``stock_offload`` records what stock vLLM's ``cpu_offload_gb`` does with the scheme at the same GPU expert
bytes (issue 27: it breaks on Marlin weights in host memory in some versions): an observation, never a
failure of the check. The scheme reaches every arm as bench-gpu's ``--quantization``; what differs per
scheme is what its bank must look like.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

ARMS = ("stock_gpu", "reap_30", "reap_30_cache", "reap_30_ram", "stock_offload")
OBSERVED = ("stock_offload",)
"""Stock arms whose outcome is recorded, not judged: the check is about reap-swap's banks."""
EXTRA_ENV = {"reap_30_cache": {"REAP_ONLINE_CACHE": "lfru", "REAP_ONLINE_CACHE_CAP": "2"},
             "reap_30_ram": {"REAP_RAM_COMPLEMENT": "1", "REAP_COMPLEMENT_SPARES": "4"}}
MAX_ROWS = 992  # vLLM's moe_align_block_size

Raw = dict[str, dict[str, Any]]


def arm_problems(raw: Raw, bank_problem: Callable[[dict[str, Any]], str | None],
                 arm_problem: Callable[[str, dict[str, Any]], str | None] = lambda name, r: None) -> list[str]:
    """What failed, per arm (empty: passed). ``bank_problem`` judges a reap arm's bank (None: as wanted);
    ``arm_problem`` any arm, stock included, that did not fail outright. Pure: tests feed made-up results."""
    out: list[str] = []
    raw = {name: r for name, r in raw.items() if name not in OBSERVED}
    stock = raw.get("stock_gpu") or {}
    if stock.get("error") or not stock.get("tokens_bs1"):
        out.append(f"stock_gpu: no reference ids ({stock.get('error') or 'no tokens_bs1'})")
    for name, r in raw.items():
        extra = None if r.get("error") else arm_problem(name, r)
        if extra:
            out.append(f"{name}: {extra}")
        if name == "stock_gpu":
            continue
        if r.get("error"):
            out.append(f"{name}: {r['error']}")
            continue
        bank = (r.get("moe_kernel") or {}).get("bank")
        if not bank:
            out.append(f"{name}: no residency bank on the MoE layer (moe_kernel={r.get('moe_kernel')})")
        else:
            why = bank_problem(bank)
            if why:
                out.append(f"{name}: unexpected bank {bank} ({why})")
        for key in ("identical_ids", "identical_ids_bs8"):
            if r.get(key) is not True:
                out.append(f"{name}: {key}={r.get(key)} (first diff at {r.get('first_diff')})")
    return out


def observed(raw: Raw, offload_gib: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per observed stock arm: whether it served, its decode tok/s and whether its ids equal stock all-GPU's.
    ``offload_gib``: each arm's ``cpu_offload_gb`` as asked (from its spec: a crashed arm may have saved none)."""
    out: dict[str, dict[str, Any]] = {}
    for name in OBSERVED:
        r = raw.get(name)
        if r is None:
            continue
        out[name] = {"served": not r.get("error") and r.get("tokens_bs1") is not None, "error": r.get("error"),
                     "offload_gib": offload_gib.get(name),
                     **{f"decode_tok_s_{bs}": (r.get(bs) or {}).get("decode_tok_s") for bs in ("bs1", "bs8")},
                     "identical_ids": r.get("identical_ids"), "identical_ids_bs8": r.get("identical_ids_bs8")}
    return out


def add_common_args(ap: argparse.ArgumentParser, default_out: str) -> None:
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)} (stock_gpu first)")
    ap.add_argument("--shape", default="30b-a3b-24l")
    ap.add_argument("--slots", type=int, default=38, help="resident experts per layer")
    ap.add_argument("--deadline-s", type=float, default=560.0)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path, default=Path(default_out))


def run_check(ap: argparse.ArgumentParser, a: argparse.Namespace, *, label: str, bench_flags: Sequence[str],
              problems: Callable[[Raw], list[str]], kernel_keys: Sequence[str]) -> int:
    """Run the arms and judge them. ``bench_flags``: bench-gpu options that carry the scheme (its
    ``--quantization``, which also sizes stock offload's ``cpu_offload_gb``); ``kernel_keys``: the
    ``moe_kernel`` fields printed per arm. Exit status 1 on any problem."""
    from reap_swap.benchmarks import gpu_bench
    from reap_swap.benchmarks.shapes import SHAPES, write_model_dir
    from reap_swap.paths import bundled_model_dir

    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if not arms or arms[0] != "stock_gpu" or any(x not in ARMS for x in arms):
        ap.error(f"--arms must start with stock_gpu and name only {', '.join(ARMS)}")
    if a.shape not in SHAPES:
        ap.error(f"--shape must be one of {', '.join(sorted(SHAPES))}, got {a.shape!r}")
    shape = SHAPES[a.shape]
    if not 0 < a.slots <= shape.experts:
        ap.error(f"--slots must be in [1, {shape.experts}], got {a.slots}")
    workdir = a.workdir or Path(tempfile.mkdtemp(prefix=f"gpu-{label.lower()}-"))
    workdir.mkdir(parents=True, exist_ok=True)
    args = gpu_bench.parse_args(["--shape", a.shape, "--device", a.device, "--arms", "stock_gpu,reap_30,stock_offload", *bench_flags, "--no-sweep",
                                 "--profile-steps", "0", "--gen", "32", "--gen-bs8", "16", "--reps", "1",
                                 "--slots-fraction", str(a.slots / shape.experts), "--deadline-s", str(a.deadline_s)])
    model_dir = write_model_dir(shape, bundled_model_dir(), workdir / "model", "bfloat16" if a.device == "cuda" else "float32")
    stock, reap, offload = gpu_bench.build_specs(args, model_dir)
    specs = [stock] + [offload if n in OBSERVED else {**reap, "name": n, "env": EXTRA_ENV.get(n, {})} for n in arms[1:]]
    raw = gpu_bench.run_arms(specs, workdir, args)
    bad = problems(raw)
    for name, r in raw.items():
        mk = r.get("moe_kernel") or {}
        print(f"{name}: error={r.get('error')} identical_ids={r.get('identical_ids')} identical_ids_bs8={r.get('identical_ids_bs8')} "
              f"kernel={'/'.join(str(mk.get(k)) for k in kernel_keys)} bank={mk.get('bank')}", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    seen = observed(raw, {s["name"]: s["offload_gib"] for s in specs if s.get("offload_gib")})
    for name, o in seen.items():
        print(f"{name} (observed, not judged): served={o['served']} error={o['error']} tok/s bs1={o['decode_tok_s_bs1']} "
              f"bs8={o['decode_tok_s_bs8']} identical_ids={o['identical_ids']}", flush=True)
    a.out.write_text(json.dumps({"quantization": a.quantization, "shape": a.shape, "slots": a.slots, "passed": not bad, "problems": bad,
                                 "observed": seen, "raw": raw}, indent=1))
    print(f"wrote {a.out} (arm logs: {workdir / 'arms.log'})")
    if bad:
        print(f"{label} CHECK FAILED: " + "; ".join(bad), file=sys.stderr)
        return 1
    print(f"{label} CHECK PASSED")
    return 0
