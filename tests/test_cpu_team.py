"""The CPU expert team (issue 16): pinned native threads taking layer steps from a mailbox.

The device posts a step exactly as ``_post_like_the_device`` does here (job address into the ring,
then the sequence number) and polls ``done``; these tests drive that protocol from Python on the
CPU, against the reference arithmetic."""

from __future__ import annotations

import time

import pytest
import torch

from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts.step import BankRows, CpuStep
from reap_swap.server_ext.cpu_experts.team import MAILBOX_WORDS, PlainStaging, TeamError, process_team, spin_us_from_env

pytestmark = pytest.mark.skipif(K.native_library() is None, reason=f"native CPU kernel unavailable: {K.native_error()}")


def _bank(e: int = 12, h: int = 64, i: int = 32, seed: int = 0) -> tuple[BankRows, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    return BankRows(w13, w2, 0, e), w13, w2


def _reference(x, w13, w2, ids, w, mask) -> torch.Tensor:
    t, k = ids.shape
    batch = K.group_pairs(ids.long(), w, mask)
    out = K.CpuExperts("torch", K.CpuThreads(1)).run(x, w13, w2, batch)
    return K.per_k_outputs(out, batch, t, k)


def _post_like_the_device(step: CpuStep, t: int) -> int:
    box = step.team.mailbox_host
    seq = int(box[0]) + 1
    box[16 + seq % 64] = step.job_address(t)
    box[0] = seq
    step.team.posted_on_device.fill_(seq)  # the split kernel stores it beside the mailbox's
    return seq


def _wait_done(step: CpuStep, seq: int, timeout_s: float = 30.0) -> None:
    t0 = time.monotonic()
    while step.team.done < seq:
        assert time.monotonic() - t0 < timeout_s, "the team never finished the step"
        time.sleep(1e-4)


def test_mailbox_layout_matches_the_native_struct():
    assert int(K.native_library().reap_mailbox_size()) == MAILBOX_WORDS * 8


def test_steps_posted_like_the_device_are_computed_in_order():
    """Many steps back to back, each waited for as the merge kernel does, each equal to the reference."""
    bank, w13, w2 = _bank()
    step = CpuStep(bank, max_tokens=4, top_k=4, threads=K.CpuThreads(2))
    g = torch.Generator().manual_seed(1)
    start = step.team.done
    for n in range(40):
        t = 1 + n % 4
        x = torch.randn(t, 64, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(t)]).to(torch.int32)
        w = torch.softmax(torch.randn(t, 4, generator=g), -1)
        mask = torch.rand(t, 4, generator=g) < 0.6
        step.stage(x, ids, w, mask)
        seq = _post_like_the_device(step, t)
        _wait_done(step, seq)
        want = _reference(x, w13, w2, ids, w, mask)
        scale = float(want.float().abs().max().clamp(min=1e-6))
        if mask.any():
            assert float((step.out[:t][mask].float() - want[mask].float()).abs().max()) <= 2**-6 * scale
    assert step.team.done == start + 40 and step.team.posted == start + 40
    assert step.stats()["calls"] == 40


def test_output_rows_wait_for_their_own_gate_up_rows():
    """Both phases share one queue; each group's last gate/up item is made to start 2 ms late, so an
    output item that did not wait for its group would read the previous step's activations."""
    bank, w13, w2 = _bank(e=12, h=64, i=64, seed=3)  # 4 gate/up items per group
    step = CpuStep(bank, max_tokens=2, top_k=4, threads=K.CpuThreads(2))
    g = torch.Generator().manual_seed(5)
    step.lib.reap_team_set_test_delay_us(2000)
    try:
        for _ in range(6):
            x = torch.randn(2, 64, generator=g).to(torch.bfloat16) * 4
            ids = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(2)]).to(torch.int32)
            w = torch.softmax(torch.randn(2, 4, generator=g), -1)
            mask = torch.ones(2, 4, dtype=torch.bool)
            step.stage(x, ids, w, mask)
            _wait_done(step, _post_like_the_device(step, 2))
            want = _reference(x, w13, w2, ids, w, mask)
            scale = float(want.float().abs().max())
            assert float((step.out[:2].float() - want.float()).abs().max()) <= 2**-6 * scale
    finally:
        step.lib.reap_team_set_test_delay_us(0)


