"""FP8 expert weights for the CPU expert path: the scales' layout, the host copy, the C mirror.

Why a host copy of the scales: vLLM's per-expert scales are side tensors (``bank/side_tensors.py``),
whole on the device at the bank's physical row ids, and the CPU team cannot read device memory.
They are tiny (the 30B-A3B shape: 4 B per expert per matrix per-tensor, 1,152 B with [128, 128]
blocks), and a host row's scales never change while the bank's host rows hold the same experts (no
RAM complement: ``check_cpu_quant``), so one copy taken when the path is built stays right.

Layouts accepted (vLLM's ``Fp8MoEMethod`` after ``process_weights_after_loading``), per bank row:
per-tensor ``[R]`` / ``[R, 1]``; per-shard ``[R, 2]`` for w13 (gate, up); blocks ``[R, ceil(N / bn),
ceil(K / bk)]`` (``weight_block_size`` [bn, bk]). Each becomes ``[R, nbn, nbk]`` fp32 with a block
``(bn, bk)``: the scale of row n, column k is ``s[r, n // bn, k // bk]``. Pure torch + ctypes.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)
"""What the CPU kernel decodes (e4m3fn: OCP FP8, vLLM's CUDA FP8; ROCm's e4m3fnuz differs in bias)."""

SCALE_NAMES = {"w13": ("w13_weight_scale", "w13_weight_scale_inv"), "w2": ("w2_weight_scale", "w2_weight_scale_inv")}
IGNORED_SIDE = ("w13_input_scale", "w2_input_scale")
"""Static activation scales: the CPU computes with the bf16 activations as they are (no activation
quantization), so it needs none."""


class CQuant(ctypes.Structure):
    """Mirror of ``reap_quant`` in native_experts.c (field order and types must match)."""

    _i = ctypes.c_int64
    _p = ctypes.c_void_p
    _fields_ = [("fp8", _i), ("s13", _p), ("s2", _p), ("s13_row_stride", _i), ("s2_row_stride", _i),
                ("bn13", _i), ("bk13", _i), ("nbk13", _i), ("bn2", _i), ("bk2", _i), ("nbk2", _i)]


@dataclass(frozen=True)
class MatrixScales:
    """One matrix's scales, ``[R, nbn, nbk]`` fp32 contiguous (host or device), block ``(bn, bk)``."""

    scales: torch.Tensor
    bn: int
    bk: int

    def expand(self, row: int, n: int, k: int) -> torch.Tensor:
        """[n, k] fp32: row ``row``'s scale of every weight."""
        s = self.scales[row]
        return s.repeat_interleave(self.bn, 0)[:n].repeat_interleave(self.bk, 1)[:, :k]


@dataclass(frozen=True)
class ExpertQuant:
    """FP8 experts' scales for the CPU kernel (``w13``: [2I, H] rows, ``w2``: [H, I] rows)."""

    w13: MatrixScales
    w2: MatrixScales

    def to_c(self) -> CQuant:
        """The C struct (points into this object's host tensors: keep the object alive)."""
        a, b = self.w13, self.w2
        if a.scales.device.type != "cpu" or b.scales.device.type != "cpu":
            raise ValueError("the CPU kernel reads host scales")
        return CQuant(fp8=1, s13=a.scales.data_ptr(), s2=b.scales.data_ptr(), s13_row_stride=a.scales.stride(0),
                      s2_row_stride=b.scales.stride(0), bn13=a.bn, bk13=a.bk, nbk13=a.scales.shape[2], bn2=b.bn, bk2=b.bk,
                      nbk2=b.scales.shape[2])

    def to(self, device: torch.device | str) -> "ExpertQuant":
        return ExpertQuant(MatrixScales(self.w13.scales.to(device), self.w13.bn, self.w13.bk),
                           MatrixScales(self.w2.scales.to(device), self.w2.bn, self.w2.bk))

    def dequantize(self, which: str, w: torch.Tensor, row: int) -> torch.Tensor:
        """[N, K] fp32 of bank row ``row`` of ``w`` (``which``: "w13" or "w2"): the CPU kernel's weights."""
        m = self.w13 if which == "w13" else self.w2
        wr = w[row].float()
        return wr * m.expand(row, *wr.shape)


def _matrix_scales(name: str, scale: torch.Tensor, rows: int, n: int, k: int, block: Sequence[int] | None, shard: int | None) -> MatrixScales:
    s = scale.detach()
    if not s.dtype.is_floating_point or s.dtype.itemsize < 2:
        raise ValueError(f"{name} is {str(s.dtype).replace('torch.', '')}; the CPU kernel reads float scales (not packed UE8M0)")
    if s.shape[0] != rows:
        raise ValueError(f"{name} has {s.shape[0]} rows, the bank {rows}")
    inner = tuple(s.shape[1:])
    if math.prod(inner) == 1:  # per-tensor: [R], [R, 1], [R, 1, 1]
        return MatrixScales(s.reshape(rows, 1, 1).to("cpu", torch.float32).contiguous(), n, k)
    if len(inner) == 1 and inner[0] == 2 and shard is not None:  # per-shard w13: [gate, up]
        return MatrixScales(s.reshape(rows, 2, 1).to("cpu", torch.float32).contiguous(), shard, k)
    if len(inner) == 2:
        nbn, nbk = inner
        if block is not None:
            bn, bk = int(block[0]), int(block[1])
        elif n % nbn == 0 and k % nbk == 0:
            bn, bk = n // nbn, k // nbk
        else:
            raise ValueError(f"{name} {list(s.shape)}: block size unknown for a [{n}, {k}] matrix (give weight_block_size)")
        if bn < 1 or bk < 1 or (nbn, nbk) != (-(-n // bn), -(-k // bk)):
            raise ValueError(f"{name} {list(s.shape)} does not fit [{bn}, {bk}] blocks of a [{n}, {k}] matrix")
        return MatrixScales(s.to("cpu", torch.float32).contiguous(), bn, bk)
    raise ValueError(f"{name} {list(s.shape)}: not a per-tensor, per-shard or block scale layout the CPU kernel reads")


def fp8_scale_names(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{"w13": name, "w2": name}`` of the weight scales among ``params`` (missing keys: not found)."""
    return {m: n for m, names in SCALE_NAMES.items() for n in names if n in params}


def expert_quant(w13: torch.Tensor, w2: torch.Tensor, params: Mapping[str, torch.Tensor],
                 block: Sequence[int] | None = None) -> ExpertQuant:
    """The host copy of FP8 experts' weight scales from a layer's per-expert parameters (bank rows).

    ``w13`` [R, 2I, H] / ``w2`` [R, H, I] float8_e4m3fn; ``block``: the checkpoint's
    ``weight_block_size`` when known. Raises ValueError naming what does not fit."""
    for name, w in (("w13_weight", w13), ("w2_weight", w2)):
        if w.dtype not in FP8_DTYPES:
            raise ValueError(f"{name} is {str(w.dtype).replace('torch.', '')}; the CPU kernel decodes float8_e4m3fn")
    names = fp8_scale_names(params)
    missing = [m for m in ("w13", "w2") if m not in names]
    if missing:
        raise ValueError(f"FP8 experts without weight scales for {missing} (looked for {[SCALE_NAMES[m] for m in missing]})")
    rows, i2, h = w13.shape
    return ExpertQuant(_matrix_scales(names["w13"], params[names["w13"]], rows, i2, h, block, i2 // 2),
                       _matrix_scales(names["w2"], params[names["w2"]], rows, h, i2 // 2, block, None))
