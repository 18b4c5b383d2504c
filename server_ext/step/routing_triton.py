"""Triton sources of the routing kernels (semantics: ``routing_kernels``' torch references).

Imported only where Triton is used (CUDA, or CPU tests under ``TRITON_INTERPRET=1``).
The functions are wrapped with ``triton.jit`` on first use because Triton decides
between compiling and interpreting when it wraps them.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl


def _remap_capture_kernel(ids_ptr, w_ptr, map_ptr, out_ptr, code_ptr, capw_ptr, n_elem, host_row_offset, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    phys = tl.load(map_ptr + ids, mask=mask, other=0)
    tl.store(out_ptr + offs, phys.to(out_ptr.dtype.element_ty), mask=mask)
    ids32 = ids.to(tl.int32)
    code = tl.where(phys >= host_row_offset, -1 - ids32, ids32)
    tl.store(code_ptr + offs, code, mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(capw_ptr + offs, w.to(tl.float32), mask=mask)


def _accumulate_kernel(  # type: ignore[no-untyped-def]
    code_ptr, capw_ptr, rows_ptr, slot_ptr, acc_ptr, n_elem, layer_stride, num_layers, num_experts, K: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elem
    layer = tl.load(rows_ptr + i).to(tl.int64)
    code = tl.load(code_ptr + layer * layer_stride + offs, mask=mask, other=0)
    w = tl.load(capw_ptr + layer * layer_stride + offs, mask=mask, other=0.0)
    slot = tl.load(slot_ptr + offs // K, mask=mask, other=0).to(tl.int64)
    missed = code < 0
    expert = tl.where(missed, -1 - code, code).to(tl.int64)
    base = acc_ptr + ((slot * num_layers + layer) * 4) * num_experts + expert
    one = tl.full([BLOCK], 1.0, tl.float32)
    zero = tl.full([BLOCK], 0.0, tl.float32)
    missed_f = tl.where(missed, one, zero)
    tl.atomic_add(base, one, mask=mask)
    tl.atomic_add(base + num_experts, missed_f, mask=mask)
    tl.atomic_add(base + 2 * num_experts, w, mask=mask)
    tl.atomic_add(base + 3 * num_experts, w * missed_f, mask=mask)


def _promotions_kernel(promo_ptr, rows_ptr, slot_ptr, acc_ptr, promo_stride, num_rows, slot_rows, acc_layers, C, BLOCK_C: tl.constexpr):  # type: ignore[no-untyped-def]
    layer = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    row = tl.load(promo_ptr + layer * promo_stride + c, mask=c < C, other=-1)
    ok = (c < C) & (row >= 0) & (row < num_rows)
    safe = tl.minimum(tl.maximum(row, 0), slot_rows - 1)
    slot = tl.load(slot_ptr + safe, mask=ok, other=0).to(tl.int64)
    one = tl.full([BLOCK_C], 1.0, tl.float32)
    tl.atomic_add(acc_ptr + slot * acc_layers + layer, one, mask=ok)


@functools.lru_cache(maxsize=2)
def jitted_promotions(interpret: bool) -> Any:
    """The promotion-booking kernel (``accounting.accumulate_promotions``); cached per interpreter mode."""
    return triton.jit(_promotions_kernel)


@functools.lru_cache(maxsize=2)
def jitted(interpret: bool) -> tuple[Any, Any]:
    """(remap_capture, accumulate) kernels; cached per interpreter mode."""
    return triton.jit(_remap_capture_kernel), triton.jit(_accumulate_kernel)
