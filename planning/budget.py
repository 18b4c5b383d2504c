"""Budget arithmetic and the per-layer split of the expert budget (pure).

Non-expert weights (attention, norms, embeddings, router gates) are always
resident; what is left of the VRAM budget buys expert slots. Slots go to
layers by marginal gain: each extra slot of a layer holds its next most
massive expert, worth that expert's share of the layer's gate mass; the
slot goes where that share is largest. Layers whose routing is concentrated
fill up first, flat layers get fewer, and the total expected coverage
(mean over layers of the share of gate mass on resident experts) is the
largest any split of the same slots reaches.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass

import numpy as np

from reap_swap.models.families import MoELayout

GIB = 1 << 30


class BudgetError(ValueError):
    pass


@dataclass(frozen=True)
class Budget:
    full_bytes: int
    resident_bytes: int
    always_resident_bytes: int
    expert_budget_bytes: int
    per_expert_bytes: int
    expert_slots: int
    ratio: float

    def to_json(self) -> dict[str, float | int]:
        return asdict(self)


def make_budget(layout: MoELayout, ratio: float | None = None, gib: float | None = None) -> Budget:
    if (ratio is None) == (gib is None):
        raise BudgetError("give exactly one of --budget-ratio and --budget-gib")
    full = layout.total_bytes
    if ratio is not None:
        if not 0 < ratio <= 1:
            raise BudgetError(f"--budget-ratio must be in (0, 1], got {ratio}")
        resident = int(full * ratio)
    else:
        assert gib is not None
        if gib <= 0:
            raise BudgetError(f"--budget-gib must be positive, got {gib}")
        resident = min(int(gib * GIB), full)
    expert_budget = resident - layout.non_expert_bytes
    if expert_budget < layout.bytes_per_expert * layout.num_moe_layers:
        raise BudgetError(
            f"a budget of {resident / GIB:.3f} GiB leaves {max(expert_budget, 0) / GIB:.3f} GiB for experts after "
            f"{layout.non_expert_bytes / GIB:.3f} GiB of always-resident weights: not one expert per MoE layer "
            f"({layout.bytes_per_expert * layout.num_moe_layers / GIB:.3f} GiB needed)"
        )
    slots = min(expert_budget // layout.bytes_per_expert, layout.num_experts * layout.num_moe_layers)
    return Budget(full, resident, layout.non_expert_bytes, expert_budget, layout.bytes_per_expert, int(slots), resident / full)


def allocate_slots(mass: np.ndarray, total: int, minimum: int = 1) -> np.ndarray:
    """Split ``total`` slots over layers by marginal gain.

    mass: [L, E] gate mass per expert. Returns [L] slot counts, each in
    [minimum, E], summing to ``total`` (deterministic; ties go to the lower layer).
    """
    num_layers, num_experts = mass.shape
    if not num_layers * minimum <= total <= num_layers * num_experts:
        raise BudgetError(f"cannot place {total} slots in {num_layers} layers of {num_experts} experts (minimum {minimum} each)")
    totals = mass.sum(axis=1, keepdims=True)
    share = np.divide(mass, totals, out=np.full_like(mass, 1.0 / num_experts, dtype=np.float64), where=totals > 0)
    ranked = -np.sort(-share, axis=1)
    counts = np.full(num_layers, minimum, dtype=np.int64)
    heap = [(-ranked[l, minimum], l) for l in range(num_layers) if minimum < num_experts]
    heapq.heapify(heap)
    for _ in range(total - minimum * num_layers):
        _, l = heapq.heappop(heap)
        counts[l] += 1
        if counts[l] < num_experts:
            heapq.heappush(heap, (-ranked[l, counts[l]], l))
    return counts
