"""Model-family adapters and the tiny model builder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reap_swap.models.families import UnsupportedModelError, layout_for
from reap_swap.models.tiny import TinySpec, build_tiny_model

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "vocab_size": 151936, "intermediate_size": 6144, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
}


def test_qwen3_30b_a3b_layout() -> None:
    lay = layout_for(QWEN3_30B_A3B)
    assert lay.num_moe_layers == 48 and lay.num_experts == 128 and lay.top_k == 8
    assert lay.bytes_per_expert == 3 * 2048 * 768 * 2 == 9_437_184
    # ~30.5B parameters in bf16: experts 28.99B + the rest
    assert 60e9 < lay.total_bytes < 62.5e9
    assert lay.vllm_experts(3) == "model.layers.3.mlp.experts.routed_experts"


def test_dense_layers_and_dtype_override() -> None:
    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=4, mlp_only_layers=[0], decoder_sparse_step=1)
    lay = layout_for(cfg, dtype="float32")
    assert lay.moe_layers == (1, 2, 3)
    assert lay.bytes_per_expert == 3 * 2048 * 768 * 4


def test_mixtral_is_a_small_addition() -> None:
    cfg = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_local_experts": 8,
           "num_experts_per_tok": 2, "intermediate_size": 14336, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000, "torch_dtype": "bfloat16"}
    lay = layout_for(cfg)
    assert lay.family == "mixtral" and lay.bytes_per_expert == 3 * 4096 * 14336 * 2
    assert 90e9 < lay.total_bytes < 95e9  # Mixtral 8x7B ~46.7B params


def test_unknown_models_are_refused() -> None:
    with pytest.raises(UnsupportedModelError, match="not a supported MoE family"):
        layout_for({"model_type": "llama", "hidden_size": 8})
    with pytest.raises(UnsupportedModelError, match="lacks"):
        layout_for({"model_type": "qwen3_moe"})


def test_tiny_model_is_deterministic_and_complete(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    build_tiny_model(again, TinySpec())
    first = json.loads((tiny_model_dir / "reap_tiny_model.json").read_text())
    second = json.loads((again / "reap_tiny_model.json").read_text())
    assert first["files"] == second["files"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_model_dir / name).is_file()
    lay = layout_for(tiny_model_dir)
    assert lay.num_moe_layers >= 4 and lay.num_experts >= 16
    assert lay.bytes_per_expert == 3 * 128 * 64 * 4


def test_tiny_model_loads_in_transformers(tiny_model_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = tok("def main():\n    return 1", return_tensors="pt").input_ids
    assert ids.shape[1] > 2
    with torch.no_grad():
        out = model(ids)
    assert out.logits.shape[-1] == model.config.vocab_size
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("kw", [{"hidden": 100}, {"top_k": 0}, {"heads": 3}, {"experts": 1}])
def test_bad_specs(kw: dict) -> None:
    with pytest.raises(ValueError):
        TinySpec(**kw).validate()
