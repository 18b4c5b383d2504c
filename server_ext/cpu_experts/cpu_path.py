"""The CPU expert path of one MoE layer (issue 16): split, stage, host compute, merge.

Per decode-sized step (at most ``max_tokens`` tokens, or up to ``max_step_tokens`` with at most
``pair_budget`` missed pairs to the CPU: ``split``'s module doc; prefill keeps the plain path), after the step's ids
are remapped and before the online cache's promotions (composed mode: the CPU takes the coldest
misses by the cache's scores, the cache promotes from the link's share -- a miss is promoted, read
over the link, or computed on the CPU: one decision each):

1. the split on the device chooses which missed experts the CPU computes so that the link's and
   the CPU's shares finish together (cost model from measured rates);
2. the CPU pairs' ids point the fused kernel at a resident row instead (HBM, ~free), so their
   host rows never cross the link; the step's inputs are staged for the host and the step is
   posted to the CPU team (``cpu_experts.team``) -- on CUDA all of it one Triton program;
3. the team computes the CPU pairs from the host rows while the GPU kernel reads the link's
   share; 4. ``merge`` waits for the team and puts its outputs into the kernel's per-(token, k)
   cache just before vLLM's ``moe_sum``, so the k-sum keeps its stock order. A wait that times out
   never merges the team's unfinished rows: the pair is recomputed on the device from its host row
   over the link, counted (``wait_timeouts``, in ``/metrics``) and logged by the worker.

Outputs differ from stock only by the CPU's arithmetic on the CPU pairs (bf16 tolerance, opt-in).
Counters: on the device ``[missed experts, CPU experts, missed pairs, CPU pairs]`` summed over
steps; on the host the jobs' busy time and bytes (CPU GB/s achieved).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from ..config import ResidencyConfigError, _bool_env, _float_env, _int_env
from .kernel import CpuThreads
from .quant import FP8_DTYPES, IGNORED_SIDE, fp8_scale_names
from .split import CostModel, plan_split
from .step import BankRows, CpuStep, Staging
from .team import WAIT_POLLS, spin_us_from_env

ENV_CPU_EXPERTS = "REAP_CPU_EXPERTS"
ENV_LINK_GBPS = "REAP_CPU_EXPERTS_LINK_GBPS"
ENV_CPU_GBPS = "REAP_CPU_EXPERTS_CPU_GBPS"
ENV_FIXED_US = "REAP_CPU_EXPERTS_FIXED_US"
ENV_PAIR_US = "REAP_CPU_EXPERTS_PAIR_US"
ENV_MAX_TOKENS = "REAP_CPU_EXPERTS_MAX_TOKENS"
ENV_MAX_STEP_TOKENS = "REAP_CPU_EXPERTS_MAX_STEP_TOKENS"
ENV_PAIR_BUDGET = "REAP_CPU_EXPERTS_PAIR_BUDGET"
COUNTERS = ("missed_experts", "cpu_experts", "missed_pairs", "cpu_pairs", "wait_timeouts")
RATE_UPDATES_KEPT = 16
MAX_STEP_PAIRS = 256  # (tokens x top-k) of the largest step the path joins: its tables and the split's keys are sized for it
# Steps of 9-32 tokens (batched decode) join under the pair budget by default: at batch 32 many missed experts
# get one or two tokens, and the CPU's cost of such an expert is its bytes, like the link's. The split of such a
# step runs in expert space (split_triton: one sort over [E] keys), not in [pairs, pairs] tables, which took 237 us
# per layer step at 32 tokens on the H200 (2026-12-03, scripts/gpu_cpu_path_check.py).
# --cpu-experts-max-step-tokens 8 (= max_tokens): only steps up to max_tokens join.
DEFAULT_STEP_TOKENS = 32


CpuPathConfigError = ResidencyConfigError  # the settings' errors are residency settings' errors

_CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_expert_weights(layer: int, weights: Mapping[str, torch.Tensor], quantization: str | None = None) -> None:
    """Refuse at load what the CPU expert kernel cannot compute: it reads unquantized ``w13_weight`` /
    ``w2_weight`` rows as they are, or float8_e4m3fn rows with their weight scales (per-tensor,
    per-shard or block: ``quant.py``); any other quantized layout (packed 4-bit, zero points, FP8
    without scales) would give wrong outputs, not an error, if it were let through.
    ``quantization`` (the model's, if any) only names the cause in the message.
    """
    dtypes = {n: t.dtype for n, t in weights.items() if n in ("w13_weight", "w2_weight")}
    fp8 = len(dtypes) == 2 and all(d in FP8_DTYPES for d in dtypes.values())
    odd = {} if fp8 else {n: str(d).replace("torch.", "") for n, d in dtypes.items() if d not in _CPU_KERNEL_DTYPES}
    side = sorted(n for n in weights if "scale" in n or "zero" in n)
    found = fp8_scale_names(weights) if fp8 else {}
    scales = [n for n in side if n not in {*found.values(), *(IGNORED_SIDE if fp8 else ())}]
    missing = [m for m in ("w13", "w2") if fp8 and m not in found]
    if len(dtypes) < 2 or odd or scales or missing:
        what = ", ".join(filter(None, [f"quantization={quantization!r}" if quantization else "",
                                       f"expert weights {odd}" if odd else "", f"per-expert tensors {scales}" if scales else "",
                                       f"float8 experts without {missing} weight scales" if missing else "",
                                       "no w13_weight/w2_weight" if len(dtypes) < 2 else ""]))
        raise CpuPathConfigError(
            f"--cpu-experts ({ENV_CPU_EXPERTS}=1) computes unquantized bf16 experts and FP8 (e4m3fn) experts with their weight "
            f"scales; layer {layer} has {what}. Serve this model without --cpu-experts (misses then read the host rows over the "
            f"link), or serve an unquantized or FP8 checkpoint")


@dataclass(frozen=True)
class CpuPathSettings:
    """What the user set (None: measured at start-up)."""

    enabled: bool = False
    link_GBps: float | None = None
    cpu_GBps: float | None = None
    fixed_us: float = 25.0
    """Per layer step: the team's pickup and grouping, its last items' tail, the merge's poll."""
    pair_us: float = 1.0
    max_tokens: int = 8
    """Steps up to this many tokens: the CPU may take any of their misses."""
    max_step_tokens: int | None = None
    """Larger steps up to this many tokens join under the pair budget (None: ``DEFAULT_STEP_TOKENS``;
    at most ``MAX_STEP_PAIRS`` / top-k, never below ``max_tokens``; equal to ``max_tokens``: none join)."""
    pair_budget: int | None = None
    """Most missed pairs the CPU takes in a step past ``max_tokens`` (None: ``max_tokens`` x top-k,
    the pairs of the largest unbudgeted step, so the CPU's tables are no larger than before)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "CpuPathSettings":
        env = os.environ if env is None else env
        return cls(
            enabled=_bool_env(env, ENV_CPU_EXPERTS, False),
            link_GBps=_float_env(env, ENV_LINK_GBPS, None, 1e-3, 1e6),
            cpu_GBps=_float_env(env, ENV_CPU_GBPS, None, 1e-3, 1e6),
            fixed_us=_float_env(env, ENV_FIXED_US, 25.0, 0.0, 1e6) or 0.0,
            pair_us=_float_env(env, ENV_PAIR_US, 1.0, 0.0, 1e6) or 0.0,
            max_tokens=_int_env(env, ENV_MAX_TOKENS, 8, 1) or 8,
            max_step_tokens=_int_env(env, ENV_MAX_STEP_TOKENS, None, 1),
            pair_budget=_int_env(env, ENV_PAIR_BUDGET, None, 1),
        )

    def step_tokens(self, top_k: int) -> int:
        """The largest step (tokens) the CPU takes part in: the rows of the layer's tables."""
        if self.max_step_tokens is not None:
            return self.max_step_tokens
        return max(self.max_tokens, min(DEFAULT_STEP_TOKENS, MAX_STEP_PAIRS // max(top_k, 1)))

    def budget(self, top_k: int) -> int:
        """The pair budget of a step past ``max_tokens``."""
        return self.max_tokens * top_k if self.pair_budget is None else self.pair_budget

    def table_pairs(self, top_k: int) -> int:
        """Most CPU pairs of any step: the CPU job's scratch (its grouping, activations) holds this many."""
        budgeted = self.step_tokens(top_k) > self.max_tokens
        return max(self.max_tokens * top_k, self.budget(top_k) if budgeted else 0)

    def cost(self, link_GBps: float, cpu_GBps: float, *, top_k: int) -> CostModel:
        return CostModel(
            link_GBps=self.link_GBps or link_GBps,
            cpu_GBps=self.cpu_GBps or cpu_GBps,
            cpu_fixed_s=self.fixed_us * 1e-6,
            cpu_per_pair_s=self.pair_us * 1e-6,
            max_tokens=self.max_tokens,
            max_step_tokens=self.step_tokens(top_k),
            pair_budget=self.budget(top_k),
        )


def check_step_pairs(settings: CpuPathSettings, top_k: int) -> None:
    """The settings must fit the split's [pairs, pairs] tables and each other: checked at load and by ``serve``."""
    max_tokens, step, budget = settings.max_tokens, settings.step_tokens(top_k), settings.budget(top_k)
    if max_tokens * top_k > MAX_STEP_PAIRS:
        raise CpuPathConfigError(
            f"{ENV_MAX_TOKENS}={max_tokens} with top-{top_k} routing gives {max_tokens * top_k} (token, expert) "
            f"pairs per step; the CPU path's split takes at most {MAX_STEP_PAIRS} (it is for decode-sized steps): "
            f"use at most {MAX_STEP_PAIRS // top_k} tokens")
    if step < max_tokens:
        raise CpuPathConfigError(
            f"{ENV_MAX_STEP_TOKENS}={step} is below {ENV_MAX_TOKENS}={max_tokens}: steps up to {ENV_MAX_TOKENS} tokens "
            f"already take part; set {ENV_MAX_STEP_TOKENS} to at least {max_tokens} (equal: no budgeted steps)")
    if step * top_k > MAX_STEP_PAIRS:
        raise CpuPathConfigError(
            f"{ENV_MAX_STEP_TOKENS}={step} with top-{top_k} routing gives {step * top_k} (token, expert) pairs per step; "
            f"the CPU path's split takes at most {MAX_STEP_PAIRS}: use at most "
            f"{MAX_STEP_PAIRS // top_k} tokens")
    if settings.pair_budget is not None and step == max_tokens:
        raise CpuPathConfigError(
            f"{ENV_PAIR_BUDGET}={budget} applies only to steps past {ENV_MAX_TOKENS}={max_tokens} tokens, and none take part: "
            f"set {ENV_MAX_STEP_TOKENS} above {max_tokens} (at most {MAX_STEP_PAIRS // top_k}) or leave {ENV_PAIR_BUDGET} unset")
    if budget > step * top_k:
        raise CpuPathConfigError(
            f"{ENV_PAIR_BUDGET}={budget} exceeds the {step * top_k} (token, expert) pairs of the largest step the CPU "
            f"takes part in ({ENV_MAX_STEP_TOKENS}={step} x top-{top_k}): use at most {step * top_k}")


class LayerCpuPath:
    """One layer's CPU expert path: the split on the device, the CPU step, the merge."""

    def __init__(self, bank: BankRows, top_k: int, filler_row: int, settings: CpuPathSettings, cost: CostModel,
                 threads: CpuThreads, device: torch.device, staging: Staging | None = None, num_experts: int | None = None,
                 fused: bool | None = None):
        """``num_experts``: the layer's logical experts when the bank has fewer host rows (RAM complement:
        a missed expert's host row is where the routing table points, not ``row_offset + e``). ``fused``
        (None: on CUDA): the two Triton programs, not ``plan_split``'s torch ops (True on CPU: interpreted)."""
        check_step_pairs(settings, top_k)
        self.bank = bank
        self.num_experts = bank.num_experts if num_experts is None else num_experts
        self.top_k = top_k
        self.filler_row = filler_row
        self.settings = settings
        self.device = device
        self.rows = settings.step_tokens(top_k)  # the largest step the CPU takes part in: every table has its rows
        self.step_job = CpuStep(bank, self.rows, top_k, threads, staging, max_pairs=settings.table_pairs(top_k))
        # counters[:4] summed by the split, [4] by the merge's poll (timeouts)
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64, device=device)
        # CUDA: split + stage + post as one Triton program, wait + merge as another (split_triton);
        # elsewhere plan_split's torch ops and a post-and-wait from the host.
        self.fused = device.type == "cuda" if fused is None else fused
        self.expected = torch.zeros(1, dtype=torch.int64, device=device)  # the seq this layer's last step was posted as
        self.cpu_pairs = torch.zeros(self.rows, top_k, dtype=torch.bool, device=device)
        self.all_rows = torch.full((1,), self.rows, dtype=torch.int32, device=device)
        self.cost = cost
        self._pending: torch.Tensor | None = None
        self.measured: dict[str, float] = {}
        self.rate_updates: list[float] = []
        """CPU GB/s the cost model took while serving, newest last (``set_cpu_GBps``)."""
        self.wait_limit = WAIT_POLLS
        # set by the merge kernel when it gave up waiting for the team (mapped: read without a sync)
        self._timeout_flag_host, self._timeout_flag = self.step_job.staging.alloc((1,), torch.int32)
        self._timeout_flag_view = self._timeout_flag_host.numpy()  # read after every step: numpy's index is ~20x torch's
        # Fused: the expert-space split's scratch (2 KB at E = 128) and where the merge recomputes a pair the team
        # did not finish in time (split_triton.Recompute), made at load: not in a graph capture, and before vLLM
        # measures free memory (the recompute scratch is [rows x top-k, I] fp32)
        self.split_scratch: torch.Tensor | None = None
        self.recompute: Any = None
        if self.fused:
            from .split_triton import Recompute, scratch_words

            job, b = self.step_job, self.bank
            self.split_scratch = torch.zeros(scratch_words(self.num_experts), dtype=torch.int64, device=device)
            quant = b.quant.to(device) if b.quant is not None else None  # FP8: the scales where the kernel reads them
            self.recompute = Recompute(job.x, job.ids.view(-1), job.weights.view(-1), b.w13, b.w2, b.row_offset, top_k,
                                       torch.zeros(self.rows * top_k, b.inter, dtype=torch.float32, device=device),
                                       self._timeout_flag, job.team.stalled_on_device, quant)

    @property
    def cost(self) -> CostModel:
        return self._cost

    @cost.setter
    def cost(self, cost: CostModel) -> None:
        k, cap = self.top_k, self.step_job.max_pairs
        most = max(cost.pair_limit(cost.max_tokens, k), cost.pair_limit(cost.step_tokens, k))
        if cost.step_tokens > self.rows or most > cap:
            raise ValueError(f"the cost model's steps (up to {cost.step_tokens} tokens, {most} CPU pairs) do not fit the "
                             f"layer's tables ({self.rows} tokens, {cap} CPU pairs)")
        self._cost = cost
        self.cost_tensor = torch.tensor(self._cost_row(cost), dtype=torch.float64, device=self.device)

    def _cost_row(self, cost: CostModel) -> list[float]:
        """What the fused split reads: link s per expert, CPU fixed s, CPU s per expert, CPU s per pair."""
        b = self.bank.expert_bytes
        return [b / (cost.link_GBps * 1e9), cost.cpu_fixed_s, cost.cpu_per_expert_s + b / (cost.cpu_GBps * 1e9), cost.cpu_per_pair_s]

    def set_cpu_GBps(self, cpu_GBps: float) -> None:
        """Re-rate the CPU pipe while serving (``rates.py``). The fused split reads ``cost_tensor`` by address, so
        captured graphs keep it and only its CPU-per-expert word changes: one stream-ordered 8-byte copy from
        pinned memory, no host sync. A split that reads it meanwhile sees the old rate or the new one."""
        cost = replace(self._cost, cpu_GBps=float(cpu_GBps))  # validates the rate
        self._cost = cost
        word = torch.tensor(self._cost_row(cost)[2:3], dtype=torch.float64)
        if self.cost_tensor.is_cuda:
            word = word.pin_memory()
        self.cost_tensor[2:3].copy_(word, non_blocking=True)
        self.rate_updates.append(float(cpu_GBps))
        del self.rate_updates[:-RATE_UPDATES_KEPT]

    def takes(self, num_tokens: int) -> bool:
        """Whether a step of this many tokens (the graph's size) runs the split: up to the cost model's largest step."""
        return 0 < num_tokens <= self.cost.step_tokens

    def before_experts(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, phys: torch.Tensor,
                       host_offset: int, valid_rows: torch.Tensor | None = None, priority: torch.Tensor | None = None) -> torch.Tensor:
        """Split, stage and launch the CPU share of this step; the ids the GPU kernel should use.

        ``valid_rows`` [1] int32 (device): the step's real token rows, the rest being a captured
        graph's padding, which never goes to the CPU (None: every row is real). ``priority`` [E]
        float32 (composed mode: the online cache's scores): the CPU takes the coldest misses.
        The step's CPU pairs are ``pending_pairs`` until the merge.
        """
        job = self.step_job
        if valid_rows is None:
            valid_rows = self.all_rows
        if self.fused:
            from .split_triton import Post, split_and_stage

            t = int(topk_ids.shape[0])
            post = Post(x.contiguous(), job.x[:t], job.team.mailbox, self.expected, job.job_address(t),  # range-checks t
                        job.team.posted_on_device)
            gpu_ids = torch.empty_like(phys)
            cpu_pairs = self.cpu_pairs[:t]
            split_and_stage(topk_ids, phys, topk_weights, self.cost_tensor, valid_rows, host_offset, self.filler_row,
                            self.num_experts, gpu_ids, cpu_pairs, job.ids[:t], job.mask[:t], job.weights[:t], self.counters,
                            post, priority=priority, pair_limit=self.cost.pair_limit(t, self.top_k), pairs_first=self.cost.budgeted(t),
                            scratch=self.split_scratch)
        else:
            rows = torch.arange(topk_ids.shape[0], device=phys.device).view(-1, 1)
            missed = (phys >= host_offset) & (rows < valid_rows.to(phys.device))
            split = plan_split(topk_ids, missed, self.num_experts, self.bank.expert_bytes, self.cost, priority=priority)
            self.counters[:4].add_(torch.stack([(split.link_experts | split.cpu_experts).sum(), split.cpu_experts.sum(),
                                            missed.sum(), split.cpu_pairs.sum()]))
            # the CPU reads each of its pairs' host row: where the table points (RAM complement), e itself otherwise
            t = job.stage(x, torch.where(split.cpu_pairs, phys - host_offset, topk_ids), topk_weights, split.cpu_pairs)
            cpu_pairs = split.cpu_pairs
            gpu_ids = torch.where(cpu_pairs, torch.full_like(phys, self.filler_row), phys)
            job.run(t)
        self._pending = cpu_pairs
        return gpu_ids

    @property
    def pending_pairs(self) -> torch.Tensor | None:
        """[T, K] bool: the CPU's pairs of the step split last, until its merge (None: none pending)."""
        return self._pending

    def merge(self, per_k: torch.Tensor) -> torch.Tensor:
        """The fused kernel's per-k cache with this step's CPU outputs in place (no-op without a pending step)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return per_k
        t = pending.shape[0]
        if not self.fused:
            return self.step_job.merge(per_k.view(t, self.top_k, -1), pending).view(per_k.shape)
        from .split_triton import wait_and_merge

        rows = per_k if per_k.is_contiguous() else per_k.contiguous()
        job = self.step_job
        wait_and_merge(rows.view(t * self.top_k, -1), job.out.view(-1, self.bank.hidden), pending.reshape(-1), job.team.mailbox,
                       self.expected, self.counters[4:], self.recompute, self.wait_limit)
        return rows.view(per_k.shape)

    def take_timeout_flag(self) -> bool:
        """True once after a merge gave up waiting for the team (pairs recomputed on the device); a
        host read of mapped memory, no sync (the step that set it may have finished just now)."""
        if self._timeout_flag_view[0] == 0:
            return False
        self._timeout_flag_view[0] = 0
        return True

    def abandon(self) -> bool:
        """After the experts ran: True if the merge took the step (a posted step the merge never
        waited for still finishes on the team, in order, before the next one)."""
        if self._pending is None:
            return True
        self._pending = None
        return False

    def stats(self) -> dict[str, int]:
        dev = dict(zip(COUNTERS, (int(v) for v in self.counters.tolist())))
        host = self.step_job.stats()  # the team's own counts
        return {**dev, **{f"host_{k}" if k in ("experts", "pairs") else k: v for k, v in host.items()}}

    def reset_stats(self) -> None:
        self.counters.zero_()
        self.step_job.reset_stats()


def summarize(paths: list[LayerCpuPath]) -> dict[str, Any]:
    """Totals over a worker's layers: shares of misses the CPU computed, CPU GB/s achieved, the cost model."""
    if not paths:
        return {"enabled": False}
    per_layer = [p.stats() for p in paths]
    tot = {k: sum(s[k] for s in per_layer) for k in per_layer[0]}
    cost = paths[0].cost
    return {
        "enabled": True,
        "layers": len(paths),
        **tot,
        "cpu_share_of_missed_experts": tot["cpu_experts"] / tot["missed_experts"] if tot["missed_experts"] else None,
        "cpu_share_of_missed_pairs": tot["cpu_pairs"] / tot["missed_pairs"] if tot["missed_pairs"] else None,
        "cpu_GBps_achieved": tot["bytes"] / tot["ns"] if tot["ns"] else None,
        "cpu_busy_us_per_step_with_work": tot["ns"] / 1e3 / tot["steps_with_work"] if tot["steps_with_work"] else None,
        "bad_id_layers": [i for i, s in enumerate(per_layer) if s["status"]],
        "device_seq_in_step": paths[0].step_job.team.seq_in_step(),
        "measured": paths[0].measured,
        "rate_updates": list(paths[0].rate_updates),  # CPU GB/s the split took while serving (rates.py), newest last
        "cost_model": {"link_GBps": cost.link_GBps, "cpu_GBps": cost.cpu_GBps, "cpu_fixed_s": cost.cpu_fixed_s,
                       "cpu_per_pair_s": cost.cpu_per_pair_s, "max_tokens": cost.max_tokens,
                       "max_step_tokens": cost.step_tokens, "pair_budget": cost.pair_budget},
        "threads": {"n": paths[0].step_job.threads.n, "cpus": list(paths[0].step_job.threads.cpus), "spin_us": spin_us_from_env()},
    }
