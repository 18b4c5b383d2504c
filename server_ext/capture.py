"""Attribute one forward step's captured routing to the requests in the batch.

The layers wrote every token's top-k expert ids and gate weights into fixed
buffers during the step. Rows are laid out request after request in batch
order, ``num_scheduled_tokens`` rows each; padding rows follow and are
ignored. Residency cannot change between the step and this call (swaps run
between steps, after it), so the resident masks are the ones the step used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class StepLayout:
    request_ids: list[str]
    num_tokens: list[int]

    @property
    def total(self) -> int:
        return sum(self.num_tokens)


def batch_layout(runner: Any, scheduler_output: Any) -> StepLayout | None:
    """Requests and their token counts, in the order their rows were fed to the model.

    Model Runner V2 keeps the step's ``InputBatch`` in ``execute_model_state``;
    V1 keeps a persistent ``input_batch`` whose order matches the rows.
    """
    state = getattr(runner, "execute_model_state", None)
    batch = getattr(state, "input_batch", None)
    if batch is not None and hasattr(batch, "num_scheduled_tokens") and hasattr(batch, "req_ids"):
        n = int(getattr(batch, "num_reqs", len(batch.req_ids)))
        ids = [str(r) for r in list(batch.req_ids)[:n]]
        counts = [int(c) for c in np.asarray(batch.num_scheduled_tokens)[:n]]
        return StepLayout(ids, counts)
    batch = getattr(runner, "input_batch", None)
    scheduled = getattr(scheduler_output, "num_scheduled_tokens", None)
    if batch is None or not isinstance(scheduled, dict):
        return None
    ids = [r for r in batch.req_ids if r is not None and r in scheduled]
    return StepLayout(ids, [int(scheduled[r]) for r in ids])


def attribute_step(
    ids_per_layer: Sequence[torch.Tensor],
    weights_per_layer: Sequence[torch.Tensor],
    resident_mask: torch.Tensor,
    layout: StepLayout,
) -> dict[str, np.ndarray]:
    """``attribute_step_device`` with the result on the host as numpy arrays."""
    return {k: v.cpu().numpy() for k, v in attribute_step_device(ids_per_layer, weights_per_layer, resident_mask, layout).items()}


def attribute_step_device(
    ids_per_layer: Sequence[torch.Tensor],
    weights_per_layer: Sequence[torch.Tensor],
    resident_mask: torch.Tensor,
    layout: StepLayout,
) -> dict[str, torch.Tensor]:
    """Per-request sums for one step.

    ids/weights: one [>=T, K] tensor per layer; resident_mask: [L, E] bool on
    the same device. Returns observed [L, R], inactive [L, R], hits,
    miss_hits and expert_mass [L, R, E], tokens [R].
    """
    t = layout.total
    num_layers, num_experts = resident_mask.shape
    r = len(layout.request_ids)
    device = resident_mask.device
    ids = torch.stack([x[:t] for x in ids_per_layer]).to(torch.int64)  # [L, T, K]
    w = torch.stack([x[:t] for x in weights_per_layer]).to(torch.float64)
    k = ids.shape[2]
    miss = ~torch.gather(resident_mask, 1, ids.reshape(num_layers, -1)).reshape(num_layers, t, k)
    row_req = torch.repeat_interleave(
        torch.arange(r, device=device), torch.tensor(layout.num_tokens, device=device)
    )  # [T]
    observed = torch.zeros(num_layers, r, dtype=torch.float64, device=device)
    observed.index_add_(1, row_req, w.sum(2))
    inactive = torch.zeros(num_layers, r, dtype=torch.float64, device=device)
    inactive.index_add_(1, row_req, (w * miss).sum(2))
    layer_base = torch.arange(num_layers, device=device).view(num_layers, 1, 1) * (r * num_experts)
    flat = layer_base + row_req.view(1, t, 1) * num_experts + ids  # [L, T, K]
    size = num_layers * r * num_experts
    hits = torch.bincount(flat.reshape(-1), minlength=size)
    miss_hits = torch.bincount(flat.reshape(-1), weights=miss.reshape(-1).to(torch.float64), minlength=size)
    mass = torch.bincount(flat.reshape(-1), weights=w.reshape(-1), minlength=size)
    return {
        "observed": observed,
        "inactive": inactive,
        "hits": hits.view(num_layers, r, num_experts),
        "miss_hits": miss_hits.round().to(torch.int64).view(num_layers, r, num_experts),
        "expert_mass": mass.view(num_layers, r, num_experts),
        "tokens": torch.tensor(layout.num_tokens, dtype=torch.int64),
    }
