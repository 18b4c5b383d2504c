"""Make vLLM's Triton fused-MoE choose its kernel path and tile config as stock would.

On CUDA the expert bank has ``host_row_offset + E`` physical rows and the
layer tells vLLM that many experts, because ``moe_align_block_size`` must
histogram physical row ids. But vLLM also derives two decisions from that
count: the tuned tile config (looked up by ``E`` in its config files; a
256-row bank of a 128-expert model finds none and falls back to a default
config) and whether a small batch skips the alignment step
(``num_tokens * top_k * 4 <= E``). Both must follow the model's logical
expert count, or residency changes the kernels that run: slower tiles and,
with other tile sizes, other rounding than stock. Each bank registers its
physical row count with the logical count; the two vLLM functions are wrapped
to translate registered counts (and behave exactly as before otherwise).
Registration happens at load, not per step, so nothing here runs inside the
traced or captured forward.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger("reap_swap.server_ext")

# Registry: physical row count of a bank -> the model's logical expert count.
_LOGICAL_OF_PHYSICAL: dict[int, int] = {}
_MODULES = (
    "vllm.model_executor.layers.fused_moe.fused_moe",
    "vllm.model_executor.layers.fused_moe.experts.triton_moe",
)


def register(physical_rows: int, logical_experts: int) -> None:
    known = _LOGICAL_OF_PHYSICAL.setdefault(physical_rows, logical_experts)
    if known != logical_experts:
        raise ValueError(f"banks of {physical_rows} rows hold both {known} and {logical_experts} experts")


def logical_count(rows: int) -> int | None:
    return _LOGICAL_OF_PHYSICAL.get(rows)


def stock_takes_naive_path(num_tokens: int, top_k: int, experts: int) -> bool:
    """vLLM's rule for skipping ``moe_align_block_size`` (few pairs among many experts)."""
    return num_tokens * top_k * 4 <= experts


def with_logical_rows(shape: Any, logical: int) -> tuple[int, ...]:
    return (logical, *tuple(shape)[1:])


def wrap_config_lookup(original: Callable[..., Any]) -> Callable[..., Any]:
    def try_get_optimal_moe_config(w1_shape: Any, w2_shape: Any, *args: Any, **kwargs: Any) -> Any:
        logical = logical_count(int(tuple(w2_shape)[0]))
        if logical is not None:
            w1_shape, w2_shape = with_logical_rows(w1_shape, logical), with_logical_rows(w2_shape, logical)
        return original(w1_shape, w2_shape, *args, **kwargs)

    try_get_optimal_moe_config.reap_wrapped = original  # type: ignore[attr-defined]
    return try_get_optimal_moe_config


def wrap_expert_assignment(original: Callable[..., Any], align: Callable[..., Any]) -> Callable[..., Any]:
    """``align`` is vLLM's ``moe_align_block_size``: the path stock takes when the pairs are many."""

    def _prepare_expert_assignment(
        topk_ids: Any, config: dict[str, Any], num_tokens: int, top_k_num: int, global_num_experts: int, expert_map: Any, **kwargs: Any
    ) -> Any:
        logical = logical_count(global_num_experts)
        if (
            logical is not None
            and expert_map is None
            and not stock_takes_naive_path(num_tokens, top_k_num, logical)
            and stock_takes_naive_path(num_tokens, top_k_num, global_num_experts)
        ):
            return align(
                topk_ids, config["BLOCK_SIZE_M"], global_num_experts, expert_map, ignore_invalid_experts=kwargs.get("ignore_invalid_experts", False)
            )
        return original(topk_ids, config, num_tokens, top_k_num, global_num_experts, expert_map, **kwargs)

    _prepare_expert_assignment.reap_wrapped = original  # type: ignore[attr-defined]
    return _prepare_expert_assignment


def install() -> bool:
    """Wrap the two functions where vLLM's Triton MoE path looks them up; idempotent."""
    import importlib

    try:
        mods = [importlib.import_module(m) for m in _MODULES]
        align = importlib.import_module("vllm.model_executor.layers.fused_moe.moe_align_block_size").moe_align_block_size
    except (ImportError, AttributeError) as exc:
        logger.warning("reap-swap: cannot pin fused-MoE configs to the logical expert count (%s); kernels may differ from stock", exc)
        return False
    for mod in mods:
        for name, wrap in (
            ("try_get_optimal_moe_config", wrap_config_lookup),
            ("_prepare_expert_assignment", lambda f: wrap_expert_assignment(f, align)),
        ):
            fn = getattr(mod, name, None)
            if fn is not None and not hasattr(fn, "reap_wrapped"):
                setattr(mod, name, wrap(fn))
    return True
