"""Issue 28's pure parts: the GGUF plan for llama.cpp's qwen3moe loader and the peers report joiner."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from reap_swap.benchmarks import peers
from reap_swap.benchmarks.peers_gguf import (
    ALIGNMENT,
    EXPERT_SUFFIXES,
    bundled_vocab_size,
    expert_bytes,
    metadata,
    shape_from_args,
    tensor_plan,
)
from reap_swap.benchmarks.shapes import SHAPES

REPO = Path(__file__).resolve().parents[1]
S30 = SHAPES["30b-a3b-24l"]

# llama.cpp's qwen3moe tensors (gguf-py constants MODEL_ARCH.QWEN3MOE, the separate-Q/K/V form)
PER_LAYER = {"attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm",
             "ffn_norm", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}


def test_plan_names_every_qwen3moe_tensor_once() -> None:
    plan = tensor_plan(S30, 8192)
    names = [t.name for t in plan]
    assert len(names) == len(set(names)) == 3 + 24 * len(PER_LAYER)
    assert names[0] == "token_embd.weight" and names[-2:] == ["output_norm.weight", "output.weight"]
    for i in range(24):
        assert {n.split(".")[2] for n in names if n.startswith(f"blk.{i}.")} == PER_LAYER
    assert all(re.fullmatch(r"(blk\.\d+\.)?[a-z_]+\.weight", n) for n in names)


def test_plan_shapes_are_ggml_ne_reversed() -> None:
    by = {t.name: t for t in tensor_plan(S30, 8192)}
    # qwen3moe.cpp: ffn_gate_exps {n_embd, n_ff_exp, n_expert}, ffn_down_exps {n_ff_exp, n_embd, n_expert}
    assert by["blk.0.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert by["blk.0.ffn_up_exps.weight"].shape == (128, 768, 2048)
    assert by["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert by["blk.0.ffn_gate_inp.weight"].shape == (128, 2048)
    assert by["blk.3.attn_q.weight"].shape == (32 * 128, 2048)
    assert by["blk.3.attn_k.weight"].shape == by["blk.3.attn_v.weight"].shape == (4 * 128, 2048)
    assert by["blk.3.attn_output.weight"].shape == (2048, 32 * 128)
    assert by["blk.3.attn_q_norm.weight"].shape == (128,)
    assert by["token_embd.weight"].shape == by["output.weight"].shape == (8192, 2048)
    assert {t.dtype for t in by.values() if len(t.shape) == 1} == {"F32"}
    assert {t.dtype for t in by.values() if t.name.split(".")[-2] in EXPERT_SUFFIXES} == {"BF16"}


def test_plan_holds_the_same_expert_bytes_as_our_shape() -> None:
    plan = tensor_plan(S30, 8192)
    assert expert_bytes(plan) == S30.expert_bytes_total == 24 * 128 * 9437184
    total = sum(t.nbytes for t in plan)
    assert 29.5e9 < total < 30.5e9  # 27 GiB of experts + attention and embeddings: ~30 GB, 27.9 GiB
    assert all(t.nbytes % 4 == 0 for t in plan) and ALIGNMENT == 32


def test_metadata_keys_are_the_ones_llama_cpp_reads() -> None:
    md = metadata(S30, 8192)
    a = "qwen3moe"
    assert md[f"{a}.block_count"] == 24 and md[f"{a}.embedding_length"] == 2048
    assert md[f"{a}.expert_count"] == 128 and md[f"{a}.expert_used_count"] == 8
    assert md[f"{a}.expert_feed_forward_length"] == 768
    assert md[f"{a}.attention.head_count"] == 32 and md[f"{a}.attention.head_count_kv"] == 4
    assert md[f"{a}.attention.key_length"] == md[f"{a}.attention.value_length"] == 128
    assert md["tokenizer.ggml.model"] == "none" and md[f"{a}.vocab_size"] == 8192
    assert all(isinstance(v, (int, float, str)) for v in md.values())


def test_vocab_and_small_shapes() -> None:
    assert bundled_vocab_size() == 8192
    s = shape_from_args("30b-a3b-24l", layers=2, experts=16)
    assert (s.layers, s.experts, s.top_k, s.hidden, s.moe_intermediate, s.dtype_bytes) == (2, 16, 8, 2048, 768, 2)
    assert shape_from_args("30b-a3b-24l") == S30
    assert shape_from_args("30b-a3b-24l", experts=4).top_k == 4


def test_tiny_gguf_reads_back(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    from reap_swap.benchmarks.peers_gguf import write_gguf

    shape = shape_from_args("tiny", layers=2)
    out = tmp_path / "t.gguf"
    summary = write_gguf(out, shape, vocab=64, block_mib=1)
    r = gguf.GGUFReader(str(out))
    plan = tensor_plan(shape, 64)
    assert [t.name for t in r.tensors] == [t.name for t in plan]
    assert summary["tensor_bytes"] == sum(t.nbytes for t in plan)
    norm = next(t for t in r.tensors if t.name == "blk.0.attn_norm.weight")
    assert float(norm.data.min()) == float(norm.data.max()) == 1.0


def _rows(ncmoe: int = 17) -> list[dict]:
    base = {"build_commit": "0c1e570", "n_gpu_layers": 99, "n_cpu_moe": ncmoe, "n_threads": 14, "cpu_mask": "0xfffc",
            "cpu_strict": True, "flash_attn": 1, "n_depth": 0}
    return [
        {**base, "n_prompt": 256, "n_gen": 0, "avg_ts": 900.0},
        {**base, "n_prompt": 512, "n_gen": 0, "avg_ts": 1200.0},
        {**base, "n_prompt": 2048, "n_gen": 0, "avg_ts": 1500.0},
        {**base, "n_prompt": 0, "n_gen": 128, "avg_ts": 40.0, "stddev_ts": 0.5},
    ]


KERNEL = {"threads": {"n": 14, "cpus": list(range(2, 16))},
          "kt_kernel": {"importable": "yes", "variant": "amx", "version": "0.6.1"},
          "backends": {"native": {"batch1": {"GBps": 80.0}, "batch8": {"GBps": 45.0}}},
          "kt_kernel_comparison": {"batch1": {"GBps": 40.0, "thread_cpus": list(range(2, 16))}, "batch8": {"GBps": 60.0}}}
GPU = {"date": "d", "command": "reap-swap bench-gpu ...", "settings": {"prompt_len": 256},
       "arms": {"reap_30_cpu": {"decode_tok_s_bs1": 80.0, "decode_tok_s_bs8": 120.0, "ttft_ms_bs1": 400.0, "slots": 38}},
       "raw": {"reap_30_cpu": {"cpu_path_bs1": {"threads": {"n": 14, "cpus": list(range(2, 16))}}}}}


def test_join_fills_the_issue_keys() -> None:
    res = peers.join(_rows(), {"command": "llama-bench ...", "n_cpu_moe_why": "w"}, KERNEL, GPU)
    assert res["llamacpp"]["decode_tok_s_bs1"] == 40.0
    assert res["llamacpp"]["prefill_tok_s_pp2048"] == 1500.0
    assert res["llamacpp"]["commit"] == "0c1e570" and res["llamacpp"]["flags"]["n_cpu_moe"] == 17
    assert res["kt_kernel"]["GBps_bs1"] == 40.0 and res["kt_kernel"]["GBps_bs8"] == 60.0
    assert res["ours"]["cpu_kernel_GBps_bs1"] == 80.0
    assert res["ours"]["reap_30_cpu"]["decode_tok_s_bs1"] == 80.0
    assert res["ours"]["reap_30_cpu"]["threads"]["n"] == 14
    assert res["ratios"]["ours_vs_llamacpp_bs1"] == pytest.approx(2.0)
    assert res["ratios"]["ours_cpu_kernel_vs_kt_bs1"] == pytest.approx(2.0)
    assert res["ratios"]["ours_vs_llamacpp_pp256_ttft"] == pytest.approx(640.0 / 900.0)
    # ours has no pp2048 figure: null with a reason, never estimated
    assert res["ratios"]["ours_vs_llamacpp_pp2048"] is None
    assert "ours.reap_30_cpu.prefill_tok_s_pp2048" in res["missing"]
    assert "ratios.ours_vs_llamacpp_pp2048" in res["missing"]
    assert res["gpu_expert_share"]["llamacpp"] == pytest.approx(7 / 24)
    assert res["gpu_expert_share"]["ours"] == pytest.approx(38 / 128)
    json.dumps(res)


def test_join_with_nothing_is_all_null_with_reasons() -> None:
    res = peers.join(None, None, None, None)
    for key in ("llamacpp.decode_tok_s_bs1", "llamacpp.prefill_tok_s_pp2048", "kt_kernel.GBps_bs1", "kt_kernel.GBps_bs8",
                "ours.cpu_kernel_GBps_bs1", "ours.reap_30_cpu.decode_tok_s_bs1", "ratios.ours_vs_llamacpp_bs1"):
        assert key in res["missing"], key
    assert res["llamacpp"]["decode_tok_s_bs1"] is None and res["kt_kernel"]["GBps_bs1"] is None
    assert all(v is None for v in res["ratios"].values())


def test_join_says_why_kt_is_missing_and_falls_back_for_ours() -> None:
    kernel = {"kt_kernel": {"importable": "no (ModuleNotFoundError: x)"}, "backends": {}}
    fallback = {"backends": {"native": {"batch1": {"GBps": 83.6}, "batch8": {"GBps": 45.4}}}, "threads": {"n": 12}}
    res = peers.join(_rows(), None, kernel, GPU, kernel_fallback=fallback)
    assert "did not import" in res["missing"]["kt_kernel.GBps_bs1"]
    assert res["ours"]["cpu_kernel_GBps_bs1"] == 83.6 and "not side by side" in res["ours"]["cpu_kernel_source"]


def test_join_says_the_kt_run_died_and_takes_the_avx2_rerun() -> None:
    died = {**KERNEL, "kt_kernel_comparison_error": "the kt-kernel run did not finish"}
    del died["kt_kernel_comparison"]
    res = peers.join(None, None, died, None)
    assert res["missing"]["kt_kernel.GBps_bs1"] == "the kt-kernel run did not finish"
    assert res["ours"]["cpu_kernel_GBps_bs1"] == 80.0  # ours was written before kt ran
    avx2 = {**KERNEL, "kt_kernel_comparison": {"batch1": {"GBps": 20.0, "moe_class": "AVX2BF16_MOE"}, "batch8": {"GBps": 30.0}}}
    res = peers.join(None, None, died, None, kt_fallback=avx2)
    assert res["kt_kernel"]["GBps_bs1"] == 20.0 and res["kt_kernel"]["moe_class"] == "AVX2BF16_MOE"
    assert "AVX2BF16_MOE rerun" in res["kt_kernel"]["fallback"]
    assert peers.join(None, None, KERNEL, None, kt_fallback=avx2)["kt_kernel"]["GBps_bs1"] == 40.0


def test_join_flags_a_build_of_another_commit() -> None:
    rows = [{**r, "build_commit": "deadbee"} for r in _rows()]
    assert "llamacpp.commit" in peers.join(rows, None, None, None)["missing"]


def test_cuda_args_name_wheel_cublas_and_the_driver(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("peers_cuda_args", REPO / "scripts" / "peers_cuda_args.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    tk = tmp_path / "cuda"
    (tk / "bin").mkdir(parents=True)
    (tk / "include").mkdir()
    (tk / "bin" / "nvcc").write_text("")
    wheel = tmp_path / "site" / "nvidia" / "cu13"
    (wheel / "include").mkdir(parents=True)
    (wheel / "lib").mkdir()
    for f in ("include/cublas_v2.h", "include/cublas_api.h", "lib/libcublas.so.13", "lib/libcublasLt.so.13"):
        (wheel / f).write_text("")
    drv = tmp_path / "drv"
    drv.mkdir()
    (drv / "libcuda.so.1").write_text("")
    args, libdirs = mod.cmake_args(str(tk / "bin" / "nvcc"), str(tmp_path / "inc"), [str(tmp_path / "site")], (str(drv),))
    assert f"-DCMAKE_CUDA_FLAGS=-I{tmp_path / 'inc'}" in args
    assert f"-DCUDA_cublas_LIBRARY={wheel / 'lib' / 'libcublas.so.13'}" in args
    assert f"-DCUDA_cublasLt_LIBRARY={wheel / 'lib' / 'libcublasLt.so.13'}" in args
    assert f"-DCUDA_cuda_driver_LIBRARY={drv / 'libcuda.so.1'}" in args
    assert sorted(p.name for p in (tmp_path / "inc").iterdir()) == ["cublas_api.h", "cublas_v2.h"]
    assert libdirs == [str(wheel / "lib")]
    # a whole toolkit needs nothing
    for f in ("include/cublas_v2.h", "lib64/libcublas.so", "lib64/libcublasLt.so", "lib64/stubs/libcuda.so"):
        (tk / f).parent.mkdir(parents=True, exist_ok=True)
        (tk / f).write_text("")
    assert mod.cmake_args(str(tk / "bin" / "nvcc"), str(tmp_path / "inc2"), [str(tmp_path / "site")], (str(drv),)) == ([], [])


def test_scripts_agree_on_the_pinned_commit_and_parse() -> None:
    export = (REPO / "scripts" / "peers_llamacpp_export.sh").read_text()
    runner = (REPO / "scripts" / "gpu_peers.sh").read_text()
    assert f"COMMIT={peers.PINNED_COMMIT}" in export
    assert f"SHORT={peers.PINNED_COMMIT[:7]}" in runner
    for script in ("gpu_peers.sh", "peers_llamacpp_export.sh"):
        subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)
    assert "/.peers/" in (REPO / ".gitignore").read_text().splitlines()


def test_join_reads_a_several_length_run_for_decode_and_pp2048() -> None:
    """``--ttft-only --prompt-len 256,2048``: decode at the shortest length, prefill tok/s = 2048 / its TTFT; the fast arm beside."""
    arm = {"decode_tok_s_bs1_p256": 90.0, "ttft_ms_p256": 50.0, "decode_tok_s_bs1_p2048": 85.0, "ttft_ms_p2048": 800.0, "slots": 38}
    gpu = {"date": "d", "command": "c", "gpu": "NVIDIA H100", "prompt_lens": [256, 2048], "settings": {"prompt_len": 256},
           "arms": {"reap_30_cpu": arm, "reap_30_fast": {**arm, "decode_tok_s_bs1_p256": 120.0}},
           "raw": {"reap_30_cpu": {"cpu_path_bs1_p256": {"threads": {"n": 14}}}}}
    res = peers.join(_rows(), None, KERNEL, gpu)
    ours = res["ours"]["reap_30_cpu"]
    assert ours["decode_tok_s_bs1"] == 90.0 and ours["prompt_len"] == 256 and ours["threads"] == {"n": 14}
    assert ours["prefill_tok_s_pp2048"] == pytest.approx(2048 / 0.8)
    assert res["ratios"]["ours_vs_llamacpp_pp2048"] == pytest.approx(2048 / 0.8 / 1500.0)
    assert res["ratios"]["ours_vs_llamacpp_bs1"] == pytest.approx(90.0 / 40.0)
    assert res["ratios"]["ours_fast_vs_llamacpp_bs1"] == pytest.approx(120.0 / 40.0)
    assert "ours.reap_30_cpu.prefill_tok_s_pp2048" not in res["missing"]
    assert res["ours"]["reap_30_fast"]["decode_tok_s_bs1"] == 120.0
