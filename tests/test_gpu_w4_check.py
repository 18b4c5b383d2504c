"""The 4-bit GPU check's harness on CPU: the W4A16 engine config, the integer dummy fill that makes every
arm serve the same 4-bit model, and the pure verdict of ``scripts/gpu_w4_check.py``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch


def _script():
    spec = importlib.util.spec_from_file_location("gpu_w4_check", Path(__file__).resolve().parents[1] / "scripts" / "gpu_w4_check.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_w4a16_engine_kwargs_carry_a_compressed_tensors_config() -> None:
    from reap_swap.benchmarks import dummy_weights, gpu_arm

    spec = {"model": "m", "dtype": "bfloat16", "max_model_len": 128, "batch": 8, "device": "cuda", "kv_cache_gib": 1.0, "kind": "stock",
            "quantization": "w4a16"}
    kw = gpu_arm._engine_kwargs(spec)
    qc = kw["hf_overrides"]["quantization_config"]
    assert "quantization" not in kw and kw["load_format"] == "dummy"
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    w = qc["config_groups"]["group_0"]["weights"]
    assert (w["num_bits"], w["group_size"], w["symmetric"], w["actorder"]) == (4, 128, True, None)
    assert "re:.*mlp.gate$" in qc["ignore"], "the router stays in the model dtype (the arms reseed it)"
    qc["ignore"].append("x")
    assert "x" not in dummy_weights.W4A16_CONFIG["ignore"], "each engine gets its own copy"


def test_integer_dummy_weights_are_filled_the_same_in_every_arm(monkeypatch: pytest.MonkeyPatch) -> None:
    from reap_swap.benchmarks import dummy_weights

    utils = pytest.importorskip("vllm.model_executor.model_loader.weight_utils")
    loader = pytest.importorskip("vllm.model_executor.model_loader.dummy_loader")
    for mod in (utils, loader):  # restored after the test
        for name in ("initialize_single_dummy_weight", "initialize_dummy_weights"):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, getattr(mod, name))
    assert dummy_weights.deterministic_int_dummies() is True
    assert dummy_weights.deterministic_int_dummies() is False, "idempotent"

    def load() -> list[torch.Tensor]:
        ts = [torch.empty(4, 8, dtype=torch.int32), torch.zeros(3, dtype=torch.bfloat16), torch.empty(2, 0, dtype=torch.int32)]
        for t in ts:
            loader.initialize_single_dummy_weight(t)
        return ts

    a = load()
    assert a[0].unique().numel() > 16 and a[1].abs().max() <= 1e-3
    monkeypatch.undo()  # a second arm: a fresh process, vLLM's loader unpatched, the patch's call count from zero
    for mod in (utils, loader):
        for name in ("initialize_single_dummy_weight",):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, getattr(mod, name))
    dummy_weights.deterministic_int_dummies()
    b = load()
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "two processes' arms fill identical weights"


def test_gpu_w4_check_names_what_failed() -> None:
    mod = _script()
    bank = {"slots": 38, "physical_rows": 168, "banked": ["w13_weight_packed", "w2_weight_packed"],
            "side": {"w13_weight_scale": [168, 16, 1536], "w13_weight_shape": [168, 2]}}
    good = {"moe_kernel": {"bank": bank}, "identical_ids": True, "identical_ids_bs8": True, "int_dummies_patched": True}
    raw = {"stock_gpu": {"tokens_bs1": [1, 2], "int_dummies_patched": True}, "reap_30": good, "reap_30_ram": dict(good)}
    assert mod.problems(raw, 38) == []
    raw["reap_30_ram"] = {**good, "identical_ids": False, "first_diff": 7}
    raw["reap_30_cache"] = {**good, "moe_kernel": {"bank": {**bank, "banked": bank["banked"] + ["w13_weight_shape"]}}}
    raw["stock_gpu"]["int_dummies_patched"] = False
    bad = mod.problems(raw, 38)
    assert len(bad) == 3
    assert any(b.startswith("stock_gpu: integer dummy weights not filled") for b in bad)
    assert any(b.startswith("reap_30_ram: identical_ids=False") for b in bad) and any(b.startswith("reap_30_cache: unexpected bank") for b in bad)
    plain = {"stock_gpu": {"tokens_bs1": [1]}, "reap_30": {**good, "int_dummies_patched": None, "moe_kernel": {"bank": {**bank, "side": {}}}}}
    assert mod.problems(plain, 38, quantized=False) == [], "the unquantized smoke run has no side tensors and no integer fill"


def test_stock_offload_is_recorded_not_judged() -> None:
    """Stock cpu_offload_gb failing on Marlin weights is what the check reports about stock vLLM, not a failure of ours."""
    from reap_swap.benchmarks import dummy_weights, quant_check

    mod = _script()
    bank = {"slots": 38, "physical_rows": 168, "banked": ["w13_weight_packed"], "side": {"w13_weight_scale": [168, 16, 1536]}}
    good = {"moe_kernel": {"bank": bank}, "identical_ids": True, "identical_ids_bs8": True, "int_dummies_patched": True}
    broken = {"error": "RuntimeError: b_q_weight is not on GPU", "spec": {"offload_gib": 2.37}}
    raw = {"stock_gpu": {"tokens_bs1": [1, 2], "int_dummies_patched": True}, "reap_30": good, "stock_offload": broken}
    assert mod.problems(raw, 38) == []
    seen = quant_check.observed(raw, {"stock_offload": 2.37})["stock_offload"]
    assert seen["served"] is False and "b_q_weight" in seen["error"] and seen["offload_gib"] == 2.37
    raw["stock_offload"] = {"tokens_bs1": [1, 2], "bs1": {"decode_tok_s": 40.0}, "identical_ids": True, "identical_ids_bs8": False}
    assert mod.problems(raw, 38) == [], "served with other ids and no bank: still stock's own outcome"
    seen = quant_check.observed(raw, {"stock_offload": 2.37})["stock_offload"]
    assert seen["served"] is True and seen["decode_tok_s_bs1"] == 40.0 and seen["decode_tok_s_bs8"] is None
    assert quant_check.observed({"stock_gpu": {}}, {}) == {}, "not asked for: not reported"
    assert dummy_weights.WEIGHT_BYTES["w4a16"] * 128 == 66, "64 bytes of int4 and one bf16 scale per 128 weights"
