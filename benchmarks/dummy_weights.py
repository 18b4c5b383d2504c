"""What vLLM's dummy loader needs to build quantized experts alike in every bench arm (``gpu_arm``).

The checkpoint configs the arms pretend to load (FP8 block scales, compressed-tensors W4A16), and the
seeded fill of integer parameters, which the dummy loader leaves uninitialized.
"""

from __future__ import annotations

from typing import Any

FP8_BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
W4A16_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128,
                                              "dynamic": False, "actorder": None, "observer": "minmax"}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "kv_cache_scheme": None,
}
"""What W4A16 checkpoints of Qwen3-MoE carry (llm-compressor's ``W4A16`` preset): every Linear 4-bit but the
head and the router (``mlp.gate``, which ``llm_probe.reseed_gates`` rewrites in the model dtype)."""
WEIGHT_BYTES = {"fp8": 1.0, "fp8-block": 1.0, "w4a16": 0.5 + 2 / 128}
"""Bytes an expert weight takes on the GPU per scheme (W4A16: 4 bits plus a bf16 scale per group of 128): what
stock offload's ``cpu_offload_gb`` is sized by to leave the reap arms' GPU expert bytes."""


LINK_WEIGHT_BYTES = {"fp8": 1.0, "fp8-block": 1.0, "w4a16": 0.5}
"""Bytes a weight that a reap arm's miss moves per scheme: the banked (packed) weights only; per-expert scales
stay whole on the GPU beside the bank (``server_ext/bank/side_tensors.py``). Stock offload moves its scales too."""


def weight_scale(quantization: str | None, dtype_bytes: int) -> float:
    """An expert's bytes under ``quantization`` over its bytes in the model dtype (1.0 unquantized)."""
    return WEIGHT_BYTES[quantization] / dtype_bytes if quantization else 1.0


def quantized_expert_bytes(expert_bytes: int, dtype_bytes: int, quantization: str | None) -> int:
    """One expert's bytes (w13 + w2 with their scales) under ``quantization``, from its bytes in the model dtype:
    what it takes on the GPU or in stock offload's host copy."""
    return round(expert_bytes * weight_scale(quantization, dtype_bytes))


def link_expert_bytes(expert_bytes: int, dtype_bytes: int, quantization: str | None) -> int:
    """The bytes a reap arm's miss of one expert moves under ``quantization``: its banked weights, no scales."""
    return round(expert_bytes * LINK_WEIGHT_BYTES[quantization] / dtype_bytes) if quantization else expert_bytes


def int_dummies_active() -> bool:
    """Whether vLLM's dummy loader, as its loaders look it up, is ``deterministic_int_dummies``' wrapper."""
    import importlib

    utils = importlib.import_module("vllm.model_executor.model_loader.weight_utils")
    return any(hasattr(getattr(utils, n, None), "reap_wrapped") for n in ("initialize_single_dummy_weight", "initialize_dummy_weights"))


def deterministic_int_dummies(seed: int = 1234) -> bool:
    """vLLM's dummy loader fills floating parameters only; integer ones (packed int4 weights, zero points)
    stay ``torch.empty`` on CUDA: whatever the allocator hands out, different in each process, so two arms
    would serve different models. This fills them with seeded random bits on their device before
    ``process_weights_after_loading`` repacks them (every 4-bit pattern is a valid weight), the same in
    every arm that calls it. Patched where the loaders look the function up; True if anything was patched."""
    import importlib

    import torch

    def fill(param: torch.Tensor, index: int) -> None:
        if param.device.type == "meta" or torch.is_floating_point(param) or param.numel() == 0:
            return
        gen = torch.Generator(device=param.device).manual_seed(seed + index)
        info = torch.iinfo(param.dtype)
        param.data.copy_(torch.randint(info.min, info.max, tuple(param.shape), generator=gen, device=param.device, dtype=param.dtype))

    patched = False
    utils = importlib.import_module("vllm.model_executor.model_loader.weight_utils")
    try:
        loader = importlib.import_module("vllm.model_executor.model_loader.dummy_loader")
    except ImportError:
        loader = None
    single = getattr(utils, "initialize_single_dummy_weight", None)
    if single is not None and not hasattr(single, "reap_wrapped"):
        count = [0]

        def initialize_single_dummy_weight(param: Any, *args: Any, **kwargs: Any) -> None:
            single(param, *args, **kwargs)
            count[0] += 1
            with torch.no_grad():
                fill(param, count[0])

        initialize_single_dummy_weight.reap_wrapped = single  # type: ignore[attr-defined]
        for mod in (utils, loader):
            if mod is not None and getattr(mod, "initialize_single_dummy_weight", None) is single:
                setattr(mod, "initialize_single_dummy_weight", initialize_single_dummy_weight)
                patched = True
    whole = getattr(utils, "initialize_dummy_weights", None)  # older vLLMs: one call over the model's state dict
    if whole is not None and not hasattr(whole, "reap_wrapped"):

        def initialize_dummy_weights(model: Any, *args: Any, **kwargs: Any) -> None:
            whole(model, *args, **kwargs)
            with torch.no_grad():
                for i, param in enumerate(model.state_dict().values()):
                    fill(param, i)

        initialize_dummy_weights.reap_wrapped = whole  # type: ignore[attr-defined]
        for mod in (utils, loader):
            if mod is not None and getattr(mod, "initialize_dummy_weights", None) is whole:
                setattr(mod, "initialize_dummy_weights", initialize_dummy_weights)
                patched = True
    return patched
