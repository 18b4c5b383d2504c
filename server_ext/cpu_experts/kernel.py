"""CPU computation of a step's CPU-assigned (token, expert) pairs from the host bank rows.

Why: the bytes of a non-resident expert already sit in host memory (the bank's host rows, plain
row-major ``w13 [2I, H]`` and ``w2 [H, I]`` bf16). Computing there moves 4 KB of hidden state per
pair across the link instead of the expert's 9 MB. The kernel reads the rows in place: no second
(repacked) copy of the bank, which the host's RAM could not hold next to the first.

Semantics are vLLM's fused MoE on bf16, per pair: ``h = bf16(x W13^T)``, ``a = bf16(bf16(silu(
h_gate)) * h_up)``, ``y = bf16(fp32(a W2^T) * routing_weight)`` -- the weight multiplies the fp32
accumulator of the second GEMM (``MUL_ROUTED_WEIGHT``), never the input. One output per pair,
so the GPU adds them into the k-sum at their own places (``split.combine``).

Backends:
  ``torch``  reference: weights widened to fp32, exact fp32 accumulation (slow; tests only).
  ``linear`` ``F.linear`` on the bf16 rows: oneDNN's brgemm matmul on the plain ``ba`` weights
             (avx512_core_bf16 / AMX), no weight copy; the second GEMM rounds to bf16 before the
             routing weight (one extra rounding, within bf16).
  ``native`` ``native_experts.c`` built on first use with the machine's compiler for its own ISA
             (AVX-512 widening + FMA; plain C elsewhere), an OpenMP team of its own whose threads
             pin to ``CpuThreads.cpus``. Chosen by ``auto`` when it builds. Serving runs the
             same dot kernels from the persistent team of ``team.py`` instead.
kt-kernel was evaluated: its MoE classes copy/repack the weights into their own buffers at load
and return the k-sum, not per-pair outputs; its plain-layout MLP/linear are not bound to Python.

Threads: ``CpuThreads`` (env ``REAP_CPU_EXPERT_THREADS``, ``REAP_CPU_EXPERT_CPUS`` e.g. ``8-15``, or
``2-7;8-13`` for one list per local rank: ``cores.py``) names the cores the CPU expert path may use; give it cores vLLM's own threads do not use and call
``CpuExperts.run`` from one dedicated host thread (serving uses the team in ``team.py``).
The torch backends use torch's process-wide intra-op pool (``torch.set_num_threads``), so they
are for tests and comparison, not for serving next to vLLM.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .cores import ENV_CPUS, parse_core_list, rank_cpus
from .quant import FP8_DTYPES, ExpertQuant

BACKENDS = ("torch", "linear", "native")
_SRC = Path(__file__).with_name("native_experts.c")
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


@dataclass(frozen=True)
class CpuThreads:
    """Threads of the CPU expert path and the cores they pin to (empty: not pinned)."""

    n: int
    cpus: tuple[int, ...] = ()

    @staticmethod
    def parse_cpus(spec: str) -> tuple[int, ...]:
        """``"8-11,14"`` -> ``(8, 9, 10, 11, 14)`` (one list; ``cores.parse_core_list``)."""
        return parse_core_list(spec)

    @classmethod
    def from_env(cls, default_n: int | None = None, local_rank: int = 0, local_world: int = 1) -> "CpuThreads":
        """Local rank ``local_rank``'s cores from ``REAP_CPU_EXPERT_CPUS`` (per-rank lists or one list
        split by rank: ``cores.rank_cpus``) and ``REAP_CPU_EXPERT_THREADS`` threads (default: one per core)."""
        cpus = rank_cpus(os.environ.get(ENV_CPUS, ""), local_rank, local_world)
        n = int(os.environ.get("REAP_CPU_EXPERT_THREADS", "0")) or len(cpus) or default_n or len(os.sched_getaffinity(0))
        return cls(n=n, cpus=cpus)


@dataclass(frozen=True)
class PairBatch:
    """A step's CPU pairs grouped by expert: group g owns pairs ``offsets[g]:offsets[g + 1]``."""

    experts: torch.Tensor  # [G] int64, ascending
    rows: torch.Tensor  # [G] int32, bank row read for each group
    offsets: torch.Tensor  # [G + 1] int32
    tokens: torch.Tensor  # [P] int32, token of each pair
    weights: torch.Tensor  # [P] float32, routing weight of each pair
    flat: torch.Tensor  # [P] int64, token * K + k: the pair's place in the per-k cache

    @property
    def num_pairs(self) -> int:
        return int(self.tokens.numel())


