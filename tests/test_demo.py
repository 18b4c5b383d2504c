"""The README's main command, in reduced mode: table, figures, nothing left running."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from reap_swap.example.corpora import realistic_corpus_files
from tests.vllm_servers import require_vllm

pytestmark = pytest.mark.vllm
MARKER_ENV = "REAP_SWAP_TEST_RUN"


def _processes_of_run(marker: str) -> set[str]:
    """Live processes whose environment carries this run's marker: the demo's children inherit it, so
    servers of tests running beside this one (pytest-xdist workers) are not counted. A zombie has exited
    and only waits to be reaped (psutil gives no environ for it; seen once in CI: ``[VLLM::Worker] <defunct>``).
    Not seen: a child started with an environment built from scratch, or one this user cannot read; the
    demo's servers take ``{**os.environ, ...}`` (``procs.ServerProcess``) and vLLM's workers inherit it."""
    found = set()
    for p in psutil.process_iter(["pid", "cmdline", "environ"]):  # unreadable fields (gone, zombie, denied) read None
        if (p.info["environ"] or {}).get(MARKER_ENV) == marker:
            found.add(f"{p.info['pid']} {' '.join(p.info['cmdline'] or [])}")
    return found


def test_demo_quick(tmp_path: Path) -> None:
    require_vllm()
    work = tmp_path / "demo"
    marker = uuid.uuid4().hex
    r = subprocess.run([sys.executable, "-m", "reap_swap.cli", "demo", "--quick", "--workdir", str(work)],
                       capture_output=True, text=True, timeout=900, env={**os.environ, MARKER_ENV: marker})
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
    left = _processes_of_run(marker)
    assert not left, f"processes left running after the demo: {left}"
