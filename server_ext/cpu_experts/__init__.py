"""CPU expert path (issue 16): the host computes part of each step's non-resident experts.

A missed expert's bytes sit in the host bank. Today the GPU reads them over the link; the host's
own memory bus is a second pipe that sits idle. ``split`` decides, per MoE layer step, which
missed experts the CPU computes so both pipes finish together, and fixes the order in which the
CPU's per-(token, k) outputs join the stock k-sum. ``kernel`` computes experts on the CPU from the
host bank rows in place (no second copy of the weights). Neither imports vLLM.

Integration (GPU session): per MoE layer step, ``plan_split`` on the routed ids and the residency
mask (graph-safe torch, on the device), ``group_pairs`` + ``CpuExperts.run`` on a host thread fed
by a host callback inside the graph (or a graph split at the MoE op), and the CPU's [P, H]
outputs ``index_copy_``'d into the fused kernel's per-k cache at ``pair_index`` before vLLM's
``moe_sum``; the GPU kernel skips the CPU's pairs (e.g. their ids set >= E, which
``moe_align_block_size`` ignores).
"""

from .split import CostModel, SplitResult, combine, plan_split, stock_moe_sum

__all__ = ["CostModel", "SplitResult", "combine", "plan_split", "stock_moe_sum"]
