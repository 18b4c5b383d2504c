"""The decode clock (planning/step_time.py), the arms' per-step counts (clock_arms), the H200 calibration
and validation files, and ``reap-swap simulate --clock`` choosing by step time (all pure numpy, fast)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reap_swap.planning.clock_arms import Arm, Batch, CacheRule, Request, SplitRule, replay, split_cpu, split_shares
from reap_swap.planning.simulate import main as simulate_main, sweep_cap
from reap_swap.planning.step_time import Clock, ClockError, StepCounts, load_clock, step_ms
from reap_swap.planning.traces import DECODE, PREFILL, RequestRoute, build, save

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
MB50 = 50_000_000  # one expert = 1 ms at 50 GB/s


def _clock(**kw: object) -> Clock:
    base = dict(base_ms=((1, 1.0), (8, 2.0)), hbm_GBps=1000.0, link_GBps=50.0, promote_GBps=50.0, cpu_GBps=25.0, host_dram_GBps=60.0)
    return Clock(**{**base, **kw})  # type: ignore[arg-type]


def _counts(link: int = 0, cpu: int = 0, resident: int = 0, promoted: int = 0, tokens: int = 1, **flags: bool) -> StepCounts:
    c = StepCounts.zeros(1, tokens, reap=False, **flags)
    c.link[0], c.cpu[0], c.resident[0], c.promoted[0] = link, cpu, resident, promoted
    return c


def test_base_interpolates_between_calibration_points() -> None:
    clock = _clock()
    assert clock.base(1) == 1.0 and clock.base(8) == 2.0 and clock.base(16) == 2.0
    assert clock.base(4) == pytest.approx(1.0 + 3 / 7)


def test_units_and_which_pipe_binds_by_hand() -> None:
    clock = _clock()
    b = step_ms(clock, _counts(link=2, resident=1), MB50)  # link 2 ms beats HBM 0.05 ms
    assert (b.link, b.hidden_hbm, b.total) == (pytest.approx(2.0), 0.0, pytest.approx(3.0))
    b = step_ms(clock, _counts(link=1, cpu=1), MB50)  # link 1, CPU 2, DRAM 100 MB / 60 GB/s = 1.67: the CPU binds
    assert b.cpu == pytest.approx(2.0) and b.link == 0 and b.host_dram == 0
    b = step_ms(clock, _counts(link=3, cpu=1), MB50)  # link 3, CPU 2, DRAM 200 / 60 = 3.33: the shared DRAM binds
    assert b.host_dram == pytest.approx(200 / 60) and b.total == pytest.approx(1.0 + 200 / 60)
    b = step_ms(clock, _counts(resident=100), MB50)  # nothing missed: the resident reads show
    assert b.hidden_hbm == pytest.approx(5.0)
    assert step_ms(clock, _counts(promoted=2), MB50).promote == pytest.approx(2.0)
    assert step_ms(clock.replace(promote_overlap=0.5), _counts(promoted=2), MB50).promote == pytest.approx(1.0)
    fixed = clock.replace(cpu_fixed_ms=0.5, cache_layer_ms=0.1, cpu_layer_ms=0.2, reap_step_ms=0.3)
    b = step_ms(fixed, StepCounts.zeros(2, 1, cache=True, cpu_path=True), MB50)
    assert b.fixed == pytest.approx(0.3 + 2 * (0.1 + 0.2)) and b.cpu == 0  # no CPU work: no pickup cost
    with pytest.raises(ClockError):
        _clock(link_GBps=0.0)
    with pytest.raises(ClockError):
        _clock(promote_overlap=1.5)


def test_step_time_is_monotone_and_the_breakdown_sums() -> None:
    clock = _clock(cpu_fixed_ms=0.05, cpu_pair_ms=0.01, cache_layer_ms=0.01)
    rng = np.random.default_rng(0)
    for _ in range(200):
        layers = 4
        c = StepCounts.zeros(layers, int(rng.integers(1, 9)), cache=True)
        for arr in (c.resident, c.link, c.cpu, c.cpu_pairs, c.promoted):
            arr[:] = rng.integers(0, 6, layers)
        b = step_ms(clock, c, MB50)
        parts = b.as_dict()
        assert parts["total"] == pytest.approx(sum(v for k, v in parts.items() if k != "total"))
        for name in ("link", "cpu", "promoted", "resident"):
            more = StepCounts(c.tokens, c.resident.copy(), c.link.copy(), c.cpu.copy(), c.cpu_pairs.copy(), c.promoted.copy(), cache=True)
            getattr(more, name)[int(rng.integers(layers))] += 1
            assert step_ms(clock, more, MB50).total >= b.total - 1e-12
        faster = clock.replace(link_GBps=100.0, cpu_GBps=50.0, host_dram_GBps=120.0, promote_GBps=100.0)
        assert step_ms(faster, c, MB50).total <= b.total + 1e-12


def test_clock_json_round_trip(tmp_path: Path) -> None:
    clock = _clock(fitted=("base_ms",), provenance={"fit": {"base_ms": "x"}})
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"clock": clock.to_json()}))
    back = load_clock(path)
    assert back == clock and back.provenance == clock.provenance and back.fitted == ("base_ms",)
    with pytest.raises(ClockError):
        load_clock(tmp_path / "missing.json")


def test_h200_calibration_loads_and_every_measured_constant_names_its_file_and_key() -> None:
    clock = load_clock(RESULTS / "step_time_h200.json")
    assert clock.fitted == ("base_ms",) and "base_ms" in clock.provenance["fit"]
    measured = clock.provenance["measured"]
    for name in ("hbm_GBps", "link_GBps", "promote_GBps", "cpu_GBps", "host_dram_GBps", "cpu_fixed_ms", "cpu_pair_ms",
                 "reap_step_ms", "cache_layer_ms", "cpu_layer_ms", "expert_bytes"):
        assert name in measured, name
        entry = measured[name]
        data = json.loads((REPO / entry["file"]).read_text())
        for part in entry["key"].split("."):
            data = data[part]
        assert data == entry["value"]
    assert clock.link_GBps == measured["link_GBps"]["value"] and clock.hbm_GBps == measured["hbm_GBps"]["value"]
    assert clock.expert_bytes == 9437184 and 0 < clock.base(1) < clock.base(8)


def test_committed_validation_holds_every_reap_arm_within_ten_percent() -> None:
    report = json.loads((RESULTS / "simulate_clock_h200.json").read_text())
    assert report["clock"] == load_clock(RESULTS / "step_time_h200.json").to_json()
    reap = [r for r in report["rows"] if r["arm"].startswith("reap") and not r.get("prediction")]
    assert {r["batch"] for r in reap} == {1, 8} and len(reap) == 14
    fast = [r for r in report["rows"] if r.get("prediction")]  # serve --fast and two designs not built: no H200 run of any
    assert [r["arm"] for r in fast] == [a for a in ("reap_fast", "reap_fast_bg", "reap_static_cpu_sliced", "reap_fast_sliced") for _ in (1, 8)]
    assert all(r["measured_ms"] is None and r["simulated_ms"] > 0 for r in fast)
    assert report["all_reap_within_10pct"] and all(abs(r["error_pct"]) <= 10.0 for r in reap)
    assert report["fitted"] == {"constants": ["base_ms"], "on_arms": ["stock_gpu"]}


# --- per-step counts on a hand-made trace --------------------------------------------------------------


def _tiny() -> object:
    """One request, 2 layers, 6 experts, top-2: prompt rows 0-1, decode rows 2-5 (see the hand counts below)."""
    l0 = [[0, 1], [2, 3], [0, 4], [4, 5], [4, 0], [1, 2]]
    ids = np.array([[row, [0, 1]] for row in l0], dtype=np.int64)  # layer 1 always routes 0, 1
    phase = np.array([PREFILL] * 2 + [DECODE] * 4, dtype=np.uint8)
    meta = {"model": {"path": "tiny"}, "moe_layers": [0, 1], "num_experts": 6, "top_k": 2, "expert_bytes": MB50}
    return build(meta, [RequestRoute("r0", phase, ids, np.full(ids.shape, 0.5), {})])


def _batch() -> list[Batch]:
    # gen 5: the prefill makes the first token, decode steps s = 0..3 read rows 2..5; timed: s = 1, 2
    return [Batch((Request(0, 2, 5),), {0: np.array([0, 1]), 1: np.array([0, 1])})]


def test_static_arm_counts_by_hand() -> None:
    steps = replay(_tiny(), _batch(), Arm("s", "static"), MB50, slots=2)  # type: ignore[arg-type]
    assert [(s.timed, s.decode) for s in steps] == [(False, False), (False, True), (True, True), (True, True), (False, True)]
    s1, s2 = steps[2].counts, steps[3].counts
    assert list(s1.link) == [2, 0] and list(s1.resident) == [0, 2]  # row 3 routes 4, 5: both missed
    assert list(s2.link) == [1, 0] and list(s2.resident) == [1, 2]  # row 4 routes 4, 0
    dec = [s for s in steps if s.decode]
    assert sum(s.missed_pairs for s in dec) == 5 and sum(s.pairs for s in dec) == 16


def test_cache_arm_counts_by_hand() -> None:
    """cap 1, decay 0.5, prior 2.0 on {0, 1}: row 2 promotes 4 (evicts 1), row 3 promotes 5 (evicts 0), row 4 promotes 0."""
    arm = Arm("c", "cache", cache=CacheRule(cap=1, decay=0.5))
    steps = replay(_tiny(), _batch(), arm, MB50, slots=2)  # type: ignore[arg-type]
    assert steps[0].counts.promoted.sum() == 0  # prefill: no victim outside the routed set
    for s in steps[1:4]:
        assert list(s.counts.promoted) == [1, 0] and list(s.counts.link) == [0, 0] and s.counts.resident[0] == 2
    last = steps[4].counts  # row 5 routes 1, 2, both missed: one promoted, one over the link
    assert list(last.promoted) == [1, 0] and list(last.link) == [1, 0]
    assert sum(s.missed_pairs for s in steps if s.decode) == 5  # as routed, before promotions
    assert all(s.counts.cache and s.counts.reap for s in steps)


def test_cpu_split_by_hand_and_on_the_arm() -> None:
    rule = SplitRule(link_GBps=50.0, cpu_GBps=50.0, fixed_s=0.0, pair_s=0.0)
    assert list(split_cpu(np.array([1, 1]), rule, MB50, 1)) == [0]  # 1 ms each side beats 2 ms on one
    assert list(split_cpu(np.array([3, 1, 1, 2]), rule, MB50, 1)) == [1, 2]  # fewest missed pairs first, then id
    assert len(split_cpu(np.array([1, 1]), SplitRule(50.0, 50.0, fixed_s=1.5e-3), MB50, 1)) == 0  # pickup too dear
    assert len(split_cpu(np.array([1, 1]), rule, MB50, 9)) == 0  # more than max_tokens: all to the link
    steps = replay(_tiny(), _batch(), Arm("sc", "static", cpu=rule), MB50, slots=2)  # type: ignore[arg-type]
    s1 = steps[2].counts
    assert (s1.cpu[0], s1.cpu_pairs[0], s1.link[0], s1.cpu_path) == (1, 1, 1, True)
    assert steps[0].counts.cpu_path  # a 2-token prefill is a small step: the server's path takes it too
    narrow = replay(_tiny(), _batch(), Arm("sc", "static", cpu=SplitRule(50.0, 50.0, 0.0, 0.0, max_tokens=1)), MB50, slots=2)  # type: ignore[arg-type]
    assert narrow[0].counts.cpu.sum() == 0 and not narrow[0].counts.cpu_path and narrow[2].counts.cpu[0] == 1


def test_fast_order_split_first_by_hand() -> None:
    """One layer, 4 experts, top-2, 3 slots holding {0} (prior 2.0), cap 2, decay 0.5, the split as above.

    Prefill row [0, 3]: one miss, the split keeps it on the link (1 ms either way: smallest n), 3 is
    promoted. Scores then 0: 2, 3: 1; decode row [1, 2] (both missed, scores 0 before the update).
    Cache first: 1 fills the free slot, 2 (1.0) evicts 3 (0.5): 2 promoted, nothing on the CPU.
    Split first: n = 1, the CPU takes 1 (equal scores and pairs: lowest id), the cache promotes 2 only.
    """
    rule = SplitRule(link_GBps=50.0, cpu_GBps=50.0, fixed_s=0.0, pair_s=0.0)
    assert list(split_cpu(np.array([1, 1]), rule, MB50, 1, priority=np.array([5.0, 0.0]))) == [1]  # the colder one
    assert list(split_cpu(np.array([1, 2]), rule, MB50, 1, priority=np.array([0.0, 0.0]))) == [0]  # ties: fewest pairs
    ids = np.array([[[0, 3]], [[1, 2]]], dtype=np.int64)
    meta = {"model": {"path": "tiny"}, "moe_layers": [0], "num_experts": 4, "top_k": 2, "expert_bytes": MB50}
    trace = build(meta, [RequestRoute("r0", np.array([PREFILL, DECODE], dtype=np.uint8), ids, np.full(ids.shape, 0.5), {})])
    batch = [Batch((Request(0, 1, 2),), {0: np.array([0])})]
    cache = CacheRule(cap=2, decay=0.5)
    old = replay(trace, batch, Arm("cc", "cache", cache=cache, cpu=rule), MB50, slots=3)  # type: ignore[arg-type]
    new = replay(trace, batch, Arm("f", "fast", cache=cache, cpu=rule), MB50, slots=3)  # type: ignore[arg-type]
    for steps in (old, new):
        p = steps[0].counts
        assert (p.promoted[0], p.cpu[0], p.link[0], p.resident[0]) == (1, 0, 0, 2)
    o, n = old[1].counts, new[1].counts
    assert (o.promoted[0], o.cpu[0], o.link[0], o.resident[0]) == (2, 0, 0, 2)
    assert (n.promoted[0], n.cpu[0], n.cpu_pairs[0], n.link[0], n.resident[0]) == (1, 1, 1, 0, 1)
    assert old[1].missed_pairs == new[1].missed_pairs == 2 and n.cache and n.cpu_path and n.reap


def test_sliced_split_by_hand() -> None:
    """Slices of one expert go to either pipe: equal pipes halve a lone miss; a CPU twice the link's speed takes
    3 of 4 slices (0.375 ms against 0.25, where 2 of 4 leave the link 0.5 ms); candidates in ``split_cpu``'s order;
    one slice per expert is ``split_cpu`` (the same general code, compared on random steps)."""
    even = SplitRule(link_GBps=50.0, cpu_GBps=50.0, fixed_s=0.0, pair_s=0.0)
    assert list(split_shares(np.array([1]), even, MB50, 1)) == [0.0]  # whole: 1 ms either way, the link (smallest n)
    assert list(split_shares(np.array([1]), SplitRule(50.0, 50.0, 0.0, 0.0, slices=2), MB50, 1)) == [0.5]
    assert list(split_shares(np.array([1]), SplitRule(50.0, 100.0, 0.0, 0.0, slices=4), MB50, 1)) == [0.75]
    # the candidates' order is split_cpu's: fewest missed pairs first, so expert 1 (1 pair) before 0 (3 pairs)
    assert list(split_shares(np.array([3, 1]), SplitRule(50.0, 100.0, 0.0, 0.0, slices=4), MB50, 1)) == [0.25, 1.0]
    assert not split_shares(np.array([1, 1]), SplitRule(50.0, 50.0, 0.0, 0.0, slices=4), MB50, 9).any()  # past max_tokens
    halves = SplitRule(50.0, 50.0, 0.0, 0.0, max_tokens=1, max_step_tokens=8, pair_budget=2, slices=2)
    # unbudgeted (1 token): coldest first -- 1, then 2 -- and 3 of 6 slices balance the pipes (1.5 ms each)
    assert list(split_shares(np.array([1, 1, 1]), halves, MB50, 1, priority=np.array([3.0, 1.0, 2.0]))) == [0.0, 1.0, 0.5]
    # budgeted (4 tokens): fewest pairs first, then the scores -- 0, then half of 2 (1.5 ms each side, 2 pairs); by the
    # scores first, 1's 2 pairs would come second and bust the budget
    assert list(split_shares(np.array([1, 2, 1]), halves, MB50, 4, priority=np.array([0.0, 0.0, 5.0]))) == [1.0, 0.0, 0.5]
    # a slice ships every token of its expert: 3 pairs never fit a budget of 2, however small the share
    assert not split_shares(np.array([3]), halves, MB50, 4).any()
    rng = np.random.default_rng(0)
    for _ in range(50):  # one slice per expert is the server's whole-expert rule, priorities and budgets included
        rule = SplitRule(50.0, float(rng.uniform(20, 150)), 25e-6, 1e-6, 8, 32, int(rng.integers(8, 64)))
        per, t = rng.integers(1, 9, size=int(rng.integers(0, 12))), int(rng.integers(1, 40))
        prio = rng.random(len(per)).astype(np.float32)
        want = np.zeros(len(per))
        want[split_cpu(per, rule, 9437184, t, prio)] = 1.0
        assert list(split_shares(per, rule, 9437184, t, prio)) == list(want)
    with pytest.raises(ValueError, match="slices"):
        SplitRule(50.0, 50.0, slices=0)


def test_sliced_split_on_the_arms() -> None:
    """The by-hand trace's timed step with two misses: whole experts put one on each pipe (1 ms); with a CPU twice
    the link's speed and 4 slices the CPU takes 5 of 8 (0.625 ms against 0.75 on the link, where 6 of 8 would leave
    the CPU 0.75 and 4 of 8 the link 1 ms).

    The fast order on the trace of ``test_fast_order_split_first_by_hand`` with a CPU half the link's speed: the
    prefill's lone miss (3) goes 1 slice to the CPU, 3 to the link, and is not promoted (the CPU computes part of it);
    the decode row's misses [1, 2] give the CPU 2 of 8 slices, both of expert 1 (equal scores and pairs: lowest id),
    so 2, wholly the link's, is promoted and 1's other half crosses the link.
    """
    whole, sliced = SplitRule(50.0, 100.0, 0.0, 0.0), SplitRule(50.0, 100.0, 0.0, 0.0, slices=4)
    a = replay(_tiny(), _batch(), Arm("s", "static", cpu=whole), MB50, slots=2)[2].counts  # type: ignore[arg-type]
    b = replay(_tiny(), _batch(), Arm("s", "static", cpu=sliced), MB50, slots=2)[2].counts  # type: ignore[arg-type]
    assert (a.cpu[0], a.link[0]) == (1, 1) and (b.cpu[0], b.link[0], b.cpu_pairs[0]) == (1.25, 0.75, 2)
    clock = _clock(cpu_GBps=100.0, host_dram_GBps=1000.0)
    assert step_ms(clock, b, MB50).total < step_ms(clock, a, MB50).total
    ids = np.array([[[0, 3]], [[1, 2]]], dtype=np.int64)
    meta = {"model": {"path": "tiny"}, "moe_layers": [0], "num_experts": 4, "top_k": 2, "expert_bytes": MB50}
    trace = build(meta, [RequestRoute("r0", np.array([PREFILL, DECODE], dtype=np.uint8), ids, np.full(ids.shape, 0.5), {})])
    batch = [Batch((Request(0, 1, 2),), {0: np.array([0])})]
    slow_cpu = SplitRule(50.0, 25.0, 0.0, 0.0, slices=4)
    p, d = (s.counts for s in replay(trace, batch, Arm("f", "fast", cache=CacheRule(cap=2, decay=0.5), cpu=slow_cpu), MB50, slots=3))  # type: ignore[arg-type]
    assert (p.promoted[0], p.cpu[0], p.link[0], p.resident[0]) == (0, 0.25, 0.75, 1)
    assert (d.promoted[0], d.cpu[0], d.cpu_pairs[0], d.link[0], d.resident[0]) == (1, 0.5, 1, 0.5, 1)
    with pytest.raises(ValueError, match="unsliced"):
        replay(_tiny(), _batch(), Arm("b", "fast_bg", cache=CacheRule(), cpu=sliced), MB50, slots=2)  # type: ignore[arg-type]


def test_split_matches_the_servers_plan_split() -> None:
    torch = pytest.importorskip("torch")
    from reap_swap.server_ext.cpu_experts.split import CostModel, plan_split

    rng = np.random.default_rng(1)
    cost = CostModel(link_GBps=50.0, cpu_GBps=65.0, cpu_fixed_s=25e-6, cpu_per_pair_s=1e-6, max_tokens=8)
    rule = SplitRule(50.0, 65.0, 25e-6, 1e-6, 8)
    for _ in range(50):
        t, e = int(rng.integers(1, 9)), 32
        ids = np.stack([rng.choice(e, 8, replace=False) for _ in range(t)])
        resident = rng.random(e) < 0.3
        missed = ~resident[ids]
        res = plan_split(torch.from_numpy(ids), torch.from_numpy(missed), e, 9437184, cost)
        experts, per = np.unique(ids[missed], return_counts=True)
        mine = set(experts[split_cpu(per, rule, 9437184, t)].tolist())
        assert mine == set(np.flatnonzero(res.cpu_experts.numpy()).tolist())


def test_budgeted_split_matches_the_servers_plan_split() -> None:
    """Steps past max_tokens (issue 26): the pair budget and, with the cache's scores, fewest missed pairs first."""
    torch = pytest.importorskip("torch")
    from reap_swap.server_ext.cpu_experts.split import CostModel, plan_split

    rng = np.random.default_rng(2)
    held = 0
    for i in range(60):
        t, e, k = int(rng.integers(1, 41)), 128, 8
        budget = int(rng.integers(1, 65))
        cost = CostModel(link_GBps=50.0, cpu_GBps=90.0, cpu_fixed_s=25e-6, cpu_per_pair_s=1e-6, max_tokens=8, max_step_tokens=32,
                         pair_budget=budget)
        rule = SplitRule(50.0, 90.0, 25e-6, 1e-6, 8, 32, budget)
        pop = rng.dirichlet(np.full(e, 0.3))
        ids = np.stack([rng.choice(e, k, replace=False, p=pop) for _ in range(t)])
        missed = ~(rng.random(e) < 0.3)[ids]
        prio = np.floor(rng.random(e) * 4).astype(np.float32) if i % 2 else None
        res = plan_split(torch.from_numpy(ids), torch.from_numpy(missed), e, 9437184, cost,
                         priority=None if prio is None else torch.from_numpy(prio))
        experts, per = np.unique(ids[missed], return_counts=True)
        chosen = split_cpu(per, rule, 9437184, t, None if prio is None else prio[experts], top_k=k)
        assert set(experts[chosen].tolist()) == set(np.flatnonzero(res.cpu_experts.numpy()).tolist())
        assert per[chosen].sum() <= rule.pair_limit(t, k) and (t <= 32 or len(chosen) == 0)
        free = split_cpu(per, SplitRule(50.0, 90.0, 25e-6, 1e-6, 8, 32, t * k), 9437184, t, None if prio is None else prio[experts], top_k=k)
        held += int(per[free].sum() > budget)  # the budget held the CPU back
    assert held > 0


