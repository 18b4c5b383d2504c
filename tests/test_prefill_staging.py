"""Prefill staging (``server_ext/cache/prefill_staging.py``) on CPU tensors: the choice of staged
experts and the remap against a plain-Python reference over random routings and edge cases (no
misses, more misses than staging rows, experts below the token threshold, graph padding rows,
ids outside the expert range, RAM-complement host rows), and a step through a bank whose
outputs equal the unstaged step's (torch copy and the Triton copy under its interpreter)."""

from __future__ import annotations

import random

import pytest
import torch

from reap_swap.server_ext.cache.prefill_staging import (StagingParams, expert_miss_counts, plan_staging, remap_staged,
                                                        stage_step)
from reap_swap.server_ext.cache.promote import copy_rows_triton


def reference_plan(ids: list[list[int]], phys_map: list[int], h: int, rows: int, min_tokens: int, valid_rows: int) -> list[tuple[int, int, int, int]]:
    """(expert, host row, missed pairs, first row) of each staged expert, in staging-row order."""
    e = len(phys_map)
    count, first = [0] * e, [None] * e
    for t, row in enumerate(ids[:valid_rows]):
        for x in row:
            if 0 <= x < e:
                if first[x] is None:
                    first[x] = t
                if phys_map[x] >= h:
                    count[x] += 1
    cands = sorted((x for x in range(e) if count[x] > min_tokens), key=lambda x: (-count[x], x))[:rows]
    return [(x, phys_map[x] - h, count[x], first[x]) for x in cands]


def reference_remap(ids: list[list[int]], phys_map: list[int], staged: list[int], staging_offset: int) -> list[list[int]]:
    pos = {x: i for i, x in enumerate(staged)}
    e = len(phys_map)
    return [[staging_offset + pos[x] if x in pos else (phys_map[x] if 0 <= x < e else -7) for x in row] for row in ids]


def routed_phys(ids: torch.Tensor, phys_map: torch.Tensor) -> torch.Tensor:
    """The remap kernel's output; ids outside the range keep a marker row (-7) the staging must leave alone."""
    e = phys_map.shape[0]
    ok = (ids >= 0) & (ids < e)
    return torch.where(ok, phys_map[ids.clamp(0, e - 1).long()].to(ids.dtype), torch.full_like(ids, -7))


def check_against_reference(ids: list[list[int]], phys_map: list[int], h: int, params: StagingParams, valid_rows: int | None,
                            staging_offset: int) -> None:
    ids_t = torch.tensor(ids, dtype=torch.int32).view(len(ids), -1)
    pm = torch.tensor(phys_map, dtype=torch.int32)
    vr = None if valid_rows is None else torch.tensor([valid_rows], dtype=torch.int32)
    phys = routed_phys(ids_t, pm)
    plan = plan_staging(ids_t, phys, pm, h, params, vr)
    want = reference_plan(ids, phys_map, h, params.rows, params.min_expert_tokens, len(ids) if valid_rows is None else valid_rows)
    n = len(want)
    assert plan.valid.tolist() == [True] * n + [False] * (plan.valid.shape[0] - n)
    got = list(zip(plan.expert[:n].tolist(), plan.src[:n].tolist(), plan.tokens[:n].tolist(), plan.first_row[:n].tolist()))
    assert got == want
    assert plan.first_row[n:].tolist() == [-1] * (plan.valid.shape[0] - n)
    assert plan.tokens[n:].tolist() == [0] * (plan.valid.shape[0] - n) and plan.src[n:].tolist() == [0] * (plan.valid.shape[0] - n)
    out = remap_staged(ids_t, phys, plan, staging_offset, len(phys_map))
    assert out.dtype == phys.dtype and out.shape == phys.shape
    assert out.tolist() == reference_remap(ids_t.tolist(), phys_map, [w[0] for w in want], staging_offset)


def random_case(rng: random.Random) -> tuple[list[list[int]], list[int], int]:
    e = rng.choice([4, 8, 16, 33])
    k = rng.randint(1, min(4, e))
    t = rng.randint(1, 40)
    slots = rng.randint(0, e)
    pad = rng.randint(0, 3)
    h = slots + pad + 2
    resident = rng.sample(range(e), slots)
    phys_map = [h + x for x in range(e)]
    for s, x in enumerate(resident):
        phys_map[x] = s
    skew = [rng.random() ** 3 for _ in range(e)]
    ids = [rng.choices(range(e), weights=skew, k=k) for _ in range(t)]
    return ids, phys_map, h


@pytest.mark.parametrize("seed", range(60))
def test_random_routings_match_reference(seed: int) -> None:
    rng = random.Random(seed)
    ids, phys_map, h = random_case(rng)
    params = StagingParams(rows=rng.randint(1, 6), min_step_tokens=1, min_expert_tokens=rng.randint(0, 5))
    valid_rows = rng.choice([None, rng.randint(0, len(ids))])
    check_against_reference(ids, phys_map, h, params, valid_rows, staging_offset=rng.randint(0, 3))


