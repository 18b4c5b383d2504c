"""The incremental policy (``WishSums`` + vectorized selection) against the seed's pure-Python
decide, kept here only as the oracle: identical targets and decisions on random plans and wishes
(union and latest, slice-only, expert and mixed wishes), and exact sums after many admit/release cycles."""

from __future__ import annotations

import random
from typing import Mapping, Sequence

import numpy as np
import pytest

from reap_swap.plan import Plan, parse_plan
from reap_swap.planning.expert_select import select_experts
from reap_swap.proxy.policy import ResidencyPolicy, Wish
from reap_swap.proxy.wish_sums import WishSums
from reap_swap.selection import select_layer
from reap_swap.server_ext.control.active_set import signature


def _normalized(scores: Sequence[float]) -> list[float]:
    clipped = [max(float(s), 0.0) for s in scores]
    total = sum(clipped)
    return [s / total for s in clipped] if total > 0 else [1.0 / max(len(clipped), 1)] * len(clipped)


def reference_decide(plan: Plan, hysteresis: float, mode: str, wishes: Sequence[Wish], current: Mapping[int, tuple[int, ...]],
                     prior: Mapping[int, Sequence[float]] | None = None) -> tuple[dict[int, tuple[int, ...]], bool, str]:
    """The seed's ResidencyPolicy.decide (commit 18c87e7), verbatim in substance."""
    if not wishes:
        return dict(current), False, signature(current)
    if mode == "latest":
        wishes, hysteresis = [wishes[-1]], 0.0
    per_expert = all(w.expert_scores for w in wishes)
    target: dict[int, tuple[int, ...]] = {}
    kept = got = 0.0
    for layer, lp in plan.layers.items():
        cur = current.get(layer, lp.core)
        if per_expert:
            acc = [0.0] * lp.num_experts
            for w in wishes:
                for e, s in enumerate(_normalized(w.expert_scores.get(layer, [0.0] * lp.num_experts))):
                    acc[e] += s
            chosen = select_experts(lp, acc)
            got += sum(acc[e] for e in chosen)
            kept += sum(acc[e] for e in cur if 0 <= e < lp.num_experts)
        else:
            acc = [0.0] * len(lp.slices)
            for w in wishes:
                for j, s in enumerate(_normalized(w.scores.get(layer, [0.0] * len(lp.slices)))):
                    acc[j] += s

            def value(experts: Sequence[int]) -> float:
                have = set(experts)
                return sum(sc * len(have & set(s.experts)) / len(s.experts) for s, sc in zip(lp.slices, acc) if s.experts)

            chosen, _ = select_layer(lp, acc, prior.get(layer) if prior else None)
            got += value(chosen)
            kept += value(cur)
        target[layer] = tuple(chosen)
    sig = signature(target)
    fraction = kept / got if got > 0 else 1.0
    if sig == signature(current):
        return target, False, sig
    if fraction >= 1.0 - hysteresis and all(set(plan.layers[l].core) <= set(current.get(l, ())) for l in plan.layers):
        return dict(current), False, signature(current)
    return target, True, sig


def random_plan(rng: random.Random, layers: int = 4) -> Plan:
    per_layer = {}
    for i in range(layers):
        n = rng.choice([8, 16, 24])
        experts = list(range(n))
        rng.shuffle(experts)
        core = sorted(experts[: rng.randint(0, 4)])
        rest = experts[len(core):]
        slices, k = [], 0
        while k < len(rest) - rng.randint(0, 3):  # some experts in no slice
            size = rng.randint(1, 5)
            slices.append({"sliceId": f"l{i}s{len(slices)}", "experts": rest[k:k + size]})
            k += size
        spec = rng.randint(0, n - len(core))
        per_layer[f"layer_{i}"] = {"numExperts": n, "coreExperts": core, "sliceCatalog": slices, "specialistActiveExpertTarget": spec}
    return parse_plan({"mode": "dynamic_core_specialist", "model": "t", "budget": {"per_expert_bytes": 1, "max_refreshes_per_request": 1},
                       "perLayer": per_layer, "summary": {}, "scorerArtifacts": {}})


def random_scores(rng: random.Random, n: int) -> list[float]:
    kind = rng.random()
    if kind < 0.15:
        return [0.0] * n  # uniform after normalization
    if kind < 0.35:
        return [float(rng.randint(-1, 3)) for _ in range(n)]  # ties and negatives
    return [rng.random() ** 3 for _ in range(n)]


def random_wish(rng: random.Random, plan: Plan, experts: bool) -> Wish:
    scores = {l: random_scores(rng, len(lp.slices)) for l, lp in plan.layers.items() if rng.random() < 0.9}
    es = {l: random_scores(rng, lp.num_experts) for l, lp in plan.layers.items() if rng.random() < 0.9} if experts else {}
    return Wish(scores, expert_scores=es)


