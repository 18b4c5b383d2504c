"""The CPU expert step job (issue 16): staged inputs in, per-(token, k) outputs out, as the host
callback runs it -- checked against the reference arithmetic and the pure split/merge rules."""

from __future__ import annotations

import pytest
import torch

from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts.split import CostModel, plan_split, stock_moe_sum
from reap_swap.server_ext.cpu_experts.step import BankRows, CpuStep

pytestmark = pytest.mark.skipif(K.native_library() is None, reason=f"native CPU kernel unavailable: {K.native_error()}")


def _bank(e: int, h: int, i: int, offset: int, seed: int = 0) -> tuple[BankRows, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(offset + e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(offset + e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    w13[:offset] = float("nan")  # slot rows: the step must never read them
    w2[:offset] = float("nan")
    return BankRows(w13, w2, offset, e), w13[offset:], w2[offset:]


def _reference_per_k(x, w13, w2, ids, w, mask) -> torch.Tensor:
    t, k = ids.shape
    batch = K.group_pairs(ids, w, mask)
    out = K.CpuExperts("torch", K.CpuThreads(1)).run(x, w13, w2, batch)
    return K.per_k_outputs(out, batch, t, k)


@pytest.mark.parametrize("t,k,e,h,i", [(1, 8, 16, 64, 32), (3, 4, 12, 96, 48), (8, 8, 32, 128, 64)])
def test_step_writes_each_cpu_pair_at_its_place(t, k, e, h, i):
    bank, w13, w2 = _bank(e, h, i, offset=5, seed=t)
    g = torch.Generator().manual_seed(10 + t)
    step = CpuStep(bank, max_tokens=8, top_k=k, threads=K.CpuThreads(2))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    mask = torch.rand(t, k, generator=g) < 0.5
    mask[0, 0] = True
    sentinel = torch.full_like(step.out, 7.0)
    step.out.copy_(sentinel)
    assert step.stage(x, ids, w, mask) == t
    step.run(t)
    want = _reference_per_k(x, w13, w2, ids.long(), w, mask)
    got = step.out[:t]
    scale = want.float().abs().max().clamp(min=1e-6)
    assert float((got[mask].float() - want[mask].float()).abs().max()) <= 2**-6 * float(scale)
    assert torch.equal(got[~mask], sentinel[:t][~mask])  # the GPU's places are untouched
    s = step.stats()
    experts = len(set(ids[mask].tolist()))
    assert (s["calls"], s["experts"], s["pairs"], s["status"]) == (1, experts, int(mask.sum()), 0)
    assert s["bytes"] == experts * bank.expert_bytes and s["ns"] > 0


def test_merge_then_stock_sum_is_the_all_gpu_step_when_arithmetic_agrees():
    """The merge puts CPU outputs at their (token, k) places before the stock k-sum."""
    e, h, i, t, k = 16, 64, 32, 4, 8
    bank, w13, w2 = _bank(e, h, i, offset=0, seed=3)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    all_gpu = _reference_per_k(x, w13, w2, ids, w, torch.ones(t, k, dtype=torch.bool))
    split = plan_split(ids, torch.rand(t, k, generator=g) < 0.7, e, bank.expert_bytes, CostModel(link_GBps=50, cpu_GBps=50))
    step = CpuStep(bank, max_tokens=t, top_k=k, threads=K.CpuThreads(2))
    step.stage(x, ids.to(torch.int32), w, split.cpu_pairs)
    step.run(t)
    gpu_side = torch.where(split.cpu_pairs[..., None], torch.zeros_like(all_gpu), all_gpu)  # the GPU never computed them
    merged = step.merge(gpu_side, split.cpu_pairs)
    assert torch.equal(merged[~split.cpu_pairs], all_gpu[~split.cpu_pairs])
    got, want = stock_moe_sum(merged), stock_moe_sum(all_gpu)
    scale = want.float().abs().max()
    assert float((got.float() - want.float()).abs().max()) <= 2**-6 * float(scale)


def test_nothing_masked_computes_nothing_and_bad_ids_are_reported():
    bank, _, _ = _bank(8, 32, 16, offset=2)
    step = CpuStep(bank, max_tokens=2, top_k=2, threads=K.CpuThreads(1))
    x = torch.zeros(2, 32, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    step.stage(x, ids, torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.bool))
    step.run(2)
    assert step.stats()["experts"] == 0 and step.stats()["calls"] == 1
    step.stage(x, torch.tensor([[0, 9], [2, 3]], dtype=torch.int32), torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="outside 0..7"):
        step.run(2)
    with pytest.raises(ValueError, match="1..2"):
        step.job(3)
    with pytest.raises(ValueError, match="do not fit"):
        step.stage(torch.zeros(2, 16, dtype=torch.bfloat16), ids, torch.ones(2, 2), torch.ones(2, 2, dtype=torch.bool))


def test_a_step_past_its_pair_budget_is_refused_not_computed():
    """The job's scratch holds max_pairs CPU pairs (the split's budget): a mask with more is refused
    (status, no expert computed, no write past the scratch); one within it computes."""
    bank, _, _ = _bank(8, 32, 16, offset=2)
    with pytest.raises(ValueError, match="max_pairs"):
        CpuStep(bank, max_tokens=4, top_k=2, threads=K.CpuThreads(1), max_pairs=9)
    step = CpuStep(bank, max_tokens=4, top_k=2, threads=K.CpuThreads(2), max_pairs=3)
    x = torch.randn(4, 32).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]], dtype=torch.int32)
    three = torch.zeros(4, 2, dtype=torch.bool)
    three[0, 0] = three[2, 1] = three[3, 0] = True
    step.stage(x, ids, torch.ones(4, 2), three)
    step.run(4)
    assert (step.stats()["pairs"], step.stats()["status"]) == (3, 0)
    step.stage(x, ids, torch.ones(4, 2), torch.ones(4, 2, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="more than its 3 pairs"):
        step.run(4)
    assert step.stats()["pairs"] == 3  # nothing computed for the refused step


def test_bank_rows_are_validated():
    w13 = torch.zeros(4, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not \\[R, 2I, H\\]"):
        BankRows(w13, torch.zeros(4, 16, 5, dtype=torch.bfloat16), 0, 4)
    with pytest.raises(ValueError, match="bf16"):
        BankRows(w13.float(), torch.zeros(4, 16, 4), 0, 4)
    with pytest.raises(ValueError, match="exceed"):
        BankRows(w13, torch.zeros(4, 16, 4, dtype=torch.bfloat16), 1, 4)


def test_one_program_cuda_split_equals_plan_split() -> None:
    """The CUDA path's Triton split (interpreted) gives plan_split's masks, GPU ids, staging and counters exactly.
    In a subprocess: Triton's reductions run interpreted only when TRITON_INTERPRET is set before it is imported."""
    pytest.importorskip("triton")
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.split_triton_check"], cwd=Path(__file__).resolve().parents[1], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "split_triton == plan_split" in proc.stdout


@pytest.mark.parametrize("h,i", [(64, 24), (96, 48)])
def test_step_reads_padded_bank_rows(h, i):
    """A paged bank pads awkward rows (learned128: 6 KiB -> 8 KiB, bank_layout.py): the step follows the
    row stride and never reads the padding (filled with NaN here)."""
    from reap_swap.server_ext.bank.bank import strided_rows

    e, offset, t, k = 16, 4, 2, 8
    ref_bank, w13, w2 = _bank(e, h, i, offset=offset, seed=7)
    rows = offset + e
    strides = [1 << (2 * i * h * 2 - 1).bit_length(), 1 << (h * i * 2 - 1).bit_length()]
    p13 = strided_rows(torch.full((rows * strides[0] // 2,), float("nan"), dtype=torch.bfloat16).view(torch.uint8), rows, strides[0], (2 * i, h), torch.bfloat16)
    p2 = strided_rows(torch.full((rows * strides[1] // 2,), float("nan"), dtype=torch.bfloat16).view(torch.uint8), rows, strides[1], (h, i), torch.bfloat16)
    p13.copy_(ref_bank.w13)
    p2.copy_(ref_bank.w2)
    assert p13.stride(0) * 2 > 2 * i * h * 2  # really padded
    bank = BankRows(p13, p2, offset, e)
    g = torch.Generator().manual_seed(8)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    mask = torch.ones(t, k, dtype=torch.bool)
    step = CpuStep(bank, max_tokens=t, top_k=k, threads=K.CpuThreads(2))
    step.stage(x, ids, w, mask)
    step.run(t)
    want = _reference_per_k(x, w13, w2, ids.long(), w, mask)
    got = step.out[:t]
    assert bool(torch.isfinite(got.float()).all())
    assert float((got.float() - want.float()).abs().max()) <= 2**-6 * float(want.float().abs().max())