def test_no_misses_stages_nothing() -> None:
    phys_map = [0, 1, 2, 3]  # every expert resident
    ids = [[0, 1], [2, 3], [0, 3]] * 10
    check_against_reference(ids, phys_map, 6, StagingParams(rows=3, min_expert_tokens=0), None, 4)


def test_more_misses_than_rows_takes_the_most_routed_lower_id_on_ties() -> None:
    h = 2
    phys_map = [0, h + 1, h + 2, h + 3, h + 4, h + 5]  # expert 0 resident
    ids = [[1, 2]] * 5 + [[3, 4]] * 5 + [[5, 0]] * 9
    check_against_reference(ids, phys_map, h, StagingParams(rows=2, min_expert_tokens=0), None, 1)
    plan = plan_staging(torch.tensor(ids), routed_phys(torch.tensor(ids), torch.tensor(phys_map)), torch.tensor(phys_map), h,
                        StagingParams(rows=2, min_expert_tokens=0))
    assert plan.expert.tolist() == [5, 1] and plan.valid.tolist() == [True, True]


def test_experts_at_or_below_the_threshold_keep_their_host_rows() -> None:
    h = 1
    phys_map = [h + x for x in range(4)]
    ids = [[0]] * 3 + [[1]] * 4 + [[2]] * 5
    check_against_reference(ids, phys_map, h, StagingParams(rows=4, min_expert_tokens=4), None, 0)
    plan = plan_staging(torch.tensor(ids), routed_phys(torch.tensor(ids), torch.tensor(phys_map)), torch.tensor(phys_map), h,
                        StagingParams(rows=4, min_expert_tokens=4))
    assert plan.valid.tolist() == [True, False, False, False] and int(plan.expert[0]) == 2


def test_padding_rows_are_not_counted_but_remapped_consistently() -> None:
    h = 0
    phys_map = [h + x for x in range(3)]
    ids = [[0]] * 2 + [[1]] * 8  # rows 2.. are graph padding
    check_against_reference(ids, phys_map, h, StagingParams(rows=2, min_expert_tokens=0), 2, 5)
    counts = expert_miss_counts(torch.tensor(ids), torch.tensor(ids), h, 3, torch.tensor([2], dtype=torch.int32))
    assert counts.tolist() == [2, 0, 0]


def test_ids_outside_the_range_are_left_alone() -> None:
    h = 3
    phys_map = [h, h + 1, h + 2]
    ids = [[0, -1], [0, 3], [0, 1], [7, 0]]
    check_against_reference(ids, phys_map, h, StagingParams(rows=2, min_expert_tokens=0), None, 1)


def test_complement_host_rows_are_the_sources() -> None:
    h = 4
    phys_map = [0, h + 2, h + 0, 1]  # RAM complement: host rows are not the ids
    ids = [[1, 2]] * 6
    check_against_reference(ids, phys_map, h, StagingParams(rows=2, min_expert_tokens=0), None, 2)


def test_rows_capped_by_expert_count() -> None:
    h = 0
    phys_map = [0, 1]
    ids = [[0, 1]] * 3
    plan = plan_staging(torch.tensor(ids), torch.tensor(ids), torch.tensor(phys_map), h, StagingParams(rows=8, min_expert_tokens=0))
    assert plan.valid.shape == (2,) and plan.valid.all()


def test_applies_only_to_large_steps() -> None:
    p = StagingParams(rows=4, min_step_tokens=512)
    assert not p.applies(511) and p.applies(512)
    assert not StagingParams(rows=0, min_step_tokens=1).applies(10**6)


