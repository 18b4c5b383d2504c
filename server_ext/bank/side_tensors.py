"""Per-expert side tensors (quantization scales, zero points, biases): kept whole on the device,
outside the paged row space, indexed by the same physical row ids as the weights.

Why: a paged backing starts the host region on a page boundary in *every* banked tensor. A 4-byte
per-tensor FP8 scale row needs ``page / 4 = 524288`` rows before the host region can start on a
2 MiB page, so the bank of the 30B-A3B shape at FP8 needed 524416 physical rows, far past what
vLLM's ``moe_align_block_size`` takes (992, ``bank_layout.MAX_PHYSICAL_ROWS``). Side tensors are
tiny (a block-quantized [128, 128] expert of the 30B shape has 768 + 384 B of scales), so each is
one ordinary device tensor of ``[physical rows, *row]`` -- the same rows as the weights, slot rows
and host rows alike -- and the layout is computed from the weight matrices only (168 rows there).

Why the same row ids rather than the logical expert id: the fused kernel gets one id per
(token, expert) pair, the physical row, and reads every per-expert operand at that id (vLLM's
Triton kernel: ``b_scale_ptr + off_experts * stride``). A side tensor indexed by logical id would
need a second id stream through vLLM's kernels. With one row space, every copy that moves an
expert's weight rows (slot swaps, RAM-complement exchanges, the online cache's promotions, all of
which loop over ``ExpertBank.params``) moves its side rows in the same call, in the same order:
consistency needs no extra bookkeeping. The side rows' "host" rows live in device memory; the host
link accounting (``LayerHostRows`` blocks, host byte spans) counts the banked tensors only.
Pure torch, no CUDA.
"""

from __future__ import annotations

import math
import re

import torch

SIDE_MAX_ROW_BYTES = 64 * 2**10
"""A per-expert parameter over this stays in the paged bank whatever its name (device memory is the
thing residency saves; 64 KiB x (rows) per tensor is a rounding error beside a slot row)."""

_SIDE_NAME = re.compile(r"(scale|zero|bias|g_idx|perm|alpha|beta|_weight_shape$)", re.IGNORECASE)
"""``*_weight_shape``: compressed-tensors' per-expert ``[E, 2]`` record of each packed matrix's shape
(``w13_weight_shape``, ``w2_weight_shape``, 4 B a row), read at load only; banked, its 4-byte rows
would need ``page / 4`` rows before a page-aligned host region, as FP8's per-tensor scales did."""


def is_side_tensor(name: str, row_bytes: int) -> bool:
    """Scales, zero points, biases, group indices (and act-order sort indices), shape records: by name,
    and only when small. Zero-byte rows (GPTQ-Marlin's ``[E, 0]`` g_idx without act order) are side
    tensors whatever their name. The weight matrices (``w13_weight``, ``w2_weight``, ``*qweight*``,
    ``*_weight_packed``) are never side tensors."""
    if row_bytes == 0:
        return True
    return row_bytes <= SIDE_MAX_ROW_BYTES and _SIDE_NAME.search(name) is not None


def split_params(row_bytes: dict[str, int]) -> tuple[list[str], list[str]]:
    """(banked names, side names), each in parameter order; refuses a bank with no banked tensor."""
    side = [n for n, b in row_bytes.items() if is_side_tensor(n, b)]
    banked = [n for n in row_bytes if n not in side]
    if not banked:
        raise ValueError(f"no per-expert weight matrix to bank among {list(row_bytes)} (all look like side tensors)")
    return banked, side


def side_rows(num_rows: int, like: torch.Tensor) -> torch.Tensor:
    """A device tensor of ``[num_rows, *like.shape[1:]]`` with ``like``'s strides, so a column-major or
    padded (TMA-aligned) scale keeps the layout its kernel expects; rows that would overlap (or
    broadcast strides) get contiguous rows instead."""
    shape, inner = tuple(like.shape[1:]), tuple(like.stride()[1:])
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, inner))
    row_stride = like.stride(0)
    if row_stride < max(extent, math.prod(shape)) or any(st <= 0 for n, st in zip(shape, inner) if n > 1):
        return torch.empty((num_rows, *shape), dtype=like.dtype, device=like.device)
    flat = torch.empty(num_rows * row_stride, dtype=like.dtype, device=like.device)
    return flat.as_strided((num_rows, *shape), (row_stride, *inner))


def side_bytes(num_rows: int, t: torch.Tensor) -> int:
    """Device bytes of a side tensor of ``num_rows`` rows (row padding included)."""
    return num_rows * max(t.stride(0), math.prod(t.shape[1:])) * t.element_size()
