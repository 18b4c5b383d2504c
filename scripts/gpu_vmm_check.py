"""GPU check of the CUDA expert bank (no vLLM): VMM backing, swaps, bytes, CUDA graphs, host-link speed.

Run on a CUDA machine: python scripts/gpu_vmm_check.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from reap_swap.server_ext.bank.bank import ExpertBank
from reap_swap.server_ext.bank.cuda_vmm import VmmBacking


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_vmm_check.json")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--slots", type=int, default=38)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    E, S, H, I = a.experts, a.slots, a.hidden, a.inter
    w13 = torch.randn(E, 2 * I, H, dtype=torch.bfloat16, device=dev)
    w2 = torch.randn(E, H, I, dtype=torch.bfloat16, device=dev)
    ref13, ref2 = w13.clone(), w2.clone()
    params = {"w13_weight": torch.nn.Parameter(w13, requires_grad=False), "w2_weight": torch.nn.Parameter(w2, requires_grad=False)}
    phys = torch.zeros(E, dtype=torch.int32, device=dev)
    backing = VmmBacking(dev)
    bank = ExpertBank(0, params, phys, S, backing)
    out: dict = {"granularity": backing.granularity, "host_row_offset": bank.table.host_row_offset, "expert_bytes": bank.expert_bytes}
    del w13, w2
    torch.cuda.empty_cache()

    def gathered() -> torch.Tensor:
        return params["w13_weight"].data[phys.long()]

    assert torch.equal(gathered(), ref13), "host rows differ after load"
    # CUDA graph over a read of every logical expert through the routing table.
    x = torch.randn(1, H, dtype=torch.bfloat16, device=dev)
    static_out = torch.empty(E, 2 * I, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up cuBLAS outside capture, as graph capture requires
        for _ in range(3):
            static_out.copy_(torch.einsum("eoh,h->eo", params["w13_weight"].data[phys.long()], x[0]))
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out.copy_(torch.einsum("eoh,h->eo", params["w13_weight"].data[phys.long()], x[0]))
    g.replay()
    base = static_out.clone()
    swaps = []
    for n in (1, 4, 16, 38):
        t = time.perf_counter()
        st = bank.swap(tuple(range(n)))
        swaps.append({"experts": n, "loaded": st.experts_loaded, "bytes": st.bytes_copied, "copy_ms": st.copy_s * 1e3,
                      "total_ms": (time.perf_counter() - t) * 1e3, "GBps": st.bytes_copied / max(st.copy_s, 1e-9) / 1e9})
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, base), f"graph output changed after swapping in {n}"
        assert torch.equal(gathered(), ref13) and torch.equal(params["w2_weight"].data[phys.long()], ref2)
        assert bank.verify() == []
    st = bank.swap(tuple(range(E - S, E)))
    swaps.append({"experts": S, "loaded": st.experts_loaded, "bytes": st.bytes_copied, "copy_ms": st.copy_s * 1e3,
                  "GBps": st.bytes_copied / max(st.copy_s, 1e-9) / 1e9, "note": "replace all residents"})
    g.replay()
    assert torch.equal(static_out, base)
    out["swaps"] = swaps
    # read bandwidth: slot rows vs host rows, one expert's w13 through a matvec
    def bench(rows: torch.Tensor) -> float:
        for _ in range(3):
            torch.einsum("eoh,h->eo", rows, x[0])
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            torch.einsum("eoh,h->eo", rows, x[0])
        torch.cuda.synchronize()
        return rows.numel() * rows.element_size() * 20 / (time.perf_counter() - t) / 1e9

    data = params["w13_weight"].data
    out["read_GBps_slot_rows"] = bench(data[:S])
    out["read_GBps_host_rows"] = bench(data[bank.table.host_row_offset : bank.table.host_row_offset + S])
    out["ok"] = True
    print(json.dumps(out, indent=1))
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
