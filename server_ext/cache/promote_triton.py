"""Triton source of the cache's row copies (semantics: ``promote.copy_rows_reference``).

Imported only where Triton is used (CUDA, or CPU tests under ``TRITON_INTERPRET=1``);
wrapped with ``triton.jit`` on first use, as ``routing_triton`` does.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl


def _promote_kernel(buf_ptr, valid_ptr, src_ptr, dst_ptr, row_words, row_stride, src_offset, dst_offset, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """One program per (pair, chunk of a row): row ``src_offset + src[i]`` -> row ``dst_offset + dst[i]``;
    a pair not taken exits before reading a row. Rows are ``row_stride`` words apart (padded banks)."""
    pair = tl.program_id(0)
    if tl.load(valid_ptr + pair) == 0:
        return
    src = tl.load(src_ptr + pair).to(tl.int64) + src_offset
    dst = tl.load(dst_ptr + pair).to(tl.int64) + dst_offset
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    v = tl.load(buf_ptr + src * row_stride + offs, mask=mask)
    tl.store(buf_ptr + dst * row_stride + offs, v, mask=mask)


def _exchange_kernel(buf_ptr, valid_ptr, evict_ptr, src_ptr, slot_ptr, dst_ptr, row_words, row_stride, host_row_offset, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """RAM-complement promotion, both directions in one program per (pair, chunk): the victim's slot
    chunk is read, the candidate's host chunk is read, the first is written to the spare row (D2H) and
    the second into the slot (H2D). Each element's slot load and store are the same thread's accesses
    to one address, so the read comes first; D2H and H2D traffic overlap on the full-duplex link."""
    pair = tl.program_id(0)
    if tl.load(valid_ptr + pair) == 0:
        return
    slot = tl.load(slot_ptr + pair).to(tl.int64)
    src = tl.load(src_ptr + pair).to(tl.int64) + host_row_offset
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    incoming = tl.load(buf_ptr + src * row_stride + offs, mask=mask)
    if tl.load(evict_ptr + pair) != 0:
        dst = tl.load(dst_ptr + pair).to(tl.int64) + host_row_offset
        outgoing = tl.load(buf_ptr + slot * row_stride + offs, mask=mask)
        tl.store(buf_ptr + dst * row_stride + offs, outgoing, mask=mask)
    tl.store(buf_ptr + slot * row_stride + offs, incoming, mask=mask)


@functools.lru_cache(maxsize=2)
def jitted_exchange(interpret: bool) -> Any:
    """The complement exchange kernel; cached per interpreter mode."""
    return triton.jit(_exchange_kernel)


@functools.lru_cache(maxsize=2)
def jitted(interpret: bool) -> Any:
    """The promotion kernel; cached per interpreter mode."""
    return triton.jit(_promote_kernel)
