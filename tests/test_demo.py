"""The README's main command, in reduced mode: table, figures, nothing left running."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from reap_swap.example.corpora import realistic_corpus_files
from tests.vllm_servers import require_vllm

pytestmark = pytest.mark.vllm


def _server_like_processes() -> set[str]:
    """Live ones: a zombie has exited and only waits to be reaped -- by PID 1 once orphaned, which on
    the sandbox's init can lag the demo's exit (seen once in CI: ``[VLLM::Worker] <defunct>``)."""
    out = subprocess.run(["ps", "-eo", "pid,stat,args"], capture_output=True, text=True).stdout.splitlines()[1:]
    keys = ("reap_swap", "vllm", "VLLM", "spawn_main", "multiprocessing")
    live = (line.split(None, 2) for line in out)
    return {f"{pid} {args}" for pid, stat, args in (f for f in live if len(f) == 3) if not stat.startswith("Z") and any(k in args for k in keys)}


def test_demo_quick(tmp_path: Path) -> None:
    require_vllm()
    work = tmp_path / "demo"
    before = _server_like_processes()
    r = subprocess.run([sys.executable, "-m", "reap_swap.cli", "demo", "--quick", "--workdir", str(work)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "token-weighted mean" in r.stdout and "top-k" in r.stdout and "best non-predictive baseline" in r.stdout
    assert r.stdout.count("per-layer split:") == 1 and r.stdout.count("core fraction:") == 1  # the plan's CV tables, once
    result = json.loads((work / "demo.json").read_text())
    domains = {json.loads(line)["tags"][0] for line in realistic_corpus_files()[1].read_text().splitlines()}
    assert len(result["requests"]) == len(domains)  # one per domain
    for row in result["requests"]:
        assert row["tokens"] > 0 and 0 <= row["miss_ratio"] <= 1
    assert any(row["bytes_copied"] > 0 for row in result["requests"])
    for fig in result["figures"]:
        assert (work / fig).stat().st_size > 1000
    left = _server_like_processes() - before
    assert not left, f"processes left running after the demo: {left}"
