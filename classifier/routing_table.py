"""The served model's own routing of each vocabulary token, seen alone (a [V, L, E] table).

A bag of tokens learns only the tokens the training prompts contained; prompts
from other sources bring identifiers and words it has never seen. The model
itself knows where every token routes: running it on each token alone (a
one-token sequence, so attention sees only that token) gives, per layer, the
gate weights of the token's top-k experts. Averaged over a prompt's tokens this
is a cheap sketch of the prompt's routing that transfers to unseen text; the
scorer learns how it relates to the whole request's routing (context and the
answer shift it). Computed once at training time with HF transformers and
stored with the classifier; at serving time it is a table lookup.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

BATCH = 1024


def compute_routing_table(model_dir: Path) -> np.ndarray:
    """[V, L, E] float16: top-k gate weights of each token alone, per MoE layer (zeros elsewhere)."""
    import torch

    from reap_swap.models import hf_moe
    from reap_swap.models.families import layout_for
    from reap_swap.planning.observe import load_model

    layout = layout_for(model_dir)
    model, _ = load_model(model_dir, "cpu")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    table = np.zeros((vocab, layout.num_moe_layers, layout.num_experts), np.float16)
    caught: dict[int, torch.Tensor] = {}
    blocks = [hf_moe.moe_block(model, layout, layer) for layer in layout.moe_layers]
    hooks = [b.register_forward_pre_hook(lambda m, a, li=li: caught.__setitem__(li, a[0].reshape(-1, a[0].shape[-1])))
             for li, b in enumerate(blocks)]
    try:
        with torch.no_grad():
            for start in range(0, vocab, BATCH):
                ids = torch.arange(start, min(vocab, start + BATCH))[:, None]
                model(input_ids=ids)
                for li, block in enumerate(blocks):
                    r = hf_moe.route(block, caught[li], layout.top_k, layout.norm_topk_prob)
                    w = torch.zeros(len(ids), layout.num_experts)
                    w.scatter_(1, r.ids.cpu(), r.weights.float().cpu())
                    table[start : start + len(ids), li] = w.numpy().astype(np.float16)
    finally:
        for h in hooks:
            h.remove()
    return table


def table_sha256(table: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(table).tobytes()).hexdigest()
