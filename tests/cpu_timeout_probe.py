"""``TRITON_INTERPRET=1 python -m tests.cpu_timeout_probe``: one layer's CPU expert step on the CUDA
path's programs (split-and-post, wait-and-merge; interpreted on the CPU) with the real native team,
slowed by its test delay so the merge gives up waiting. The merged rows must be the pairs
recomputed from the host rows (never the team's unfinished output buffer), the timeout counted and
flagged for the worker's error log. Prints ``OK`` and a JSON line of what it saw."""

from __future__ import annotations

import json
import logging
import os
import types

import torch

from reap_swap.server_ext.cpu_experts import cpu_path as cp
from reap_swap.server_ext.cpu_experts import kernel as K
from reap_swap.server_ext.cpu_experts.split import CostModel
from reap_swap.server_ext.cpu_experts.step import BankRows
from reap_swap.server_ext.worker_ext import WorkerResidency
from tests.split_triton_check import _pair_reference


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(5)
    e, h, i, off, t, k = 16, 64, 32, 4, 2, 4
    w13 = (torch.randn(off + e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(off + e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
    bank = BankRows(w13, w2, off, e)
    settings = cp.CpuPathSettings(enabled=True, max_tokens=t)
    path = cp.LayerCpuPath(bank, k, 0, settings, CostModel(link_GBps=1e-3, cpu_GBps=1e3, max_tokens=t), K.CpuThreads(1),
                           torch.device("cpu"), fused=True)  # the CUDA path's two programs, interpreted
    path.wait_limit = 2000
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.softmax(torch.randn(t, k, generator=g), -1)
    phys = ids + off  # every pair missed; the cost model gives them all to the CPU
    lib = path.step_job.lib
    path.step_job.out.fill_(3.0)  # what the unfinished team's buffer holds
    lib.reap_team_set_test_delay_us(3_000_000)
    try:
        gpu_ids = path.before_experts(x, ids, w, phys, off)
        cpu_pairs = path._pending
        assert cpu_pairs is not None and bool(cpu_pairs.all()), cpu_pairs
        per_k = torch.zeros(t, k, h, dtype=torch.bfloat16)
        merged = path.merge(per_k)
    finally:
        lib.reap_team_set_test_delay_us(0)
    want = _pair_reference(x, w13[off:], w2[off:], ids.reshape(-1).to(torch.int32), w.reshape(-1), k).view(t, k, h)
    err = float((merged.float() - want.float()).abs().max())
    scale = float(want.float().abs().max())
    stats = path.stats()
    logs: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: logs.append(rec.getMessage())  # type: ignore[method-assign]
    logging.getLogger("reap_swap.server_ext").addHandler(handler)
    worker = types.SimpleNamespace(cpu_paths={7: path}, cpu_timeout_steps=0)  # the parts of WorkerResidency the check reads
    logged = WorkerResidency.check_cpu_timeouts(worker)  # type: ignore[arg-type]
    again = WorkerResidency.check_cpu_timeouts(worker)  # type: ignore[arg-type]
    seen = {"err": err, "scale": scale, "wait_timeouts": stats["wait_timeouts"], "cpu_pairs": stats["cpu_pairs"],
            "logged_layers": logged, "second_check": again, "logs": logs, "gpu_ids_filler": bool((gpu_ids == 0).all())}
    print(json.dumps(seen))
    assert not bool((merged == 3.0).any()), "the team's unfinished rows were merged"
    assert err <= 2**-5 * scale, seen
    assert stats["wait_timeouts"] == t * k and stats["cpu_pairs"] == t * k, seen
    assert logged == [7] and again == [] and any("did not finish a step in time in layers [7]" in m for m in logs), seen
    path.step_job.team.stop()
    print("OK")


if __name__ == "__main__":
    main()
