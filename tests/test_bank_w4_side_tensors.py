"""4-bit (W4A16, Marlin) experts through the slot bank (issue 27 item 3): the per-expert tensors vLLM's
compressed-tensors WNA16 and GPTQ-Marlin MoE methods leave after ``process_weights_after_loading``.

After Marlin repacking every per-expert tensor has the expert dim leading: the packed int32 weights
(``w13_weight_packed`` / ``w13_qweight`` ``[E, K/16, 2N*16/8]``) are banked, the group scales (bf16/fp16
``[E, K/group, 2N]``), zero points, act-order ``g_idx`` and sort indices (int32 ``[E, K]``, or ``[E, 0]``
without act order) and compressed-tensors' ``[E, 2]`` shape records are side tensors with the weights'
physical rows. The 30B-A3B shape at group 128 needs 168 physical rows (38 slots, 2 MiB pages); with
the shape records banked it needed hundreds of thousands. On CPU tensors of those dtypes, swaps,
RAM-complement exchanges and the online cache's promotions keep every side row at its weights' row,
and the kernel-operand check refuses monolithic kernels and per-expert copies the kernel holds.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from reap_swap.server_ext.bank.bank import ComplementSpec, ExpertBank, PlainBacking
from tests.bank_checks import check_random_swaps
from reap_swap.server_ext.bank.bank_layout import MAX_PHYSICAL_ROWS, check_kernel_rows, page_layout
from reap_swap.server_ext.bank.side_tensors import is_side_tensor, split_params
from reap_swap.server_ext.cache.online_cache import CacheParams, LayerCache
from reap_swap.server_ext.cpu_experts.cpu_path import CpuPathConfigError, check_expert_weights

PAGE = 2 * 2**20
E30, H30, I30 = 128, 2048, 768  # Qwen3-30B-A3B: experts, hidden, moe intermediate


def w4_30b_row_bytes(scheme: str, group: int = 128, act_order: bool = False, asym: bool = False) -> dict[str, int]:
    """Per-expert bytes of the 30B-A3B shape's 4-bit parameters after Marlin repacking, by vLLM's names:
    ``ct`` = CompressedTensorsWNA16(Marlin)MoEMethod, ``gptq`` = GPTQMarlinMoEMethod. Marlin packs a
    [K, N] 4-bit matrix as int32 [K/16, N*16/8]; scales stay [K/group, N] in the model dtype."""
    w13 = (H30 // 16) * (2 * I30 * 16 // 8) * 4  # 1.5 MiB
    w2 = (I30 // 16) * (H30 * 16 // 8) * 4  # 768 KiB
    s13, s2 = (H30 // group) * 2 * I30 * 2, (I30 // group) * H30 * 2
    z13, z2 = (H30 // group) * (2 * I30 // 8) * 4, (I30 // group) * (H30 // 8) * 4
    gi13, gi2 = (H30 * 4, I30 * 4) if act_order else (0, 0)
    if scheme == "ct":
        rows = {"w13_weight_packed": w13, "w2_weight_packed": w2, "w13_weight_scale": s13, "w2_weight_scale": s2,
                "w2_weight_shape": 4, "w13_weight_shape": 4, "w13_weight_g_idx": gi13, "w2_weight_g_idx": gi2,
                "w13_g_idx_sort_indices": gi13, "w2_g_idx_sort_indices": gi2}
        if asym:
            rows |= {"w13_weight_zero_point": z13, "w2_weight_zero_point": z2}
        return rows
    assert scheme == "gptq"
    return {"w13_qweight": w13, "w2_qweight": w2, "w13_scales": s13, "w2_scales": s2, "w13_qzeros": z13 // 2, "w2_qzeros": z2 // 2,
            "w13_g_idx": gi13, "w2_g_idx": gi2, "w13_g_idx_sort_indices": gi13, "w2_g_idx_sort_indices": gi2}


@pytest.mark.parametrize("scheme", ["ct", "gptq"])
@pytest.mark.parametrize("act_order", [False, True])
def test_the_30b_w4_bank_fits_the_kernel(scheme: str, act_order: bool) -> None:
    rows = w4_30b_row_bytes(scheme, act_order=act_order, asym=scheme == "ct")
    banked, side = split_params(rows)
    assert banked == ([f"{m}_weight_packed" for m in ("w13", "w2")] if scheme == "ct" else ["w13_qweight", "w2_qweight"])
    assert set(side) == set(rows) - set(banked)
    full = check_kernel_rows(page_layout(38, E30, [rows[n] for n in banked], PAGE))
    assert (full.host_row_offset, full.num_rows) == (40, 168)
    ram = check_kernel_rows(page_layout(38, E30 - 38 + 4, [rows[n] for n in banked], PAGE, pad=False))
    assert ram.num_rows <= MAX_PHYSICAL_ROWS
    if scheme == "ct":  # the [E, 2] shape records banked (before they were side tensors): 4-byte rows, a page of them
        old = page_layout(38, E30, [rows[n] for n in banked] + [4, 4], PAGE)
        assert old.num_rows > MAX_PHYSICAL_ROWS
        with pytest.raises(ValueError, match="physical rows"):
            check_kernel_rows(old)


def test_group_32_scales_are_banked_and_still_fit() -> None:
    """Group-32 scales of the 30B shape are 192 / 96 KiB an expert: over the side limit, so banked (paged)."""
    rows = w4_30b_row_bytes("ct", group=32)
    banked, side = split_params(rows)
    assert banked == ["w13_weight_packed", "w2_weight_packed", "w13_weight_scale", "w2_weight_scale"]
    lay = check_kernel_rows(page_layout(38, E30, [rows[n] for n in banked], PAGE))
    assert lay.num_rows <= MAX_PHYSICAL_ROWS


def test_w4_side_tensor_names() -> None:
    for name in ("w13_weight_shape", "w2_weight_shape", "w13_weight_g_idx", "w2_g_idx_sort_indices", "w13_weight_zero_point",
                 "w13_qzeros", "w2_scales"):
        assert is_side_tensor(name, 8), name
    for name in ("w13_weight_packed", "w2_weight_packed", "w13_qweight", "w2_qweight"):
        assert not is_side_tensor(name, 8), "packed weight matrices stay banked"
    assert is_side_tensor("w13_g_idx", 0) and is_side_tensor("anything", 0), "zero-byte rows (g_idx without act order) are never paged"


# ------------------------------------------------------------------ a bank of W4A16-like experts on CPU

E, S, K, N2 = 12, 4, 256, 64  # experts, slots; w13 packed [K/16, N2*2] int32 = 8 KiB, w2 [N2/2/16, K*2] = 4 KiB
GROUP = 64
SMALL_PAGE = 64 * 2**10  # banked 4-byte shape records would need 16384 rows before the host region


def w4_params(scheme: str, act_order: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bits in Marlin's post-repack shapes and dtypes (the bank moves bytes: layout, not values, matters)."""
    gen = torch.Generator().manual_seed(seed)

    def bits(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(torch.int32)

    def perm_rows(k: int) -> torch.Tensor:
        return torch.stack([torch.randperm(k, generator=gen) for _ in range(E)]).to(torch.int32)

    half = N2 // 2
    p = {"w13": bits(E, K // 16, N2 * 2), "w2": bits(E, half // 16, K * 2),
         "s13": (torch.rand(E, K // GROUP, N2, generator=gen) + 0.5).to(torch.bfloat16),
         "s2": (torch.rand(E, max(1, half // GROUP), K, generator=gen) + 0.5).to(torch.bfloat16)}
    g13, g2 = (perm_rows(K), perm_rows(half)) if act_order else (torch.empty(E, 0, dtype=torch.int32), torch.empty(E, 0, dtype=torch.int32))
    if scheme == "ct":
        return {"w13_weight_packed": p["w13"], "w2_weight_packed": p["w2"], "w13_weight_scale": p["s13"], "w2_weight_scale": p["s2"],
                "w2_weight_shape": torch.rand(E, 2, generator=gen).to(torch.bfloat16), "w13_weight_shape": torch.rand(E, 2, generator=gen).to(torch.bfloat16),
                "w13_weight_g_idx": g13 // GROUP if act_order else g13, "w2_weight_g_idx": g2 // GROUP if act_order else g2,
                "w13_g_idx_sort_indices": g13.clone(), "w2_g_idx_sort_indices": g2.clone()}
    return {"w13_qweight": p["w13"], "w2_qweight": p["w2"], "w13_scales": p["s13"].half(), "w2_scales": p["s2"].half(),
            "w13_qzeros": bits(E, K // GROUP, N2 * 2 // 8), "w2_qzeros": bits(E, max(1, half // GROUP), K // 8),
            "w13_g_idx": g13, "w2_g_idx": g2, "w13_g_idx_sort_indices": g13.clone(), "w2_g_idx_sort_indices": g2.clone()}


def make_bank(scheme: str, act_order: bool, complement: ComplementSpec | None = None) -> tuple[ExpertBank, dict[str, torch.Tensor]]:
    orig = w4_params(scheme, act_order)
    params = {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in orig.items()}
    bank = ExpertBank(0, params, torch.zeros(E, dtype=torch.int32), S, PlainBacking(torch.device("cpu"), page=SMALL_PAGE), complement)
    return bank, orig


def assert_kernel_reads_the_logical_experts(bank: ExpertBank, orig: dict[str, torch.Tensor]) -> None:
    """Gather every parameter at ``phys_map[e]`` (what the Marlin kernel does with its expert ids) and
    compare with expert e: weights, scales, zero points, g_idx and sort indices alike."""
    phys = bank.phys_map.long()
    for n, t in orig.items():
        got = bank.params[n].data[phys]
        assert got.dtype == t.dtype and torch.equal(got, t), n


CASES = [("ct", False), ("ct", True), ("gptq", False), ("gptq", True)]


@pytest.mark.parametrize(("scheme", "act_order"), CASES)
def test_the_layout_keeps_w4_side_tensors_beside_the_paged_weights(scheme: str, act_order: bool) -> None:
    bank, orig = make_bank(scheme, act_order)
    weights = [n for n in orig if n.endswith(("_weight_packed", "_qweight"))]
    assert bank.banked == weights and bank.side == [n for n in orig if n not in weights]
    lay = bank.layout
    assert len(lay.row_strides) == 2 and lay.num_rows == bank.physical_rows <= MAX_PHYSICAL_ROWS
    for n in bank.side:
        t = bank.params[n].data
        assert t.shape == (lay.num_rows, *orig[n].shape[1:]) and t.dtype == orig[n].dtype
    assert bank.link_bytes == sum(bank.row_bytes[n] for n in weights), "link bytes: the packed weights"
    assert bank.host_bytes == E * sum(lay.row_strides)
    assert_kernel_reads_the_logical_experts(bank, orig)


@pytest.mark.parametrize(("scheme", "act_order"), CASES)
def test_swaps_move_w4_side_tensors_with_weights(scheme: str, act_order: bool) -> None:
    bank, orig = make_bank(scheme, act_order)
    check_random_swaps(bank, E, S, lambda: assert_kernel_reads_the_logical_experts(bank, orig))


@pytest.mark.parametrize(("scheme", "act_order"), CASES)
def test_ram_complement_exchanges_move_w4_side_tensors(scheme: str, act_order: bool) -> None:
    bank, orig = make_bank(scheme, act_order, ComplementSpec(spares=2, start=(0, 1, 2, 3)))
    comp = bank.complement
    assert comp is not None and len(comp.rows.block) == 2
    rng = np.random.default_rng(2)
    for _ in range(12):
        bank.swap(tuple(int(x) for x in rng.choice(E, size=S, replace=False)))
        assert bank.check() == [] and bank.verify() == []
        assert_kernel_reads_the_logical_experts(bank, orig)
    assert bank.counters.h2d_bytes % sum(comp.rows.block) == 0


@pytest.mark.parametrize("complement", [False, True])
@pytest.mark.parametrize(("scheme", "act_order"), [("ct", True), ("gptq", False)])
def test_online_cache_promotions_move_w4_side_tensors(scheme: str, act_order: bool, complement: bool) -> None:
    spec = ComplementSpec(spares=2, start=(0, 1, 2, 3)) if complement else None
    bank, orig = make_bank(scheme, act_order, spec)
    bank.swap((0, 1, 2, 3))
    comp = bank.complement
    cache = LayerCache(E, S, bank.table.host_row_offset, bank.phys_map, CacheParams(2, 0.9, None),
                       host_rows=comp.rows.num_rows if comp is not None else None)
    cache.install(bank.table.owners(), prior=(0, 1, 2, 3), protected=(), row_owners=comp.rows.owners() if comp is not None else None)
    rows = [p.data for n, p in bank.params.items() if bank.row_bytes[n] > 0]  # the layer's copy list (zero-byte rows left out)
    rng = np.random.default_rng(3)
    for _ in range(30):
        ids = torch.tensor([[int(x) for x in rng.permutation(E)[:3]] for _ in range(2)], dtype=torch.int32)
        out = cache.step(ids, rows, None, None)
        for n, t in orig.items():
            assert torch.equal(bank.params[n].data[out.long()], t[ids.long()]), n
        assert_kernel_reads_the_logical_experts(bank, orig)
    assert int(cache.counters()["promotions"]) > 5


# ------------------------------------------------------------------ load-time refusals


def _stand_in(bank: ExpertBank, *, monolithic: bool = False, experts_attrs: dict | None = None, qc_attrs: dict | None = None):
    experts = types.SimpleNamespace(is_monolithic=lambda: monolithic, **(experts_attrs or {}))
    qm = type("CompressedTensorsWNA16MarlinMoEMethod", (), {})()
    qm.moe_kernel = types.SimpleNamespace(fused_experts=experts)
    qm.moe_quant_config = types.SimpleNamespace(**(qc_attrs or {}))
    return qm


def test_kernel_operand_check_accepts_the_banks_tensors_and_refuses_copies() -> None:
    from reap_swap.server_ext.layer import kernel_operand_problem

    bank, orig = make_bank("ct", True)
    p = bank.params
    ok = _stand_in(bank, experts_attrs={"w13_g_idx": p["w13_weight_g_idx"], "w2_g_idx_sort_indices": p["w2_g_idx_sort_indices"],
                                        "workspace": torch.zeros(E * 4, dtype=torch.int32)},
                   qc_attrs={"w1_scale": p["w13_weight_scale"], "w2_scale": p["w2_weight_scale"], "w1_zp": None})
    assert kernel_operand_problem(3, ok, bank) is None
    stale = _stand_in(bank, experts_attrs={"w13_g_idx": orig["w13_weight_g_idx"]}, qc_attrs={"w1_scale": p["w13_weight_scale"]})
    assert "own per-expert w13_g_idx (12, 256)" in kernel_operand_problem(3, stale, bank)
    stale_scale = _stand_in(bank, qc_attrs={"w1_scale": orig["w13_weight_scale"]})
    assert "CompressedTensorsWNA16MarlinMoEMethod's kernel holds its own per-expert w1_scale" in kernel_operand_problem(3, stale_scale, bank)
    mono = _stand_in(bank, monolithic=True)
    assert "monolithic fused-MoE kernel" in kernel_operand_problem(3, mono, bank)
    prop = _stand_in(bank)
    type(prop).is_monolithic = property(lambda self: True)  # vLLM's FusedMoEMethodBase.is_monolithic is a property
    assert "routes inside the kernel" in kernel_operand_problem(3, prop, bank)


def test_cpu_expert_path_refuses_w4_experts() -> None:
    p = w4_params("ct", False)
    with pytest.raises(CpuPathConfigError, match=r"compressed-tensors.*per-expert tensors.*no w13_weight/w2_weight"):
        check_expert_weights(0, p, "compressed-tensors")
