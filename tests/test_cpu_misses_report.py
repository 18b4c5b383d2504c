"""bench_gpu_cpu_misses.json is assembled from the bench-gpu results it names (issue 16): the ratios and
link/CPU rates are recomputed here from the committed raw arm results."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from reap_swap.benchmarks import cpu_misses

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_with_link_derives_per_step_rates() -> None:
    stats = {"layers": 2, "calls": 20, "missed_experts": 60, "cpu_experts": 40, "bytes": 40 * 1000, "ns": 10_000}
    out = cpu_misses.with_link(stats, decode_tok_s=100.0, batch=1, expert_bytes=1000)
    assert out["decode_steps"] == 10 and out["link_experts_per_step"] == 2 and out["cpu_experts_per_step"] == 4
    assert out["link_GBps_achieved"] == 2 * 1000 / 0.01 / 1e9
    assert cpu_misses.with_link({"layers": 0}, 1.0, 1, 1) == {"layers": 0}


def test_assembled_file_matches_its_sources(tmp_path: Path) -> None:
    out = tmp_path / "cpu_misses.json"
    args = argparse.Namespace(dummy=RESULTS / "bench_gpu_cpu_dummy.json", learned=RESULTS / "bench_gpu_learned_cpu.json",
                              check=RESULTS / "cpu_path_check_h200.json", exactness=RESULTS / "cpu_exactness_h200.json", out=out)
    assert cpu_misses.assemble(args) == 0
    got = json.loads(out.read_text())
    raw = json.loads((RESULTS / "bench_gpu_cpu_dummy.json").read_text())["raw"]
    rate = lambda arm, b: raw[arm][b]["decode_tok_s"]  # noqa: E731
    assert got["ratios"]["cpu_path_vs_stock_offload_bs1"] == rate("reap_30_cpu", "bs1") / rate("stock_offload", "bs1")
    assert got["ratios"]["cpu_path_vs_link_only_bs1"] == rate("reap_30_cpu", "bs1") / rate("reap_30", "bs1")
    cpu = raw["reap_30_cpu"]["cpu_path_bs1"]
    assert got["cpu_kernel_GBps"] == cpu["bytes"] / cpu["ns"]
    for key in ("cpu_kernel_GBps", "memcpy_GBps", "max_abs_logit_delta", "greedy_agreement_256"):
        assert isinstance(got[key], float)
    committed = json.loads((RESULTS / "bench_gpu_cpu_misses.json").read_text())
    assert committed["ratios"] == got["ratios"]  # the committed file is this assembly
    assert (out.with_suffix(".md")).read_text().startswith("# CPU expert path")
