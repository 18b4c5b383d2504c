"""The composed fast mode's one decision per miss (issue 25), on CPU tensors: the split runs first and
gives the CPU the coldest misses by the online cache's scores, the cache promotes only from the link's
share, the CPU's pairs read the filler row, and the merged layer output is the stock one."""

from __future__ import annotations

import pytest
import torch

from reap_swap.server_ext.cache.online_cache import CacheParams, LayerCache, check_bijection
from reap_swap.server_ext.cpu_experts import cpu_path as cp
from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts.split import CostModel, plan_split
from reap_swap.server_ext.cpu_experts.step import BankRows

needs_native = pytest.mark.skipif(K.native_library() is None, reason=f"native CPU kernel unavailable: {K.native_error()}")


def test_priority_gives_the_cpu_the_lowest_scores_and_ties_fall_back_to_pairs_then_id() -> None:
    ids = torch.tensor([[0, 1, 2, 3]])
    missed = torch.ones(1, 4, dtype=torch.bool)
    cost = CostModel(link_GBps=50, cpu_GBps=50)  # equal pipes: two of four to the CPU
    plain = plan_split(ids, missed, 8, 1 << 20, cost)
    assert int(plain.n_cpu) == 2 and plain.cpu_experts.nonzero().view(-1).tolist() == [0, 1]  # (pairs, id)
    prio = torch.tensor([5.0, 1.0, 3.0, 0.5, 0, 0, 0, 0])
    split = plan_split(ids, missed, 8, 1 << 20, cost, priority=prio)
    assert split.cpu_experts.nonzero().view(-1).tolist() == [1, 3]  # the two coldest
    assert int(split.n_cpu) == 2 and torch.equal(split.link_s, plain.link_s)  # the count is the cost model's, not the order's
    tie = plan_split(ids, missed, 8, 1 << 20, cost, priority=torch.tensor([2.0, 2.0, 2.0, 9.0, 0, 0, 0, 0]))
    assert tie.cpu_experts.nonzero().view(-1).tolist() == [0, 1]
    # an expert with two missed pairs ties on score with one that has one: the CPU takes the cheaper one
    ids2 = torch.tensor([[0, 1], [0, 2]])
    two = plan_split(ids2, torch.ones(2, 2, dtype=torch.bool), 8, 1 << 20, CostModel(link_GBps=50, cpu_GBps=25),
                     priority=torch.tensor([1.0, 1.0, 7.0, 0, 0, 0, 0, 0]))
    assert two.cpu_experts.nonzero().view(-1).tolist() == [1]


def _layer(e: int, h: int, i: int, slots: int, seed: int) -> tuple[list[torch.Tensor], BankRows, torch.Tensor]:
    """A full-copy bank: rows [0, slots) slots, row ``slots`` a zero padding row (the filler), [slots + 1, + E) host rows."""
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    off = slots + 1
    rows = [torch.zeros(off + e, *w.shape[1:], dtype=w.dtype) for w in (w13, w2)]
    rows[0][off:], rows[1][off:] = w13, w2
    phys_map = off + torch.arange(e, dtype=torch.int32)
    return rows, BankRows(rows[0], rows[1], off, e), phys_map