def test_the_simulators_cpu_rule_is_the_servers_default() -> None:
    pytest.importorskip("torch")
    from reap_swap.planning.simulate import cpu_rule
    from reap_swap.server_ext.cpu_experts.cpu_path import CpuPathSettings

    for k in (2, 8, 16):
        want = CpuPathSettings(enabled=True).cost(50.0, 65.0, top_k=k)
        rule = cpu_rule(_clock(link_GBps=50.0, cpu_GBps=65.0, cpu_fixed_ms=0.025, cpu_pair_ms=0.001), top_k=k)
        assert (rule.max_tokens, rule.step_tokens, rule.pair_budget) == (want.max_tokens, want.step_tokens, want.pair_budget)
        assert [rule.pair_limit(t, k) for t in range(1, 40)] == [want.pair_limit(t, k) for t in range(1, 40)]


def test_the_bs32_replay_gives_the_cpu_one_token_experts() -> None:
    """A 32-request batch: with the budgeted rule the replay's decode steps put missed experts on the CPU, without it none."""
    rng = np.random.default_rng(3)
    e, k, L = 32, 4, 2
    routes = []
    for r in range(32):
        ids = np.stack([[rng.choice(e, k, replace=False) for _ in range(L)] for _ in range(6)])
        routes.append(RequestRoute(f"r{r}", np.array([PREFILL] * 2 + [DECODE] * 4, dtype=np.uint8), ids, np.full(ids.shape, 0.25), {}))
    trace = build({"model": {"path": "bs32"}, "moe_layers": [0, 1], "num_experts": e, "top_k": k, "expert_bytes": MB50}, routes)
    batch = [Batch(tuple(Request(r, 2, 4) for r in range(32)), {0: np.arange(8), 1: np.arange(8)})]
    on = replay(trace, batch, Arm("s", "static", cpu=SplitRule(50.0, 100.0, 25e-6, 1e-6, 8, 32, 32)), MB50, slots=8)
    off = replay(trace, batch, Arm("s", "static", cpu=SplitRule(50.0, 100.0, 25e-6, 1e-6, 8)), MB50, slots=8)
    decode = [s for s in on if s.decode]
    assert all(s.counts.tokens == 32 and s.counts.cpu_path for s in decode) and not on[0].counts.cpu_path  # the 64-token prefill: link
    assert sum(int(s.counts.cpu.sum()) for s in decode) > 0 and max(int(s.counts.cpu_pairs.max()) for s in decode) <= 32
    assert all(int(s.counts.cpu.sum()) == 0 and not s.counts.cpu_path for s in off)
    clock = _clock()
    assert sum(step_ms(clock, s.counts, MB50).total for s in decode) < sum(step_ms(clock, s.counts, MB50).total for s in off if s.decode)


