"""Reading routing and expert outputs out of HF transformers MoE blocks.

The observer needs, for every token of every MoE layer, the router's top-k
experts and gate weights and the norm of each chosen expert's output. HF
changed the MoE block layout between major versions (4.x: a ``gate`` Linear
and a ``ModuleList`` of expert MLPs; 5.x: a router module and fused 3-D
expert weights), so this adapter reads both, from the weights alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .families import MoELayout


@dataclass
class Routing:
    ids: torch.Tensor  # [T, K] int64
    weights: torch.Tensor  # [T, K] float32


def moe_block(model: torch.nn.Module, layout: MoELayout, layer: int) -> torch.nn.Module:
    return model.get_submodule(layout.hf_experts_path.format(layer=layer).rsplit(".", 1)[0])


def gate_weight(block: torch.nn.Module) -> torch.Tensor:
    gate = block.gate
    return gate.weight


def route(block: torch.nn.Module, hidden: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """Top-k routing exactly as Qwen3-MoE computes it (softmax in fp32, then top-k, then renorm)."""
    logits = F.linear(hidden, gate_weight(block))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    return Routing(ids=ids, weights=w)


def _expert_weights(block: torch.nn.Module, expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate_proj [I, H], up_proj [I, H], down_proj [H, I]) of one expert, either HF layout."""
    experts: Any = block.experts
    if hasattr(experts, "gate_up_proj"):
        gate, up = experts.gate_up_proj[expert].chunk(2, dim=0)
        return gate, up, experts.down_proj[expert]
    mlp = experts[expert]
    return mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight


def expert_output(block: torch.nn.Module, expert: int, x: torch.Tensor) -> torch.Tensor:
    gate, up, down = _expert_weights(block, expert)
    experts: Any = block.experts
    act = getattr(experts, "act_fn", None) or getattr(experts[expert], "act_fn", F.silu)
    return F.linear(act(F.linear(x, gate)) * F.linear(x, up), down)