def test_host_run_waits_for_its_step_and_counts_it():
    bank, w13, w2 = _bank(seed=2)
    step = CpuStep(bank, max_tokens=1, top_k=3, threads=K.CpuThreads(2))
    before = step.team.done
    x = torch.randn(1, 64).to(torch.bfloat16)
    ids = torch.tensor([[4, 0, 9]], dtype=torch.int32)
    step.stage(x, ids, torch.ones(1, 3), torch.ones(1, 3, dtype=torch.bool))
    step.run(1)
    assert step.team.done == before + 1
    assert int(step.team.posted_on_device) == step.team.posted == before + 1  # the device's next post follows it
    s = step.stats()
    assert (s["steps_with_work"], s["experts"], s["pairs"], s["bytes"]) == (1, 3, 3, 3 * bank.expert_bytes)


def test_a_bad_id_finishes_the_step_without_computing_it():
    """A step with an id out of range must still be marked done (the device waits on it) and report status."""
    bank, _, _ = _bank()
    step = CpuStep(bank, max_tokens=1, top_k=2, threads=K.CpuThreads(2))
    step.stage(torch.zeros(1, 64, dtype=torch.bfloat16), torch.tensor([[1, 99]], dtype=torch.int32), torch.ones(1, 2),
               torch.ones(1, 2, dtype=torch.bool))
    seq = _post_like_the_device(step, 1)
    _wait_done(step, seq)
    assert step.stats()["status"] != 0 and step.stats()["experts"] == 0
    with pytest.raises(RuntimeError, match="outside 0..11"):
        step.check()


def test_a_replaced_team_refuses_work_and_the_process_keeps_one_team():
    bank, _, _ = _bank()
    old = CpuStep(bank, max_tokens=1, top_k=2, threads=K.CpuThreads(2))
    new = CpuStep(bank, max_tokens=1, top_k=2, threads=K.CpuThreads(1))  # other threads: the team restarts
    assert new.team is not old.team and not old.team.running
    assert process_team(K.CpuThreads(1), PlainStaging()) is new.team
    old.stage(torch.zeros(1, 64, dtype=torch.bfloat16), torch.tensor([[0, 1]], dtype=torch.int32), torch.ones(1, 2),
              torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(TeamError, match="stopped"):
        old.run(1)
    new.stage(torch.zeros(1, 64, dtype=torch.bfloat16), torch.tensor([[0, 1]], dtype=torch.int32), torch.ones(1, 2),
              torch.ones(1, 2, dtype=torch.bool))
    new.run(1)


def test_spin_setting_is_validated(monkeypatch):
    monkeypatch.setenv("REAP_CPU_EXPERT_SPIN_US", "soon")
    with pytest.raises(TeamError, match="REAP_CPU_EXPERT_SPIN_US"):
        spin_us_from_env()
    monkeypatch.setenv("REAP_CPU_EXPERT_SPIN_US", "-1")
    with pytest.raises(TeamError, match=">= 0"):
        spin_us_from_env()
    monkeypatch.setenv("REAP_CPU_EXPERT_SPIN_US", "0")
    assert spin_us_from_env() == 0


_EXIT_WITH_A_RUNNING_TEAM = """
import os
import torch
from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts.step import BankRows, CpuStep

if __name__ == "__main__":
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # CI's box: the team shares two cores
    w13 = (torch.randn(8, 64, 64) / 8).to(torch.bfloat16)
    w2 = (torch.randn(8, 64, 32) / 6).to(torch.bfloat16)
    step = CpuStep(BankRows(w13, w2, 0, 8), max_tokens=2, top_k=2, threads=K.CpuThreads(2))
    x = torch.randn(2, 64).to(torch.bfloat16)
    step.stage(x, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.full((2, 2), 0.5), torch.ones(2, 2, dtype=torch.bool))
    for _ in range(20):
        step.run(2)
    print("ran", flush=True)
"""


def test_a_process_exits_cleanly_with_its_team_still_running():
    """The team is never stopped by the script: the exit hook must join its threads before the
    mailbox is freed (a spinning thread reading freed memory crashed pytest at exit in CI)."""
    import subprocess
    import sys

    for _ in range(6):
        done = subprocess.run([sys.executable, "-c", _EXIT_WITH_A_RUNNING_TEAM], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
        assert done.stdout.strip() == "ran"
