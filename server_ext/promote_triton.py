"""Triton source of the promotion copy (semantics: ``promote.promote_copy_reference``).

Imported only where Triton is used (CUDA, or CPU tests under ``TRITON_INTERPRET=1``);
wrapped with ``triton.jit`` on first use, as ``routing_triton`` does.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl


def _promote_kernel(buf_ptr, valid_ptr, cand_ptr, slot_ptr, row_words, host_row_offset, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    """One program per (pair, chunk of a row); a pair not taken exits before reading a row."""
    pair = tl.program_id(0)
    if tl.load(valid_ptr + pair) == 0:
        return
    cand = tl.load(cand_ptr + pair).to(tl.int64)
    slot = tl.load(slot_ptr + pair).to(tl.int64)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    v = tl.load(buf_ptr + (host_row_offset + cand) * row_words + offs, mask=mask)
    tl.store(buf_ptr + slot * row_words + offs, v, mask=mask)


@functools.lru_cache(maxsize=2)
def jitted(interpret: bool) -> Any:
    """The promotion kernel; cached per interpreter mode."""
    return triton.jit(_promote_kernel)
