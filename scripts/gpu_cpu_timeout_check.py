"""H200 check of issue 31 point 4 (no vLLM): a CPU-path merge that gives up waiting for the CPU team
recomputes the pairs on the GPU from the host rows (UVA over the link) instead of merging the team's
unfinished output rows; eager and replayed in a CUDA graph, compiled (not interpreted) Triton.

The team is slowed for real with its test delay (``reap_team_set_test_delay_us``) and the merge's
poll budget is cut (``LayerCpuPath.wait_limit``) so a timeout takes milliseconds, not 17 s. Checked:
the merged rows equal the reference within bf16 tolerance and none equals the sentinel the team's
buffer was filled with; ``wait_timeouts`` counts the pairs; the mapped flag is raised for the host;
the next step (team still behind) recomputes at once; once the team has caught up (delay off), a
step merges the team's rows again. Also a normal step before any fault, for comparison.

Usage: python scripts/gpu_cpu_timeout_check.py OUT.json   (REAP_CPU_EXPERT_CPUS picks the cores)
"""

from __future__ import annotations

import json
import sys
import time

import torch

from reap_swap.server_ext.bank.cuda_vmm import VmmBacking
from reap_swap.server_ext.cpu_experts.cpu_path import CpuPathSettings, LayerCpuPath
from reap_swap.server_ext.cpu_experts.cuda_host import MappedStaging
from reap_swap.server_ext.cpu_experts.kernel import CpuThreads
from reap_swap.server_ext.cpu_experts.split import CostModel
from reap_swap.server_ext.cpu_experts.step import BankRows

from gpu_cpu_path_check import close as rel_err, reference, vmm_bank  # the same all-GPU reference and error (scripts/ is on the path)

E, H, I, S, K = 32, 2048, 768, 8, 8
SENTINEL = 3.0


def main(out_path: str) -> int:
    dev = torch.device("cuda", 0)
    backing, w13, w2, off, g = vmm_bank(dev)
    bank = BankRows(w13, w2, off, E)
    settings = CpuPathSettings(enabled=True, max_tokens=8)
    path = LayerCpuPath(bank, K, S if off > S else 0, settings, CostModel(link_GBps=1e-3, cpu_GBps=1e3, max_tokens=8),
                        CpuThreads.from_env(), dev, MappedStaging(dev))  # every missed expert goes to the CPU
    path.wait_limit = 20_000  # ~20 ms of polls instead of ~17 s
    lib = path.step_job.lib
    res: dict = {"device": torch.cuda.get_device_name(dev), "threads": list(path.step_job.threads.cpus) or "unpinned"}

    sx = torch.zeros(1, H, dtype=torch.bfloat16, device=dev)
    sids = torch.zeros(1, K, dtype=torch.int64, device=dev)
    sw = torch.zeros(1, K, dtype=torch.float32, device=dev)

    def step() -> torch.Tensor:
        phys = sids + off  # all missed
        path.before_experts(sx, sids, sw, phys, off)
        return path.merge(torch.zeros(1, K, H, dtype=torch.bfloat16, device=dev))

    def new_inputs() -> None:
        sx.copy_(torch.randn(1, H, generator=g).to(torch.bfloat16).to(dev))
        sids.copy_(torch.randperm(E - S, generator=g)[:K].add(S).view(1, K).to(dev))
        sw.copy_(torch.softmax(torch.randn(1, K, generator=g), -1).to(dev))

    def run(replay: "torch.cuda.CUDAGraph | None", merged_holder: list[torch.Tensor]) -> dict:
        new_inputs()
        t0 = time.perf_counter()
        if replay is None:
            merged_holder[:] = [step()]
        else:
            replay.replay()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        merged = merged_holder[0]
        return {"ms": ms, "rel_err": rel_err(merged, reference(sx, sids, sw, bank)),
                "sentinel_rows_merged": int((merged == SENTINEL).all(-1).sum()), "timeouts": int(path.counters[4]),
                "flag": path.take_timeout_flag()}

    holder: list[torch.Tensor] = []
    res["eager_normal"] = run(None, holder)
    cases = {}
    for mode in ("eager", "graph"):
        graph = None
        if mode == "graph":
            new_inputs()
            holder[:] = [step()]  # warm-up outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                holder[:] = [step()]
            torch.cuda.synchronize()
            path.take_timeout_flag()
        before = int(path.counters[4])
        path.step_job.out.fill_(SENTINEL)  # what an unfinished team leaves in its output rows
        lib.reap_team_set_test_delay_us(2_000_000)
        timed_out = run(graph, holder)
        behind = run(graph, holder)  # the team is still on the delayed step: recomputed without waiting again
        lib.reap_team_set_test_delay_us(0)
        team, t_wait = path.step_job.team, time.perf_counter()
        while team.done < team.posted and time.perf_counter() - t_wait < 120:  # let the team finish the delayed steps
            time.sleep(0.05)
        caught_up_after_s = time.perf_counter() - t_wait
        caught_up = run(graph, holder)
        cases[mode] = {"timed_out": timed_out, "behind": behind, "caught_up": caught_up, "timeouts_before": before,
                       "team_caught_up_after_s": caught_up_after_s}
    res["cases"] = cases
    ok = res["eager_normal"]["timeouts"] == 0 and res["eager_normal"]["rel_err"] < 2**-5
    for c in cases.values():
        ok &= c["timed_out"]["rel_err"] < 2**-5 and c["timed_out"]["sentinel_rows_merged"] == 0 and c["timed_out"]["flag"]
        ok &= c["timed_out"]["timeouts"] - c["timeouts_before"] == K
        ok &= c["behind"]["rel_err"] < 2**-5 and c["behind"]["sentinel_rows_merged"] == 0
        ok &= c["caught_up"]["rel_err"] < 2**-5 and c["caught_up"]["timeouts"] == c["behind"]["timeouts"] and not c["caught_up"]["flag"]
    res["ok"] = bool(ok)
    path.step_job.team.stop()
    print(json.dumps(res, indent=1))
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