def random_current(rng: random.Random, plan: Plan) -> dict[int, tuple[int, ...]]:
    out = {}
    for l, lp in plan.layers.items():
        if rng.random() < 0.8:
            extra = rng.sample([e for e in range(lp.num_experts) if e not in lp.core], rng.randint(0, lp.specialist_experts))
            out[l] = tuple(sorted(set(lp.core) | set(extra)))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_incremental_decide_matches_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    plan = random_plan(rng)
    prior = {l: [rng.random() for _ in range(lp.num_experts)] for l, lp in plan.layers.items()} if seed % 2 else None
    for mode in ("union", "latest"):
        hysteresis = rng.choice([0.0, 0.05, 0.3])
        policy = ResidencyPolicy(plan, hysteresis, mode)
        sums = WishSums(plan)
        live: dict[str, Wish] = {}
        current = random_current(rng, plan)
        kind = seed % 3  # 0: expert wishes, 1: slice-only wishes, 2: mixed
        for step in range(30):
            if live and rng.random() < 0.35:
                key = rng.choice(list(live))
                del live[key]
                sums.discard(key)
            else:
                key = f"r{step}"
                live[key] = random_wish(rng, plan, kind == 0 or (kind == 2 and rng.random() < 0.7))
                sums.add(key, live[key])
            ref_target, ref_swap, ref_sig = reference_decide(plan, hysteresis, mode, list(live.values()), current, prior)
            d = policy.decide_sums(sums, current, prior)
            assert d.target == ref_target and d.swap == ref_swap and d.signature == ref_sig, (seed, mode, step)
            assert policy.decide(list(live.values()), current, prior).target == ref_target
            if d.swap:
                current = dict(d.target)


def test_sums_stay_exact_over_many_admit_release_cycles() -> None:
    rng = random.Random(7)
    plan = random_plan(rng, layers=3)
    sums = WishSums(plan)
    keep = {f"k{i}": random_wish(rng, plan, True) for i in range(5)}
    for k, w in keep.items():
        sums.add(k, w)
    fresh = WishSums(plan)
    for k, w in keep.items():
        fresh.add(k, w)
    for cycle in range(3000):
        w = random_wish(rng, plan, rng.random() < 0.5)
        sums.add(f"c{cycle}", w)
        if cycle % 3 == 0:
            sums.discard(f"c{cycle}")
        elif cycle % 3 == 2:
            sums.discard(f"c{cycle - 1}")
            sums.discard(f"c{cycle}")
    assert sums.keys() == list(keep)
    assert np.array_equal(sums.slice_sum, fresh.slice_sum) and np.array_equal(sums.expert_sum, fresh.expert_sum)
    s, e, without = sums.recompute()
    assert np.array_equal(s, sums.slice_sum) and np.array_equal(e, sums.expert_sum) and without == sums.without_experts == 0
    for k in keep:
        sums.discard(k)
    assert not sums.slice_sum.any() and not sums.expert_sum.any() and len(sums) == 0


def test_wishes_expire_and_are_bounded() -> None:
    plan = random_plan(random.Random(1), layers=2)
    now = [0.0]
    sums = WishSums(plan, max_wishes=3, ttl_s=10.0, clock=lambda: now[0])
    rng = random.Random(2)
    for i in range(4):
        sums.add(f"r{i}", random_wish(rng, plan, True))
        now[0] += 1.0
    assert sums.keys() == ["r1", "r2", "r3"]
    now[0] = 11.5  # r1 (admitted at 1.0) is older than 10 s
    assert sums.expire() == 1 and sums.keys() == ["r2", "r3"]
    assert np.array_equal(sums.recompute()[1], sums.expert_sum)


class StubBackend:
    """Just enough of ``BackendClient`` for the coordinator: status and swap."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.swaps: list[dict] = []

    async def status(self) -> dict:
        return {"plan": {"sha256": self.plan.sha256},
                "resident": {"by_layer": {f"layer_{l}": list(lp.core) for l, lp in self.plan.layers.items()}}}

    async def swap(self, payload: dict) -> dict:
        from reap_swap.server_ext.control.active_set import signature as sig

        self.swaps.append(payload)
        target = {int(k.removeprefix("layer_")): tuple(v) for k, v in payload["active_set"].items()}
        return {"plan_sha256": self.plan.sha256, "active_set_signature": sig(target)}


def test_coordinator_admits_into_the_sums_and_releases_out_of_them() -> None:
    import asyncio

    from reap_swap.proxy.residency import ResidencyCoordinator

    rng = random.Random(3)
    plan = random_plan(rng)
    backend = StubBackend(plan)
    coord = ResidencyCoordinator(backend, ResidencyPolicy(plan), {})  # type: ignore[arg-type]
    wishes = [random_wish(rng, plan, True) for _ in range(3)]

    async def run() -> None:
        await coord.sync()
        for i, w in enumerate(wishes):
            out = await coord.admit(f"r{i}", w)
            assert out.status in ("swapped", "kept", "coalesced")
        assert coord.state()["wishes_in_flight"] == 3
        ref_target, _, _ = reference_decide(plan, 0.05, "union", wishes, coord.current)
        assert coord.policy.decide_sums(coord.wishes, coord.current, {}).target == ref_target
        for i in range(3):
            coord.release(f"r{i}")
        coord.release("r0")  # twice: no-op
        assert coord.state()["wishes_in_flight"] == 0 and not coord.wishes.expert_sum.any() and not coord.wishes.slice_sum.any()

    asyncio.run(run())
    assert backend.swaps, "a first request's own set is installed"
