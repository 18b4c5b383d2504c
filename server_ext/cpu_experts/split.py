"""Per-step split of a MoE layer's missed experts between the host link and the host CPU.

Why: a non-resident expert can be read by the GPU over the link (bytes / link GB/s) or computed
by the CPU next to its bytes (bytes / CPU GB/s + overheads); only hidden states cross the link
then. Both pipes run at once, so a step costs ``max(link_s, cpu_s)``. This module picks the CPU's
share of the step's missed experts to minimise that maximum, and fixes where the CPU's
per-(token, k) outputs enter the stock k-sum so the reduction order never changes.

Cost model (one MoE layer step, ``B`` = bytes of one expert, every expert of a layer the same):

    link_s(n) = (m - n) * B / link_bw                      m = distinct missed experts
    cpu_s(n)  = [n > 0] * fixed + n * (per_expert + B / cpu_bw) + per_pair * pairs(n)

An expert is computed once per side whatever its token count (its bytes are read once), so the
unit of the split is the expert, never the pair. With equal byte sizes the greedy-by-bytes choice
reduces to choosing ``n``; every ``n`` is scanned (exact optimum of the model, no heuristic). Tie
rules, all exact: (1) among equal step times the smallest ``n`` wins (the stock path is the
default; fewer outputs differ from the GPU's arithmetic); (2) for a given ``n`` the CPU takes the
experts with the fewest missed pairs (cheapest CPU work, fewest hidden states to ship), then the
lowest expert id. With ``priority`` (the online cache's scores, in the composed mode) the CPU takes
the lowest-priority experts first and (2) breaks ties among equal priorities: the link keeps the
misses worth promoting, the CPU computes the cold ones, whose slot would be wasted. Experts in ``forced_link`` (e.g. being promoted to a GPU slot this step: their
bytes cross the link anyway) always stay on the link side.

Step size. Steps of at most ``max_tokens`` tokens may give the CPU any of their misses. Larger
steps up to ``max_step_tokens`` (batched decode: at batch 32 many missed experts get one or two
tokens, and the CPU's cost of such an expert is its bytes, like the link's) give the CPU at most
``pair_budget`` missed pairs -- the CPU's tables are fixed at start-up -- and order its candidates
by missed pairs first (then priority, then id): for each ``n`` the ``n`` experts with the fewest
pairs are the cheapest and the likeliest to fit, so the scan stays the exact optimum of the model
under the budget when there is no priority. Still larger steps (prefill) send everything to the
link: the CPU pipe does not scale with tokens, the GPU does.

Everything is vectorised torch on fixed shapes ([E] masks, [E + 1] cost curve) with no host
sync, so the same code can run on the device inside a captured graph or on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_GB = 1e9


@dataclass(frozen=True)
class CostModel:
    """Measured pipe rates and overheads; seconds and GB/s (1e9 bytes)."""

    link_GBps: float
    cpu_GBps: float
    cpu_fixed_s: float = 0.0
    cpu_per_expert_s: float = 0.0
    cpu_per_pair_s: float = 0.0
    max_tokens: int = 8
    max_step_tokens: int = 0
    """Largest step (tokens) under the pair budget; 0: ``max_tokens`` (no budgeted steps)."""
    pair_budget: int = 0
    """Most missed pairs the CPU takes in a step of more than ``max_tokens`` tokens."""

    def __post_init__(self) -> None:
        if self.link_GBps <= 0 or self.cpu_GBps <= 0:
            raise ValueError(f"pipe rates must be positive, got link {self.link_GBps}, cpu {self.cpu_GBps}")
        if min(self.cpu_fixed_s, self.cpu_per_expert_s, self.cpu_per_pair_s) < 0:
            raise ValueError("overheads must be >= 0")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.max_step_tokens and self.max_step_tokens < self.max_tokens:
            raise ValueError(f"max_step_tokens ({self.max_step_tokens}) must be 0 or >= max_tokens ({self.max_tokens})")
        if self.pair_budget < 0:
            raise ValueError(f"pair_budget must be >= 0, got {self.pair_budget}")

    @property
    def step_tokens(self) -> int:
        """The largest step (tokens) whose misses the CPU may take part in."""
        return max(self.max_tokens, self.max_step_tokens)

    def budgeted(self, tokens: int) -> bool:
        """A step past ``max_tokens``: the pair budget applies and candidates go by missed pairs first."""
        return tokens > self.max_tokens

    def pair_limit(self, tokens: int, top_k: int) -> int:
        """Most missed pairs the CPU may take in a step of ``tokens`` rows (all of them up to
        ``max_tokens``, the budget up to ``step_tokens``, none past it)."""
        if not self.budgeted(tokens):
            return tokens * top_k
        return self.pair_budget if tokens <= self.step_tokens else 0

    def link_s(self, n_experts: int, expert_bytes: int) -> float:
        """Scalar form of the link term (for reports and tests)."""
        return n_experts * expert_bytes / (self.link_GBps * _GB)

    def cpu_s(self, n_experts: int, n_pairs: int, expert_bytes: int) -> float:
        """Scalar form of the CPU term (for reports and tests)."""
        if n_experts == 0:
            return 0.0
        per_expert = self.cpu_per_expert_s + expert_bytes / (self.cpu_GBps * _GB)
        return self.cpu_fixed_s + n_experts * per_expert + n_pairs * self.cpu_per_pair_s


@dataclass(frozen=True)
class SplitResult:
    """One layer step's decision. Masks are [E] (experts) or [T, K] (pairs); times are 0-d float64."""

    cpu_experts: torch.Tensor
    link_experts: torch.Tensor
    cpu_pairs: torch.Tensor
    n_cpu: torch.Tensor
    link_s: torch.Tensor
    cpu_s: torch.Tensor

    @property
    def step_s(self) -> torch.Tensor:
        return torch.maximum(self.link_s, self.cpu_s)

    def summary(self) -> dict[str, float | int]:
        """Host-side numbers for logs and benchmarks (synchronises if on a device)."""
        return {
            "cpu_experts": int(self.cpu_experts.sum()),
            "link_experts": int(self.link_experts.sum()),
            "cpu_pairs": int(self.cpu_pairs.sum()),
            "link_s": float(self.link_s),
            "cpu_s": float(self.cpu_s),
            "step_s": float(self.step_s),
        }


