"""The online cache's row copies, for each taken pair of a step (fixed shape, no host synchronization).

Each bank tensor is ``[H + R, *row]`` (slot rows, then host rows; one VA range
on CUDA, so host rows are read and written over the link by the same kernel).

* promotion: host row ``H + src[i]`` -> slot row ``slot[i]`` (``src``: the
  promoted expert's host row; in full-copy mode that is its id);
* eviction (RAM-complement mode only): slot row ``slot[i]`` -> host row
  ``H + dst[i]``, a spare row; it runs before the promotions of the same step,
  which overwrite those slots (stream order on CUDA).

In complement mode both directions of a step run as one exchange (``exchange_rows``): on CUDA one
Triton program per (pair, chunk) reads the victim's slot chunk before it writes the candidate's
bytes there, so the D2H and H2D halves overlap on the full-duplex link instead of running one
after the other. Both run inside the forward and are captured in CUDA graphs. CUDA: one Triton
launch per parameter and direction (``promote_triton``), one program per
(pair, 16 KiB chunk); a pair not taken exits before reading anything. CPU: the
torch reference below defines the semantics (CI checks the Triton kernel
against it under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os
from typing import Callable, Sequence

import torch

BLOCK = 4096  # 32-bit words per program


def copy_rows_reference(rows: Sequence[torch.Tensor], valid: torch.Tensor, src: torch.Tensor, src_offset: int, dst: torch.Tensor, dst_offset: int) -> None:
    """Row ``src_offset + src[i]`` -> row ``dst_offset + dst[i]`` where ``valid[i]``. A pair not taken
    copies its source row onto itself (a no-op by value); taken pairs' destinations are distinct and
    never another pair's source, and every source is read before any row is written."""
    a = src_offset + src.to(torch.int64)
    b = torch.where(valid, dst_offset + dst.to(torch.int64), a)
    for t in rows:
        if t.element_size() == 1 and t.dtype != torch.uint8:  # float8 rows: torch's CPU index_copy_ has no kernel for them
            t = t.view(torch.uint8)
        t.index_copy_(0, b, t.index_select(0, a))


def _dense_row(row: torch.Tensor) -> bool:
    """A row that covers exactly its elements, in any dimension order."""
    if row.is_contiguous():
        return True
    order = sorted(range(row.dim()), key=lambda i: -row.stride(i))
    return row.permute(order).is_contiguous()


def as_words(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The tensor as a flat array of 32-bit words (bytes when a row is not word-sized), words per row,
    and words from one row to the next (more than a row in padded banks)."""
    size, row = t.element_size(), t[0]
    extent = 1 + sum((n - 1) * st for n, st in zip(row.shape, row.stride()))
    if t.stride(0) < max(row.numel(), extent) or any(st < 0 for st in row.stride()):
        raise ValueError("the promotion copy needs bank rows that do not overlap")
    # A dense row (any dimension order) is copied as its elements, a padded one (a TMA-aligned
    # scale) as its whole span, padding included.
    row_bytes = (row.numel() if _dense_row(row) else t.stride(0)) * size
    stride_bytes = t.stride(0) * size
    flat = t.as_strided((t.shape[0] * t.stride(0),), (1,)).view(torch.uint8)
    if row_bytes % 4 == 0 and stride_bytes % 4 == 0 and t.data_ptr() % 4 == 0:
        return flat.view(torch.int32), row_bytes // 4, stride_bytes // 4
    return flat, row_bytes, stride_bytes


def copy_rows_triton(rows: Sequence[torch.Tensor], valid: torch.Tensor, src: torch.Tensor, src_offset: int, dst: torch.Tensor, dst_offset: int,
                     block: int = BLOCK) -> None:
    from . import promote_triton

    kernel = promote_triton.jitted(os.environ.get("TRITON_INTERPRET", "0") == "1")
    flags = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    for t in rows:
        words, row_words, row_stride = as_words(t)
        grid = (int(valid.shape[0]), -(-row_words // block))
        kernel[grid](words, flags, src, dst, row_words, row_stride, src_offset, dst_offset, BLOCK=block, num_warps=4)


def copy_rows(rows: Sequence[torch.Tensor], valid: torch.Tensor, src: torch.Tensor, src_offset: int, dst: torch.Tensor, dst_offset: int) -> None:
    if not rows or valid.numel() == 0:
        return
    fn = copy_rows_triton if rows[0].is_cuda else copy_rows_reference
    fn(rows, valid, src, src_offset, dst, dst_offset)


def promote_copy(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, src: torch.Tensor, slot: torch.Tensor) -> None:
    """Copy host row ``H + src[i]`` into slot row ``slot[i]`` of every tensor in ``rows`` where ``valid[i]``."""
    copy_rows(rows, valid, src, host_row_offset, slot, 0)


def evict_copy(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, slot: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy slot row ``slot[i]`` into host row ``H + dst[i]`` of every tensor in ``rows`` where ``valid[i]``."""
    copy_rows(rows, valid, slot, 0, dst, host_row_offset)


def promote_copy_reference(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, src: torch.Tensor, slot: torch.Tensor) -> None:
    copy_rows_reference(rows, valid, src, host_row_offset, slot, 0)


def promote_copy_triton(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, src: torch.Tensor, slot: torch.Tensor,
                        block: int = BLOCK) -> None:
    copy_rows_triton(rows, valid, src, host_row_offset, slot, 0, block)


def exchange_rows_reference(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, evict: torch.Tensor, src: torch.Tensor,
                            slot: torch.Tensor, dst: torch.Tensor, copy: Callable[..., None] = copy_rows) -> None:
    """Semantics of an exchange: evictions (slot -> host row ``H + dst``) first, then promotions (``H + src`` -> slot)."""
    copy(rows, evict, slot, 0, dst, host_row_offset)
    copy(rows, valid, src, host_row_offset, slot, 0)


def exchange_rows_triton(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, evict: torch.Tensor, src: torch.Tensor,
                         slot: torch.Tensor, dst: torch.Tensor, block: int = BLOCK) -> None:
    from . import promote_triton

    kernel = promote_triton.jitted_exchange(os.environ.get("TRITON_INTERPRET", "0") == "1")
    flags = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    ev = evict.view(torch.uint8) if evict.dtype == torch.bool else evict
    for t in rows:
        words, row_words, row_stride = as_words(t)
        grid = (int(valid.shape[0]), -(-row_words // block))
        kernel[grid](words, flags, ev, src, slot, dst, row_words, row_stride, host_row_offset, BLOCK=block, num_warps=4)


def exchange_rows(rows: Sequence[torch.Tensor], host_row_offset: int, valid: torch.Tensor, evict: torch.Tensor, src: torch.Tensor,
                  slot: torch.Tensor, dst: torch.Tensor) -> None:
    """RAM-complement step copies: where ``evict[i]`` slot ``slot[i]`` -> host row ``H + dst[i]``, and where
    ``valid[i]`` host row ``H + src[i]`` -> slot ``slot[i]`` (after that slot was read)."""
    if not rows or valid.numel() == 0:
        return
    fn = exchange_rows_triton if rows[0].is_cuda else exchange_rows_reference
    fn(rows, host_row_offset, valid, evict, src, slot, dst)
