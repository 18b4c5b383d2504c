"""The decode clock: one step's milliseconds from what the step moved (pure numpy).

Why: hit rate is not speed. A hit is free, a miss costs its bytes over one of two pipes (the
host link, read by the fused kernel over UVA, or the host CPU computing it next to its bytes),
both pipes draw on one host DRAM, and a promotion copies an expert over the link before the
fused kernel runs. Choosing a policy by hit rate alone can pick one that moves more bytes over
the slower path; this model lets ``reap-swap simulate`` pick by step time.

Per MoE layer of a step (``B`` = bytes of one expert, every expert of a layer the same size)::

    hbm_ms   = resident experts read * B / hbm_GBps          (the fused kernel's resident blocks)
    link_ms  = link experts * B / link_GBps                  (missed experts read over UVA)
    cpu_ms   = [cpu experts > 0] * cpu_fixed + cpu experts * B / cpu_GBps + cpu pairs * cpu_pair
    host_ms  = (link + cpu experts) * B / host_dram_GBps     (both pipes read the same DRAM)
    layer_ms = max(hbm_ms, link_ms, cpu_ms, host_ms)         (they run at once)
             + (1 - promote_overlap) * promoted * B / promote_GBps + per-layer fixed costs

The fast order (``serve --fast``: the split posts the CPU's share first, then the cache's policy program,
its copies and the fused kernel run) overlaps all three with the CPU instead::

    layer_ms = max(policy_ms + promote_ms + max(hbm_ms, link_ms), cpu_ms, (link + cpu + promoted) * B / host_dram_GBps)
             + per-layer fixed costs other than the policy program (which the max now holds)

    step_ms  = base_ms(tokens) + sum over layers + reap per-step fixed

An expert counts once per layer step whatever its token count: at decode batch sizes each
expert's tokens fit one M-block of the fused kernel, so its weights are read once
(``missed_experts`` of the bench's CPU-path counters are distinct experts per layer step, and
the bs8 link law holds with distinct experts, not pairs). At batch 32 an expert rarely gets
more tokens than one block holds (16 at small M); one that does is read once per block, which
this model undercounts. Which steps have CPU experts, and how many pairs, is the server's
split rule (``clock_arms.SplitRule``: any share up to ``max_tokens`` tokens, at most
``pair_budget`` pairs up to ``max_step_tokens``, none past it -- issue 26); the CPU's cost grows
with its pairs by ``cpu_pair_ms`` each, the link's does not. ``cpu_layer_ms`` was measured at one
token (``split_kernel_h200.json``); the split's [pairs, pairs] tables cost more at 256 pairs, not
yet measured (``scripts/gpu_split_bench.py``). ``base_ms`` is everything else
(attention, dense layers, sampling, launch gaps): the all-GPU step minus its ``hbm_ms``,
interpolated linearly in the token count between the calibration points.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

_MB = 1e6  # bytes per MB; GB/s = 1e9 bytes/s = 1e6 bytes/ms


class ClockError(ValueError):
    pass


@dataclass(frozen=True)
class Clock:
    """Step-time parameters (ms, GB/s = 1e9 bytes/s). ``provenance`` maps a field to where it comes from."""

    base_ms: tuple[tuple[int, float], ...]
    """(tokens, ms) points of the non-MoE step cost; linear between them, flat outside."""
    hbm_GBps: float
    link_GBps: float
    promote_GBps: float
    cpu_GBps: float
    host_dram_GBps: float
    cpu_fixed_ms: float = 0.0
    """Per layer step that gives the CPU work: the team's pickup, its tail, the merge's poll."""
    cpu_pair_ms: float = 0.0
    promote_overlap: float = 0.0
    """Share of the promotion copies hidden under compute (0: serialized before the fused kernel)."""
    reap_step_ms: float = 0.0
    """Per step of any reap arm: the remap/capture and accounting kernels."""
    cache_layer_ms: float = 0.0
    """Per layer step with the online cache: its policy program."""
    cpu_layer_ms: float = 0.0
    """Per layer step with the CPU path: its split-and-post and wait-merge programs."""
    expert_bytes: int = 0
    """Bytes of one expert of the shape this clock was calibrated on (a default for replays of small traces)."""
    name: str = ""
    provenance: dict[str, Any] = field(default_factory=dict, compare=False)
    fitted: tuple[str, ...] = ()
    """Fields fitted to step times (the rest measured); ``provenance['fit']`` says on which arms."""

    def __post_init__(self) -> None:
        rates = (self.hbm_GBps, self.link_GBps, self.promote_GBps, self.cpu_GBps, self.host_dram_GBps)
        if min(rates) <= 0:
            raise ClockError(f"pipe rates must be positive: {rates}")
        if not self.base_ms or any(t < 1 or ms < 0 for t, ms in self.base_ms):
            raise ClockError(f"base_ms needs (tokens >= 1, ms >= 0) points: {self.base_ms}")
        if min(self.cpu_fixed_ms, self.cpu_pair_ms, self.reap_step_ms, self.cache_layer_ms, self.cpu_layer_ms) < 0:
            raise ClockError("fixed costs must be >= 0")
        if not 0.0 <= self.promote_overlap <= 1.0:
            raise ClockError(f"promote_overlap must be in [0, 1]: {self.promote_overlap}")

    def base(self, tokens: int) -> float:
        pts = sorted(self.base_ms)
        return float(np.interp(tokens, [t for t, _ in pts], [ms for _, ms in pts]))

    def replace(self, **changes: Any) -> "Clock":
        return Clock(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["base_ms"] = {str(t): ms for t, ms in self.base_ms}
        d["fitted"] = list(self.fitted)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Clock":
        try:
            base = tuple(sorted((int(t), float(ms)) for t, ms in dict(d["base_ms"]).items()))
            kw = {f.name: d[f.name] for f in fields(cls) if f.name in d and f.name not in ("base_ms", "fitted")}
            return cls(base_ms=base, fitted=tuple(d.get("fitted", ())), **kw)
        except (KeyError, TypeError, ValueError) as exc:
            raise ClockError(f"not a step-time calibration: {exc}") from None


def load_clock(path: str | Path) -> Clock:
    """The calibration file's ``clock`` object (or the file itself when it is one)."""
    path = Path(path)
    if not path.is_file():
        raise ClockError(f"calibration file not found: {path}")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ClockError(f"{path}: not JSON ({exc})") from None
    return Clock.from_json(data.get("clock", data))


