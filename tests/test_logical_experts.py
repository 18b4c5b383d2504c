"""The fused-MoE path and tile config follow the model's logical expert count, not the bank's rows.

The registry is process-wide; the tests use row counts no other test registers."""

from __future__ import annotations

from typing import Any

import pytest

from reap_swap.server_ext.step import logical_experts as le
from reap_swap.server_ext.step.logical_experts import stock_takes_naive_path, wrap_config_lookup, wrap_expert_assignment


def _fakes() -> tuple[list[Any], Any, Any, Any]:
    calls: list[Any] = []

    def config(w1: Any, w2: Any, top_k: int, dtype: Any, m: int, block_shape: Any = None) -> dict[str, int]:
        calls.append(("config", tuple(w1)[0], tuple(w2)[0]))
        return {"BLOCK_SIZE_M": 16}

    def prepare(topk_ids: Any, cfg: dict[str, int], n: int, k: int, e: int, expert_map: Any, **kw: Any) -> str:
        return "naive" if stock_takes_naive_path(n, k, e) and expert_map is None else f"align:{e}"

    def align(topk_ids: Any, block: int, e: int, expert_map: Any, ignore_invalid_experts: bool = False) -> str:
        return f"align:{e}"

    return calls, config, prepare, align


def test_config_lookup_sees_logical_rows_only_inside_a_banked_layer() -> None:
    calls, config, _, _ = _fakes()
    lookup = wrap_config_lookup(config)
    lookup((256, 1536, 2048), (256, 2048, 768), 8, None, 8)
    le.register(250, 128)
    lookup((250, 1536, 2048), (250, 2048, 768), 8, None, 8)
    assert calls == [("config", 256, 256), ("config", 128, 128)]
    with pytest.raises(ValueError):
        le.register(250, 64)


def test_alignment_decision_follows_the_logical_count() -> None:
    _, _, prepare, align = _fakes()
    prep = wrap_expert_assignment(prepare, align)
    # 8 tokens x top-8: stock with 128 experts aligns (256 > 128); 256 physical rows alone would go naive.
    assert prep(None, {"BLOCK_SIZE_M": 16}, 8, 8, 258, None) == "naive"  # not a registered bank: untouched
    le.register(258, 128)
    assert prep(None, {"BLOCK_SIZE_M": 16}, 8, 8, 258, None) == "align:258"
    assert prep(None, {"BLOCK_SIZE_M": 16}, 4, 8, 258, None) == "naive"  # stock is naive here too
    assert prep(None, {"BLOCK_SIZE_M": 16}, 64, 8, 258, None) == "align:258"
