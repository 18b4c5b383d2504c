"""FP8 experts through the slot bank (issue 27): per-expert scales are side tensors, outside the paged
row space, with the weights' physical rows (``server_ext/bank/side_tensors.py``).

The 30B-A3B shape at FP8 (128 experts, 38 slots, 2 MiB pages) needed 524416 physical rows when its
4-byte scale rows were laid out like the weights; with side tensors it needs 168 (full copy) or 134
(RAM complement, 4 spares), within vLLM's 992. On CPU tensors (float8 weights, per-tensor and
[128, 128]-block scales, a small page that reproduces the overflow), slot swaps, RAM-complement
exchanges and the online cache's promotions keep every expert's scales at its weights' row: what the
fused kernel reads through the routing table is the logical expert's weights and scales.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reap_swap.server_ext.bank.bank import ComplementSpec, ExpertBank, PlainBacking
from tests.bank_checks import check_random_swaps
from reap_swap.server_ext.bank.bank_layout import MAX_PHYSICAL_ROWS, check_kernel_rows, page_layout
from reap_swap.server_ext.bank.side_tensors import SIDE_MAX_ROW_BYTES, is_side_tensor, side_rows, split_params
from reap_swap.server_ext.cache.online_cache import CacheParams, LayerCache
from reap_swap.server_ext.cache.promote import copy_rows_triton
from reap_swap.server_ext.cpu_experts.cpu_path import CpuPathConfigError, check_expert_weights

PAGE = 2 * 2**20
E30, H30, I30 = 128, 2048, 768  # Qwen3-30B-A3B: experts, hidden, moe intermediate


def fp8_30b_row_bytes(block: bool) -> dict[str, int]:
    """Per-expert bytes of the 30B-A3B shape's FP8 parameters as vLLM's Fp8MoEMethod leaves them."""
    rows = {"w13_weight": 2 * I30 * H30, "w2_weight": H30 * I30}
    if block:  # [E, 2I/128, H/128] and [E, H/128, I/128] float32
        rows |= {"w13_weight_scale_inv": (2 * I30 // 128) * (H30 // 128) * 4, "w2_weight_scale_inv": (H30 // 128) * (I30 // 128) * 4}
    else:  # one float32 per expert and matrix
        rows |= {"w13_weight_scale": 4, "w2_weight_scale": 4}
    return rows


@pytest.mark.parametrize("block", [False, True])
def test_the_30b_fp8_bank_fits_the_kernel_with_side_tensors(block: bool) -> None:
    rows = fp8_30b_row_bytes(block)
    banked, side = split_params(rows)
    assert banked == ["w13_weight", "w2_weight"] and len(side) == 2
    full = check_kernel_rows(page_layout(38, E30, [rows[n] for n in banked], PAGE))
    assert (full.host_row_offset, full.num_rows) == (40, 168)
    ram = check_kernel_rows(page_layout(38, E30 - 38 + 4, [rows[n] for n in banked], PAGE, pad=False))
    assert ram.num_rows == 134 <= MAX_PHYSICAL_ROWS
    old = page_layout(38, E30, list(rows.values()), PAGE)  # every tensor in the paged row space
    assert old.num_rows > MAX_PHYSICAL_ROWS
    if not block:
        assert old.num_rows == 524416, "the issue's measured count"
        with pytest.raises(ValueError, match="524416 physical rows"):
            check_kernel_rows(old)


def test_what_is_a_side_tensor() -> None:
    for name in ("w13_weight_scale", "w2_weight_scale_inv", "w13_bias", "w13_qzeros", "w13_g_idx", "w2_input_scale"):
        assert is_side_tensor(name, 4), name
    for name in ("w13_weight", "w2_weight", "w13_qweight"):
        assert not is_side_tensor(name, 4), "weight matrices stay banked, however small"
    assert not is_side_tensor("w13_weight_scale", SIDE_MAX_ROW_BYTES + 1), "a large per-expert tensor stays banked"
    with pytest.raises(ValueError, match="no per-expert weight matrix"):
        split_params({"w13_weight_scale": 4, "w2_bias": 8})


def test_side_rows_keep_a_column_major_layout() -> None:
    like = torch.randn(4, 6, 3).transpose(1, 2)  # [E, 6->3, ...] rows column-major (DeepGEMM-style scales)
    t = side_rows(9, like)
    assert t.shape == (9, 3, 6) and t.stride() == (18, 1, 3)
    t[2].copy_(like[1])
    assert torch.equal(t[2], like[1])
    assert side_rows(5, torch.ones(4)).shape == (5,)
    padded = torch.zeros(4, 3, 8)[:, :, :6].transpose(1, 2)  # [E, 6, 3], column-major, each row padded to 24 elements
    t = side_rows(9, padded)
    assert t.shape == (9, 6, 3) and t.stride() == (24, 1, 8), "a TMA-aligned layout is kept, padding included"
    assert side_rows(3, torch.ones(1).expand(4)).stride() == (1,), "broadcast rows get their own elements"


# ------------------------------------------------------------------ a bank of FP8-like experts on CPU

E, S, N2, K = 12, 4, 16, 128  # experts, slots; w13 rows [N2, K] float8 = 2 KiB, w2 [K, N2 // 2] = 1 KiB
SMALL_PAGE = 64 * 2**10  # 4-byte (16-byte) scale rows would need 16384 (4096) rows before the host region: > 992


def fp8_params(block: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    p = {"w13_weight": (torch.randn(E, N2, K, generator=gen) * 50).to(torch.float8_e4m3fn),
         "w2_weight": (torch.randn(E, K, N2 // 2, generator=gen) * 50).to(torch.float8_e4m3fn)}
    if block:  # one scale per 8 x 64 block here (the shapes, not the 128 x 128 sizes, are what matter)
        p["w13_weight_scale_inv"] = torch.rand(E, N2 // 8, K // 64, generator=gen) + 0.5
        p["w2_weight_scale_inv"] = torch.rand(E, K // 8, 1, generator=gen) + 0.5
    else:
        p["w13_weight_scale"] = torch.rand(E, generator=gen) + 0.5
        p["w2_weight_scale"] = torch.rand(E, generator=gen) + 0.5
    return p


def make_bank(block: bool, complement: ComplementSpec | None = None) -> tuple[ExpertBank, dict[str, torch.Tensor]]:
    orig = fp8_params(block)
    params = {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in orig.items()}
    bank = ExpertBank(0, params, torch.zeros(E, dtype=torch.int32), S, PlainBacking(torch.device("cpu"), page=SMALL_PAGE), complement)
    return bank, orig


def dequantized(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w * scale per expert, scales broadcast over their blocks (per tensor: one per expert)."""
    w = w.float()
    if scale.dim() == 1:
        return w * scale.view(-1, 1, 1)
    rep = (w.shape[1] // scale.shape[1], w.shape[2] // scale.shape[2])
    return w * scale.repeat_interleave(rep[0], 1).repeat_interleave(rep[1], 2)


def assert_kernel_reads_the_logical_experts(bank: ExpertBank, orig: dict[str, torch.Tensor]) -> None:
    """Gather every parameter at ``phys_map[e]`` (what the fused kernel does) and compare with expert e."""
    phys = bank.phys_map.long()
    for n, t in orig.items():
        got = bank.params[n].data[phys]
        assert torch.equal(got.view(torch.uint8) if t.element_size() == 1 else got, t.view(torch.uint8) if t.element_size() == 1 else t), n
    for m in ("w13", "w2"):
        s = next(n for n in orig if n.startswith(f"{m}_weight_scale"))
        assert torch.equal(dequantized(bank.params[f"{m}_weight"].data[phys], bank.params[s].data[phys]), dequantized(orig[f"{m}_weight"], orig[s]))


@pytest.mark.parametrize("block", [False, True])
def test_the_layout_keeps_scales_beside_the_paged_weights(block: bool) -> None:
    bank, orig = make_bank(block)
    scales = [n for n in orig if "scale" in n]
    assert bank.banked == ["w13_weight", "w2_weight"] and bank.side == scales
    assert page_layout(S, E, list(bank.row_bytes.values()), SMALL_PAGE).num_rows > MAX_PHYSICAL_ROWS, "the old layout overflows"
    lay = bank.layout
    assert len(lay.row_strides) == 2 and lay.num_rows == bank.physical_rows <= MAX_PHYSICAL_ROWS
    for n in scales:
        t = bank.params[n].data
        assert t.shape == (lay.num_rows, *orig[n].shape[1:]) and t.is_contiguous()
    side = sum(lay.num_rows * bank.row_bytes[n] for n in scales)
    assert bank.side_bytes == side
    assert bank.slot_bytes == lay.host_row_offset * sum(lay.row_strides) + side, "side tensors are device memory"
    assert bank.host_bytes == E * sum(lay.row_strides), "host bytes: the banked rows only"
    assert bank.expert_bytes == sum(bank.row_bytes.values()), "a swap copies the scales too"
    assert bank.link_bytes == bank.row_bytes["w13_weight"] + bank.row_bytes["w2_weight"], "promotions' link bytes: the banked rows"
    assert_kernel_reads_the_logical_experts(bank, orig)


@pytest.mark.parametrize("block", [False, True])
def test_swaps_move_scales_with_weights(block: bool) -> None:
    bank, orig = make_bank(block)
    check_random_swaps(bank, E, S, lambda: assert_kernel_reads_the_logical_experts(bank, orig))


@pytest.mark.parametrize("block", [False, True])
def test_ram_complement_exchanges_move_scales_with_weights(block: bool) -> None:
    bank, orig = make_bank(block, ComplementSpec(spares=2, start=(0, 1, 2, 3)))
    comp = bank.complement
    assert comp is not None and comp.rows.block == (bank.row_bytes["w13_weight"], bank.row_bytes["w2_weight"])
    assert bank.layout.num_rows == bank.layout.host_row_offset + E - S + 2
    spans = bank.host_spans()
    assert len(spans) == 2 and spans[0][0] == bank.params["w13_weight"].data[bank.layout.host_row_offset].data_ptr()
    assert_kernel_reads_the_logical_experts(bank, orig)
    rng = np.random.default_rng(2)
    for _ in range(12):
        target = tuple(int(x) for x in rng.choice(E, size=S, replace=False))
        bank.swap(target)
        assert set(bank.resident()) == set(target) and bank.check() == [] and bank.verify() == []
        assert_kernel_reads_the_logical_experts(bank, orig)
    c = bank.counters
    assert c.exchanges > 0 and c.h2d_bytes % sum(comp.rows.block) == 0, "link bytes count the banked rows only"


@pytest.mark.parametrize("complement", [False, True])
@pytest.mark.parametrize("block", [False, True])
def test_online_cache_promotions_move_scales_with_weights(block: bool, complement: bool) -> None:
    spec = ComplementSpec(spares=2, start=(0, 1, 2, 3)) if complement else None
    bank, orig = make_bank(block, spec)
    bank.swap((0, 1, 2, 3))
    comp = bank.complement
    cache = LayerCache(E, S, bank.table.host_row_offset, bank.phys_map, CacheParams(2, 0.9, None),
                       host_rows=comp.rows.num_rows if comp is not None else None)
    cache.install(bank.table.owners(), prior=(0, 1, 2, 3), protected=(), row_owners=comp.rows.owners() if comp is not None else None)
    rows = [p.data for p in bank.params.values()]  # what the layer's forward hands the cache
    rng = np.random.default_rng(3)
    for i in range(40):
        ids = torch.tensor([[int(x) for x in rng.permutation(E)[:3]] for _ in range(2)], dtype=torch.int32)
        out = cache.step(ids, rows, None, None)
        for n, t in orig.items():  # the step's remapped ids read the routed experts' weights and scales
            got, want = bank.params[n].data[out.long()], t[ids.long()]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if t.element_size() == 1 else torch.equal(got, want), n
        assert_kernel_reads_the_logical_experts(bank, orig)
        if i % 10 == 9:  # the control plane reads the cache back and swaps (worker_ext.sync_tables, reset_caches)
            bank.table.assign(cache.read_owners())
            if comp is not None:
                c = cache.counters()
                comp.adopt_rows(cache.read_row_owners(), c["evictions"], c["promotions"])
            target = tuple(int(x) for x in rng.choice(E, size=S, replace=False))
            bank.swap(target)
            assert_kernel_reads_the_logical_experts(bank, orig)
            cache.install(bank.table.owners(), prior=target, protected=(), row_owners=comp.rows.owners() if comp is not None else None)
    assert int(cache.counters()["promotions"]) > 10


def test_triton_promotions_copy_side_rows_like_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a, orig = make_bank(True)
    b, _ = make_bank(True)
    r, m, k = a.params["w13_weight_scale_inv"].shape
    col = torch.full((r, k, m + 3), -7.0)[:, :, :m].transpose(1, 2)  # the same values in column-major rows with padding
    col.copy_(a.params["w13_weight_scale_inv"].data)
    assert not col[0].is_contiguous() and col.stride(0) > 1 + (m - 1) * col.stride(1) + (k - 1) * col.stride(2)
    b.params["w13_weight_scale_inv"].data = col
    r, m, k = a.params["w2_weight_scale_inv"].shape
    pad = torch.full((r, k, m + 3), -7.0)[:, :, :m].transpose(1, 2)  # dense rows 3 elements apart
    pad.copy_(a.params["w2_weight_scale_inv"].data)
    b.params["w2_weight_scale_inv"].data = pad
    caches = []
    for bank in (a, b):
        c = LayerCache(E, S, bank.table.host_row_offset, bank.phys_map, CacheParams(2, 0.9, None))
        c.install(bank.table.owners(), prior=(), protected=())
        caches.append(c)
    rng = np.random.default_rng(4)
    for _ in range(15):
        ids = torch.tensor([[int(x) for x in rng.permutation(E)[:3]]], dtype=torch.int32)
        caches[0].step(ids, [p.data for p in a.params.values()], None, None)
        caches[1].step(ids, [p.data for p in b.params.values()], None, None, copy=lambda *args: copy_rows_triton(*args, block=16))
    for n in orig:
        x, y = a.params[n].data, b.params[n].data
        assert torch.equal(x.view(torch.uint8) if x.element_size() == 1 else x, y.view(torch.uint8) if y.element_size() == 1 else y), n
    assert_kernel_reads_the_logical_experts(b, orig)


# ------------------------------------------------------------------ the CPU expert path refuses FP8


def test_cpu_expert_path_takes_fp8_experts_and_refuses_stray_scales_naming_the_flag() -> None:
    for block in (False, True):  # FP8 with its weight scales: the CPU kernel computes them (issue 27)
        check_expert_weights(3, fp8_params(block=block), "fp8")
    p = {k: v for k, v in fp8_params(block=False).items() if k != "w2_weight_scale"}
    with pytest.raises(CpuPathConfigError, match=r"--cpu-experts \(REAP_CPU_EXPERTS=1\).*float8 experts without \['w2'\] weight scales"):
        check_expert_weights(3, p, "fp8")
    with pytest.raises(CpuPathConfigError, match="per-expert tensors"):
        check_expert_weights(3, {"w13_weight": torch.zeros(2, 4, 4), "w2_weight": torch.zeros(2, 4, 2), "w13_weight_scale": torch.ones(2)})
    check_expert_weights(0, {"w13_weight": torch.zeros(2, 4, 4, dtype=torch.bfloat16), "w2_weight": torch.zeros(2, 4, 2, dtype=torch.bfloat16)})
