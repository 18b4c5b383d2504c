"""A GEMM-only forward for HF Qwen3-MoE sparse blocks, for training speed.

Why: HF's eager MoE loops over experts with data-dependent indexing (a host
sync and a handful of tiny kernels per expert per layer), and 5.x's grouped_mm
path depends on the torch/GPU combination. With 16 small experts it is
cheaper to run every expert on every token as two large matmuls and zero the
unrouted ones with the (sparse) routing weights. Routing (softmax, top-k,
renormalisation) is exactly Qwen3-MoE's, so forward values and gradients
match the sparse computation; only the FLOP count (x E/top_k on the experts)
differs. Parameters keep HF's layout, so checkpoints are unchanged.

Works with both HF layouts: 5.x (router module + fused ``gate_up_proj`` /
``down_proj`` 3-D tensors) and 4.x (``gate`` Linear + ModuleList of MLPs).
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


def _stacked_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H], down [E, H, I]) for either HF layout."""
    if hasattr(experts, "gate_up_proj"):
        return experts.gate_up_proj, experts.down_proj
    gate = torch.stack([e.gate_proj.weight for e in experts])
    up = torch.stack([e.up_proj.weight for e in experts])
    down = torch.stack([e.down_proj.weight for e in experts])
    return torch.cat([gate, up], dim=1), down


def _route(block: nn.Module, x: torch.Tensor, top_k: int, norm_topk: bool):
    """(router_logits, top-k weights, top-k ids), calling the block's own gate module.

    Calling the module (not its weight) keeps HF 5.x's output recorders working,
    which is how 5.x collects router logits for the aux loss.
    """
    out = block.gate(x)
    if isinstance(out, tuple):  # 5.x router: (logits, top-k weights, top-k ids)
        return out[0], out[1], out[2]
    logits = out  # 4.x: gate is an nn.Linear
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return logits, w.to(x.dtype), ids


def dense_moe_forward(self: nn.Module, hidden_states: torch.Tensor):
    """Drop-in forward for ``Qwen3MoeSparseMoeBlock`` (returns what the HF version returns)."""
    bsz, seq, hid = hidden_states.shape
    x = hidden_states.reshape(-1, hid)
    logits, top_w, top_ids = _route(self, x, self._dense_top_k, self._dense_norm_topk)
    gate_up, down = _stacked_weights(self.experts)
    n_exp, two_i, _ = gate_up.shape
    inter = two_i // 2
    gu = F.linear(x, gate_up.reshape(n_exp * two_i, hid)).view(-1, n_exp, two_i)
    gate, up = gu.split(inter, dim=-1)
    h = F.silu(gate) * up  # [N, E, I]
    dense_w = torch.zeros(x.shape[0], n_exp, dtype=h.dtype, device=h.device)
    dense_w = dense_w.scatter(1, top_ids, top_w.to(h.dtype))
    h = h * dense_w.unsqueeze(-1)
    down_mat = down.permute(0, 2, 1).reshape(n_exp * inter, hid)  # row e*I+i = down[e, :, i]
    out = torch.matmul(h.reshape(-1, n_exp * inter), down_mat.to(h.dtype)).to(hidden_states.dtype)
    out = out.view(bsz, seq, hid)
    if self._dense_returns_logits:
        return out, logits
    return out


def patch_dense_moe(model: nn.Module) -> int:
    """Swap every sparse MoE block's forward for ``dense_moe_forward``; returns blocks patched."""
    cfg = model.config
    n = 0
    for module in model.modules():
        if module.__class__.__name__.endswith("SparseMoeBlock") and hasattr(module, "gate"):
            act = getattr(cfg, "hidden_act", "silu")
            if act != "silu":
                raise ValueError(f"dense MoE path assumes silu experts, config has {act}")
            module._dense_top_k = int(cfg.num_experts_per_tok)
            module._dense_norm_topk = bool(getattr(cfg, "norm_topk_prob", True))
            module._dense_returns_logits = isinstance(module.gate, nn.Linear)  # 4.x contract
            module.forward = types.MethodType(dense_moe_forward, module)
            n += 1
    return n


def unpatch_dense_moe(model: nn.Module) -> int:
    """Undo ``patch_dense_moe`` (the class's own forward applies again); returns blocks restored."""
    n = 0
    for module in model.modules():
        if "forward" in module.__dict__ and hasattr(module, "_dense_top_k"):
            del module.forward
            n += 1
    return n
