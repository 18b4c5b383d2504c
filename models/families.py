"""What REAP-swap knows about MoE model families.

A family adapter answers, from a model's ``config.json`` alone, the questions
every other part of the project asks: which decoder layers are MoE layers,
how many routed experts each has, the router's top-k, where the gate and the
experts live (in HF transformers and in vLLM), and how many bytes one expert
costs at a given dtype. Adding a family (Mixtral, DeepSeek, Qwen3.5) means
adding one small ``MoEFamily`` to the registry below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "fp8": 1,
    "int8": 1,
}


class UnsupportedModelError(ValueError):
    """The config describes a model no registered family understands."""


@dataclass(frozen=True)
class MoELayout:
    """The routing-relevant shape of one model, derived from its config."""

    family: str
    model_type: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden_size: int
    moe_intermediate_size: int
    dtype: str
    bytes_per_expert: int
    non_expert_bytes: int
    norm_topk_prob: bool
    hf_gate_path: str
    hf_experts_path: str
    vllm_gate_path: str
    vllm_experts_path: str

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def total_expert_bytes(self) -> int:
        return self.bytes_per_expert * self.num_experts * self.num_moe_layers

    @property
    def total_bytes(self) -> int:
        return self.total_expert_bytes + self.non_expert_bytes

    def hf_gate(self, layer: int) -> str:
        return self.hf_gate_path.format(layer=layer)

    def vllm_experts(self, layer: int) -> str:
        return self.vllm_experts_path.format(layer=layer)

    def to_json(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in self.__dataclass_fields__}
        data["moe_layers"] = list(self.moe_layers)
        return data


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a config dtype name (``torch_dtype``/``dtype``)."""
    key = str(dtype).replace("torch.", "").lower()
    if key not in DTYPE_BYTES:
        raise UnsupportedModelError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_BYTES)}")
    return DTYPE_BYTES[key]


def _attention_params(cfg: Mapping[str, Any]) -> int:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", heads))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    params = hidden * heads * head_dim  # q
    params += 2 * hidden * kv_heads * head_dim  # k, v
    params += heads * head_dim * hidden  # o
    if cfg.get("attention_bias"):
        params += heads * head_dim + 2 * kv_heads * head_dim
    return params


@dataclass(frozen=True)
class MoEFamily:
    """One family of MoE architectures and how to read its config."""

    name: str
    model_types: tuple[str, ...]
    experts_key: str
    top_k_key: str
    hf_gate_path: str
    hf_experts_path: str
    vllm_gate_path: str
    vllm_experts_path: str
    moe_layer_rule: Callable[[Mapping[str, Any], int], bool]
    expert_intermediate_key: str = "moe_intermediate_size"
    per_layer_extra_params: Callable[[Mapping[str, Any]], int] = _attention_params
    qk_norm: bool = False

    def layout(self, cfg: Mapping[str, Any], dtype: str | None = None) -> MoELayout:
        """Derive the MoE layout; ``dtype`` overrides the config's dtype."""
        try:
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            experts = int(cfg[self.experts_key])
            top_k = int(cfg[self.top_k_key])
            inter = int(cfg[self.expert_intermediate_key])
            vocab = int(cfg["vocab_size"])
        except KeyError as exc:
            raise UnsupportedModelError(
                f"{self.name}: config.json lacks {exc.args[0]!r}"
            ) from None
        if experts <= 0 or not 0 < top_k <= experts:
            raise UnsupportedModelError(
                f"{self.name}: need 0 < top_k <= num_experts, got top_k={top_k}, experts={experts}"
            )
        dt = dtype or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
        nbytes = dtype_bytes(dt)
        moe_layers = tuple(i for i in range(layers) if self.moe_layer_rule(cfg, i))
        dense_layers = layers - len(moe_layers)
        dense_inter = int(cfg.get("intermediate_size", 0))
        head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
        per_layer = self.per_layer_extra_params(cfg) + 2 * hidden  # attention + 2 norms
        if self.qk_norm:
            per_layer += 2 * head_dim
        non_expert = layers * per_layer
        non_expert += len(moe_layers) * experts * hidden  # router gate
        non_expert += dense_layers * 3 * hidden * dense_inter
        non_expert += vocab * hidden  # embeddings
        if not cfg.get("tie_word_embeddings", False):
            non_expert += vocab * hidden
        non_expert += hidden  # final norm
        return MoELayout(
            family=self.name,
            model_type=str(cfg.get("model_type")),
            num_hidden_layers=layers,
            moe_layers=moe_layers,
            num_experts=experts,
            top_k=top_k,
            hidden_size=hidden,
            moe_intermediate_size=inter,
            dtype=dt.replace("torch.", ""),
            bytes_per_expert=3 * hidden * inter * nbytes,
            non_expert_bytes=non_expert * nbytes,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            hf_gate_path=self.hf_gate_path,
            hf_experts_path=self.hf_experts_path,
            vllm_gate_path=self.vllm_gate_path,
            vllm_experts_path=self.vllm_experts_path,
        )