def moe_reference(x: torch.Tensor, ids: torch.Tensor, phys: torch.Tensor, w: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """Per pair: x @ bank[phys row] weighted, summed over k (the fused kernel's arithmetic, spelled out)."""
    t, k = ids.shape
    out = torch.zeros(t, bank.shape[1])
    for i in range(t):
        for j in range(k):
            out[i] += w[i, j] * (bank[int(phys[i, j])] @ x[i])
    return out


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_staged_step_computes_the_same_outputs(monkeypatch: pytest.MonkeyPatch, impl: str) -> None:
    """A bank with slots [0, S), staging rows [S, S + P), host rows [H, H + E): the staged step reads
    staging rows and equals the step that reads host rows; the staging rows hold the staged experts."""
    torch.manual_seed(0)
    e, s, p, d = 8, 2, 3, 4
    h = s + p
    experts = torch.randn(e, d, d)
    bank = torch.zeros(h + e, d, d)
    bank[h:] = experts
    side = torch.zeros(h + e, dtype=torch.int32)  # a second bank tensor (scales): copied alike
    side[h:] = torch.arange(100, 100 + e, dtype=torch.int32)
    phys_map = torch.tensor([h + x for x in range(e)], dtype=torch.int32)
    for slot, x in enumerate((0, 5)):
        phys_map[x] = slot
        bank[slot] = experts[x]
        side[slot] = 100 + x
    ids = torch.randint(0, e, (40, 2), dtype=torch.int32)
    weights = torch.rand(40, 2)
    xs = torch.randn(40, d)
    phys = phys_map[ids.long()].to(ids.dtype)
    want = moe_reference(xs, ids, phys, weights, bank)
    copy = None
    if impl == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        copy = lambda *args: copy_rows_triton(*args, block=16)  # noqa: E731
    first = torch.full((p,), 9, dtype=torch.int32)
    kwargs = {"copy": copy} if copy is not None else {}
    params = StagingParams(rows=p, min_step_tokens=1, min_expert_tokens=2)
    staged = stage_step(ids, phys, phys_map, h, s, [bank, side], params, None, first, **kwargs)
    plan = plan_staging(ids, phys, phys_map, h, params)
    assert int(plan.valid.sum()) == p
    assert bool(((staged >= s) & (staged < h)).any())
    assert torch.equal(moe_reference(xs, ids, staged, weights, bank), want)
    for i, x in enumerate(plan.expert.tolist()):
        assert torch.equal(bank[s + i], experts[x]) and int(side[s + i]) == 100 + x
    assert first.tolist() == plan.first_row.tolist()
    assert torch.equal(bank[h:], experts)  # host rows untouched


def test_layouts_put_staging_rows_between_slots_and_host_rows() -> None:
    from reap_swap.server_ext.bank.bank_layout import contiguous_layout, page_layout

    plain = contiguous_layout(5, 8, [24], staging_rows=3)
    assert (plain.staging_offset, plain.staging_rows, plain.host_row_offset, plain.num_rows) == (5, 3, 8, 16)
    page = 2 << 20
    mib = 1 << 20
    for slots, staging in ((38, 8), (0, 5), (3, 1), (37, 96)):
        lay = page_layout(slots, 128, [6 * mib, 3 * mib], page, staging_rows=staging)
        base = page_layout(slots, 128, [6 * mib, 3 * mib], page)
        assert lay.staging_rows == staging and lay.staging_offset >= slots
        assert lay.host_row_offset - lay.staging_offset >= staging
        for stride in lay.row_strides:  # both regions start on a page and the staging one is whole pages
            assert lay.staging_offset * stride % page == 0 and lay.host_row_offset * stride % page == 0
        assert base.staging_rows == 0 and base.staging_region_rows == 0


def test_bank_with_staging_rows_keeps_its_table_and_swaps() -> None:
    from reap_swap.server_ext.bank.bank import ExpertBank, PlainBacking

    e, s, p = 6, 2, 3
    gen = torch.Generator().manual_seed(3)
    params = {"w13_weight": torch.nn.Parameter(torch.randn(e, 4, 2, generator=gen), requires_grad=False),
              "w2_weight": torch.nn.Parameter(torch.randn(e, 2, 2, generator=gen), requires_grad=False)}
    orig = {k: v.data.clone() for k, v in params.items()}
    phys_map = torch.zeros(e, dtype=torch.int32)
    bank = ExpertBank(0, params, phys_map, s, PlainBacking(torch.device("cpu")), staging_rows=p)
    assert (bank.staging_offset, bank.staging_rows, bank.table.host_row_offset) == (s, p, s + p)
    assert bank.physical_rows == s + p + e
    bank.swap((1, 4))
    assert phys_map.tolist() == [s + p + x if x not in (1, 4) else (0 if x == 1 else 1) for x in range(e)]
    assert bank.verify() == []
    for k, t in orig.items():
        assert torch.equal(params[k].data[s + p:], t) and not params[k].data[s:s + p].any()
    assert bank.staging_bytes == p * sum(bank.layout.row_strides)


def test_settings_from_the_environment() -> None:
    from reap_swap.server_ext import config as reap_config

    off = reap_config.from_env({})
    assert off.staging_rows == 0
    on = reap_config.from_env({"REAP_PREFILL_STAGING_ROWS": "96", "REAP_PREFILL_STAGING_MIN_STEP_TOKENS": "1024",
                               "REAP_PREFILL_STAGING_MIN_EXPERT_TOKENS": "0"})
    assert (on.staging_rows, on.staging_min_step_tokens, on.staging_min_expert_tokens) == (96, 1024, 0)
    for env, message in (({"REAP_PREFILL_STAGING_ROWS": "-2"}, "REAP_PREFILL_STAGING_ROWS must be >= 0"),
                         ({"REAP_PREFILL_STAGING_ROWS": "513"}, "must be <= 512"),
                         ({"REAP_PREFILL_STAGING_ROWS": "x"}, "must be an integer"),
                         ({"REAP_PREFILL_STAGING_MIN_STEP_TOKENS": "0"}, "REAP_PREFILL_STAGING_MIN_STEP_TOKENS must be >= 1")):
        with pytest.raises(reap_config.ResidencyConfigError, match=message):
            reap_config.from_env(env)
