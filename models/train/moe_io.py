"""Config, packed-data loading and checkpoint writing for train_moe.py.

Why a separate module: the checkpoint must load in HF transformers 4.x and
5.x and in vLLM whatever transformers version wrote it, so the config.json is
our explicit dict (keys every reader knows), the safetensors layout is checked
(per-expert keys, as vLLM's Qwen3-MoE loader expects) and the tokenizer config
is written in a form both tokenizer generations read.
"""

from __future__ import annotations

import inspect
import io
import json
import lzma
from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = (  # same ChatML template as reap_swap.models.tokenizer.CHAT_TEMPLATE
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
VLLM_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 256)


def load_packed(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """Arrays and JSON header of ``moe_data.npz.xz`` (or an uncompressed ``.npz``)."""
    raw = lzma.decompress(path.read_bytes()) if path.suffix == ".xz" else path.read_bytes()
    with np.load(io.BytesIO(raw)) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta_json").tobytes())
    return arrays, meta


def build_config_dict(meta: dict, seq_len: int, aux_coef: float, overrides: dict) -> dict:
    """The model's config.json: 6 MoE layers x 16 experts (top-4), hidden 128; <= 8 MB in bf16."""
    eot = meta["special_tokens"]["<|endoftext|>"]
    im_end = meta["special_tokens"]["<|im_end|>"]
    cfg = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": int(meta["vocab_size"]),
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "intermediate_size": 256,  # only for mlp_only_layers (none)
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "output_router_logits": True,
        "router_aux_loss_coef": aux_coef,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": max(2048, seq_len),
        "max_window_layers": 6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_cache": True,
        "sliding_window": None,
        "use_sliding_window": False,
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "pad_token_id": eot,
        "torch_dtype": "bfloat16",
    }
    cfg.update(overrides)
    cfg["max_window_layers"] = cfg["num_hidden_layers"]
    if cfg["hidden_size"] % 32 or cfg["head_dim"] not in VLLM_HEAD_DIMS:
        raise ValueError("vLLM needs hidden_size % 32 == 0 and head_dim in " + str(VLLM_HEAD_DIMS))
    return cfg


def count_params(model: torch.nn.Module, cfg: dict) -> tuple[int, int]:
    """(total, active per token): tied embeddings counted once; experts scaled by top_k/E."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - expert + expert * cfg["num_experts_per_tok"] // cfg["num_experts"]
    return total, active


def _per_expert_layout(path: Path, n_exp: int, tied: bool) -> str:
    """Rewrite fused 5.x expert tensors (if a transformers version saved them) to per-expert keys."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(path))
    fused = [k for k in sd if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj")]
    changed = bool(fused) or (tied and "lm_head.weight" in sd)
    if tied:
        sd.pop("lm_head.weight", None)
    for key in fused:
        prefix = key.rsplit(".", 1)[0]
        w = sd.pop(key)
        for e in range(n_exp):
            if key.endswith("gate_up_proj"):
                gate, up = w[e].chunk(2, dim=0)
                sd[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous()
                sd[f"{prefix}.{e}.up_proj.weight"] = up.contiguous()
            else:
                sd[f"{prefix}.{e}.down_proj.weight"] = w[e].contiguous()
    if changed:
        save_file(dict(sorted(sd.items())), str(path), metadata={"format": "pt"})
    return "per-expert (rewritten)" if changed else "per-expert"


def write_tokenizer(arrays: dict[str, np.ndarray], out: Path, max_len: int) -> None:
    """tokenizer.json + a tokenizer_config.json that transformers 4.x and 5.x both load."""
    for key, arr in arrays.items():
        if key.startswith("file__"):
            (out / key[len("file__"):]).write_bytes(arr.tobytes())
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    extra = cfg.pop("extra_special_tokens", None)
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast",
        chat_template=CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=list(extra) if isinstance(extra, list) else ["<|im_start|>"],
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_checkpoint(model: torch.nn.Module, cfg_dict: dict, arrays: dict[str, np.ndarray], out: Path) -> dict:
    """save_pretrained in bf16 safetensors, then our config.json, tokenizer and generation config."""
    model = model.to(torch.bfloat16)
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(str(out), **kwargs)
    st = out / "model.safetensors"
    if not st.exists():
        raise RuntimeError("save_pretrained wrote no single model.safetensors (sharded?)")
    layout = _per_expert_layout(st, cfg_dict["num_experts"], cfg_dict["tie_word_embeddings"])
    saved = dict(cfg_dict, output_router_logits=False)  # inference default, as Qwen ships it
    (out / "config.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    write_tokenizer(arrays, out, cfg_dict["max_position_embeddings"])
    gen = {
        "bos_token_id": cfg_dict["bos_token_id"],
        "eos_token_id": [cfg_dict["eos_token_id"], cfg_dict["pad_token_id"]],
        "pad_token_id": cfg_dict["pad_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return {"safetensors_bytes": st.stat().st_size, "layout": layout}
