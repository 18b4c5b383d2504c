"""Residency settings, read from the environment in every vLLM process.

``reap-swap serve`` turns its flags into these variables before vLLM starts,
so spawned workers (which build the model) and the API server (which runs the
control plane) see the same configuration. The seed's names are kept.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Mapping

from reap_swap.plan import Plan, layer_index, load_plan

ENV_PLAN = "REAP_PLAN_FILE"
ENV_SLOTS = "REAP_RESIDENT_EXPERTS_PER_LAYER"
ENV_START = "REAP_START_RESIDENT"
ENV_PREFIXES = "REAP_START_RESIDENT_PREFIXES"
ENV_TOKEN = "REAP_CONTROL_TOKEN"
ENV_CARTRIDGES = "REAP_MAX_LOADED_CARTRIDGES"
ENV_CARTRIDGE_DIR = "REAP_CARTRIDGE_DIR"
ENV_VALIDATE_ONLY = "REAP_SWAP_VALIDATE_ONLY"
ENV_LEDGER = "REAP_MISS_LEDGER_SIZE"
ENV_MAX_BODY = "REAP_MAX_BODY_BYTES"
ENV_SWAP_RATE = "REAP_SWAP_BYTES_PER_S"
ENV_FORENSICS_BYTES = "REAP_FORENSICS_MAX_BYTES"
DEFAULT_FORENSICS_BYTES = 64 << 20  # swap results as JSON; one is ~44 KB at 48 layers x 128 experts
DEFAULT_MAX_BODY = 256 << 10  # a full active set of a 94-layer x 128-slot model is ~50 KB
DEFAULT_SWAP_RATE = 16 << 30  # bytes/s; about a third of an H200's host link
ENV_ACCOUNTING = "REAP_MISS_ACCOUNTING"
ENV_COMPLEMENT = "REAP_RAM_COMPLEMENT"
ENV_SPARES = "REAP_COMPLEMENT_SPARES"
DEFAULT_SPARES = 4  # spare host rows per layer; a swap batch evicts at most this many at once
ENV_ONLINE_CACHE = "REAP_ONLINE_CACHE"
ENV_CACHE_CAP = "REAP_ONLINE_CACHE_CAP"
ENV_CACHE_DECAY = "REAP_ONLINE_CACHE_DECAY"
ENV_CACHE_HYSTERESIS = "REAP_ONLINE_CACHE_HYSTERESIS"
ENV_CACHE_PRIOR = "REAP_ONLINE_CACHE_PRIOR_WEIGHT"
ENV_CACHE_FUSED = "REAP_ONLINE_CACHE_FUSED"
ENV_STAGING_ROWS = "REAP_PREFILL_STAGING_ROWS"
ENV_STAGING_MIN_STEP = "REAP_PREFILL_STAGING_MIN_STEP_TOKENS"
ENV_STAGING_MIN_EXPERT = "REAP_PREFILL_STAGING_MIN_EXPERT_TOKENS"
MAX_STAGING_ROWS = 512  # more than any model's experts per layer here; the bank's row limit is 992 in all
ONLINE_POLICIES = ("lfru",)
# Chosen on learned 128-expert traces at 30 % slots (reap-swap simulate --policies lfru_cap, T=0.8):
# decode hits 0.829 / 0.836 / 0.839 at cap 1 / 2 / 4 (decay 0.9; uncapped LFRU 0.839), 0.845 with
# decay 0.95 at cap 4; any hysteresis >= 0.5 only loses hits. planning/simulate.py uses the same defaults.
DEFAULT_CACHE_CAP = 4
DEFAULT_CACHE_DECAY = 0.95
DEFAULT_CACHE_PRIOR = 1.0


class ResidencyConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ResidencyConfig:
    plan_path: str | None
    slots_override: int | None
    start: str  # "core", "none", or a JSON active set
    start_prefixes: tuple[str, ...]
    control_token: str | None
    max_loaded_cartridges: int
    cartridge_dir: str | None
    validate_only: bool
    ledger_size: int
    max_body_bytes: int
    swap_bytes_per_s: int = DEFAULT_SWAP_RATE
    """Token-bucket rate on bytes copied by swaps (0: unlimited)."""
    accounting: bool = True  # per-request router-miss sums; "0" only to diagnose its cost
    ram_complement: bool = False
    """Host rows only for non-resident experts + spares; exchanges rotate row ownership."""
    complement_spares: int = DEFAULT_SPARES
    online_cache: str | None = None
    """Promote-on-miss policy inside the forward (``online_cache.py``); None: residency changes only by swaps."""
    cache_cap: int = DEFAULT_CACHE_CAP
    cache_decay: float = DEFAULT_CACHE_DECAY
    cache_hysteresis: float | None = None
    cache_prior_weight: float = DEFAULT_CACHE_PRIOR
    cache_fused: bool = True
    """CUDA: the step as one Triton program; 0 keeps the torch ops (same results, to compare on a GPU)."""
    forensics_max_bytes: int = DEFAULT_FORENSICS_BYTES
    """Bound on the control plane's swap forensics (JSON bytes, oldest requests evicted first)."""
    staging_rows: int = 0
    """Prefill staging (``cache/prefill_staging.py``): device rows a large step's missed experts are copied
    into once each; 0: off."""
    staging_min_step_tokens: int = 512
    staging_min_expert_tokens: int = 16

    @property
    def enabled(self) -> bool:
        return self.plan_path is not None or self.slots_override is not None

    def plan(self) -> Plan | None:
        return _cached_plan(self.plan_path) if self.plan_path else None

    def slots_for(self, layer: int, num_experts: int) -> int:
        """Slot-bank size of a layer: the override, else the plan's core + specialist capacity."""
        if self.slots_override is not None:
            return min(self.slots_override, num_experts)
        plan = self.plan()
        if plan is None or layer not in plan.layers:
            return 0
        return min(plan.layers[layer].resident_capacity, num_experts)

    def core(self, layer: int) -> tuple[int, ...]:
        """The plan's core experts of a layer (the online cache never evicts them)."""
        plan = self.plan()
        return tuple(plan.layers[layer].core) if plan and layer in plan.layers else ()

    def start_resident(self, layer: int, num_experts: int, slots: int) -> tuple[int, ...]:
        """Experts resident at start-up: prefixes, an explicit set, the plan's core, or none."""
        if self.start_prefixes:
            chosen = [e for e in range(num_experts) if prefix_selects(self.start_prefixes, layer, e)]
        elif self.start == "none":
            chosen = []
        elif self.start == "core":
            plan = self.plan()
            chosen = list(plan.layers[layer].core) if plan and layer in plan.layers else []
        else:
            chosen = list(_explicit_start(self.start).get(layer, []))
        bad = [e for e in chosen if not 0 <= e < num_experts]
        if bad:
            raise ResidencyConfigError(f"start-up residents of layer {layer} out of range: {bad}")
        if len(chosen) > slots:
            raise ResidencyConfigError(
                f"layer {layer}: {len(chosen)} start-up residents exceed its slot bank of {slots}"
            )
        return tuple(sorted(set(chosen)))


