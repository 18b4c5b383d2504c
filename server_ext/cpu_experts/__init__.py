"""The CPU expert path: the host computes part of each step's missed experts from the host bank's
rows in place, beside the link (split by a cost model, posted to a pinned team, merged in k-sum order).
Imports ``bank`` (mapped rows) and ``config``; called by ``layer`` (per step) and ``launcher`` (settings)."""

# A missed expert's bytes sit in the host bank. Without this path the GPU reads them over the link;
# the host's own memory bus is a second pipe that sits idle. ``split`` decides, per MoE layer step,
# which missed experts the CPU computes so both pipes finish together, and fixes the order in which
# the CPU's per-(token, k) outputs join the stock k-sum. ``kernel`` computes experts on the CPU from
# the host bank rows in place (no second copy of the weights). Neither imports vLLM.
#
# Modules: ``split`` (the cost model and the split, torch, any device), ``split_triton`` (the same
# split plus staging as one CUDA program), ``kernel`` (the native expert kernel and its references),
# ``step`` (one layer's CPU step as a native job the team takes), ``team`` (the process's pinned
# native threads and the device-mapped mailbox the split kernel posts steps to and the merge kernel
# polls), ``cuda_host`` (mapped staging buffers), ``rates`` (the pipes' rates: probes at load, the CPU's re-rating
# from the team's counters while serving), ``cpu_path`` (settings and the
# per-layer path that puts them in a layer's forward; the merge into vLLM's per-k cache before
# ``moe_sum`` keeps stock k-sum order).

from .split import CostModel, SplitResult, combine, plan_split, stock_moe_sum

__all__ = ["CostModel", "SplitResult", "combine", "plan_split", "stock_moe_sum"]