@dataclass
class StepCounts:
    """What one step moved, per MoE layer (float arrays of length L): distinct experts, not pairs; fractions of
    experts where a sliced split (``clock_arms.SplitRule.slices``) puts part of one on each pipe, or stock offload
    keeps part of a layer on the GPU."""

    tokens: int
    resident: np.ndarray
    """Routed experts read from a GPU slot (hits, and promoted experts read after their copy)."""
    link: np.ndarray
    """Missed experts the fused kernel reads over the link."""
    cpu: np.ndarray
    """Missed experts the host CPU computes."""
    cpu_pairs: np.ndarray
    """Token-expert pairs the CPU computes (an expert it computes a slice of counts all its pairs)."""
    promoted: np.ndarray
    """Experts copied into a slot this step (before the fused kernel)."""
    cache: bool = False
    cpu_path: bool = False
    reap: bool = True
    promote_beside_cpu: bool = False
    """The fast order (split first): the CPU's job is posted before the cache's policy program, so the program, its
    copies and the fused kernel run on the GPU side while the CPU computes its share."""
    background: np.ndarray | None = None
    """Experts the CPU computes this step and a copy stream promotes beside it (published next step): they hold
    the link across the step and a second DRAM read in their layer, not the GPU side (issue 25's design for
    off-critical-path promotions; a prediction)."""

    @classmethod
    def zeros(cls, layers: int, tokens: int, **flags: bool) -> "StepCounts":
        z = lambda: np.zeros(layers)  # noqa: E731
        return cls(tokens, z(), z(), z(), z(), z(), **flags)


