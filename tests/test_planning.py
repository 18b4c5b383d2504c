"""Observation and planning on the tiny model and the example corpus."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from reap_swap.models.families import layout_for
from reap_swap.paths import example_corpus_files
from reap_swap.plan import parse_plan
from reap_swap.planning.budget import BudgetError, allocate_slots, make_budget
from reap_swap.planning.corpus import CorpusError, read_corpus
from reap_swap.planning.observations import ObservationError, load_observations
from reap_swap.planning.observe import observe
from reap_swap.planning.planner import PlanParams, build_plan, expert_correlation
from reap_swap.server_ext.launcher import plan_env

N_SAMPLES = 24


@pytest.fixture(scope="module")
def obs_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("obs")
    observe(tiny_model_dir, example_corpus_files(), out, max_samples=N_SAMPLES, max_tokens=96, batch_size=5, progress=False)
    return out


def brute_force(model_dir: Path, obs_dir: Path, n: int) -> dict[str, np.ndarray]:
    """Per-token recomputation with HF's own modules, one sample at a time, no batching."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    L = cfg.num_hidden_layers
    rows = [json.loads(x) for x in (obs_dir / "samples.jsonl").read_text().splitlines()][:n]
    samples, _ = read_corpus(example_corpus_files(), lambda m: tok.apply_chat_template(m, tokenize=False), N_SAMPLES)
    by_id = {s.sample_id: s for s in samples}
    mass = np.zeros((n, L, E)); freq = np.zeros((n, L, E)); sal = np.zeros((n, L, E)); coact = np.zeros((L, E, E))
    for si, row in enumerate(rows):
        ids = tok(by_id[row["id"]].text, add_special_tokens=False, truncation=True, max_length=96)["input_ids"]
        inputs: dict[int, torch.Tensor] = {}
        hooks = [layer.mlp.register_forward_pre_hook(lambda m, a, li=li: inputs.__setitem__(li, a[0][0])) for li, layer in enumerate(model.model.layers)]
        with torch.no_grad():
            model(torch.tensor([ids]))
            for h in hooks:
                h.remove()
            for li, layer in enumerate(model.model.layers):
                for x in inputs[li]:
                    probs = torch.softmax(x @ layer.mlp.gate.weight.T, dim=-1)
                    w, top = torch.topk(probs, K)
                    w = w / w.sum()
                    for a in top.tolist():
                        for b in top.tolist():
                            coact[li, a, b] += 1
                    for k in range(K):
                        e = int(top[k])
                        out = layer.mlp.experts(x[None], torch.tensor([[e]]), torch.ones(1, 1))[0]
                        mass[si, li, e] += float(w[k]); freq[si, li, e] += 1; sal[si, li, e] += float(w[k]) * float(out.norm())
    return {"ids": [r["id"] for r in rows], "mass": mass, "freq": freq, "sal": sal, "coact": coact}


def test_observation_equals_brute_force_per_token_recomputation(tiny_model_dir: Path, obs_dir: Path) -> None:
    n = 6
    ref = brute_force(tiny_model_dir, obs_dir, n)
    obs = load_observations(obs_dir)
    for si, sid in enumerate(ref["ids"]):
        i = obs.sample_ids.index(sid)
        np.testing.assert_allclose(obs.sample_mass[i], ref["mass"][si], rtol=1e-4, atol=1e-5)
        np.testing.assert_array_equal(obs.sample_freq[i], ref["freq"][si])
        np.testing.assert_allclose(obs.sample_saliency[i], ref["sal"][si], rtol=1e-4, atol=1e-5)
    sub = obs.subset([obs.sample_ids.index(s) for s in ref["ids"]])
    assert sub.freq.sum() == ref["freq"].sum()
    # saliency = mean over routed tokens of gate x ||E(x)||
    total_sal = ref["sal"].sum(0)
    np.testing.assert_allclose(sub.saliency, np.divide(total_sal, ref["freq"].sum(0), where=ref["freq"].sum(0) > 0,
                               out=np.zeros_like(total_sal)), rtol=1e-4, atol=1e-6)


