"""Paged bank layouts (bank_layout.py) and the padded-row banks they produce, on the CPU.

The learned 128-expert model's rows (6 KiB / 3 KiB) once gave a VMM bank of 2176 physical rows,
which vLLM's moe_align_block_size refuses; padded rows bring it under the limit. ``PlainBacking``
with a page builds the same strided banks the CUDA backing does, so swaps, promotions and the CPU
expert path run on them here.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from reap_swap.server_ext.bank.bank import ExpertBank, PlainBacking, strided_rows
from reap_swap.server_ext.bank.bank_layout import MAX_PHYSICAL_ROWS, BankLayout, check_kernel_rows, contiguous_layout, page_layout
from reap_swap.server_ext.cache.promote import copy_rows_reference, copy_rows_triton

PAGE = 2 * 2**20


def _check_paged(layout: BankLayout, num_slots: int, num_experts: int, row_bytes: list[int], page: int) -> None:
    assert layout.host_row_offset >= num_slots
    assert layout.num_rows == layout.host_row_offset + num_experts
    for stride, rb in zip(layout.row_strides, row_bytes):
        assert stride >= rb
        assert (layout.host_row_offset * stride) % page == 0  # the host region starts on a page in every tensor


def test_learned128_rows_fit_vllm_after_padding() -> None:
    rows = [2 * 24 * 64 * 2, 64 * 24 * 2]  # 6144 and 3072 bytes
    unpadded = page_layout(38, 128, rows, PAGE, pad=False)
    assert unpadded.num_rows == 2176 > MAX_PHYSICAL_ROWS  # what made the model unrunnable with the VMM bank
    layout = page_layout(38, 128, rows, PAGE)
    _check_paged(layout, 38, 128, rows, PAGE)
    assert layout.row_strides == (8192, 4096) and layout.num_rows == 640
    assert sum(layout.region_bytes(PAGE)) < sum(unpadded.region_bytes(PAGE))
    assert check_kernel_rows(layout) is layout
    with pytest.raises(ValueError, match="2176 physical rows"):  # RAM-complement banks keep rows unpadded
        check_kernel_rows(unpadded)


def test_page_multiple_rows_are_never_padded() -> None:
    rows = [2 * 768 * 2048 * 2, 2048 * 768 * 2]  # Qwen3-30B-A3B: 3 and 1.5 pages
    layout = page_layout(38, 128, rows, PAGE)
    assert layout.row_strides == tuple(rows)
    assert layout.host_row_offset == 38 + 38 % 2  # 1.5-page rows: an even row count is whole pages


def test_padding_is_taken_only_when_it_saves_bytes() -> None:
    rows = [1536 * 1024]  # 0.75 page: 4 rows per 3 pages unpadded, 1 page per row padded
    layout = page_layout(3, 256, rows, PAGE)
    assert layout.row_strides == (1536 * 1024,) and layout.host_row_offset == 4  # padding 256 host rows costs far more than one slot row


@pytest.mark.parametrize("num_slots,num_experts", [(0, 8), (1, 64), (38, 128), (77, 256), (500, 512)])
def test_every_layout_is_page_aligned_and_no_larger_than_unpadded(num_slots: int, num_experts: int) -> None:
    for rows in itertools.product([96, 3072, 6144, 5000, PAGE, 3 * PAGE // 2, 5 * PAGE // 3 + 2], repeat=2):
        rows_l = list(rows)
        layout = page_layout(num_slots, num_experts, rows_l, PAGE)
        unpadded = page_layout(num_slots, num_experts, rows_l, PAGE, pad=False)
        _check_paged(layout, num_slots, num_experts, rows_l, PAGE)
        _check_paged(unpadded, num_slots, num_experts, rows_l, PAGE)
        assert unpadded.row_strides == tuple(rows_l)
        if unpadded.num_rows <= MAX_PHYSICAL_ROWS:
            assert layout.num_rows <= MAX_PHYSICAL_ROWS
            assert sum(layout.region_bytes(PAGE)) <= sum(unpadded.region_bytes(PAGE))
        else:
            assert layout.num_rows <= unpadded.num_rows


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="bad bank shape"):
        page_layout(4, 0, [64], PAGE)
    with pytest.raises(ValueError, match="row bytes"):
        page_layout(4, 8, [0], PAGE)
    with pytest.raises(ValueError, match="does not fit"):
        strided_rows(torch.empty(100, dtype=torch.uint8), 4, 6, (2,), torch.float32)
    assert contiguous_layout(3, 8, [24]) == BankLayout(3, (24,), 11)


# ------------------------------------------------------------------ padded banks on the CPU

E, S, SMALL_PAGE = 16, 3, 256  # rows of 6*4*4 = 96 B and 4*3*4 = 48 B


def _strided_bank() -> tuple[ExpertBank, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    originals = {"w13_weight": torch.randn(E, 6, 4, generator=gen), "w2_weight": torch.randn(E, 4, 3, generator=gen)}
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in originals.items()}
    bank = ExpertBank(0, params, torch.zeros(E, dtype=torch.int32), S, PlainBacking(torch.device("cpu"), page=SMALL_PAGE))
    return bank, originals


def test_a_padded_bank_swaps_like_a_plain_one() -> None:
    bank, orig = _strided_bank()
    layout = bank.layout
    assert layout == page_layout(S, E, [96, 48], SMALL_PAGE) and layout.row_strides != (96, 48)  # some rows padded
    for (name, p), stride in zip(bank.params.items(), layout.row_strides):
        assert p.data.stride(0) * 4 == stride and p.data[0].is_contiguous()
        assert layout.host_row_offset * stride % SMALL_PAGE == 0
    assert bank.slot_bytes == layout.host_row_offset * sum(layout.row_strides)
    for target in [(1, 4, 6), (1, 2, 15), (0, 9, 10), ()]:
        bank.swap(target)
        assert bank.resident() == tuple(sorted(target)) or set(bank.resident()) == set(target)
        for name, t in orig.items():
            assert torch.equal(bank.params[name].data[bank.phys_map.long()], t)
        assert bank.verify() == []


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_row_copies_on_padded_rows_leave_the_padding_alone(monkeypatch: pytest.MonkeyPatch, impl: str) -> None:
    """The online cache's promotion copy on a padded bank: whole rows move, the bytes between rows do not."""
    if impl == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    h, e, stride = 5, 8, 40 * 4  # rows of 3*7 float32 (84 B) every 160 B
    raw = torch.randint(0, 255, ((h + e) * stride,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    before = raw.clone()
    rows = [strided_rows(raw, h + e, stride, (3, 7), torch.float32)]
    valid = torch.tensor([True, False, True])
    src, slot = torch.tensor([6, 1, 0]), torch.tensor([3, 2, 0])
    if impl == "triton":
        copy_rows_triton(rows, valid, src, h, slot, 0, block=16)
    else:
        copy_rows_reference(rows, valid, src, h, slot, 0)
    want = before.clone().view(h + e, stride)
    want[3, :84] = before.view(h + e, stride)[h + 6, :84]
    want[0, :84] = before.view(h + e, stride)[h + 0, :84]
    assert torch.equal(raw.view(h + e, stride), want)


def test_a_complement_bank_keeps_rows_unpadded_and_counts_only_its_host_rows() -> None:
    from reap_swap.server_ext.bank.bank import ComplementSpec

    gen = torch.Generator().manual_seed(4)
    params = {"w13_weight": torch.nn.Parameter(torch.randn(E, 6, 4, generator=gen), requires_grad=False),
              "w2_weight": torch.nn.Parameter(torch.randn(E, 4, 3, generator=gen), requires_grad=False)}
    bank = ExpertBank(0, params, torch.zeros(E, dtype=torch.int32), S, PlainBacking(torch.device("cpu"), page=SMALL_PAGE), ComplementSpec(2, ()))
    layout = bank.layout
    assert layout.row_strides == (96, 48)  # exchanges move contiguous spans
    assert layout.num_rows == layout.host_row_offset + E - S + 2 == bank.physical_rows
    assert layout == page_layout(S, E - S + 2, [96, 48], SMALL_PAGE, pad=False)