@dataclass(frozen=True)
class Breakdown:
    """One step's ms by where it went; ``total`` is their sum (the pipes' share is the per-layer max)."""

    base: float
    hidden_hbm: float
    """Layers where the resident blocks outlast the host pipes."""
    link: float
    cpu: float
    host_dram: float
    promote: float
    fixed: float

    @property
    def total(self) -> float:
        return self.base + self.hidden_hbm + self.link + self.cpu + self.host_dram + self.promote + self.fixed

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "total": self.total}


def step_ms(clock: Clock, c: StepCounts, expert_bytes: int) -> Breakdown:
    """The step's milliseconds (see module doc); each layer's pipe share is booked to its slowest pipe."""
    mb = expert_bytes / _MB  # MB per expert; MB / (GB/s) = ms
    hbm = c.resident * mb / clock.hbm_GBps
    link = c.link * mb / clock.link_GBps
    cpu = np.where(c.cpu > 0, clock.cpu_fixed_ms, 0.0) + c.cpu * mb / clock.cpu_GBps + c.cpu_pairs * clock.cpu_pair_ms
    copies = (1.0 - clock.promote_overlap) * c.promoted * mb / clock.promote_GBps
    layers = len(c.resident)
    policy = clock.cache_layer_ms if c.cache else 0.0
    if c.promote_beside_cpu:  # GPU side = policy program, copies, then the kernel; beside it the CPU; all reads from one DRAM
        background = np.zeros(layers) if c.background is None else c.background
        # a background expert is read twice from DRAM: by the CPU computing it and by its copy
        host = (c.link + c.cpu + c.promoted + background) * mb / clock.host_dram_GBps
        # the split posts the CPU's job before the cache's policy program runs (server_ext/layer.py), so the
        # program is GPU-side work the CPU's share hides, not a fixed cost in series
        gpu = policy + copies + np.maximum(hbm, link)
        pipes = np.stack([gpu, cpu, host])
        which, worst = np.argmax(pipes, axis=0), pipes.max(axis=0)
        on_gpu = which == 0
        kernel_hbm = on_gpu & (hbm >= link)
        share = [float(hbm[kernel_hbm].sum()), float(link[on_gpu & ~kernel_hbm].sum()), float(worst[which == 1].sum()),
                 float(worst[which == 2].sum())]
        promote = float(copies[on_gpu].sum())
        policy_paid = policy * float(on_gpu.sum())  # where the CPU or the DRAM binds, the max hides it
    else:
        host = (c.link + c.cpu) * mb / clock.host_dram_GBps
        pipes = np.stack([hbm, link, cpu, host])  # [4, L]
        which = np.argmax(pipes, axis=0)
        worst = pipes.max(axis=0)
        share = [float(worst[which == i].sum()) for i in range(4)]
        promote = float(copies.sum())
        policy_paid = policy * layers
    fixed = (clock.reap_step_ms if c.reap else 0.0) + layers * (clock.cpu_layer_ms if c.cpu_path else 0.0) + policy_paid
    if c.background is not None and c.background.any():
        # background copies run on a copy stream across the step (published next step): the step lasts at least
        # as long as everything that crosses the link (whole copies: an overlapped copy still holds the link)
        wire = float((c.background + c.promoted).sum() * mb / clock.promote_GBps + link.sum())
        busy = clock.base(c.tokens) + share[0] + share[1] + share[2] + share[3] + promote + fixed
        promote += max(0.0, wire - busy)
    return Breakdown(clock.base(c.tokens), share[0], share[1], share[2], share[3], promote, fixed)


def base_from_all_gpu(all_gpu_ms: float, resident_experts: float, expert_bytes: int, hbm_GBps: float) -> float:
    """``base_ms`` at one token count from a measured all-GPU step: its time minus its resident reads."""
    return all_gpu_ms - resident_experts * expert_bytes / _MB / hbm_GBps
