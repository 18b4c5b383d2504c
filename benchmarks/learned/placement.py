"""Where stock vLLM put the expert weights, and the stock arms' hit rates from it (``learned.arm``'s stock side).

Stock offload has no miss accounting: a routed pair hits when its layer's experts sit on the GPU, so the
hit rate is read from the loaded parameters (or vLLM's offload order) times the trace rows run.
"""

from __future__ import annotations

from typing import Any

from ..gpu_arm import Results, on_model
from .inputs import Batch, layer_fractions, offline_rates, offload_order_fractions, tp_of


def offload_placement(model: Any) -> dict[str, Any]:
    """Bytes of each MoE layer's expert weights on the GPU and on the host, read from the loaded parameters.

    vLLM's UVA offload leaves ``p.device`` on CUDA (a view of pinned host memory)
    and marks the parameter ``_vllm_is_uva_offloaded``; its non-UVA fallback moves
    the tensor to the CPU.
    """
    import torch

    from ..llm_probe import layer_index

    out: dict[int, list[int]] = {}
    for name, p in model.named_parameters():
        if ".experts." not in f".{name}." or not name.endswith(("w13_weight", "w2_weight")):
            continue
        layer = layer_index(name)
        if layer is None:
            continue
        host = bool(getattr(p, "_vllm_is_uva_offloaded", False)) or (p.device.type == "cpu" and torch.cuda.is_available())
        row = out.setdefault(layer, [0, 0])
        row[1 if host else 0] += p.numel() * p.element_size()
    return {f"layer_{k}": {"gpu_bytes": v[0], "host_bytes": v[1]} for k, v in sorted(out.items())}


def stock_hits(spec: dict[str, Any], llm: Any, trace: Any, runs: dict[str, list[Batch]], res: Results) -> dict[str, Any]:
    """Stock arms' hit rates from where the expert weights are, over the trace rows of the requests run.

    Every token routes top-k pairs in every layer, so a pair hits when its layer's
    experts are on the GPU (a layer split between GPU and host counts its GPU byte
    share): the hit rate is the byte-weighted share of layers kept on the GPU.
    """
    layers = spec["layers"]
    if spec.get("offload_gib"):
        placed_ranks = on_model(llm, offload_placement)
        placed = placed_ranks[0]
        host = sum(v["host_bytes"] for v in placed.values())
        if host:
            fr = [placed[f"layer_{j}"]["gpu_bytes"] / max(1, placed[f"layer_{j}"]["gpu_bytes"] + placed[f"layer_{j}"]["host_bytes"]) for j in range(layers)]
            source = "loaded parameters (UVA marker / device)"
        elif spec["device"] == "cuda":
            fr = offload_order_fractions(layers, spec["experts"], spec["expert_bytes"] // tp_of(spec), spec["offload_gib"] * 2**30)
            source = "vLLM's first-come offload order (no parameter carried an offload marker)"
        else:
            fr, source = [1.0] * layers, "cpu_offload_gb is a no-op on the CPU backend"
        placement = {"source": source, "gpu_fraction_by_layer": fr, "host_gib": host / 2**30, "by_layer": placed}
        if len(placed_ranks) > 1:  # host_gib: rank 0's (cpu_offload_gb is per GPU); every rank's beside it
            placement["host_gib_by_rank"] = [sum(v["host_bytes"] for v in r.values()) / 2**30 for r in placed_ranks]
            placement["gpu_fraction_by_layer_same_on_every_rank"] = all(
                {k: v["gpu_bytes"] > 0 for k, v in r.items()} == {k: v["gpu_bytes"] > 0 for k, v in placed.items()} for r in placed_ranks)
        res.save("placement", placement)
    else:
        fr, source = [1.0] * layers, "every expert on the GPU"
    out = {}
    for key, batches in runs.items():
        h = offline_rates(trace, spec["trace_layers"], [(reqs, layer_fractions(fr, spec["experts"])) for _, reqs, _ in batches])
        out[key] = {**h, "source": source}
    return out
