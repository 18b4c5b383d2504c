"""Subprocess for test_trace_routing: an offline vLLM engine whose MoE layers replay a trace.

``python tests/trace_routing_probe.py SPEC.json OUT.json``. SPEC: model, trace, kind
("reap" with ``slots`` resident experts per layer, or "stock"), ``runs``: lists of
{"id", "prompt", "trace_request"} run concurrently (one list = one batch), ``gen``,
optional ``expert_std`` (random expert weights, stock only: outputs then depend on routing).
OUT: per request its generated ids and, for reap, its ``reap_router_misses`` report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from probe_support import run_batch  # this script's directory is on sys.path


def random_experts(std: float) -> Any:
    """Replace the dummy loader's near-zero expert weights so that which experts run shows in the output."""

    def fn(model: Any) -> int:
        import torch

        n = 0
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "experts" in name and name.endswith(("w13_weight", "w2_weight")):
                    g = torch.Generator().manual_seed(n)
                    p.data.copy_((torch.randn(tuple(p.shape), generator=g) * std).to(p.dtype))
                    n += 1
        return n

    return fn


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from reap_swap.benchmarks import gpu_arm
    from reap_swap.benchmarks import trace_routing_vllm as trv
    from reap_swap.planning import traces

    gpu_arm._environment({"kind": spec["kind"], "slots": spec.get("slots", 0), "layers": spec["layers"]})
    routing = trv.install(traces.load(spec["trace"]))
    from vllm import LLM

    kw: dict[str, Any] = dict(model=spec["model"], dtype="float32", load_format="dummy", max_model_len=256,
                              enable_prefix_caching=False, seed=0, max_num_seqs=4)
    if spec["kind"] == "reap":
        kw["worker_extension_cls"] = "reap_swap.server_ext.worker_ext.ReapWorkerExtension"
    llm = LLM(**kw)
    if spec["kind"] == "reap":
        llm.collective_rpc("reap_install")
    if spec.get("expert_std"):
        llm.apply_model(random_experts(float(spec["expert_std"])))
    out: dict[str, Any] = {"runs": [], "describe": None}
    for batch in spec["runs"]:
        tokens = run_batch(llm, batch, spec["gen"], lambda req: routing.assign(req["id"], req["trace_request"]))
        reports = {}
        if spec["kind"] == "reap":
            reports = {r["id"]: llm.collective_rpc("reap_router_misses", args=(r["id"],))[0] for r in batch}
        out["runs"].append({"tokens": tokens, "reports": reports})
    out["describe"] = routing.describe()
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
