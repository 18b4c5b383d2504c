"""The host-link law of offloaded MoE decode (pure).

At small batch every routed expert that is not resident is read over the
host link by the fused kernel, so a decode step costs

    step = t_compute + missed_bytes / link_bytes_per_s,
    missed_bytes = (1 - hit_rate) * layers * routed_experts_per_layer * expert_bytes

where ``routed_experts_per_layer`` is the number of distinct experts the
step's tokens route to in a layer (top_k at batch 1). ``t_compute`` is the
step time with every routed expert resident.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    t_compute_s: float
    link_gbps: float  # 1e9 bytes per second
    layers: int
    expert_bytes: int

    def missed_bytes(self, hit_rate: float, experts_per_layer: float) -> float:
        return (1.0 - hit_rate) * self.layers * experts_per_layer * self.expert_bytes

    def step_s(self, hit_rate: float, experts_per_layer: float) -> float:
        return self.t_compute_s + self.missed_bytes(hit_rate, experts_per_layer) / (self.link_gbps * 1e9)

    def tok_s(self, hit_rate: float, experts_per_layer: float, batch: int = 1) -> float:
        return batch / self.step_s(hit_rate, experts_per_layer)


def compare(model: LinkModel, points: list[dict[str, float]], experts_per_layer: float, tolerance: float = 0.10) -> list[dict[str, float | bool]]:
    """Measured tok/s against the law at each point (``{"hit_rate", "decode_tok_s"}``)."""
    out: list[dict[str, float | bool]] = []
    for p in points:
        predicted = model.tok_s(p["hit_rate"], experts_per_layer)
        ratio = p["decode_tok_s"] / predicted
        out.append({**p, "predicted_tok_s": predicted, "measured_over_predicted": ratio, "within_tolerance": abs(ratio - 1.0) <= tolerance})
    return out


def stock_offload_missed_bytes(offloaded_layers: float, experts_per_layer: float, expert_bytes: int) -> float:
    """Stock layer offload reads every routed expert of each offloaded layer over the link."""
    return offloaded_layers * experts_per_layer * expert_bytes
