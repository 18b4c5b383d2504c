"""One MoE layer's CPU expert step: staging buffers, the native job, the merge into the k-sum.

Why a job object: the CPU's share of a step must run without Python (inside a captured CUDA graph
the device posts it to the CPU team's mailbox, ``team.py``), so everything it needs -- where the
device staged the step's ids, mask, routing weights and hidden states, where the bank's host rows
are, scratch space, counters -- lives in one C struct per captured token count.

Flow of a step (same order on CPU and CUDA; only *who posts and waits* differs):

1. staging: device ops copy ``x`` [T, H], logical ``topk_ids`` [T, K], ``topk_weights`` and the
   split's ``cpu_pairs`` mask into buffers the host can read (pinned + device-mapped on CUDA, so
   these are ordinary kernels: no memcpy node, graph-safe) -- ``stage`` here, or the CUDA split
   kernel itself (``split_triton``);
2. the team computes the job: posted from the host and waited for (``run``), or posted by the
   split kernel and waited for by the merge kernel;
3. merge: the fused kernel's per-(token, k) cache takes the CPU's outputs at the CPU pairs'
   places, before vLLM's own ``moe_sum`` -- the k-sum order stays stock.

The staging allocator is injected (``Staging``): plain CPU tensors, or ``cuda_host.MappedStaging``.
No vLLM import here.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from .kernel import CpuThreads, check_bank_dtypes, native_library, native_error
from .quant import CQuant, ExpertQuant
from .team import CpuTeam, PlainStaging, Staging, process_team

__all__ = ["BankRows", "CpuJob", "CpuStep", "PlainStaging", "Staging"]


class CpuJob(ctypes.Structure):
    """Mirror of ``reap_cpu_job`` in native_experts.c (field order and types must match)."""

    _p = ctypes.c_void_p
    _i = ctypes.c_int64
    _fields_ = [
        ("ids", _p), ("mask", _p), ("weights", _p), ("x", _p), ("out", _p), ("w13", _p), ("w2", _p),
        ("w13_row_stride", _i), ("w2_row_stride", _i), ("row_offset", _i), ("expert_bytes", _i),
        ("T", _i), ("K", _i), ("H", _i), ("I", _i), ("E", _i), ("nthreads", _i), ("max_pairs", _i),
        ("counts", _p), ("group_rows", _p), ("group_off", _p), ("pair_tok", _p), ("pair_dst", _p), ("group_done", _p), ("pair_w", _p),
        ("xs", _p), ("hs", _p), ("as_", _p), ("sel", _p),
        ("calls", _i), ("steps_with_work", _i), ("experts", _i), ("pairs", _i), ("ns", _i), ("bytes", _i), ("status", _i),
        ("quant", CQuant),
    ]


STAT_FIELDS = ("calls", "steps_with_work", "experts", "pairs", "ns", "bytes")


@dataclass(frozen=True)
class BankRows:
    """The bank tensors the CPU reads (host-addressable rows) and where expert ``e``'s host row is."""

    w13: torch.Tensor  # [R, 2I, H] bf16 or float8_e4m3fn
    w2: torch.Tensor  # [R, H, I]
    row_offset: int  # bank row of expert e = row_offset + e (full host copy)
    num_experts: int
    quant: ExpertQuant | None = None  # FP8 rows: their scales per bank row (host copy)

    def __post_init__(self) -> None:
        r, i2, h = self.w13.shape
        if self.w2.shape != (r, h, i2 // 2) or i2 % 2:
            raise ValueError(f"bank shapes w13 {tuple(self.w13.shape)} w2 {tuple(self.w2.shape)} are not [R, 2I, H] / [R, H, I]")
        check_bank_dtypes(self.w13, self.w2, self.quant)
        if self.quant is not None:
            self.quant.to_c()  # host scales
        if self.w13[0].stride() != (h, 1) or self.w2[0].stride() != (i2 // 2, 1):
            raise ValueError("the CPU expert path needs row-contiguous bank rows")
        if self.row_offset < 0 or self.row_offset + self.num_experts > r:
            raise ValueError(f"host rows {self.row_offset}..{self.row_offset + self.num_experts} exceed the bank's {r} rows")

    @property
    def hidden(self) -> int:
        return int(self.w13.shape[2])

    @property
    def inter(self) -> int:
        return int(self.w2.shape[2])

    @property
    def expert_bytes(self) -> int:
        """Weight bytes of one expert (what a miss moves over the link or the CPU reads; scales not counted)."""
        return self.w13[0].numel() * self.w13.element_size() + self.w2[0].numel() * self.w2.element_size()


class CpuStep:
    """A layer's CPU expert step for up to ``max_tokens`` tokens with ``top_k`` experts each, of
    which at most ``max_pairs`` (default: all) are the CPU's: the staging is [max_tokens, top_k],
    the grouping and activation scratch [max_pairs] (the split's pair budget keeps to it; the
    native step refuses a step past it rather than write past its scratch)."""

    def __init__(self, bank: BankRows, max_tokens: int, top_k: int, threads: CpuThreads, staging: Staging | None = None,
                 team: CpuTeam | None = None, max_pairs: int | None = None):
        lib = native_library()
        if lib is None:
            raise RuntimeError(f"the CPU expert path needs the native kernel, which did not build: {native_error()}")
        if int(lib.reap_cpu_job_size()) != ctypes.sizeof(CpuJob):
            raise RuntimeError(f"native job struct is {lib.reap_cpu_job_size()} bytes, the Python mirror {ctypes.sizeof(CpuJob)}")
        if max_tokens < 1 or top_k < 1:
            raise ValueError(f"max_tokens and top_k must be >= 1, got {max_tokens}, {top_k}")
        max_pairs = max_tokens * top_k if max_pairs is None else max_pairs
        if not 1 <= max_pairs <= max_tokens * top_k:
            raise ValueError(f"max_pairs must be in 1..{max_tokens * top_k} (the table's pairs), got {max_pairs}")
        if len(threads.cpus) > 1024 or threads.n > 1024:
            raise ValueError(f"the CPU expert team takes at most 1024 threads and cores, got {threads.n} / {len(threads.cpus)}")
        self.lib = lib
        self.bank = bank
        self.max_tokens = max_tokens
        self.top_k = top_k
        self.max_pairs = max_pairs
        self.threads = threads
        staging = staging or PlainStaging()
        self.staging = staging
        self.team = team or process_team(threads, staging)
        t, k, h, i = max_tokens, top_k, bank.hidden, bank.inter
        self._ids_h, self.ids = staging.alloc((t, k), torch.int32)
        self._mask_h, self.mask = staging.alloc((t, k), torch.uint8)
        self._w_h, self.weights = staging.alloc((t, k), torch.float32)
        self._x_h, self.x = staging.alloc((t, h), torch.bfloat16)
        self._out_h, self.out = staging.alloc((t, k, h), torch.bfloat16)
        pairs = max_pairs  # the CPU's pairs of one step, grouped by expert
        act = int(lib.reap_cpu_act_size())
        self._scratch = {
            "counts": torch.zeros(bank.num_experts + 1, dtype=torch.int32),
            "group_rows": torch.zeros(pairs, dtype=torch.int32),
            "group_off": torch.zeros(pairs + 1, dtype=torch.int32),
            "pair_tok": torch.zeros(pairs, dtype=torch.int32),
            "pair_dst": torch.zeros(pairs, dtype=torch.int32),
            "group_done": torch.zeros(pairs, dtype=torch.int32),
            "pair_w": torch.zeros(pairs, dtype=torch.float32),
            "xs": torch.zeros(t * h * act, dtype=torch.uint8),
            "hs": torch.zeros(pairs * 2 * i, dtype=torch.float32),
            "as_": torch.zeros(pairs * i * act, dtype=torch.uint8),
            "sel": torch.zeros(t * k, dtype=torch.int32),  # the whole table's ids / mask read once (native_experts.c plan_job)
        }
        self._jobs: dict[int, CpuJob] = {}

    def job(self, num_tokens: int) -> CpuJob:
        """The job of a step with ``num_tokens`` tokens (one per captured size; addresses never move)."""
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"{num_tokens} tokens: the CPU expert step takes 1..{self.max_tokens}")
        job = self._jobs.get(num_tokens)
        if job is None:
            b = self.bank
            job = CpuJob(
                ids=self._ids_h.data_ptr(), mask=self._mask_h.data_ptr(), weights=self._w_h.data_ptr(),
                x=self._x_h.data_ptr(), out=self._out_h.data_ptr(), w13=b.w13.data_ptr(), w2=b.w2.data_ptr(),
                w13_row_stride=b.w13.stride(0), w2_row_stride=b.w2.stride(0), row_offset=b.row_offset,
                expert_bytes=b.expert_bytes, T=num_tokens, K=self.top_k, H=b.hidden, I=b.inter, E=b.num_experts,
                nthreads=self.threads.n, max_pairs=self.max_pairs, **{name: t.data_ptr() for name, t in self._scratch.items()},
                quant=b.quant.to_c() if b.quant is not None else CQuant(),
            )
            self._jobs[num_tokens] = job
        return job

    def job_address(self, num_tokens: int) -> int:
        return ctypes.addressof(self.job(num_tokens))

    def stage(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, cpu_pairs: torch.Tensor) -> int:
        """Device ops writing the step's inputs where the job reads them; returns T."""
        t = int(topk_ids.shape[0])
        if topk_ids.shape != (t, self.top_k) or x.shape != (t, self.bank.hidden):
            raise ValueError(f"step shapes x {tuple(x.shape)} ids {tuple(topk_ids.shape)} do not fit [T, {self.bank.hidden}] / [T, {self.top_k}]")
        self.job(t)  # range check before any write
        self.ids[:t].copy_(topk_ids)
        self.mask[:t].copy_(cpu_pairs)
        self.weights[:t].copy_(topk_weights)
        self.x[:t].copy_(x)
        return t

    def run(self, num_tokens: int) -> None:
        """The CPU's share of a staged step, posted from the host; returns when the team has done it."""
        self.team.run(self.job_address(num_tokens))
        self.check()

    def check(self) -> None:
        bad = [t for t, j in self._jobs.items() if j.status == -1]
        if bad:
            raise RuntimeError(f"CPU expert step saw an expert id outside 0..{self.bank.num_experts - 1} (tokens {bad})")
        over = [t for t, j in self._jobs.items() if j.status]
        if over:
            raise RuntimeError(f"CPU expert step was given more than its {self.max_pairs} pairs (tokens {over}): the split broke its pair budget")

    def merge(self, per_k: torch.Tensor, cpu_pairs: torch.Tensor) -> torch.Tensor:
        """The fused kernel's [T, K, H] per-(token, k) outputs with the CPU pairs' places replaced."""
        t = per_k.shape[0]
        return torch.where(cpu_pairs[:t, :, None], self.out[:t], per_k.view(t, self.top_k, -1))

    def stats(self) -> dict[str, int]:
        """Counters summed over the jobs (host side: calls, experts and pairs computed, busy ns, bytes read)."""
        return {f: sum(int(getattr(j, f)) for j in self._jobs.values()) for f in (*STAT_FIELDS, "status")}

    def reset_stats(self) -> None:
        for j in self._jobs.values():
            for f in (*STAT_FIELDS, "status"):
                setattr(j, f, 0)

