"""The promotion copy: host row -> slot row of every per-expert parameter, for each taken pair.

Each bank tensor is ``[H + E, *row]`` (slot rows, then host rows; one VA
range on CUDA, so the host rows are read over the link by the same kernel).
Pair ``i`` copies row ``H + cand[i]`` to row ``slot[i]`` where ``valid[i]``.
Fixed shape (``C`` pairs), no host synchronization: it runs inside the
forward and is captured in CUDA graphs.

CUDA: one Triton launch per parameter (``promote_triton``), one program per
(pair, 16 KiB chunk of the row); a program whose pair is not taken exits
before reading anything. CPU: the torch reference below, which defines the
semantics (CI checks the Triton kernel against it under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

BLOCK = 4096  # 32-bit words per program


def promote_copy_reference(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, cand: torch.Tensor, slot: torch.Tensor) -> None:
    """Masked row copies in torch. A pair not taken copies its own host row onto itself (a no-op
    by value); its rows never meet a taken pair's (slots < H <= host rows; candidates are distinct)."""
    src = host_row_offset + cand.to(torch.int64)
    dst = torch.where(valid, slot.to(torch.int64), src)
    for t in rows:
        t.index_copy_(0, dst, t.index_select(0, src))


def as_words(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The tensor as a flat array of 32-bit words (bytes when a row is not word-sized), and words per row."""
    if not t.is_contiguous():
        raise ValueError("the promotion copy needs contiguous bank tensors")
    row_bytes = t[0].numel() * t.element_size()
    flat = t.view(-1).view(torch.uint8)
    if row_bytes % 4 == 0 and t.data_ptr() % 4 == 0:
        return flat.view(torch.int32), row_bytes // 4
    return flat, row_bytes


def promote_copy_triton(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, cand: torch.Tensor, slot: torch.Tensor,
                        block: int = BLOCK) -> None:
    from . import promote_triton

    kernel = promote_triton.jitted(os.environ.get("TRITON_INTERPRET", "0") == "1")
    flags = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    for t in rows:
        words, row_words = as_words(t)
        grid = (int(valid.shape[0]), -(-row_words // block))
        kernel[grid](words, flags, cand, slot, row_words, host_row_offset, BLOCK=block, num_warps=4)


def promote_copy(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, cand: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy host row ``H + cand[i]`` into slot row ``slot[i]`` of every tensor in ``rows`` where ``valid[i]``."""
    if not rows or valid.numel() == 0:
        return
    fn = promote_copy_triton if rows[0].is_cuda else promote_copy_reference
    fn(rows, host_row_offset, valid, cand, slot)
