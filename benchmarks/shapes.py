"""Benchmark model shapes: a Qwen3-MoE config with a real model's expert shape (pure).

vLLM's dummy loader builds the weights from the config alone, so a 29 GiB
model needs no checkpoint on disk. The tokenizer is the committed small_moe
one (only its vocabulary size matters here).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class MoeShape:
    name: str
    layers: int
    hidden: int
    experts: int
    top_k: int
    moe_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    max_positions: int = 4096
    """``max_position_embeddings``: the longest prompt + generation the shape serves."""

    @property
    def expert_bytes(self) -> int:
        """w13 (gate + up) and w2 of one expert."""
        return 3 * self.hidden * self.moe_intermediate * self.dtype_bytes

    @property
    def expert_bytes_total(self) -> int:
        return self.layers * self.experts * self.expert_bytes

    def offload_gib_for_slots(self, slots: int) -> float:
        """Stock ``cpu_offload_gb`` that leaves the same expert bytes on the GPU as ``slots`` per layer."""
        return self.layers * (self.experts - slots) * self.expert_bytes / 2**30


SHAPES: dict[str, MoeShape] = {
    # Qwen3-30B-A3B's expert shape and attention, 24 of its 48 layers (fits beside a stock all-GPU arm).
    "30b-a3b-24l": MoeShape("30b-a3b-24l", layers=24, hidden=2048, experts=128, top_k=8, moe_intermediate=768, heads=32, kv_heads=4, head_dim=128),
    # The same with 40K positions: prompts of 32K tokens (issue 26's TTFT at 2K / 8K / 32K).
    "30b-a3b-24l-40k": MoeShape("30b-a3b-24l-40k", layers=24, hidden=2048, experts=128, top_k=8, moe_intermediate=768, heads=32, kv_heads=4,
                                head_dim=128, max_positions=40960),
    # Same structure, small enough for a CPU smoke run.
    "tiny": MoeShape("tiny", layers=4, hidden=128, experts=16, top_k=4, moe_intermediate=64, heads=4, kv_heads=2, head_dim=32, dtype_bytes=4),
    # The learned traces' routing shape (128 experts, top-8) on 4 layers, for a CPU smoke run of learned mode.
    "tiny128": MoeShape("tiny128", layers=4, hidden=64, experts=128, top_k=8, moe_intermediate=32, heads=2, kv_heads=1, head_dim=32, dtype_bytes=4),
}


def qwen3_moe_config(shape: MoeShape, vocab_size: int, dtype: str) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.moe_intermediate * shape.top_k,
        "moe_intermediate_size": shape.moe_intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "num_hidden_layers": shape.layers,
        "num_experts": shape.experts,
        "num_experts_per_tok": shape.top_k,
        "norm_topk_prob": True,
        "max_position_embeddings": shape.max_positions,
        "max_window_layers": shape.layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": vocab_size,
        "initializer_range": 0.02,
    }


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def write_model_dir(shape: MoeShape, tokenizer_dir: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """config.json for ``shape`` + the tokenizer files; weights come from vLLM's dummy loader."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        src = tokenizer_dir / name
        if src.is_file():
            shutil.copy(src, out / name)
    vocab = len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    (out / "config.json").write_text(json.dumps(qwen3_moe_config(shape, vocab, dtype), indent=1))
    return out