# --- choosing by step time --------------------------------------------------------------------------


def _drifting(requests: int = 6, experts: int = 16, k: int = 4, decode: int = 60, seed: int = 0) -> object:
    rng = np.random.default_rng(seed)
    routes = []
    for r in range(requests):
        ids = np.empty((8 + decode, 2, k), dtype=np.int64)
        for layer in range(2):
            pref = rng.dirichlet(np.full(experts, 0.3))
            for t in range(8 + decode):
                ids[t, layer] = rng.choice(experts, size=k, replace=False, p=pref)
        phase = np.array([PREFILL] * 8 + [DECODE] * decode, dtype=np.uint8)
        routes.append(RequestRoute(f"r{r}", phase, ids, np.full(ids.shape, 1.0 / k), {"split": "train" if r < 2 else "test"}))
    return build({"model": {"path": "drift"}, "moe_layers": [0, 1], "num_experts": experts, "top_k": k, "expert_bytes": MB50}, routes)


def test_step_time_picks_a_cheaper_cap_than_hit_rate_with_the_cpu_path() -> None:
    """With a CPU twice the link, a promotion turns a miss computed beside the link into a serialized copy."""
    clock = _clock(cpu_GBps=100.0, host_dram_GBps=1000.0)
    sw = sweep_cap(_drifting(), 0.25, [0, 1, 2, 4], clock, "step_time", cpu_path=True)  # type: ignore[arg-type]
    rows = {r["cap"]: r for r in sw["caps"]}
    assert sw["chosen_by_hit_rate"] != 0 and rows[sw["chosen_by_hit_rate"]]["hit_rate_decode"] > rows[0]["hit_rate_decode"]
    assert sw["chosen"] == sw["chosen_by_step_time"] != sw["chosen_by_hit_rate"]
    assert rows[sw["chosen"]]["step_ms_decode"] < rows[sw["chosen_by_hit_rate"]]["step_ms_decode"]
    link_only = sweep_cap(_drifting(), 0.25, [0, 1, 2, 4], clock, "hit_rate")  # type: ignore[arg-type]
    # without the CPU a promotion costs what its miss would: both choices agree
    assert link_only["chosen"] == link_only["chosen_by_hit_rate"] == link_only["chosen_by_step_time"] != 0