def _qwen_moe_layer(cfg: Mapping[str, Any], i: int) -> bool:
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return i not in set(cfg.get("mlp_only_layers") or []) and (i + 1) % step == 0


def _every_layer(cfg: Mapping[str, Any], i: int) -> bool:
    return True


FAMILIES: dict[str, MoEFamily] = {}
"""Registry: family name -> adapter. Register new families with ``register``."""


def register(family: MoEFamily) -> MoEFamily:
    FAMILIES[family.name] = family
    return family


register(
    MoEFamily(
        name="qwen3_moe",
        model_types=("qwen3_moe", "qwen2_moe"),
        experts_key="num_experts",
        top_k_key="num_experts_per_tok",
        hf_gate_path="model.layers.{layer}.mlp.gate",
        hf_experts_path="model.layers.{layer}.mlp.experts",
        vllm_gate_path="model.layers.{layer}.mlp.gate",
        vllm_experts_path="model.layers.{layer}.mlp.experts.routed_experts",
        moe_layer_rule=_qwen_moe_layer,
        qk_norm=True,
    )
)
register(
    MoEFamily(
        name="mixtral",
        model_types=("mixtral",),
        experts_key="num_local_experts",
        top_k_key="num_experts_per_tok",
        hf_gate_path="model.layers.{layer}.block_sparse_moe.gate",
        hf_experts_path="model.layers.{layer}.block_sparse_moe.experts",
        vllm_gate_path="model.layers.{layer}.block_sparse_moe.gate",
        vllm_experts_path="model.layers.{layer}.block_sparse_moe.experts.routed_experts",
        moe_layer_rule=_every_layer,
        expert_intermediate_key="intermediate_size",
    )
)


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal wrappers (Qwen3.5-MoE) keep the LM config under text_config."""
    inner = cfg.get("text_config")
    if isinstance(inner, Mapping) and "hidden_size" in inner:
        merged = dict(inner)
        merged.setdefault("model_type", cfg.get("model_type"))
        return merged
    return cfg


def family_for(cfg: Mapping[str, Any]) -> MoEFamily:
    model_type = str(_text_config(cfg).get("model_type") or cfg.get("model_type"))
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    known = sorted(t for f in FAMILIES.values() for t in f.model_types)
    raise UnsupportedModelError(
        f"model_type {model_type!r} is not a supported MoE family (supported: {known})"
    )


def read_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{model_dir}: no config.json (is this a model directory?)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UnsupportedModelError(f"{path}: expected a JSON object")
    return data


def layout_for(model: str | Path | Mapping[str, Any], dtype: str | None = None) -> MoELayout:
    """The MoE layout of a model directory or an already-parsed config."""
    cfg = read_config(model) if isinstance(model, (str, Path)) else model
    text = _text_config(cfg)
    return family_for(cfg).layout(text, dtype)
