"""Which request each token row of the step that just ran belongs to.

The layers wrote every token's routing into the arena's capture rows during
the step. Rows are laid out request after request in batch order,
``num_scheduled_tokens`` rows each; padding rows (CUDA-graph batch padding)
follow and are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


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
