"""reap-swap learned-sets: exact hit-rate scoring, static top-k, set sizes, the oracle bound, and the CLI end to end.

Everything runs on hand-made or synthetic data (no .obs, no ../shared, no GPU); the
end-to-end test builds a small synthetic observation in models/small_moe's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reap_swap.benchmarks.learned import sets as ls
from reap_swap.plan import parse_plan
from reap_swap.planning import traces as tr
from reap_swap.proxy.classify import Classifier
from reap_swap.proxy.policy import ResidencyPolicy, Wish

from .conftest import tiny_plan_dict

REPO = Path(__file__).resolve().parents[1]


def hand_trace() -> tr.RoutingTrace:
    """MoE layers 1 and 3 (not 0..L-1, so layer ids must be mapped), 4 experts, top-2; two requests."""
    def req(rid: str, phase: list[int], ids: list[list[list[int]]], w: float = 0.5) -> tr.RequestRoute:
        a = np.array(ids, dtype=np.int64)
        return tr.RequestRoute(rid, np.array(phase, dtype=np.uint8), a, np.full(a.shape, w, dtype=np.float32), {"source": "s", "tags": ["t"]})

    r0 = req("a", [0, 0, 1], [[[0, 1], [2, 3]], [[0, 2], [0, 1]], [[1, 3], [3, 2]]])
    r1 = req("b", [0, 1, 1], [[[3, 2], [1, 0]], [[0, 1], [0, 1]], [[2, 3], [2, 1]]])
    return tr.build({"moe_layers": [1, 3], "num_experts": 4, "top_k": 2}, [r0, r1])


def test_hit_rate_scoring_is_exact_on_a_hand_made_trace() -> None:
    trace = hand_trace()
    sets = {1: [0, 1], 3: [0, 1]}
    s = ls.score(trace, ls.fixed(sets), slots=2)
    # decode rows: a[2] = L1 {1,3} (1 hit), L3 {3,2} (0); b[1] = L1 {0,1} (2), L3 {0,1} (2); b[2] = L1 {2,3} (0), L3 {2,1} (1)
    assert s["decode_pairs"] == 12 and s["hit_rate_decode"] == pytest.approx(6 / 12)
    # prefill rows: a[0] = {0,1}:2, {2,3}:0; a[1] = {0,2}:1, {0,1}:2; b[0] = {3,2}:0, {1,0}:2
    assert s["prefill_pairs"] == 12 and s["hit_rate_prefill"] == pytest.approx(7 / 12)
    assert s["gate_mass_hit_decode"] == pytest.approx(6 / 12)  # equal weights: mass share = pair share
    # per-request sets: request b gets every expert of layer 1 it routes in decode
    per = [sets, {1: [0, 1, 2, 3], 3: [0, 1, 2, 3]}]
    s2 = ls.score(trace, ls.per_request(per))
    assert s2["hit_rate_decode"] == pytest.approx((1 + 0 + 8) / 12)
    assert s2["hit_rate_prefill"] == pytest.approx((2 + 0 + 1 + 2 + 4) / 12)
    only_b = ls.score(trace, ls.per_request(per), requests=[1])
    assert only_b["hit_rate_decode"] == 1.0 and only_b["requests"] == 1


def test_gate_mass_hit_weights_pairs_by_gate_weight() -> None:
    ids = np.array([[[0, 1]]])
    w = np.array([[[0.9, 0.1]]], dtype=np.float16)
    mask = np.array([[True, False]])
    hits, pairs, hit_mass, mass = ls.tally(ids, w, mask)
    assert (hits, pairs) == (1, 2)
    assert hit_mass / mass == pytest.approx(0.9, abs=1e-3)


def test_resident_mask_refuses_bad_sets() -> None:
    with pytest.raises(ls.SetsError):
        ls.resident_mask({1: [0, 0]}, [1], 4)
    with pytest.raises(ls.SetsError):
        ls.resident_mask({1: [0, 4]}, [1], 4)
    with pytest.raises(ls.SetsError):
        ls.resident_mask({1: [0]}, [1, 3], 4)
    with pytest.raises(ls.SetsError):
        ls.resident_mask({1: [0, 1, 2]}, [1], 4, slots=2)


def test_static_topk_picks_the_top_mass_experts() -> None:
    rng = np.random.default_rng(0)
    mass = rng.random((30, 3, 16)).astype(np.float32)
    mass[:, 0, [5, 9, 2]] += 10.0  # layer 0: 5, 9, 2 dominate
    mass[:, 2, :] = 1.0  # layer 2: all tied -> lowest ids
    sets = ls.static_topk(mass, [4, 7, 9], 3)
    assert sets[4] == [2, 5, 9]
    total = mass.astype(np.float64).sum(axis=0)
    assert sets[7] == sorted(np.argsort(-total[1], kind="stable")[:3].tolist())
    assert sets[9] == [0, 1, 2]
    assert ls.slots_for(0.3, 128) == 38 and ls.slots_for(0.3, 16) == 5


def test_every_arm_holds_exactly_s_distinct_experts_per_layer() -> None:
    plan = parse_plan(tiny_plan_dict(layers=4, experts=16, core=4, slice_size=4, specialist=4))
    slots = 8
    ls.check_capacity(plan, slots)
    policy = ResidencyPolicy(plan, 0.05)
    plain = Classifier(plan, None)
    try:
        plan_set = ls.static_policy_set(policy, plain.prior_wish(), {})
    finally:
        plain.close()
    # the plan's no-prompt set: core + the first slices in catalogue order
    assert plan_set == {l: list(range(8)) for l in range(4)}
    rng = np.random.default_rng(1)
    wishes = [Wish({}, expert_scores={l: rng.random(16).tolist() for l in range(4)}) for _ in range(12)]
    bs1 = ls.replay_policy(policy, [[w] for w in wishes], {})
    bs4 = ls.replay_policy(policy, [[wishes[i] for i in g] for g in ls.groups_of(12, 4)], {})
    trace = random_trace(rng, layers=list(range(4)), experts=16, requests=5)
    oracle = [ls.oracle_sets(trace, [r], slots) for r in range(5)]
    for sets in [plan_set, *bs1.sets, *bs4.sets, *oracle]:
        for layer in range(4):
            assert len(sets[layer]) == slots == len(set(sets[layer]))
    for sets in [*bs1.sets, *bs4.sets]:
        assert all(set(plan.layers[l].core) <= set(sets[l]) for l in range(4))  # the policy never drops the core
    assert len(bs4.sets) == 3 and bs1.swaps >= 1
    with pytest.raises(ls.SetsError):
        ls.check_capacity(plan, 9)


def random_trace(rng: np.random.Generator, layers: list[int], experts: int, requests: int, top_k: int = 4) -> tr.RoutingTrace:
    routes = []
    for r in range(requests):
        t = int(rng.integers(4, 12))
        skew = 0.9 * rng.dirichlet(np.full(experts, 0.3), size=len(layers)) + 0.1 / experts
        ids = np.stack([[rng.choice(experts, top_k, replace=False, p=skew[li] / skew[li].sum()) for li in range(len(layers))] for _ in range(t)])
        w = rng.random(ids.shape).astype(np.float32)
        phase = np.array([0] * (t // 2) + [1] * (t - t // 2), dtype=np.uint8)
        routes.append(tr.RequestRoute(f"r{r}", phase, ids, w / w.sum(axis=2, keepdims=True), {}))
    return tr.build({"moe_layers": layers, "num_experts": experts, "top_k": top_k}, routes)


def test_oracle_captures_at_least_every_other_arms_decode_mass_on_its_request() -> None:
    rng = np.random.default_rng(2)
    layers, experts, slots = [0, 2, 5], 16, 5
    trace = random_trace(rng, layers, experts, requests=8)
    others = [ls.top_sets(rng.random((3, experts)), layers, slots) for _ in range(20)]
    others.append(ls.top_sets(sum(ls.routed_mass(*ls.request_rows(trace, r), experts) for r in range(8)), layers, slots))
    for r in range(trace.num_requests):
        best = ls.score(trace, ls.fixed(ls.oracle_sets(trace, [r], slots)), slots, [r])["gate_mass_hit_decode"]
        for sets in others:
            assert best >= ls.score(trace, ls.fixed(sets), slots, [r])["gate_mass_hit_decode"] - 1e-12
    group = ls.oracle_sets(trace, [0, 1, 2], slots)
    g = ls.score(trace, ls.fixed(group), slots, [0, 1, 2])["gate_mass_hit_decode"]
    assert all(g >= ls.score(trace, ls.fixed(s), slots, [0, 1, 2])["gate_mass_hit_decode"] - 1e-12 for s in others)


def test_format_table_lists_every_arm() -> None:
    table = ls.format_table({"t": {"a": {"hit_rate_decode": 0.5, "hit_rate_prefill": None, "gate_mass_hit_decode": 0.25}}})
    assert "| a | 0.500 | – | 0.250 |" in table


# ---- end to end: a synthetic observation in small_moe's layout, a synthetic trace of realistic test prompts


def write_observation(out: Path, model: Path) -> None:
    from reap_swap.models.families import layout_for
    from reap_swap.planning.corpus import read_corpus
    from reap_swap.planning.observations import append_rows, file_sha256, write_manifest

    layout = layout_for(model)
    samples = read_corpus([REPO / "example" / "realistic" / "train.jsonl"], lambda m: "\n".join(x["content"] for x in m), 60)[0]
    rng = np.random.default_rng(3)
    n, L, E = len(samples), layout.num_moe_layers, layout.num_experts
    domains = sorted({s.tags[0] for s in samples})
    pref = {d: rng.dirichlet(np.full(E, 0.5), size=L) for d in domains}
    mass = np.stack([pref[s.tags[0]] * 100 + rng.random((L, E)) for s in samples]).astype(np.float32)
    out.mkdir(parents=True)
    np.savez(out / "chunk-0000.npz", sample_mass=mass, sample_freq=(mass * 4).astype(np.int32), sample_saliency=mass,
             coact=np.ones((L, E, E), dtype=np.int64))
    append_rows(out, [{"id": s.sample_id, "source": s.source, "tags": list(s.tags), "tokens": 100, "prompt": s.prompt,
                       "file": s.file, "chunk": "chunk-0000.npz"} for s in samples])
    write_manifest(out, {
        "format_version": 1, "chunks": [{"file": "chunk-0000.npz", "samples": n, "tokens": 100 * n, "sha256": file_sha256(out / "chunk-0000.npz")}],
        "model": {"config_sha256": file_sha256(model / "config.json"), "model_type": "qwen3_moe", "moe_layers": list(layout.moe_layers),
                  "num_experts": E, "top_k": layout.top_k, "path": str(model), "dtype": "bfloat16"},
        "params": {"max_tokens": 256}, "samples": n, "tokens": 100 * n})


def write_trace(path: Path, model: Path) -> None:
    from reap_swap.models.families import layout_for
    from reap_swap.planning.corpus import read_corpus

    layout = layout_for(model)
    test = REPO / "example" / "realistic" / "test.jsonl"
    samples = read_corpus([test], lambda m: "\n".join(x["content"] for x in m), 10)[0]
    rng = np.random.default_rng(4)
    routes = []
    for s in samples:
        ids = np.stack([[rng.choice(layout.num_experts, layout.top_k, replace=False) for _ in layout.moe_layers] for _ in range(9)])
        phase = np.array([0] * 4 + [1] * 5, dtype=np.uint8)
        routes.append(tr.RequestRoute(s.sample_id, phase, ids, np.full(ids.shape, 1 / layout.top_k, np.float32),
                                      {"source": s.source, "tags": list(s.tags), "split": s.file}))
    meta = {"moe_layers": list(layout.moe_layers), "num_experts": layout.num_experts, "top_k": layout.top_k, "corpus": [str(test)],
            "decoding": {"max_prompt_tokens": 160}}
    tr.save(tr.build(meta, routes), path)


def test_cli_end_to_end_on_a_synthetic_observation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("sklearn")
    from reap_swap.cli import main

    model = REPO / "models" / "small_moe"
    write_observation(tmp_path / "obs", model)
    write_trace(tmp_path / "small_t.npz", model)
    out = tmp_path / "sets.json"
    argv = ["learned-sets", "--obs", str(tmp_path / "obs"), "--trace", str(tmp_path / "small_t.npz"), "--model", str(model),
            "--slots-fraction", "0.3", "--features", "tokens", "--batch", "4", "--extra-batches", "6", "--workdir", str(tmp_path / "work"),
            "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    slots, layers = data["slots_per_layer"], data["layers"]
    assert slots == 5 and layers == list(range(6)) and data["num_experts"] == 16
    everything = list(data["sets"].values())
    for arm in ("classifier", "classifier_bs8", "oracle", "oracle_bs8", "classifier_bs6", "oracle_bs6"):
        everything += list(data["per_request"][arm]["small_t"].values())
    assert len(data["per_request"]["classifier"]["small_t"]) == 10 and len(data["per_request"]["classifier_bs8"]["small_t"]) == 3
    # --extra-batches 6: the proxy's policy over groups of 6 in flight (requests 0-5, 6-9), scored like the others
    assert data["groups_bs6"]["small_t"] == {"0": [0, 1, 2, 3, 4, 5], "1": [6, 7, 8, 9]} and len(data["per_request"]["classifier_bs6"]["small_t"]) == 2
    for sets in everything:
        assert sorted(sets) == sorted(f"layer_{l}" for l in layers)
        assert all(len(v) == slots == len(set(v)) for v in sets.values())
    scores = data["scores"]["small_t"]
    assert set(scores) >= {"static_topk", "plan", "classifier", "classifier_bs8", "oracle", "classifier_bs6", "oracle_bs6"}
    assert all(0 <= scores[a]["hit_rate_decode"] <= 1 for a in scores)
    assert scores["oracle"]["gate_mass_hit_decode"] >= max(scores[a]["gate_mass_hit_decode"] for a in scores) - 1e-12
    assert data["classifier"]["chosen_features"] == "tokens" and 0 < data["classifier"]["cv_coverage"] <= 1
    assert [s["name"] for s in data["provenance"]["steps"]] == ["plan", "train-tokens"]
    assert "| static_topk |" in capsys.readouterr().out
    # a second run reuses the plan and the classifier (same commands, same inputs)
    assert main(argv) == 0
    assert all(s["reused"] for s in json.loads(out.read_text())["provenance"]["steps"])


@pytest.mark.parametrize("extra, said", [("8", "differ from --batch 4 and from 8"), ("4", "differ from --batch 4"), ("1", "must be >= 2"),
                                         ("x", "takes group sizes like 32")])
def test_cli_refuses_bad_extra_batches(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: str, said: str) -> None:
    """classifier_bs8 names --batch's groups whatever their size, so 8 cannot be an extra group size beside another --batch."""
    from reap_swap.cli import main

    argv = ["learned-sets", "--obs", str(tmp_path), "--trace", str(tmp_path / "t.npz"), "--model", str(tmp_path), "--batch", "4",
            "--extra-batches", extra, "--workdir", str(tmp_path / "w"), "--out", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and said in capsys.readouterr().err and not (tmp_path / "o.json").exists()
