"""The proxy's concurrency policy and prompt extraction (pure)."""

from __future__ import annotations

from reap_swap.plan import parse_plan
from reap_swap.proxy.policy import ResidencyPolicy, Wish
from reap_swap.proxy.prompts import prompt_from_body
from reap_swap.server_ext.control.active_set import signature
from tests.conftest import tiny_plan_dict

# core 0-3, slices of 4 (4-7, 8-11, 12-15), capacity 8: one slice fits per layer
PLAN = parse_plan(tiny_plan_dict(layers=2, specialist=4))
CORE = {0: (0, 1, 2, 3), 1: (0, 1, 2, 3)}


def wish(best: int) -> Wish:
    return Wish({layer: [1.0 if j == best else 0.0 for j in range(3)] for layer in (0, 1)})


def test_single_request_gets_its_slice() -> None:
    d = ResidencyPolicy(PLAN).decide([wish(1)], CORE)
    assert d.swap and d.target[0] == (0, 1, 2, 3, 8, 9, 10, 11)


def test_union_keeps_the_majority_and_does_not_thrash() -> None:
    policy = ResidencyPolicy(PLAN)
    first = policy.decide([wish(0), wish(0), wish(2)], CORE)
    assert first.target[1] == (0, 1, 2, 3, 4, 5, 6, 7)
    # one more request for slice 2 arrives while two for slice 0 are still in flight: no swap
    again = policy.decide([wish(0), wish(0), wish(2), wish(2)], first.target)
    assert again.swap is False and again.signature == first.signature
    naive = ResidencyPolicy(PLAN, mode="latest").decide([wish(0), wish(0), wish(2)], first.target)
    assert naive.swap and naive.target[0] == (0, 1, 2, 3, 12, 13, 14, 15)


def test_hysteresis_and_noop() -> None:
    policy = ResidencyPolicy(PLAN, hysteresis=0.3)
    near = Wish({layer: [1.0, 0.8, 0.0] for layer in (0, 1)})
    current = {l: (0, 1, 2, 3, 8, 9, 10, 11) for l in (0, 1)}
    d = policy.decide([near], current)
    assert d.swap is False and d.signature == signature(current)
    assert policy.decide([wish(1)], current).reason == "already resident"
    assert policy.decide([], current).swap is False


def test_prompt_extraction() -> None:
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hello"}]}]}
    assert prompt_from_body("/v1/chat/completions", chat).endswith("hello")
    assert prompt_from_body("/v1/completions", {"prompt": "abc"}) == "abc"
    assert prompt_from_body("/v1/completions", {"prompt": ["a", "b"]}) == "a\nb"
    assert prompt_from_body("/v1/completions", {"prompt": [1, 2, 3]}) is None
    assert prompt_from_body("/v1/chat/completions", {"messages": []}) is None


def expert_wish(hot: list[int], layers: tuple[int, ...] = (0, 1)) -> Wish:
    scores = [0.0] * 16
    for e in hot:
        scores[e] = 1.0
    return Wish({layer: [0.0, 0.0, 0.0] for layer in layers}, expert_scores={layer: scores for layer in layers})


def test_expert_scores_fill_slots_expert_by_expert_across_slices() -> None:
    """Wanted experts from three different slices: whole slices could hold only one of them."""
    d = ResidencyPolicy(PLAN).decide([expert_wish([5, 9, 13, 14])], CORE)
    assert d.swap and d.target[0] == (0, 1, 2, 3, 5, 9, 13, 14)


def test_expert_union_of_in_flight_requests_keeps_the_shared_experts() -> None:
    policy = ResidencyPolicy(PLAN)
    first = policy.decide([expert_wish([4, 5, 6, 7]), expert_wish([4, 5, 12, 13])], CORE)
    assert set(first.target[0]) >= {0, 1, 2, 3, 4, 5}
    # a third request that agrees with what is resident changes nothing
    again = policy.decide([expert_wish([4, 5, 6, 7]), expert_wish([4, 5, 12, 13]), expert_wish(list(first.target[0][4:]))], first.target)
    assert again.swap is False


def test_wishes_without_expert_scores_fall_back_to_slices() -> None:
    d = ResidencyPolicy(PLAN).decide([wish(1), expert_wish([5, 9, 13, 14])], CORE)
    assert d.target[0] == (0, 1, 2, 3, 8, 9, 10, 11)
