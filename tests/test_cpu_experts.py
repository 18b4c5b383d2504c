"""CPU expert path (issue 16): split cost model, k-sum order, CPU kernel vs references. Fast, CPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from reap_swap.server_ext.cpu_experts.split import (
    CostModel,
    combine,
    missed_pairs_per_expert,
    pair_index,
    plan_split,
    stock_moe_sum,
)

B = 9_437_184  # one Qwen3-30B-A3B expert in bf16: (2*768*2048 + 2048*768) * 2 bytes


def _ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def _all_missed(ids: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(ids, dtype=torch.bool)


# --- split ----------------------------------------------------------------------------------


def test_equal_pipes_split_in_half():
    ids = _ids([[0, 1, 2, 3]])
    r = plan_split(ids, _all_missed(ids), 8, B, CostModel(link_GBps=50, cpu_GBps=50))
    assert int(r.n_cpu) == 2
    assert r.cpu_experts.tolist() == [True, True, False, False, False, False, False, False]
    assert r.link_experts.tolist() == [False, False, True, True, False, False, False, False]
    assert float(r.link_s) == pytest.approx(2 * B / 50e9)
    assert float(r.cpu_s) == pytest.approx(2 * B / 50e9)


def test_cpu_half_as_fast_takes_a_third():
    ids = _ids([[0, 1, 2, 3, 4, 5]])
    r = plan_split(ids, _all_missed(ids), 16, B, CostModel(link_GBps=50, cpu_GBps=25))
    assert int(r.n_cpu) == 2  # link 4B/50 == cpu 2B/25
    assert float(r.step_s) == pytest.approx(4 * B / 50e9)


def test_fixed_overhead_can_keep_everything_on_the_link():
    ids = _ids([[0, 1]])
    cost = CostModel(link_GBps=50, cpu_GBps=50, cpu_fixed_s=1.0)
    r = plan_split(ids, _all_missed(ids), 4, B, cost)
    assert int(r.n_cpu) == 0 and not r.cpu_experts.any() and r.link_experts.sum() == 2
    assert float(r.cpu_s) == 0.0


def test_tie_prefers_fewer_cpu_experts():
    ids = _ids([[3]])
    r = plan_split(ids, _all_missed(ids), 4, B, CostModel(link_GBps=50, cpu_GBps=50))
    assert int(r.n_cpu) == 0  # one expert: link B/50 == cpu B/50, stock path wins the tie


def test_cpu_takes_experts_with_fewest_pairs_then_lowest_id():
    # expert 7 used by 3 tokens, 5 by 2, 1/2/6 by one token each; 5 distinct, equal pipes
    ids = _ids([[7, 5], [7, 1], [7, 6], [5, 2]])
    cost = CostModel(link_GBps=50, cpu_GBps=50, cpu_per_pair_s=1e-9)
    r = plan_split(ids, _all_missed(ids), 8, B, cost)
    assert int(r.n_cpu) == 2
    assert r.cpu_experts.nonzero().reshape(-1).tolist() == [1, 2]
    assert r.cpu_pairs.tolist() == [[False, False], [False, True], [False, False], [False, True]]


def test_expert_used_by_many_tokens_costs_its_bytes_once():
    ids = _ids([[4, 0], [4, 1], [4, 2], [4, 3]])
    r = plan_split(ids, _all_missed(ids), 8, B, CostModel(link_GBps=50, cpu_GBps=50))
    # 5 distinct experts -> 2 on the CPU, 3 on the link, whatever the 4 tokens on expert 4
    assert int(r.n_cpu) == 2 and int(r.link_experts.sum()) == 3
    assert float(r.link_s) == pytest.approx(3 * B / 50e9)


def test_only_missed_pairs_count():
    ids = _ids([[0, 1], [2, 3]])
    missed = torch.tensor([[True, False], [False, True]])
    r = plan_split(ids, missed, 4, B, CostModel(link_GBps=50, cpu_GBps=50))
    assert missed_pairs_per_expert(ids, missed, 4).tolist() == [1, 0, 0, 1]
    assert int(r.n_cpu) == 1 and r.cpu_experts.tolist() == [True, False, False, False]
    assert not (r.cpu_pairs & ~missed).any()


def test_batch_threshold_sends_everything_to_the_link():
    ids = torch.arange(9 * 2).reshape(9, 2) % 16
    cost = CostModel(link_GBps=50, cpu_GBps=500, max_tokens=8)
    r = plan_split(ids, _all_missed(ids), 16, B, cost)
    assert int(r.n_cpu) == 0 and not r.cpu_pairs.any() and int(r.link_experts.sum()) == 16
    r8 = plan_split(ids[:8], _all_missed(ids[:8]), 16, B, cost)
    assert int(r8.n_cpu) > 0
    # a padded graph batch: 9 rows, 3 real tokens (padding rows not missed)
    missed = _all_missed(ids)
    missed[3:] = False
    rp = plan_split(ids, missed, 16, B, cost, num_tokens=torch.tensor(3))
    assert int(rp.n_cpu) > 0 and not rp.cpu_pairs[3:].any()


def test_forced_link_experts_stay_on_the_link():
    ids = _ids([[0, 1, 2, 3]])
    forced = torch.zeros(8, dtype=torch.bool)
    forced[0] = forced[1] = True
    r = plan_split(ids, _all_missed(ids), 8, B, CostModel(link_GBps=50, cpu_GBps=50), forced_link=forced)
    assert not (r.cpu_experts & forced).any()
    assert int(r.n_cpu) == 2 and r.cpu_experts.nonzero().reshape(-1).tolist() == [2, 3]


def test_fixed_shapes_and_dtypes():
    for t, k, e in [(1, 8, 128), (8, 8, 128), (3, 2, 4)]:
        ids = torch.randint(0, e, (t, k))
        r = plan_split(ids, torch.rand(t, k) < 0.6, e, B, CostModel(link_GBps=55, cpu_GBps=60, cpu_fixed_s=2e-5))
        assert r.cpu_experts.shape == (e,) and r.cpu_experts.dtype == torch.bool
        assert r.link_experts.shape == (e,) and r.cpu_pairs.shape == (t, k)
        assert not (r.cpu_experts & r.link_experts).any()
        assert r.n_cpu.dim() == 0 and r.link_s.dtype == torch.float64


def _brute_force(ids, missed, e, cost, forced):
    pairs = missed_pairs_per_expert(ids, missed, e).tolist()
    missed_e = [x for x in range(e) if pairs[x] > 0]
    eligible = [x for x in missed_e if not forced[x]]
    best = float("inf")
    for n in range(len(eligible) + 1):
        for subset in itertools.combinations(eligible, n):
            link = cost.link_s(len(missed_e) - n, B)
            cpu = cost.cpu_s(n, sum(pairs[x] for x in subset), B)
            best = min(best, max(link, cpu))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_split_is_the_optimum_of_the_model(seed):
    g = torch.Generator().manual_seed(seed)
    e, t, k = 10, int(torch.randint(1, 4, (1,), generator=g)), 3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    missed = torch.rand(t, k, generator=g) < 0.7
    forced = torch.rand(e, generator=g) < 0.2
    cost = CostModel(
        link_GBps=float(torch.empty(1).uniform_(20, 80, generator=g)),
        cpu_GBps=float(torch.empty(1).uniform_(10, 80, generator=g)),
        cpu_fixed_s=float(torch.empty(1).uniform_(0, 3e-4, generator=g)),
        cpu_per_expert_s=float(torch.empty(1).uniform_(0, 5e-5, generator=g)),
        cpu_per_pair_s=float(torch.empty(1).uniform_(0, 5e-5, generator=g)),
    )
    r = plan_split(ids, missed, e, B, cost, forced_link=forced)
    assert float(r.step_s) == pytest.approx(_brute_force(ids, missed, e, cost, forced.tolist()), rel=1e-12)
    # the prediction is the model's cost of the set actually chosen
    chosen_pairs = int(missed_pairs_per_expert(ids, missed, e)[r.cpu_experts].sum())
    assert float(r.cpu_s) == pytest.approx(cost.cpu_s(int(r.n_cpu), chosen_pairs, B))
    assert float(r.link_s) == pytest.approx(cost.link_s(int(r.link_experts.sum()), B))


def test_cost_model_rejects_nonsense():
    with pytest.raises(ValueError):
        CostModel(link_GBps=0, cpu_GBps=10)
    with pytest.raises(ValueError):
        CostModel(link_GBps=10, cpu_GBps=10, cpu_fixed_s=-1)


# --- k-sum order ----------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", ["auto", "scalar_seq", "fp32_seq"])
def test_combine_is_bit_exact_with_the_all_gpu_sum(k, mode):
    g = torch.Generator().manual_seed(k)
    t, h = 16, 256
    all_gpu = (torch.randn(t, k, h, generator=g) * torch.logspace(-3, 1, k)[None, :, None]).bfloat16()
    cpu_mask = torch.rand(t, k, generator=g) < 0.5
    garbage = torch.randn(t, k, h, generator=g).bfloat16() * 100
    gpu_partial = torch.where(cpu_mask[..., None], garbage, all_gpu)  # GPU never wrote the CPU's pairs
    cpu_per_k = torch.where(cpu_mask[..., None], all_gpu, -garbage)  # CPU only wrote its own pairs
    got = combine(gpu_partial, cpu_per_k, cpu_mask, mode)
    want = stock_moe_sum(all_gpu, mode)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_stock_orders_are_the_documented_loops():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 3, 64, generator=g) * 10).bfloat16()
    seq = torch.zeros(4, 64, dtype=torch.bfloat16)
    for j in range(3):
        seq = (seq.float() + x[:, j].float()).bfloat16()
    assert torch.equal(stock_moe_sum(x, "scalar_seq"), seq)
    assert torch.equal(stock_moe_sum(x, "auto"), seq)  # K = 3: vLLM's templated moe_sum
    f32 = x[:, 0].float() + x[:, 1].float() + x[:, 2].float()
    assert torch.equal(stock_moe_sum(x, "fp32_seq"), f32.bfloat16())


def test_adding_the_cpu_part_afterwards_is_not_stock_order():
    g = torch.Generator().manual_seed(1)
    t, k, h = 64, 4, 512
    all_gpu = (torch.randn(t, k, h, generator=g) * 4).bfloat16()
    cpu_mask = torch.zeros(t, k, dtype=torch.bool)
    cpu_mask[:, 0] = True
    naive = stock_moe_sum(torch.where(cpu_mask[..., None], 0, all_gpu), "scalar_seq") + all_gpu[:, 0]
    assert not torch.equal(naive, stock_moe_sum(all_gpu, "scalar_seq"))


def test_pair_index_places_cpu_outputs_in_the_per_k_cache():
    t, k, h = 3, 4, 8
    cpu_mask = torch.tensor([[True, False, False, True], [False] * 4, [False, True, False, False]])
    idx = pair_index(cpu_mask)
    assert idx.tolist() == [0, 3, 9]
    cache = torch.zeros(t * k, h)
    cpu_out = torch.arange(3 * h, dtype=torch.float32).reshape(3, h)
    cache.index_copy_(0, idx, cpu_out)
    assert torch.equal(cache.view(t, k, h)[cpu_mask], cpu_out)


# --- the CPU kernel -------------------------------------------------------------------------

from reap_swap.server_ext.cpu_experts import kernel as K  # noqa: E402


def _layer(e: int, h: int, i: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    return w13, w2, g


def _routing(t: int, k: int, e: int, g: torch.Generator):
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    return ids, w


def _assert_bf16_close(a: torch.Tensor, b: torch.Tensor) -> None:
    # a few bf16 ulps of the output's scale: different fp32 accumulation orders, one extra rounding
    scale = b.float().abs().max().clamp(min=1e-6)
    assert float((a.float() - b.float()).abs().max()) <= 2**-6 * float(scale)


def _backends() -> list[str]:
    out = ["torch", "linear"]
    if K.native_library() is not None:
        out.append("native")
    return out


def test_group_pairs_groups_by_expert_in_token_k_order():
    ids = torch.tensor([[5, 2], [2, 7], [5, 1]])
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.9, 0.1]])
    mask = torch.tensor([[True, True], [True, False], [True, True]])
    b = K.group_pairs(ids, w, mask, row_of_expert=torch.arange(8) + 100)
    assert b.experts.tolist() == [1, 2, 5]
    assert b.rows.tolist() == [101, 102, 105] and b.rows.dtype == torch.int32
    assert b.offsets.tolist() == [0, 1, 3, 5]
    assert b.flat.tolist() == [5, 1, 2, 0, 4]
    assert b.tokens.tolist() == [2, 0, 1, 0, 2]
    assert torch.equal(b.weights, torch.tensor([0.1, 0.4, 0.7, 0.6, 0.9]))


def test_cpu_threads_from_env(monkeypatch):
    assert K.CpuThreads.parse_cpus("8-11, 14") == (8, 9, 10, 11, 14)
    monkeypatch.setenv("REAP_CPU_EXPERT_CPUS", "2-3")
    monkeypatch.delenv("REAP_CPU_EXPERT_THREADS", raising=False)
    assert K.CpuThreads.from_env() == K.CpuThreads(n=2, cpus=(2, 3))
    monkeypatch.setenv("REAP_CPU_EXPERT_THREADS", "5")
    assert K.CpuThreads.from_env().n == 5


@pytest.mark.parametrize("shape", [(6, 64, 48, 1, 4), (6, 64, 48, 7, 4), (5, 72, 40, 9, 3), (8, 256, 128, 3, 8)])
def test_backends_match_the_reference(shape):
    e, h, i, t, k = shape
    w13, w2, g = _layer(e, h, i)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids, w = _routing(t, k, e, g)
    mask = torch.rand(t, k, generator=g) < 0.7
    mask[0, 0] = True
    batch = K.group_pairs(ids, w, mask)
    ref = K.CpuExperts("torch", K.CpuThreads(1)).run(x, w13, w2, batch)
    # the reference is the per-pair formula itself
    p = 0
    for lo, hi, e_ in zip(batch.offsets[:-1].tolist(), batch.offsets[1:].tolist(), batch.experts.tolist()):
        for p in range(lo, hi):
            xt = x[int(batch.tokens[p])].float()
            hh = (xt @ w13[e_].float().t()).to(torch.bfloat16)
            a = K.silu_and_mul_bf16(hh)
            want = ((a.float() @ w2[e_].float().t()) * batch.weights[p]).to(torch.bfloat16)
            assert torch.equal(ref[p], want)
    for backend in _backends():
        got = K.CpuExperts(backend, K.CpuThreads(2)).run(x, w13, w2, batch)
        _assert_bf16_close(got, ref)


def test_bank_rows_are_read_through_row_of_expert():
    e, h, i = 4, 64, 32
    w13, w2, g = _layer(e + 3, h, i)  # a bank with 3 slot rows before the host rows
    x = torch.randn(2, h, generator=g).to(torch.bfloat16)
    ids, w = _routing(2, 2, e, g)
    mask = torch.ones(2, 2, dtype=torch.bool)
    host = K.group_pairs(ids, w, mask, row_of_expert=torch.arange(e) + 3)
    direct = K.group_pairs(ids, w, mask)
    for backend in _backends():
        ce = K.CpuExperts(backend, K.CpuThreads(1))
        assert torch.equal(ce.run(x, w13, w2, host), ce.run(x, w13[3:], w2[3:], direct))


def test_empty_batch_and_bad_banks():
    w13, w2, _ = _layer(2, 32, 16)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    empty = K.group_pairs(torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.bool))
    assert K.CpuExperts("linear", K.CpuThreads(1)).run(x, w13, w2, empty).shape == (0, 32)
    with pytest.raises(ValueError):
        K.CpuExperts("linear", K.CpuThreads(1)).run(x, w13.float(), w2, empty)
    with pytest.raises(ValueError):
        K.CpuExperts("nope")


def test_a_split_step_equals_the_all_gpu_step():
    """GPU pairs from the reference arithmetic, CPU pairs from each backend, merged in k order."""
    e, h, i, t, k = 16, 128, 64, 4, 4
    w13, w2, g = _layer(e, h, i, seed=3)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids, w = _routing(t, k, e, g)
    all_pairs = K.group_pairs(ids, w, torch.ones(t, k, dtype=torch.bool))
    ref = K.CpuExperts("torch", K.CpuThreads(1))
    all_gpu = K.per_k_outputs(ref.run(x, w13, w2, all_pairs), all_pairs, t, k)
    split = plan_split(ids, torch.rand(t, k, generator=g) < 0.8, e, B, CostModel(link_GBps=50, cpu_GBps=50))
    cpu_batch = K.group_pairs(ids, w, split.cpu_pairs)
    assert cpu_batch.num_pairs > 0
    for backend in _backends():
        cpu_per_k = K.per_k_outputs(K.CpuExperts(backend, K.CpuThreads(2)).run(x, w13, w2, cpu_batch), cpu_batch, t, k)
        got = combine(all_gpu, cpu_per_k, split.cpu_pairs)
        want = stock_moe_sum(all_gpu)
        if backend == "torch":  # same arithmetic on both sides: bit-identical to the all-GPU step
            assert torch.equal(got, want)
        _assert_bf16_close(got, want)


def test_matches_vllm_cpu_fused_moe_on_a_tiny_layer():
    ops = pytest.importorskip("vllm._custom_ops")
    if not hasattr(torch.ops._C, "cpu_fused_moe"):
        pytest.skip("this vLLM build has no CPU fused MoE")
    e, h, i, t, k = 8, 64, 64, 3, 2
    w13, w2, g = _layer(e, h, i, seed=7)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids, w = _routing(t, k, e, g)
    out = torch.empty(t, h, dtype=torch.bfloat16)
    ops.cpu_fused_moe(
        out, x, ops.cpu_prepack_moe_weight(w13, "vec"), ops.cpu_prepack_moe_weight(w2, "vec"),
        None, None, w.float(), ids.to(torch.int32), "silu", "vec",
    )
    batch = K.group_pairs(ids, w, torch.ones(t, k, dtype=torch.bool))
    for backend in _backends():
        per_k = K.per_k_outputs(K.CpuExperts(backend, K.CpuThreads(2)).run(x, w13, w2, batch), batch, t, k)
        _assert_bf16_close(stock_moe_sum(per_k), out)


def test_native_threads_pin_to_their_cores_and_leave_the_caller_alone():
    import os
    import threading

    if K.native_library() is None or not hasattr(os, "sched_getaffinity"):
        pytest.skip(f"native backend unavailable: {K.native_error()}")
    main_mask = os.sched_getaffinity(0)
    core = min(main_mask)
    w13, w2, g = _layer(4, 64, 32)
    x = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    ids, w = _routing(2, 2, 4, g)
    batch = K.group_pairs(ids, w, torch.ones(2, 2, dtype=torch.bool))
    seen: dict[str, object] = {}

    def worker() -> None:  # the dedicated host thread of the CPU expert path
        seen["out"] = K.CpuExperts("native", K.CpuThreads(2, cpus=(core,))).run(x, w13, w2, batch)
        seen["mask"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    try:
        assert seen["mask"] == {core}
        assert os.sched_getaffinity(0) == main_mask
        unpinned = K.CpuExperts("native", K.CpuThreads(2)).run(x, w13, w2, batch)
        assert torch.equal(seen["out"], unpinned)
        assert os.sched_getaffinity(0) == main_mask
    finally:
        K.CpuExperts("native", K.CpuThreads(2))  # leave the process unpinned