def group_pairs(
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    cpu_pairs: torch.Tensor,
    row_of_expert: torch.Tensor | None = None,
) -> PairBatch:
    """Group the [T, K] pairs marked in ``cpu_pairs`` by expert (pairs keep (token, k) order).

    ``row_of_expert`` [E] maps an expert to the bank row holding it (``phys_map`` minus the host
    offset); identity when None.
    """
    k = topk_ids.shape[1]
    flat = torch.nonzero(cpu_pairs.reshape(-1), as_tuple=False).reshape(-1)
    experts_per_pair = topk_ids.reshape(-1)[flat].long()
    experts_per_pair, order = torch.sort(experts_per_pair, stable=True)
    flat = flat[order]
    experts, counts = torch.unique_consecutive(experts_per_pair, return_counts=True)
    offsets = torch.zeros(experts.numel() + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    rows = experts if row_of_expert is None else row_of_expert.long()[experts]
    return PairBatch(
        experts=experts,
        rows=rows.to(torch.int32),
        offsets=offsets,
        tokens=(flat // k).to(torch.int32),
        weights=topk_weights.reshape(-1)[flat].float().contiguous(),
        flat=flat,
    )


def silu_and_mul_bf16(h: torch.Tensor) -> torch.Tensor:
    """vLLM's CUDA ``silu_and_mul`` on bf16: silu rounded to bf16, then the bf16 product."""
    i = h.shape[-1] // 2
    s = F.silu(h[..., :i].float()).to(torch.bfloat16)
    return (s.float() * h[..., i:].float()).to(torch.bfloat16)


# --- the native library ----------------------------------------------------------------------

_native: ctypes.CDLL | None = None
_native_error: str | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("REAP_SWAP_CACHE", Path.home() / ".cache" / "reap_swap"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def native_library() -> ctypes.CDLL | None:
    """Build (once per source, compiler and CPU) and load ``native_experts.c``; None if impossible."""
    global _native, _native_error
    if _native is not None or _native_error is not None:
        return _native
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(_SRC.read_bytes() + " ".join(_CFLAGS).encode() + version.encode() + _cpu_flags().encode())
        path = _cache_dir() / f"native_experts_{key.hexdigest()[:16]}.so"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
                tmp_so = Path(tmp) / path.name
                subprocess.run([cc, *_CFLAGS, str(_SRC), "-o", str(tmp_so), "-lm"], check=True, capture_output=True, timeout=300)
                os.replace(tmp_so, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        _native_error = f"{exc!r} {detail.decode(errors='replace')[-500:]}"
        return None
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.reap_cpu_experts.argtypes = [p, i64, p, i64, p, p, i32, p, p, i32, p, i64, i32, i32, p, p, p, p, i32, p]
    lib.reap_cpu_experts.restype = i32
    lib.reap_cpu_experts_set_cpus.argtypes = [p, i32]
    lib.reap_cpu_experts_set_cpus.restype = i32
    lib.reap_cpu_job_size.restype = ctypes.c_size_t
    lib.reap_cpu_act_size.restype = ctypes.c_size_t
    lib.reap_mailbox_size.restype = ctypes.c_size_t
    lib.reap_team_start.argtypes = [p, p, i32, i32, i64]
    lib.reap_team_start.restype = i32
    lib.reap_team_stop.argtypes = []
    lib.reap_team_stop.restype = i32
    lib.reap_team_run.argtypes = [p, p, i64]
    lib.reap_team_run.restype = i32
    lib.reap_team_set_test_delay_us.argtypes = [i64]
    lib.reap_team_set_test_delay_us.restype = None
    lib.reap_job_set_test_clobber_ids.argtypes = [i32]
    lib.reap_job_set_test_clobber_ids.restype = None
    _native = lib
    return lib


def native_error() -> str | None:
    """Why the native backend is unavailable (None if it loaded or was never tried)."""
    return _native_error


# --- the computation -------------------------------------------------------------------------


class CpuExperts:
    """Computes PairBatches from the bank rows with one backend and one thread setting.

    The native backend's core pinning is process-wide (the last constructed instance's
    ``threads.cpus`` wins; empty restores the mask the process had) and applies to the thread that
    calls ``run`` as well as to its OpenMP team.
    """

    def __init__(self, backend: str = "auto", threads: CpuThreads | None = None) -> None:
        self.threads = threads or CpuThreads.from_env()
        if backend == "auto":
            backend = "native" if native_library() is not None else "linear"
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; one of {BACKENDS} or 'auto'")
        if backend == "native":
            lib = native_library()
            if lib is None:
                raise RuntimeError(f"native backend unavailable: {native_error()}")
            cpus = (ctypes.c_int * max(1, len(self.threads.cpus)))(*self.threads.cpus)
            lib.reap_cpu_experts_set_cpus(ctypes.cast(cpus, ctypes.c_void_p), len(self.threads.cpus))
        self.backend = backend
        self._scratch: dict[str, torch.Tensor] = {}

    def run(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        batch: PairBatch,
        out: torch.Tensor | None = None,
        quant: ExpertQuant | None = None,
    ) -> torch.Tensor:
        """[P, H] bf16 outputs of ``batch``'s pairs (group order) from ``x`` [T, H] bf16.

        ``w13`` [R, 2I, H] and ``w2`` [R, H, I] are the bank tensors (any rows beyond the batch's are
        never touched); each row's weights must be contiguous. bf16 rows, or float8_e4m3fn rows with
        ``quant`` (their scales per bank row; every backend computes ``(w * s)`` in fp32 against the
        bf16 activations).
        """
        p, h = batch.num_pairs, x.shape[1]
        i = w2.shape[2]
        if w13.shape[1:] != (2 * i, h) or w2.shape[1] != h:
            raise ValueError(f"bank shapes w13 {tuple(w13.shape)} w2 {tuple(w2.shape)} do not fit H={h}, I={i}")
        check_bank_dtypes(w13, w2, quant)
        if x.dtype != torch.bfloat16:
            raise ValueError(f"the CPU expert path takes bf16 hidden states, got {x.dtype}")
        if out is None:
            out = torch.empty(p, h, dtype=torch.bfloat16)
        if p == 0:
            return out
        if self.backend == "native":
            self._run_native(x, w13, w2, batch, out, quant)
        else:
            with _torch_threads(self.threads.n):
                self._run_torch(x, w13, w2, batch, out, exact=self.backend == "torch", quant=quant)
        return out

    def _run_torch(
        self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, batch: PairBatch, out: torch.Tensor, exact: bool,
        quant: ExpertQuant | None = None,
    ) -> None:
        offs = batch.offsets.tolist()
        for g, row in enumerate(batch.rows.tolist()):
            lo, hi = offs[g], offs[g + 1]
            xg = x.index_select(0, batch.tokens[lo:hi].long())
            wg = batch.weights[lo:hi, None]
            if quant is not None:  # both torch backends: the dequantized fp32 rows, fp32 accumulation
                hg = (xg.float() @ quant.dequantize("w13", w13, row).t()).to(torch.bfloat16)
                y = silu_and_mul_bf16(hg).float() @ quant.dequantize("w2", w2, row).t()
            elif exact:
                hg = (xg.float() @ w13[row].float().t()).to(torch.bfloat16)
                y = silu_and_mul_bf16(hg).float() @ w2[row].float().t()
            else:
                y = F.linear(silu_and_mul_bf16(F.linear(xg, w13[row])), w2[row]).float()
            out[lo:hi] = (y * wg).to(torch.bfloat16)

    def _buf(self, name: str, numel: int) -> torch.Tensor:
        t = self._scratch.get(name)
        if t is None or t.numel() < numel:
            t = torch.empty(numel, dtype=torch.float32)
            self._scratch[name] = t
        return t

    def _run_native(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, batch: PairBatch, out: torch.Tensor,
                    quant: ExpertQuant | None = None) -> None:
        p, h = batch.num_pairs, x.shape[1]
        i = w2.shape[2]
        if w13[0].stride() != (h, 1) or w2[0].stride() != (i, 1) or x.stride(1) != 1 or not out.is_contiguous():
            raise ValueError("native backend needs row-contiguous bank rows, x and out")
        xs, hs, acts = self._buf("xs", p * h), self._buf("hs", p * max(2 * i, h)), self._buf("as", p * i)
        rows, offs = batch.rows.contiguous(), batch.offsets.contiguous()
        toks, wts = batch.tokens.contiguous(), batch.weights.contiguous()
        cq = quant.to_c() if quant is not None else None
        rc = native_library().reap_cpu_experts(  # type: ignore[union-attr]
            w13.data_ptr(), w13.stride(0), w2.data_ptr(), w2.stride(0),
            rows.data_ptr(), offs.data_ptr(), rows.numel(),
            toks.data_ptr(), wts.data_ptr(), p,
            x.data_ptr(), x.stride(0), h, i,
            xs.data_ptr(), hs.data_ptr(), acts.data_ptr(), out.data_ptr(), self.threads.n,
            ctypes.addressof(cq) if cq is not None else None,
        )
        if rc != 0:
            raise RuntimeError(f"native CPU expert kernel failed ({rc})")


def check_bank_dtypes(w13: torch.Tensor, w2: torch.Tensor, quant: ExpertQuant | None) -> None:
    """bf16 rows without scales, or float8_e4m3fn rows with them: what every backend computes."""
    if quant is None:
        if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
            raise ValueError(f"the CPU expert path computes bf16 rows, or float8_e4m3fn rows with their scales; got "
                             f"{w13.dtype} / {w2.dtype} without scales")
        return
    if w13.dtype not in FP8_DTYPES or w2.dtype not in FP8_DTYPES:
        raise ValueError(f"scales were given for {w13.dtype} / {w2.dtype} rows; the CPU kernel decodes float8_e4m3fn")
    for name, w, m in (("w13", w13, quant.w13), ("w2", w2, quant.w2)):
        rows, n, k = w.shape
        if m.scales.shape[0] < rows or tuple(m.scales.shape[1:]) != (-(-n // m.bn), -(-k // m.bk)):
            raise ValueError(f"{name} scales {tuple(m.scales.shape)} with block [{m.bn}, {m.bk}] do not fit rows {tuple(w.shape)}")


class _torch_threads:
    """Set torch's intra-op thread count for a block and put it back."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.prev = 0

    def __enter__(self) -> None:
        self.prev = torch.get_num_threads()
        if self.n and self.n != self.prev:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        if torch.get_num_threads() != self.prev:
            torch.set_num_threads(self.prev)


def per_k_outputs(out: torch.Tensor, batch: PairBatch, num_tokens: int, top_k: int) -> torch.Tensor:
    """Scatter [P, H] pair outputs into a zeroed [T, K, H] per-k tensor (for ``split.combine``)."""
    full = torch.zeros(num_tokens * top_k, out.shape[1], dtype=out.dtype)
    full.index_copy_(0, batch.flat, out)
    return full.view(num_tokens, top_k, out.shape[1])