def _per_k(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the fused kernel's per-(token, k) cache holds for these row ids (the CPU kernel's arithmetic)."""
    t, k = ids.shape
    batch = K.group_pairs(ids, w, torch.ones(t, k, dtype=torch.bool))
    return K.per_k_outputs(K.CpuExperts("torch", K.CpuThreads(1)).run(x, w13, w2, batch), batch, t, k)


@needs_native
def test_composed_steps_split_first_promote_the_link_share_and_merge_to_the_stock_output() -> None:
    e, h, i, slots, k = 16, 64, 32, 5, 4
    rows, bank, phys_map = _layer(e, h, i, slots, seed=3)
    off = bank.row_offset
    logical_w13, logical_w2 = rows[0][off:].clone(), rows[1][off:].clone()
    cache = LayerCache(e, slots, off, phys_map, CacheParams(cap=2, decay=0.9))
    cache.install([-1] * slots)
    cost = CostModel(link_GBps=50, cpu_GBps=40, max_tokens=4)
    path = cp.LayerCpuPath(bank, k, slots, cp.CpuPathSettings(enabled=True, max_tokens=4), cost, K.CpuThreads(2), torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    hot = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    cpu_total = promoted_total = 0
    for step in range(40):
        t = int(torch.randint(1, 4, (1,), generator=g))
        ids = torch.stack([hot[torch.randperm(8, generator=g)[:k]] if step % 5 else torch.randperm(e, generator=g)[:k] for _ in range(t)])
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        w = torch.softmax(torch.randn(t, k, generator=g), -1)
        score_before = cache.score.clone()
        resident_before = phys_map < off
        phys = phys_map[ids].to(ids.dtype)
        path.before_experts(x, ids, w, phys, off, priority=cache.score)
        pairs = path.pending_pairs
        assert pairs is not None
        want = plan_split(ids, ~resident_before[ids], e, bank.expert_bytes, cost, priority=score_before)
        assert torch.equal(pairs, want.cpu_pairs)
        on_cpu = set(ids[pairs].tolist())
        link = set(ids[~resident_before[ids]].tolist()) - on_cpu
        if on_cpu and link:  # the CPU's experts are the coldest misses
            assert max(float(score_before[x]) for x in on_cpu) <= min(float(score_before[x]) for x in link)
        promos_before = int(cache.promotions)
        gpu_ids = cache.step(ids, rows, cpu_pairs=pairs, filler=slots)
        newly = {x for x in range(e) if not resident_before[x] and phys_map[x] < off}
        assert newly <= link, f"step {step}: promoted {newly} outside the link's share {link}"
        assert torch.equal(gpu_ids[pairs], torch.full_like(gpu_ids[pairs], slots))  # the filler (padding) row
        assert check_bijection(cache.expert_in_slot.tolist(), phys_map.tolist(), off) == []
        # the fused kernel: every non-CPU pair reads its expert's bytes through the remapped ids
        per_k = _per_k(x, rows[0], rows[1], gpu_ids, w)
        ref = _per_k(x, logical_w13, logical_w2, ids, w)
        assert torch.equal(per_k[~pairs], ref[~pairs])
        merged = path.merge(per_k.reshape(t * k, -1)).view(t, k, -1)
        assert path.abandon() is True
        assert torch.equal(merged[~pairs], ref[~pairs])
        scale = float(ref.float().abs().max())
        assert float((merged - ref).float().abs().max()) <= 2**-6 * scale
        cpu_total += int(pairs.sum())
        promoted_total += int(cache.promotions) - promos_before
    assert cpu_total > 0 and promoted_total > 0, (cpu_total, promoted_total)


def test_serve_fast_turns_on_the_cache_and_the_cpu_path(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from reap_swap.server_ext import config as reap_config
    from reap_swap.server_ext.launcher import ServeError, build_parser, plan_env

    monkeypatch.setattr(os, "cpu_count", lambda: 16)

    def env(*flags: str) -> dict[str, str]:
        args, _ = build_parser().parse_known_args(["--model", str(tiny_model_dir), "--resident-experts-per-layer", "8", *flags])
        return plan_env(args)

    fast = env("--fast")
    assert fast[cp.ENV_CPU_EXPERTS] == "1" and fast[reap_config.ENV_ONLINE_CACHE] == "lfru"
    tuned = env("--fast", "--online-cache-cap", "2", "--cpu-experts-cpus", "2-5")
    assert tuned[reap_config.ENV_CACHE_CAP] == "2" and tuned["REAP_CPU_EXPERT_CPUS"] == "2-5"
    assert reap_config.ENV_ONLINE_CACHE not in env() and cp.ENV_CPU_EXPERTS not in env()
    assert env("--fast", "--ram-complement")[reap_config.ENV_COMPLEMENT] == "1"
    with pytest.raises(ServeError, match="--online-cache-.* need --online-cache"):
        env("--online-cache-cap", "2")


@needs_native
def test_composed_with_the_ram_complement_the_cpu_reads_the_row_the_table_points_at() -> None:
    """RAM complement: host rows only for non-resident experts (+ spares), rotated by every evicting
    promotion; the CPU computes its pairs from the row the routing table names, so outputs stay stock."""
    e, h, i, slots, k, spares = 16, 64, 32, 5, 4, 2
    r = e - slots + spares
    g = torch.Generator().manual_seed(7)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    off = slots + 1  # row ``slots``: the zero padding row, the CPU pairs' filler
    rows = [torch.zeros(off + r, *w.shape[1:], dtype=w.dtype) for w in (w13, w2)]
    phys_map = torch.empty(e, dtype=torch.int32)
    row_owner = [-1] * r
    for x in range(e):
        row = x if x < slots else off + (x - slots)  # experts 0..4 resident, the rest in host rows 0..10
        phys_map[x] = row
        if x >= slots:
            row_owner[x - slots] = x
        rows[0][row], rows[1][row] = w13[x], w2[x]
    cache = LayerCache(e, slots, off, phys_map, CacheParams(cap=2, decay=0.9), host_rows=r)
    cache.install(list(range(slots)), prior=list(range(slots)), row_owners=row_owner)
    bank = BankRows(rows[0], rows[1], off, r)
    cost = CostModel(link_GBps=50, cpu_GBps=40, max_tokens=4)
    path = cp.LayerCpuPath(bank, k, slots, cp.CpuPathSettings(enabled=True, max_tokens=4), cost, K.CpuThreads(2), torch.device("cpu"),
                           num_experts=e)
    cpu_total = evictions = 0
    for step in range(40):
        t = int(torch.randint(1, 4, (1,), generator=g))
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        w = torch.softmax(torch.randn(t, k, generator=g), -1)
        phys = phys_map[ids].to(ids.dtype)
        path.before_experts(x, ids, w, phys, off, priority=cache.score)
        pairs = path.pending_pairs
        assert pairs is not None
        gpu_ids = cache.step(ids, rows, cpu_pairs=pairs, filler=slots)
        assert check_bijection(cache.expert_in_slot.tolist(), phys_map.tolist(), off, cache.row_owner.tolist()) == []
        ref = _per_k(x, w13, w2, ids, w)
        per_k = _per_k(x, rows[0], rows[1], gpu_ids, w)
        assert torch.equal(per_k[~pairs], ref[~pairs]), f"step {step}: a GPU pair read the wrong row"
        merged = path.merge(per_k.reshape(t * k, -1)).view(t, k, -1)
        assert path.abandon() is True
        scale = float(ref.float().abs().max())
        assert float((merged - ref).float().abs().max()) <= 2**-6 * scale, f"step {step}: a CPU pair read the wrong host row"
        cpu_total += int(pairs.sum())
    evictions = int(cache.evictions)
    assert cpu_total > 0 and evictions > 0, (cpu_total, evictions)