def missed_pairs_per_expert(topk_ids: torch.Tensor, missed: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int64: how many missed (token, k) pairs route to each expert."""
    ids = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=topk_ids.device)
    return counts.scatter_add_(0, ids, missed.reshape(-1).long())


def plan_split(
    topk_ids: torch.Tensor,
    missed: torch.Tensor,
    num_experts: int,
    expert_bytes: int,
    cost: CostModel,
    *,
    forced_link: torch.Tensor | None = None,
    num_tokens: int | torch.Tensor | None = None,
    priority: torch.Tensor | None = None,
) -> SplitResult:
    """Split one layer step's missed experts between link and CPU (see module doc).

    ``topk_ids`` [T, K] routed experts; ``missed`` [T, K] bool, True where the pair's expert is not
    resident (padding rows of a captured graph must be False); ``forced_link`` [E] bool;
    ``num_tokens`` the real token count when ``T`` is padded (a 0-d tensor keeps it graph-safe; the
    step size rules of the module doc follow it, else ``T``); ``priority`` [E] float: the CPU takes
    low priorities first (ties: rule (2)); in a budgeted step, fewest missed pairs first, then priority.
    """
    if topk_ids.shape != missed.shape or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and missed {tuple(missed.shape)} must both be [T, K]")
    if expert_bytes <= 0 or num_experts <= 0:
        raise ValueError("expert_bytes and num_experts must be positive")
    dev = topk_ids.device
    f64 = torch.float64
    e_idx = torch.arange(num_experts, device=dev)
    pairs = missed_pairs_per_expert(topk_ids, missed, num_experts)
    missed_e = pairs > 0
    if forced_link is None:
        forced = torch.zeros(num_experts, dtype=torch.bool, device=dev)
    else:
        forced = forced_link.to(device=dev, dtype=torch.bool) & missed_e
    eligible = missed_e & ~forced

    tokens = topk_ids.shape[0] if num_tokens is None else num_tokens
    # Tie rule (2): CPU candidates ordered by (missed pairs, expert id); keys are unique.
    big = (topk_ids.numel() + 2) * num_experts
    key = torch.where(eligible, pairs * num_experts + e_idx, torch.full_like(pairs, big) + e_idx)
    order = torch.argsort(key)
    if priority is not None:
        order = _priority_order(order, pairs, eligible, priority.to(device=dev, dtype=torch.float32), big, cost, tokens)
    rank = torch.empty_like(order).scatter_(0, order, e_idx)
    sorted_pairs = torch.where(eligible[order], pairs[order], torch.zeros_like(pairs))
    prefix_pairs = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(sorted_pairs, 0)])

    n = torch.arange(num_experts + 1, device=dev, dtype=f64)
    per_expert_cpu = cost.cpu_per_expert_s + expert_bytes / (cost.cpu_GBps * _GB)
    cpu_curve = (n > 0).to(f64) * cost.cpu_fixed_s + n * per_expert_cpu + prefix_pairs.to(f64) * cost.cpu_per_pair_s
    n_missed = missed_e.sum().to(f64)
    link_curve = (n_missed - n).clamp(min=0.0) * (expert_bytes / (cost.link_GBps * _GB))

    valid = n <= eligible.sum().to(f64)
    if isinstance(tokens, torch.Tensor):  # a device count: stays on the device
        tk = tokens.to(dev)
        limit = torch.where(tk <= cost.max_tokens, topk_ids.numel(), torch.where(tk <= cost.step_tokens, cost.pair_budget, 0))
        valid = valid & (prefix_pairs <= limit)
    else:  # a Python count (graph-safe: no host -> device copy)
        valid = valid & (prefix_pairs <= cost.pair_limit(int(tokens), topk_ids.shape[1]))
    step = torch.where(valid, torch.maximum(cpu_curve, link_curve), torch.full_like(n, float("inf")))
    best = torch.argmin(step)  # first minimum: tie rule (1), fewest CPU experts

    cpu_experts = eligible & (rank < best)
    link_experts = missed_e & ~cpu_experts
    cpu_pairs = missed & cpu_experts[topk_ids.long()]
    return SplitResult(
        cpu_experts=cpu_experts,
        link_experts=link_experts,
        cpu_pairs=cpu_pairs,
        n_cpu=best,
        link_s=link_curve.index_select(0, best.view(1)).squeeze(0),  # tensor index: no host read (graph-safe)
        cpu_s=cpu_curve.index_select(0, best.view(1)).squeeze(0),
    )


def _priority_order(by_key: torch.Tensor, pairs: torch.Tensor, eligible: torch.Tensor, priority: torch.Tensor, big: int,
                    cost: CostModel, tokens: int | torch.Tensor) -> torch.Tensor:
    """Candidates by (priority, missed pairs, id), or in a budgeted step by (missed pairs, priority,
    id); ineligible experts last. Stable sorts compose the keys (``by_key``: by (pairs, id))."""
    prio = torch.where(eligible, priority, float("inf"))
    prio_first = by_key[torch.sort(prio[by_key], stable=True).indices]
    if isinstance(tokens, int) and not cost.budgeted(tokens):
        return prio_first
    by_prio = torch.sort(prio, stable=True).indices  # (priority, id): argsort of arange order is stable
    count = torch.where(eligible, pairs, torch.full_like(pairs, big))
    pairs_first = by_prio[torch.sort(count[by_prio], stable=True).indices]
    if isinstance(tokens, int):
        return pairs_first
    return torch.where(tokens.to(by_key.device) > cost.max_tokens, pairs_first, prio_first)


# --- the k-sum order rule --------------------------------------------------------------------


def stock_moe_sum(per_k: torch.Tensor, mode: str = "auto") -> torch.Tensor:
    """Reference of vLLM's reduction of the fused kernel's [T, K, H] per-(token, k) outputs.

    ``moe_sum`` (csrc/moe, vLLM 0.26) sums in the output dtype, k = 0..K-1, rounding after every
    add, for K in {2, 3, 4} (``"scalar_seq"``); other K fall back to ``at::sum_out`` (fp32
    accumulation rounded once; ``"fp32_seq"``, k order). ``"auto"`` picks as 0.26 does. The GPU
    path never calls this: it writes the CPU's outputs into the kernel's per-k cache and lets the
    stock op reduce. This function is the CPU-testable statement of that order.
    """
    if per_k.dim() != 3:
        raise ValueError(f"per_k must be [T, K, H], got {tuple(per_k.shape)}")
    k = per_k.shape[1]
    if mode == "auto":
        mode = "scalar_seq" if k in (2, 3, 4) else "fp32_seq"
    if k == 1:
        return per_k[:, 0].clone()
    if mode == "scalar_seq":
        acc = torch.zeros_like(per_k[:, 0])
        for j in range(k):
            acc = acc + per_k[:, j]  # bf16 + bf16: exact fp32 sum, one rounding, like CUDA's +=
        return acc
    if mode == "fp32_seq":
        acc32 = torch.zeros(per_k[:, 0].shape, dtype=torch.float32, device=per_k.device)
        for j in range(k):
            acc32 = acc32 + per_k[:, j].float()
        return acc32.to(per_k.dtype)
    raise ValueError(f"unknown mode {mode!r}")


def combine(
    gpu_partial_per_k: torch.Tensor,
    cpu_per_k: torch.Tensor,
    cpu_mask: torch.Tensor,
    mode: str = "auto",
) -> torch.Tensor:
    """Sum over k with the CPU's outputs in their own (token, k) places, in stock order.

    ``gpu_partial_per_k`` [T, K, H]: the GPU kernel's per-k outputs (garbage or zero where the CPU
    owns the pair); ``cpu_per_k`` [T, K, H] the CPU's (only ``cpu_mask`` [T, K] places are read).
    Merging before the reduction (never "GPU sum + CPU sum") is what keeps the order stock: with
    equal per-k values the result is bit-identical to the all-GPU sum.
    """
    if gpu_partial_per_k.shape != cpu_per_k.shape:
        raise ValueError(f"shape mismatch {tuple(gpu_partial_per_k.shape)} vs {tuple(cpu_per_k.shape)}")
    if cpu_mask.shape != gpu_partial_per_k.shape[:2]:
        raise ValueError(f"cpu_mask {tuple(cpu_mask.shape)} must be [T, K] of {tuple(gpu_partial_per_k.shape)}")
    merged = torch.where(cpu_mask.to(torch.bool)[..., None], cpu_per_k.to(gpu_partial_per_k.dtype), gpu_partial_per_k)
    return stock_moe_sum(merged, mode)


def pair_index(cpu_pairs: torch.Tensor) -> torch.Tensor:
    """Flat (token * K + k) positions of the CPU's pairs, row-major: where its outputs go in the
    fused kernel's [T * K, H] per-k cache (``cache.index_copy_(0, pair_index(m), cpu_out)``)."""
    return torch.nonzero(cpu_pairs.reshape(-1), as_tuple=False).reshape(-1)