def test_simulate_cli_with_the_clock(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = save(_drifting(), tmp_path / "t.npz")  # type: ignore[arg-type]
    clock = tmp_path / "clock.json"
    clock.write_text(json.dumps({"clock": _clock().to_json()}))
    out = tmp_path / "sim.json"
    assert simulate_main(["--trace", str(trace), "--policies", "static_topk,lfru_cap", "--clock", str(clock), "--cpu-path",
                          "--sweep-cap", "0,2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["policies"]["lfru_cap"]["step_ms_decode"] > 0 and data["sweep"]["chosen"] in (0, 2)
    assert "step ms (bs1)" in capsys.readouterr().out
    for bad in (["--sweep-cap", "0,2"], ["--cpu-path"], ["--validate", str(tmp_path)], ["--clock", str(clock), "--sweep-cap", "x"]):
        with pytest.raises(SystemExit):
            simulate_main(["--trace", str(trace), *bad])
    assert simulate_main(["--trace", str(trace), "--clock", str(tmp_path / "none.json")]) == 2


def test_calibration_file_is_what_calibrate_builds_from_the_committed_results() -> None:
    from reap_swap.planning.clock_validate import calibrate
    from reap_swap.planning.traces import load

    sets = json.loads((RESULTS / "learned_sets.json").read_text())
    built = calibrate(load(REPO / "benchmarks" / "traces" / "learned128_t0.8.npz"), sets, RESULTS)
    assert built.to_json() == load_clock(RESULTS / "step_time_h200.json").to_json()


def test_committed_choices_part_ways_only_with_the_cpu_path() -> None:
    choices = json.loads((RESULTS / "simulate_clock_h200.json").read_text())["choices"]
    for c in choices:
        if c["cpu_path"] and c.get("order"):  # the fast order: copies beside the CPU, so promotions no longer cost the step
            assert c["chosen_by_step_time"] > 0 and c["step_time_speedup_over_hit_rate_choice"] < 1.05
        elif c["cpu_path"]:
            assert c["chosen_by_step_time"] == 0 and c["chosen_by_hit_rate"] > 0 and c["step_time_speedup_over_hit_rate_choice"] > 1.1
        else:
            assert c["chosen_by_step_time"] == c["chosen_by_hit_rate"]


def test_fast_order_runs_the_copies_beside_the_cpu() -> None:
    """The fast order posts the CPU's share before the cache's copies: a layer costs max(copies + kernel, CPU, DRAM),
    where cache-then-CPU pays the copies on top of the pipes' max."""
    clock = Clock(base_ms=((1, 1.0),), hbm_GBps=1000.0, link_GBps=50.0, promote_GBps=50.0, cpu_GBps=100.0, host_dram_GBps=1000.0)
    eb = 50_000_000  # 1 ms over the link, 0.5 ms on the CPU
    counts = dict(tokens=1, resident=np.array([0]), link=np.array([0]), cpu=np.array([4]), cpu_pairs=np.array([4]), promoted=np.array([1]))
    beside = step_ms(clock, StepCounts(**counts, promote_beside_cpu=True), eb)
    serial = step_ms(clock, StepCounts(**counts), eb)
    assert beside.total == pytest.approx(1.0 + 2.0) and beside.cpu == pytest.approx(2.0) and beside.promote == 0.0
    assert serial.total == pytest.approx(1.0 + 2.0 + 1.0) and serial.promote == pytest.approx(1.0)
    more = {**counts, "promoted": np.array([3])}  # 3 ms of copies outlast the CPU's 2 ms: the GPU side is the layer
    assert step_ms(clock, StepCounts(**more, promote_beside_cpu=True), eb).total == pytest.approx(1.0 + 3.0)


def test_fast_order_hides_the_policy_program_under_the_cpu() -> None:
    """In the fast order the cache's policy program runs after the split posted the CPU's job (server_ext/layer.py):
    GPU-side work the CPU's share hides. Cache-then-CPU pays it in series, as does a fast layer the GPU side binds."""
    clock = Clock(base_ms=((1, 1.0),), hbm_GBps=1000.0, link_GBps=50.0, promote_GBps=50.0, cpu_GBps=100.0, host_dram_GBps=1000.0,
                  cache_layer_ms=0.25)
    eb = 50_000_000  # 1 ms over the link, 0.5 ms on the CPU
    counts = dict(tokens=1, resident=np.array([0, 0]), link=np.array([0, 0]), cpu=np.array([4, 0]), cpu_pairs=np.array([4, 0]),
                  promoted=np.array([1, 1]))
    fast = step_ms(clock, StepCounts(**counts, cache=True, promote_beside_cpu=True), eb)
    # layer 0: max(0.25 + 1 copy, 2 CPU) = 2, the program hidden; layer 1: no CPU work, 0.25 + 1 ms on the GPU side
    assert fast.total == pytest.approx(1.0 + 2.0 + 1.25) and fast.fixed == pytest.approx(0.25) and fast.promote == pytest.approx(1.0)
    serial = step_ms(clock, StepCounts(**counts, cache=True), eb)
    assert serial.fixed == pytest.approx(0.5) and serial.total == pytest.approx(1.0 + 2.0 + 2.0 + 0.5)
    # the program decides which side binds: copies 1 ms < CPU 1.1 ms (2 experts + 0.1 pickup) < program + copies 1.25 ms
    close = dict(tokens=1, resident=np.array([0]), link=np.array([0]), cpu=np.array([2]), cpu_pairs=np.array([2]), promoted=np.array([1]))
    b = step_ms(clock.replace(cpu_fixed_ms=0.1), StepCounts(**close, cache=True, promote_beside_cpu=True), eb)
    assert b.total == pytest.approx(1.0 + 1.25) and b.fixed == pytest.approx(0.25) and b.cpu == 0.0


@pytest.mark.parametrize("machine", ["h100-v1", "h100-v2", "h100-fast", "h100-graphs", "h100-onerun-v1", "h100-onerun-v2", "h100-onerun2-v2",
                                     "h100-onerun3-v1", "h100-onerun4-v1"])
def test_h100_clock_is_what_calibrate_builds_and_replays_the_measured_hit_rates(machine: str) -> None:
    from reap_swap.planning.clock_validate import MACHINES, calibrate
    from reap_swap.planning.traces import load

    tag = machine.removeprefix("h100-").replace("-", "_")  # the results' file names
    v2 = machine.endswith("v2")
    trace = load(REPO / "benchmarks" / "traces" / ("learned128_v2_t0.8.npz" if v2 else "learned128_t0.8.npz"))
    sets = json.loads((RESULTS / ("learned_sets_v2.json" if v2 else "learned_sets.json")).read_text())
    built = calibrate(trace, sets, RESULTS, MACHINES[machine])
    assert built.to_json() == load_clock(RESULTS / f"step_time_h100_{tag}.json").to_json()
    assert "estimate" in built.provenance["measured"]["hbm_GBps"], "the H100's HBM rate is an estimate and says so"
    if machine in ("h100-onerun3-v1", "h100-onerun4-v1"):  # the H100 hosts whose shared host-DRAM ceiling was measured: the clock takes it
        bus = json.loads((RESULTS / f"host_bus_h100_{tag.removesuffix('_v1')}.json").read_text())
        assert built.host_dram_GBps == bus["cpu_n8_with_link"]["sum_GBps"]
    else:
        assert "why" in built.provenance["measured"]["host_dram_GBps"], "no ceiling measured there: link + CPU, said so"
    report = json.loads((RESULTS / f"simulate_clock_h100_{tag}.json").read_text())
    run = json.loads((RESULTS / MACHINES[machine].learned).read_text())
    for r in report["rows"]:
        if r["arm"] in ("reap_fast_bg", "reap_static_cpu_sliced", "reap_fast_sliced"):  # designs no run has: predictions
            assert r["prediction"] and r["measured_ms"] is None
            continue
        batch_tok_s = run["arms"][r["arm"]].get("decode_tok_s_bs1" if r["batch"] == 1 else f"decode_tok_s_bs{r['batch']}")
        if run["arms"][r["arm"]].get("error") and batch_tok_s is None:  # h100-graphs: its stock offload arm was lost with the machine
            assert r["measured_ms"] is None and r["simulated_ms"] > 0, "a lost arm is simulated, never measured"
            # a stock arm's row is a prediction; a reap arm the run did not measure fails the validation (h100-onerun: reap_cache)
            assert r["prediction"] if r["arm"].startswith("stock") else not r["prediction"] and not report["all_reap_within_10pct"]
            continue
        if r["arm"].startswith("reap_fast") or r["arm"] == "reap_cache":  # the replay's hit rate is the run's, arm by arm
            key = "hit_rate_decode" if r["batch"] == 1 else f"hit_rate_decode_bs{r['batch']}"
            assert r["simulated_hit_rate_decode"] == pytest.approx(run["arms"][r["arm"]][key], abs=0.002), (r["arm"], r["batch"])
        assert r["measured_ms"] is not None, "every arm the H100 run measured has its step"
    assert sorted({r["batch"] for r in report["rows"]}) == list(MACHINES[machine].batches)
    lost = sorted(a for a, v in run["arms"].items() if v.get("error"))
    assert lost == {"h100-graphs": ["stock_offload"], "h100-onerun-v1": ["reap_cache"], "h100-onerun-v2": ["reap_cache"],
                    "h100-onerun2-v2": ["stock_offload"], "h100-onerun3-v1": ["stock_offload"], "h100-onerun4-v1": ["reap_cache"]}.get(machine, [])
    # onerun2: cut after batch 8 (its 1 and 8 measured); onerun3: cut before its batch 1 finished; onerun4: never started
    assert all(sum(r["arm"] == a for r in report["rows"]) == len(MACHINES[machine].batches) for a in lost), "a lost arm keeps its rows"


def test_background_promotions_take_cpu_experts_only_with_link_room() -> None:
    """fast_bg on the by-hand trace above: with no idle link time the CPU's expert (1) is not promoted (the split
    balanced the pipes); with 1 ms of idle link a layer, the copy stream promotes it beside the CPU: counted as a
    background copy, not read from its slot this step, and resident from the next step on."""
    rule = SplitRule(link_GBps=50.0, cpu_GBps=50.0, fixed_s=0.0, pair_s=0.0)
    ids = np.array([[[0, 3]], [[1, 2]], [[1, 2]]], dtype=np.int64)
    meta = {"model": {"path": "tiny"}, "moe_layers": [0], "num_experts": 4, "top_k": 2, "expert_bytes": MB50}
    trace = build(meta, [RequestRoute("r0", np.array([PREFILL, DECODE, DECODE], dtype=np.uint8), ids, np.full(ids.shape, 0.5), {})])
    batch = [Batch((Request(0, 1, 3),), {0: np.array([0])})]
    cache = CacheRule(cap=2, decay=0.5)
    fast = replay(trace, batch, Arm("f", "fast", cache=cache, cpu=rule), MB50, slots=3)  # type: ignore[arg-type]
    none = replay(trace, batch, Arm("b", "fast_bg", cache=cache, cpu=rule), MB50, slots=3)  # type: ignore[arg-type]
    assert [s.counts.background[0] for s in none] == [0, 0, 0]
    assert [s.missed_pairs for s in none] == [s.missed_pairs for s in fast]
    room = replay(trace, batch, Arm("b", "fast_bg", cache=cache, cpu=rule, link_idle_ms=1.0), MB50, slots=3)  # type: ignore[arg-type]
    d = room[1].counts
    assert (d.background[0], d.promoted[0], d.cpu[0], d.resident[0]) == (1, 1, 1, 1)  # 2 in-line, 1 beside the CPU
    assert room[2].missed_pairs == 0 and fast[2].missed_pairs == 1, "the background copy is a hit at the next step"
    clock = Clock(base_ms=((1, 1.0),), hbm_GBps=1000.0, link_GBps=50.0, promote_GBps=50.0, cpu_GBps=50.0, host_dram_GBps=1000.0)
    # the copy stream's 1 ms fits beside the step's other link work (1 ms in-line copy) inside its 3 ms: no cost
    assert step_ms(clock, d, MB50).total == pytest.approx(step_ms(clock, fast[1].counts, MB50).total)


def test_validate_refuses_a_trace_or_clock_of_another_machine(capsys: pytest.CaptureFixture[str]) -> None:
    traces = REPO / "benchmarks" / "traces"
    v1 = ["--trace", str(traces / "learned128_t0.8.npz"), "--sets", str(RESULTS / "learned_sets.json"), "--validate", str(RESULTS)]
    assert simulate_main([*v1, "--machine", "h100-v2", "--clock", str(RESULTS / "step_time_h100_v2.json")]) == 2
    assert "is not the trace h100-30b-a3b-v2's run replayed" in capsys.readouterr().err
    assert simulate_main([*v1, "--machine", "h100-v1", "--clock", str(RESULTS / "step_time_h200.json")]) == 2
    assert "calibrated on 'h200-30b-a3b'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        simulate_main(["--trace", str(traces / "learned128_t0.8.npz"), "--machine", "h100-v1"])
    assert "--machine goes with --calibrate or --validate" in capsys.readouterr().err


def test_own_split_replays_the_arms_cost_model_and_refuses_a_rerated_arm(tmp_path: Path) -> None:
    """h100-onerun: the fast arm splits by its own cost model (its probe's 28.7 GB/s), static + CPU's arm by its 92.1; a
    run whose fast arm was re-rated mid-run has no single rate to replay and is refused."""
    from reap_swap.planning.clock_validate import MACHINES, ClockError, Sources, arm_rules

    machine = MACHINES["h100-onerun-v1"]
    src = Sources(RESULTS)
    fast = arm_rules(src, "reap_fast", 9437184, 24, 128, machine)
    static = arm_rules(src, "reap_static_cpu", 9437184, 24, 128, machine)
    assert fast.cpu.cpu_GBps == pytest.approx(28.708, abs=1e-3) and static.cpu.cpu_GBps == pytest.approx(92.062, abs=1e-3)
    run = json.loads((RESULTS / machine.learned).read_text())
    run["raw"]["reap_fast"]["cpu_path_bs1"]["rate_updates"] = [77.8]
    (tmp_path / machine.learned).write_text(json.dumps(run))
    with pytest.raises(ClockError, match="re-rated mid-run"):
        arm_rules(Sources(tmp_path), "reap_fast", 9437184, 24, 128, machine)


def test_the_clock_replays_the_classifier_arm_at_extra_batches_from_their_sets(tmp_path: Path) -> None:
    """A run timed at --extra-batches B with the classifier arms: the clock installs the sets file's classifier_bs<B>
    set of each group; without that block it refuses the arm at B, naming the learned-sets option."""
    import dataclasses

    from reap_swap.planning.clock_validate import H200, ClockError, Sources, workload

    reqs = [{"index": i, "name": f"q{i}", "prompt_len": 4, "gen": 3} for i in range(8)]
    spec = {"trace": "t.npz", "batch": 2, "requests_bs1": reqs[:1], "groups_bs8": [{"group": 0, "requests": reqs[:2]}],
            "extra_batches": [{"batch": 4, "key": "bs4", "groups": [{"group": 1, "requests": reqs[4:8]}]}]}
    (tmp_path / "run.json").write_text(json.dumps({"raw": {"reap_static": {"spec": spec}}}))
    machine = dataclasses.replace(H200, learned="run.json", learned_cpu="run.json")
    layer = lambda e: {"layer_0": e}  # noqa: E731
    sets = {"sets": {"static_topk": layer([0, 1]), "plan": layer([0, 2])},
            "per_request": {"classifier": {"t": {"0:q0": layer([3, 4])}}, "classifier_bs8": {"t": {"0": layer([5, 6])}},
                            "classifier_bs4": {"t": {"0": layer([1, 2]), "1": layer([6, 7])}}}}
    src = Sources(tmp_path)
    [batch] = workload(src, None, sets, "reap_fast_classifier", 4, machine)  # type: ignore[arg-type]
    assert [r.index for r in batch.requests] == [4, 5, 6, 7] and batch.sets[0].tolist() == [6, 7]
    assert workload(src, None, sets, "reap_classifier", 2, machine)[0].sets[0].tolist() == [5, 6]  # type: ignore[arg-type]
    assert workload(src, None, sets, "reap_static", 4, machine)[0].sets[0].tolist() == [0, 1]  # type: ignore[arg-type]
    del sets["per_request"]["classifier_bs4"]
    with pytest.raises(ClockError, match="no classifier sets for batch 4 .*--extra-batches 4"):
        workload(src, None, sets, "reap_classifier", 4, machine)  # type: ignore[arg-type]