def prefix_selects(prefixes: tuple[str, ...], layer: int, expert: int) -> bool:
    """Seed semantics: a parameter-name prefix makes every expert under it resident.

    ``model.layers.3`` selects all of layer 3, ``model.layers.3.mlp.experts.7``
    just expert 7; prefixes end at name components (``layers.3`` is not ``layers.30``).
    """
    name = f"model.layers.{layer}.mlp.experts.{expert}."
    return any(name.startswith(p if p.endswith(".") else p + ".") for p in prefixes)


@lru_cache(maxsize=4)
def _explicit_start(text: str) -> Mapping[int, tuple[int, ...]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResidencyConfigError(f"{ENV_START} must be 'core', 'none' or a JSON active set: {exc}") from None
    if not isinstance(data, dict):
        raise ResidencyConfigError(f"{ENV_START} JSON must be an object of layer -> expert ids")
    out: dict[int, tuple[int, ...]] = {}
    for key, ids in data.items():
        idx = layer_index(str(key))
        if idx is None or not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ResidencyConfigError(f"{ENV_START}: bad entry {key!r}")
        out[idx] = tuple(ids)
    return out


@lru_cache(maxsize=4)
def _cached_plan(path: str) -> Plan:
    return load_plan(path)


def _int_env(env: Mapping[str, str], name: str, default: int | None, minimum: int = 0) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ResidencyConfigError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ResidencyConfigError(f"{name} must be >= {minimum}, got {value}")
    return value


def _float_env(env: Mapping[str, str], name: str, default: float | None, lo: float, hi: float, none_ok: bool = False) -> float | None:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if none_ok and raw in ("none", "off"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ResidencyConfigError(f"{name} must be a number{' or none' if none_ok else ''}, got {raw!r}") from None
    if not lo <= value <= hi:
        raise ResidencyConfigError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _online_cache(env: Mapping[str, str]) -> str | None:
    raw = env.get(ENV_ONLINE_CACHE, "").strip().lower()
    if raw in ("", "0", "off", "none"):
        return None
    if raw not in ONLINE_POLICIES:
        raise ResidencyConfigError(f"{ENV_ONLINE_CACHE} must be off or one of {', '.join(ONLINE_POLICIES)}, got {raw!r}")
    return raw


def from_env(env: Mapping[str, str] | None = None) -> ResidencyConfig:
    env = os.environ if env is None else env
    decay = _float_env(env, ENV_CACHE_DECAY, DEFAULT_CACHE_DECAY, 0.0, 1.0)
    if decay is None or not 0.0 < decay < 1.0:
        raise ResidencyConfigError(f"{ENV_CACHE_DECAY} must be in (0, 1), got {decay}")
    prefixes = tuple(p.strip() for p in env.get(ENV_PREFIXES, "").split(",") if p.strip())
    online = _online_cache(env)
    complement = _bool_env(env, ENV_COMPLEMENT, False)
    spares = _int_env(env, ENV_SPARES, DEFAULT_SPARES, 1) or DEFAULT_SPARES
    cap = _int_env(env, ENV_CACHE_CAP, DEFAULT_CACHE_CAP, 1) or DEFAULT_CACHE_CAP
    if online and complement and spares < cap:
        raise ResidencyConfigError(
            f"{ENV_ONLINE_CACHE} with {ENV_COMPLEMENT} (--online-cache with --ram-complement): each of a step's up to "
            f"{ENV_CACHE_CAP}={cap} (--online-cache-cap) evictions needs a spare host row; {ENV_SPARES}={spares} "
            f"(--complement-spares) is too few (set it >= {cap})"
        )
    staging_rows = _int_env(env, ENV_STAGING_ROWS, 0, 0) or 0
    if staging_rows > MAX_STAGING_ROWS:
        raise ResidencyConfigError(f"{ENV_STAGING_ROWS} (--prefill-staging-rows) must be <= {MAX_STAGING_ROWS}, got {staging_rows}")
    return ResidencyConfig(
        plan_path=env.get(ENV_PLAN) or None,
        slots_override=_int_env(env, ENV_SLOTS, None),
        start=env.get(ENV_START, "core").strip() or "core",
        start_prefixes=prefixes,
        control_token=env.get(ENV_TOKEN) or None,
        max_loaded_cartridges=_int_env(env, ENV_CARTRIDGES, 4, 1) or 4,
        cartridge_dir=env.get(ENV_CARTRIDGE_DIR) or None,
        validate_only=env.get(ENV_VALIDATE_ONLY, "0") == "1",
        ledger_size=_int_env(env, ENV_LEDGER, 1024, 1) or 1024,
        max_body_bytes=_int_env(env, ENV_MAX_BODY, DEFAULT_MAX_BODY, 1024) or DEFAULT_MAX_BODY,
        swap_bytes_per_s=_int_env(env, ENV_SWAP_RATE, DEFAULT_SWAP_RATE, 0) or 0,
        accounting=_bool_env(env, ENV_ACCOUNTING, True),
        ram_complement=complement,
        complement_spares=spares,
        online_cache=online,
        cache_cap=cap,
        cache_decay=decay,
        cache_hysteresis=_float_env(env, ENV_CACHE_HYSTERESIS, None, 0.0, 1e6, none_ok=True),
        cache_prior_weight=_float_env(env, ENV_CACHE_PRIOR, DEFAULT_CACHE_PRIOR, 0.0, 1e6) or 0.0,
        cache_fused=_bool_env(env, ENV_CACHE_FUSED, True),
        forensics_max_bytes=_int_env(env, ENV_FORENSICS_BYTES, DEFAULT_FORENSICS_BYTES, 1024) or DEFAULT_FORENSICS_BYTES,
        staging_rows=staging_rows,
        staging_min_step_tokens=_int_env(env, ENV_STAGING_MIN_STEP, 512, 1) or 512,
        staging_min_expert_tokens=_int_env(env, ENV_STAGING_MIN_EXPERT, 16, 0) or 0,
    )


def _bool_env(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    raise ResidencyConfigError(f"{name} must be 0 or 1, got {raw!r}")
