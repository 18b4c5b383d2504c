"""The CPU path past ``max_tokens`` (issue 26): the split of a budgeted step -- at most ``pair_budget``
missed pairs to the CPU, candidates by fewest missed pairs -- on CPU tensors; steps up to
``max_tokens`` split exactly as before. Pure logic, fast."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from reap_swap.server_ext.cpu_experts.split import CostModel, SplitResult, missed_pairs_per_expert, plan_split

B = 9_437_184  # one Qwen3-30B-A3B expert in bf16


def _random_cost(g: torch.Generator, **kw: int) -> CostModel:
    u = lambda lo, hi: float(torch.empty(1).uniform_(lo, hi, generator=g))  # noqa: E731
    return CostModel(link_GBps=u(20, 80), cpu_GBps=u(10, 150), cpu_fixed_s=u(0, 3e-4), cpu_per_expert_s=u(0, 3e-5),
                     cpu_per_pair_s=u(0, 2e-5), **kw)


def _routing(g: torch.Generator, t: int, k: int, e: int, skew: float = 1.5) -> torch.Tensor:
    """[T, K] distinct experts per token from a skewed popularity (a few hot experts, a long tail)."""
    weights = torch.arange(1, e + 1, dtype=torch.float64) ** -skew
    weights = weights[torch.randperm(e, generator=g)]
    return torch.stack([torch.multinomial(weights, k, replacement=False, generator=g) for _ in range(t)])


def _same(a: SplitResult, b: SplitResult) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("cpu_experts", "link_experts", "cpu_pairs", "n_cpu", "link_s", "cpu_s"))


def test_pair_limit_follows_the_step_size() -> None:
    c = CostModel(link_GBps=50, cpu_GBps=50, max_tokens=8, max_step_tokens=32, pair_budget=20)
    assert [c.pair_limit(t, 8) for t in (1, 8, 9, 32, 33)] == [8, 64, 20, 20, 0]
    assert [c.budgeted(t) for t in (8, 9)] == [False, True] and c.step_tokens == 32
    old = CostModel(link_GBps=50, cpu_GBps=50)  # no budgeted steps: past max_tokens everything goes to the link
    assert old.step_tokens == 8 and old.pair_limit(9, 8) == 0 and old.pair_limit(8, 8) == 64
    with pytest.raises(ValueError, match="max_step_tokens"):
        CostModel(link_GBps=50, cpu_GBps=50, max_tokens=8, max_step_tokens=4)
    with pytest.raises(ValueError, match="pair_budget"):
        CostModel(link_GBps=50, cpu_GBps=50, pair_budget=-1)


def test_batch32_gives_the_cpu_the_fewest_token_experts_within_the_budget() -> None:
    g = torch.Generator().manual_seed(0)
    ids = _routing(g, 32, 8, 128)
    missed = torch.rand(128, generator=g)[ids] < 0.7
    pairs = missed_pairs_per_expert(ids, missed, 128)
    assert int((pairs == 1).sum()) > 16 and int(pairs.max()) >= 4  # the premise: a long tail of one-token misses
    cost = CostModel(link_GBps=51, cpu_GBps=60, cpu_fixed_s=25e-6, cpu_per_pair_s=1e-6, max_tokens=8, max_step_tokens=32, pair_budget=24)
    r = plan_split(ids, missed, 128, B, cost)
    assert 0 < int(r.cpu_pairs.sum()) <= 24 and int(r.n_cpu) > 0
    assert int(pairs[r.cpu_experts].max()) <= int(pairs[r.link_experts].min())  # none with more tokens than one left on the link
    assert not (r.cpu_pairs & ~missed).any() and torch.equal(r.cpu_pairs, missed & r.cpu_experts[ids])
    before = plan_split(ids, missed, 128, B, CostModel(link_GBps=51, cpu_GBps=60, cpu_fixed_s=25e-6, cpu_per_pair_s=1e-6))
    assert int(before.n_cpu) == 0 and float(r.step_s) < float(before.step_s)  # before issue 26: all to the link


@pytest.mark.parametrize("seed", range(16))
def test_the_budget_is_never_exceeded_and_the_cpu_takes_a_prefix_of_the_order(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    e, k = ((16, 2), (64, 4), (128, 8))[seed % 3]
    t = int(torch.randint(9, 33, (1,), generator=g))
    budget = int(torch.randint(1, t * k + 1, (1,), generator=g))
    ids = _routing(g, t, k, e, skew=float(torch.empty(1).uniform_(0.0, 2.0, generator=g)))
    missed = torch.rand(e, generator=g)[ids] < 0.8
    prio = torch.rand(e, generator=g).mul(4).floor() if seed % 2 else None  # whole numbers: ties on score
    cost = _random_cost(g, max_tokens=8, max_step_tokens=32, pair_budget=budget)
    r = plan_split(ids, missed, e, B, cost, priority=prio)
    assert int(r.cpu_pairs.sum()) <= budget
    pairs = missed_pairs_per_expert(ids, missed, e)
    assert int(pairs[r.cpu_experts].sum()) == int(r.cpu_pairs.sum()) and not (r.cpu_experts & (pairs == 0)).any()
    # the CPU's experts come first in (missed pairs, priority, id) order
    key = [(int(pairs[x]), float(prio[x]) if prio is not None else 0.0, x) for x in range(e) if pairs[x] > 0]
    ranked = [x for *_, x in sorted(key)]
    n = int(r.n_cpu)
    assert sorted(ranked[:n]) == r.cpu_experts.nonzero().view(-1).tolist()
    # the model's optimum among the prefixes that fit
    fits = [m for m in range(len(ranked) + 1) if sum(int(pairs[x]) for x in ranked[:m]) <= budget]
    steps = [max(cost.link_s(len(ranked) - m, B), cost.cpu_s(m, sum(int(pairs[x]) for x in ranked[:m]), B)) for m in fits]
    assert float(r.step_s) == pytest.approx(min(steps), rel=1e-12)
    assert n in [m for m, s in zip(fits, steps) if s == pytest.approx(min(steps), rel=1e-12)]


@pytest.mark.parametrize("seed", range(10))
def test_without_priority_a_budgeted_split_is_the_optimum_of_the_model(seed: int) -> None:
    """Brute force over every subset of the missed experts whose pairs fit the budget."""
    g = torch.Generator().manual_seed(200 + seed)
    e, k, t = 10, 2, int(torch.randint(3, 7, (1,), generator=g))
    ids = _routing(g, t, k, e, skew=1.0)
    missed = torch.rand(t, k, generator=g) < 0.8
    budget = int(torch.randint(1, 6, (1,), generator=g))
    cost = _random_cost(g, max_tokens=2, max_step_tokens=8, pair_budget=budget)
    r = plan_split(ids, missed, e, B, cost)
    pairs = missed_pairs_per_expert(ids, missed, e).tolist()
    cand = [x for x in range(e) if pairs[x] > 0]
    best = min(max(cost.link_s(len(cand) - n, B), cost.cpu_s(n, sum(pairs[x] for x in s), B))
               for n in range(len(cand) + 1) for s in itertools.combinations(cand, n) if sum(pairs[x] for x in s) <= budget)
    assert float(r.step_s) == pytest.approx(best, rel=1e-12) and int(r.cpu_pairs.sum()) <= budget


@pytest.mark.parametrize("seed", range(12))
def test_steps_up_to_max_tokens_split_exactly_as_before(seed: int) -> None:
    """A budget, however small, and a larger step size change nothing for steps of at most max_tokens tokens."""
    g = torch.Generator().manual_seed(300 + seed)
    e, k = ((16, 4), (128, 8))[seed % 2]
    t = int(torch.randint(1, 9, (1,), generator=g))
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    missed = torch.rand(t, k, generator=g) < 0.7
    prio = torch.rand(e, generator=g).mul(3).floor() if seed % 3 else None
    forced = torch.rand(e, generator=g) < 0.1
    old = _random_cost(g)
    new = dataclasses.replace(old, max_step_tokens=32, pair_budget=1)
    for num_tokens in (None, torch.tensor(t)):
        a = plan_split(ids, missed, e, B, old, priority=prio, forced_link=forced, num_tokens=num_tokens)
        b = plan_split(ids, missed, e, B, new, priority=prio, forced_link=forced, num_tokens=num_tokens)
        assert _same(a, b)


def test_steps_past_max_step_tokens_and_padded_graphs() -> None:
    g = torch.Generator().manual_seed(7)
    cost = CostModel(link_GBps=50, cpu_GBps=200, max_tokens=8, max_step_tokens=32, pair_budget=12)
    ids = _routing(g, 40, 4, 64)
    missed = torch.ones(40, 4, dtype=torch.bool)
    assert int(plan_split(ids, missed, 64, B, cost).n_cpu) == 0  # 40 tokens: prefill-sized, all to the link
    for real, most in ((20, 12), (5, 20), (33, 0)):  # a 40-row graph: the real count picks the rule
        m = missed.clone()
        m[real:] = False
        r = plan_split(ids, m, 64, B, cost, num_tokens=torch.tensor(real))
        assert int(r.cpu_pairs.sum()) <= most and not r.cpu_pairs[real:].any()
        alone = plan_split(ids[:real], m[:real], 64, B, cost)  # the unpadded step of that size
        assert torch.equal(r.cpu_experts, alone.cpu_experts) and torch.equal(r.cpu_pairs[:real], alone.cpu_pairs)
        assert (int(r.n_cpu) > 0) == (most > 0)


def test_priority_in_a_budgeted_step_goes_by_pairs_then_score() -> None:
    """Expert 0 is the coldest but has 4 missed pairs; 1..4 one each. Up to max_tokens the CPU takes
    the coldest first (issue 25's rule); past it the cheapest pairs first, then the coldest."""
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 4]])
    missed = torch.ones(4, 2, dtype=torch.bool)
    prio = torch.tensor([0.0, 5.0, 4.0, 3.0, 2.0, 9.0, 9.0, 9.0])
    small = CostModel(link_GBps=50, cpu_GBps=50, max_tokens=4)  # 5 missed experts, equal pipes: 2 to the CPU
    assert plan_split(ids, missed, 8, B, small, priority=prio).cpu_experts.nonzero().view(-1).tolist() == [0, 4]
    for budget, want in ((8, [3, 4]), (2, [3, 4]), (1, [4])):
        big = CostModel(link_GBps=50, cpu_GBps=50, max_tokens=2, max_step_tokens=4, pair_budget=budget)
        r = plan_split(ids, missed, 8, B, big, priority=prio)
        assert r.cpu_experts.nonzero().view(-1).tolist() == want and int(r.cpu_pairs.sum()) <= budget
        padded = plan_split(ids, missed, 8, B, big, priority=prio, num_tokens=torch.tensor(4))  # the device-count form agrees
        assert _same(r, padded)
    tie = CostModel(link_GBps=50, cpu_GBps=50, max_tokens=2, max_step_tokens=4, pair_budget=8)  # equal scores: lowest id
    r = plan_split(ids, missed, 8, B, tie, priority=torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 0, 0, 0]))
    assert r.cpu_experts.nonzero().view(-1).tolist() == [1, 2]
