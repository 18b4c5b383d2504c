"""Where a bank's rows go in a paged range: the host-row offset and each parameter's row stride.

A backing whose memory comes in pages (CUDA VMM: 2 MiB) must start the host region on a page
boundary in every parameter's tensor, and all parameters share one row index space. With rows of
awkward sizes that pads the slot region a lot: 6 KiB and 3 KiB rows need 2048 rows for whole
pages in both tensors, so a 128-expert layer of such rows has 2176 physical rows -- past what vLLM's
``moe_align_block_size`` takes (the row count rounded up to 32 must stay below 1024), and the
model cannot run. Padding each row to a divisor of the page (6 KiB -> 8 KiB: 256 rows per page)
keeps the count small. ``page_layout`` weighs the two (and rounding rows over a page up to whole
pages) and takes the layout with the fewest bytes among those the fused-MoE kernel accepts.
Pure arithmetic: no torch, no CUDA.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

# vLLM's moe_align_block_size: TORCH_CHECK(round_up(num_experts, 32) < 1024), num_experts = the bank's rows
MAX_PHYSICAL_ROWS = 992


@dataclass(frozen=True)
class BankLayout:
    """Slot rows ``[0, num_slots)``, padding rows up to ``host_row_offset``, then the host rows;
    parameter ``i``'s rows are ``row_strides[i]`` bytes apart (>= its row's bytes). With prefill
    staging, the device rows ``[staging_offset, staging_offset + staging_rows)`` (page-aligned in
    a paged layout, the region padded to whole pages up to ``host_row_offset``) are staging rows."""

    host_row_offset: int
    row_strides: tuple[int, ...]
    num_rows: int
    staging_offset: int = 0
    staging_rows: int = 0

    @property
    def staging_region_rows(self) -> int:
        """Rows from the staging offset to the host rows (the staging rows and their page padding)."""
        return self.host_row_offset - self.staging_offset if self.staging_rows else 0

    def host_region_bytes(self, row_stride: int, page: int) -> int:
        """A parameter's host region (rows ``row_stride`` bytes apart), rounded up to whole pages."""
        return -(-((self.num_rows - self.host_row_offset) * row_stride) // page) * page

    def region_bytes(self, page: int) -> tuple[int, ...]:
        """Each parameter's reserved bytes: the slot region plus the host region rounded to pages."""
        return tuple(self.host_row_offset * s + self.host_region_bytes(s, page) for s in self.row_strides)


def check_kernel_rows(layout: BankLayout) -> BankLayout:
    """Refuse at load a bank the fused-MoE kernel would refuse at its first large step."""
    if layout.num_rows > MAX_PHYSICAL_ROWS:
        raise ValueError(f"the expert bank needs {layout.num_rows} physical rows (host rows from {layout.host_row_offset}, "
                         f"row strides {list(layout.row_strides)} B); vLLM's moe_align_block_size takes at most "
                         f"{MAX_PHYSICAL_ROWS}: use fewer slots or the full host copy (rows are padded only there)")
    return layout


def contiguous_layout(num_slots: int, host_rows: int, row_bytes: Sequence[int], staging_rows: int = 0) -> BankLayout:
    """No pages: staging rows (if any) right after the slots, then the host rows, rows back to back."""
    if staging_rows < 0:
        raise ValueError(f"staging rows must be >= 0, got {staging_rows}")
    offset = num_slots + staging_rows
    return BankLayout(offset, tuple(row_bytes), offset + host_rows, num_slots if staging_rows else 0, staging_rows)


def _stride_choices(row_bytes: int, page: int, pad: bool) -> list[int]:
    if row_bytes <= 0:
        raise ValueError(f"row bytes must be positive, got {row_bytes}")
    choices = [row_bytes]
    if not pad or row_bytes % page == 0 or page % row_bytes == 0:
        return choices
    if row_bytes < page:  # the smallest divisor of the page that holds the row
        k = page // row_bytes
        while page % k:
            k -= 1
        choices.append(page // k)
    else:
        choices.append(-(-row_bytes // page) * page)
    return choices


def page_layout(num_slots: int, host_rows: int, row_bytes: Sequence[int], page: int, pad: bool = True,
                max_rows: int | None = MAX_PHYSICAL_ROWS, staging_rows: int = 0) -> BankLayout:
    """The layout with the host region page-aligned in every parameter: fewest bytes among those
    with at most ``max_rows`` physical rows (fewest rows if none qualifies; the caller reports it).
    ``pad=False`` keeps rows back to back (callers whose copies assume contiguous rows).
    ``staging_rows``: a page-aligned region of whole pages between the slots and the host rows
    (a backing may map one physical region there for every layer)."""
    if num_slots < 0 or host_rows < 1 or page < 1 or not row_bytes or staging_rows < 0:
        raise ValueError(f"bad bank shape: {num_slots} slots, {host_rows} host rows, rows {list(row_bytes)}, page {page}")
    best: tuple[tuple[bool, int, int, int], BankLayout] | None = None
    for strides in itertools.product(*(_stride_choices(rb, page, pad) for rb in row_bytes)):
        step = 1
        for s in strides:
            step = math.lcm(step, page // math.gcd(s, page))
        stage_at = -(-num_slots // step) * step
        offset = stage_at + -(-staging_rows // step) * step
        layout = BankLayout(offset, tuple(strides), offset + host_rows, stage_at if staging_rows else 0, staging_rows)
        too_many = max_rows is not None and layout.num_rows > max_rows
        padded = sum(s != rb for s, rb in zip(strides, row_bytes))
        key = (too_many, layout.num_rows if too_many else sum(layout.region_bytes(page)), padded, layout.num_rows)
        if best is None or key < best[0]:
            best = (key, layout)
    assert best is not None
    return best[1]
