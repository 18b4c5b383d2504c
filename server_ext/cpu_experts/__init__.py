"""CPU expert path (issue 16): the host computes part of each step's non-resident experts.

A missed expert's bytes sit in the host bank. Today the GPU reads them over the link; the host's
own memory bus is a second pipe that sits idle. ``split`` decides, per MoE layer step, which
missed experts the CPU computes so both pipes finish together, and fixes the order in which the
CPU's per-(token, k) outputs join the stock k-sum. ``kernel`` computes experts on the CPU from the
host bank rows in place (no second copy of the weights). Neither imports vLLM.
"""

from .split import CostModel, SplitResult, combine, plan_split, stock_moe_sum

__all__ = ["CostModel", "SplitResult", "combine", "plan_split", "stock_moe_sum"]