def test_coactivation_equals_brute_force(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    observe(tiny_model_dir, example_corpus_files(), out, max_samples=3, max_tokens=96, batch_size=2, progress=False)
    ref = brute_force(tiny_model_dir, out, 3)
    np.testing.assert_array_equal(load_observations(out).coact, ref["coact"])


def test_rerun_is_deterministic_and_incremental_equals_full(tiny_model_dir: Path, obs_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    observe(tiny_model_dir, example_corpus_files(), again, max_samples=N_SAMPLES, max_tokens=96, batch_size=5, progress=False)
    a, b = load_observations(obs_dir), load_observations(again)
    assert a.sha256 == b.sha256
    np.testing.assert_array_equal(a.sample_mass, b.sample_mass)
    inc = tmp_path / "inc"
    first = observe(tiny_model_dir, example_corpus_files(), inc, max_samples=10, max_tokens=96, batch_size=5, progress=False)
    second = observe(tiny_model_dir, example_corpus_files(), inc, max_samples=N_SAMPLES, max_tokens=96, batch_size=5, progress=False)
    assert first["new_samples"] == 10 and second["new_samples"] == N_SAMPLES - 10 and len(second["chunks"]) == 2
    c = load_observations(inc)
    assert c.sample_ids == a.sample_ids
    np.testing.assert_allclose(c.sample_mass, a.sample_mass, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(c.freq, a.freq)
    np.testing.assert_array_equal(c.coact, a.coact)
    third = observe(tiny_model_dir, example_corpus_files(), inc, max_samples=N_SAMPLES, max_tokens=96, progress=False)
    assert third["new_samples"] == 0 and len(third["chunks"]) == 2


@pytest.mark.parametrize("ratio", [0.5, 0.6, 0.8, 1.0])
def test_plan_never_exceeds_budget_and_core_slices_disjoint(tiny_model_dir: Path, obs_dir: Path, ratio: float) -> None:
    layout = layout_for(tiny_model_dir)
    budget = make_budget(layout, ratio=ratio)
    plan = build_plan(load_observations(obs_dir), layout, budget, PlanParams(), str(tiny_model_dir))
    parsed = parse_plan(plan)  # validator: core and slices disjoint, ids in range
    resident = sum(lp.resident_capacity for lp in parsed.layers.values())
    assert resident * layout.bytes_per_expert + layout.non_expert_bytes <= budget.resident_bytes
    assert resident == budget.expert_slots
    for lp in parsed.layers.values():
        covered = set(lp.core) | {e for s in lp.slices for e in s.experts}
        assert covered == set(range(layout.num_experts))


def test_slices_beat_random_partitions(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("obs-big")
    observe(tiny_model_dir, example_corpus_files(), out, max_samples=120, max_tokens=64, batch_size=8, progress=False)
    obs = load_observations(out)
    layout = layout_for(tiny_model_dir)
    plan = parse_plan(build_plan(obs, layout, make_budget(layout, ratio=0.7), PlanParams(core_fraction=0.25, slice_size=3), "tiny"))
    share = obs.mass_share()
    rng = random.Random(0)
    wins = 0
    for li, layer in enumerate(obs.layer_ids):
        lp = plan.layers[layer]
        rest = sorted({e for s in lp.slices for e in s.experts})
        corr = expert_correlation(share[:, li, rest])
        pos = {e: i for i, e in enumerate(rest)}

        def score(groups: list[list[int]]) -> float:
            vals = [corr[pos[a], pos[b]] for g in groups for i, a in enumerate(g) for b in g[i + 1 :]]
            return float(np.mean(vals))

        planned = score([list(s.experts) for s in lp.slices])
        sizes = [len(s.experts) for s in lp.slices]
        randoms = []
        for _ in range(200):
            perm = rest[:]
            rng.shuffle(perm)
            groups, k = [], 0
            for n in sizes:
                groups.append(perm[k : k + n])
                k += n
            randoms.append(score(groups))
        assert planned > np.mean(randoms)
        wins += planned > np.percentile(randoms, 95)
    assert wins >= len(obs.layer_ids) - 1


def test_allocation_favours_concentrated_layers() -> None:
    mass = np.array([[10, 0.1, 0.1, 0.1], [1, 1, 1, 1]], dtype=float)
    assert allocate_slots(mass, 4).tolist() == [1, 3]
    assert allocate_slots(mass, 8).tolist() == [4, 4]
    with pytest.raises(BudgetError):
        allocate_slots(mass, 9)


def test_budget_errors_name_the_problem(tiny_model_dir: Path) -> None:
    layout = layout_for(tiny_model_dir)
    with pytest.raises(BudgetError, match="always-resident"):
        make_budget(layout, ratio=0.2)
    with pytest.raises(BudgetError, match="exactly one"):
        make_budget(layout)
    with pytest.raises(BudgetError, match=r"\(0, 1\]"):
        make_budget(layout, ratio=1.5)


def test_generated_plan_passes_server_preflight(tiny_model_dir: Path, obs_dir: Path, tmp_path: Path) -> None:
    layout = layout_for(tiny_model_dir)
    plan = build_plan(load_observations(obs_dir), layout, make_budget(layout, ratio=0.5), PlanParams(), str(tiny_model_dir))
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    args = Namespace(model=tiny_model_dir, plan=str(path), resident_experts_per_layer=None, start_resident="core",
                     start_resident_prefixes="", control_token=None, validate_only=False)
    env = plan_env(args)
    assert env["REAP_PLAN_FILE"] == str(path.resolve())


def test_corpus_reading_and_errors(tmp_path: Path) -> None:
    f = tmp_path / "c.jsonl"
    good = {"messages": [{"role": "user", "content": "fix it", "code_context": [{"file": "a.py", "code": "x = 1"}]},
                         {"role": "assistant", "content": "done", "suggested_diffs": [{"file": "a.py", "diff": "-x\n+y"}]}],
            "source": "cursor", "created_at": 1}
    f.write_text("\n".join([json.dumps(good), "{broken", json.dumps({"messages": []}), json.dumps({"text": "plain text"}),
                            json.dumps([1, 2]), json.dumps({"messages": [{"role": "assistant", "content": "hi"}]})]) + "\n")
    samples, stats = read_corpus([f], lambda m: "|".join(x["content"] for x in m))
    assert len(samples) == 2
    assert "File: a.py" in samples[0].text and "x = 1" in samples[0].text and "+y" in samples[0].text
    assert samples[0].source == "cursor" and samples[0].tags == ("untagged",)
    assert dict(stats.skipped) == {"invalid_json": 1, "no_messages": 1, "not_an_object": 1, "no_user_turn": 1}
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{nope\n[]\n")
    with pytest.raises(CorpusError, match="no usable sample.*invalid_json: 1"):
        read_corpus([bad], str)
    with pytest.raises(CorpusError, match="not found"):
        read_corpus([tmp_path / "missing.jsonl"], str)


def test_corrupt_observations_are_refused(obs_dir: Path, tmp_path: Path) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(obs_dir, broken)
    chunk = next(broken.glob("chunk-*.npz"))
    chunk.write_bytes(chunk.read_bytes()[:-10])
    with pytest.raises(ObservationError, match="sha256"):
        load_observations(broken)
    with pytest.raises(ObservationError, match="no manifest"):
        load_observations(tmp_path / "nothing")


def test_cli_chain_and_report(tiny_model_dir: Path, obs_dir: Path, tmp_path: Path) -> None:
    cli = [sys.executable, "-m", "reap_swap.cli"]
    plan = tmp_path / "plan.json"
    r = subprocess.run(cli + ["plan", "--observations", str(obs_dir), "--model", str(tiny_model_dir), "--budget-ratio", "0.5",
                              "--out", str(plan)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    rep = tmp_path / "rep"
    r = subprocess.run(cli + ["plan-report", str(plan), "--observations", str(obs_dir), "--out", str(rep)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for name in ("allocation.png", "concentration.png", "coverage.png", "summary.txt", "summary.json"):
        assert (rep / name).stat().st_size > 0
    summary = json.loads((rep / "summary.json").read_text())
    strat = summary["coverage"]["strategies"]
    assert strat["core+oracle_slices"]["mean"] >= strat["core+static_slices"]["mean"] >= strat["core"]["mean"]
    r = subprocess.run(cli + ["plan", "--observations", str(tmp_path / "none"), "--model", str(tiny_model_dir),
                              "--budget-ratio", "0.5", "--out", str(plan)], capture_output=True, text=True)
    assert r.returncode == 2 and "no manifest" in r.stderr
    r = subprocess.run(cli + ["observe", "--model", str(tiny_model_dir), "--corpus", str(tmp_path / "x.jsonl"), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "not found" in r.stderr
