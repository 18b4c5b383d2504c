"""train_moe.py's router options and checkpoint/resume, on a synthetic packed corpus (CPU, seconds).

Why: learned128 v2 is trained in one GPU run that may be cut and continued in a second call, with
router settings (aux loss, z-loss, router init) chosen on CPU; each must work before the GPU sees it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

TRAIN_DIR = Path(__file__).resolve().parents[1] / "models" / "train"
TINY = ["--set", "hidden_size=64", "--set", "num_hidden_layers=2", "--set", "num_experts=8", "--set", "num_experts_per_tok=2",
        "--set", "moe_intermediate_size=16", "--set", "num_attention_heads=2", "--set", "num_key_value_heads=1"]


@pytest.fixture(scope="module")
def train_moe():  # noqa: ANN201 - the script module
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(TRAIN_DIR))
    import train_moe as mod

    torch.set_num_threads(1)
    return mod


def _packed(path: Path) -> Path:
    """A random-token .npz in moe_data's layout: train, held-out (all and per domain), meta_json."""
    rng = np.random.default_rng(0)
    meta = {"domains": ["a", "b"], "train_tokens": 20000, "vocab_size": 256,
            "special_tokens": {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}}
    arrays = {"train": rng.integers(3, 256, 20000).astype(np.uint16), "heldout": rng.integers(3, 256, 800).astype(np.uint16),
              "heldout__a": rng.integers(3, 256, 400).astype(np.uint16), "heldout__b": rng.integers(3, 256, 400).astype(np.uint16),
              "meta_json": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    np.savez(path, **arrays)
    return path


def test_router_init_and_z_loss(train_moe) -> None:  # noqa: ANN001
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model("qwen3_moe", hidden_size=64, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert train_moe.init_routers(model, 0.0) == 2
    gates = [m.gate.weight for m in model.modules() if m.__class__.__name__.endswith("SparseMoeBlock")]
    assert all(float(g.detach().abs().max()) == 0.0 for g in gates)
    train_moe.init_routers(model, 0.5)
    assert all(0.3 < float(g.detach().std()) < 0.7 for g in gates)
    logits = (torch.zeros(5, 8), torch.zeros(5, 8))
    assert float(train_moe.router_z_loss(logits, 8)) == pytest.approx(float(np.log(8)) ** 2, rel=1e-5)
    big = (torch.full((5, 8), 3.0),)
    assert float(train_moe.router_z_loss(big, 8)) > float(train_moe.router_z_loss(logits, 8))


def test_checkpoint_resume_continues_the_schedule(train_moe, tmp_path: Path) -> None:  # noqa: ANN001
    data = _packed(tmp_path / "data.npz")
    out, ckpt = tmp_path / "run", tmp_path / "ckpt" / "train.pt"
    base = ["--data", str(data), "--out", str(out), "--device", "cpu", "--moe-impl", "dense", "--batch-size", "2", "--seq-len", "32",
            "--eval-windows", "1", "--eval-every", "0", "--warmup-steps", "2", "--log-every", "1", "--ckpt", str(ckpt), "--ckpt-every-s", "0",
            "--router-z-coef", "1e-3", "--router-init-std", "0", *TINY]
    assert train_moe.main(base + ["--steps", "4"]) == 0
    first = json.loads((out / "eval.json").read_text())
    assert first["steps"] == 4 and first["finished"] and first["resumed_from_step"] == 0
    state = __import__("torch").load(ckpt, weights_only=False)
    assert state["step"] == 3 and state["total_steps"] == 4  # the last periodic checkpoint before the end
    assert train_moe.main(base + ["--steps", "6", "--resume"]) == 0
    again = json.loads((out / "eval.json").read_text())
    assert again["resumed_from_step"] == 3 and again["steps"] == 6 and again["finished"]
    steps = [json.loads(line)["step"] for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps[:4] == [1, 2, 3, 4] and steps[4:] == [4, 5, 6]  # appended, continuing at the checkpoint's step
    assert (out / "model.safetensors").is_file()
    assert state["tokens"] == 3 * 2 * 32 and again["tokens_seen"] == 6 * 2 * 32


def test_tokens_seen_counts_each_run_at_its_own_batch_size(train_moe, tmp_path: Path) -> None:  # noqa: ANN001
    """A resume at another batch size (the first run halved it on out-of-memory, or the resume did) counts the
    checkpoint's tokens plus its own steps at its own size, not every step at the last size."""
    torch = __import__("torch")
    data = _packed(tmp_path / "data.npz")
    out, ckpt = tmp_path / "run", tmp_path / "ckpt" / "train.pt"
    base = ["--data", str(data), "--out", str(out), "--device", "cpu", "--moe-impl", "dense", "--seq-len", "32", "--eval-windows", "1",
            "--eval-every", "0", "--warmup-steps", "2", "--log-every", "1", "--ckpt", str(ckpt), "--ckpt-every-s", "0", *TINY]
    assert train_moe.main(base + ["--batch-size", "4", "--steps", "4"]) == 0
    state = torch.load(ckpt, weights_only=False)
    assert state["step"] == 3 and state["tokens"] == 3 * 4 * 32
    state["batch_size"] = 2  # the resumed run trains at half the batch
    torch.save(state, ckpt)
    assert train_moe.main(base + ["--batch-size", "4", "--steps", "6", "--resume"]) == 0
    again = json.loads((out / "eval.json").read_text())
    assert again["batch_size"] == 2 and again["tokens_seen"] == 3 * 4 * 32 + 3 * 2 * 32


def test_impl_trial_keeps_a_working_forward(train_moe, tmp_path: Path) -> None:  # noqa: ANN001
    """--pick-impl-steps times dense and grouped_mm on the real shapes; whatever fails, training goes on with a timed one."""
    data = _packed(tmp_path / "data.npz")
    out = tmp_path / "run"
    assert train_moe.main(["--data", str(data), "--out", str(out), "--device", "cpu", "--moe-impl", "dense", "--batch-size", "2",
                           "--seq-len", "32", "--eval-windows", "1", "--eval-every", "0", "--minutes", "0.5", "--reserve-s", "10",
                           "--calib-steps", "2", "--pick-impl-steps", "1", *TINY]) == 0
    ev = json.loads((out / "eval.json").read_text())
    timed = {k: v for k, v in ev["impl_trial_ms_per_step"].items() if not k.endswith("_error")}
    assert "dense" in timed and ev["moe_impl"] in ("dense", "hf") and ev["steps"] >= 5
    assert (ev["moe_impl"] == "dense") == (min(timed, key=timed.get) == "dense")


def test_per_layer_balance_sees_what_the_concatenated_loss_hides(train_moe) -> None:  # noqa: ANN001
    """Layer 0 sends every token to expert 0 and layer 1 to expert 1: concatenated over layers that looks
    half balanced; per layer both are fully collapsed."""
    import torch

    e, k = 4, 1
    l0 = torch.full((6, e), -9.0)
    l0[:, 0] = 9.0
    l1 = torch.full((6, e), -9.0)
    l1[:, 1] = 9.0
    concat = float(train_moe.balance_loss((l0, l1), e, k))
    per_layer = float(train_moe.per_layer_balance_loss((l0, l1), e, k))
    assert per_layer == pytest.approx(e * 1.0, rel=1e-3)  # all load and all probability on one expert
    assert concat == pytest.approx(e * 2 * 0.5 * 0.5, rel=1e-3) and per_layer > concat
    uniform = torch.zeros(6, e)
    assert float(train_moe.per_layer_balance_loss((uniform, uniform), e, k)) == pytest.approx(1.0, abs=0.5)


def test_depth_weights_grade_the_balance_and_keep_its_scale(train_moe) -> None:  # noqa: ANN001
    import torch

    w = train_moe.depth_weights(5, 0.1)
    assert float(w.mean()) == pytest.approx(1.0, rel=1e-6)
    assert float(w[-1] / w[0]) == pytest.approx(0.1, rel=1e-5) and bool((w[1:] < w[:-1]).all())
    assert torch.equal(train_moe.depth_weights(5, 1.0), torch.ones(5))
    # layer 0 collapsed, layer 1 uniform: weighting layer 0 more raises the loss, weighting it less lowers it
    e = 4
    collapsed = torch.full((6, e), -9.0)
    collapsed[:, 0] = 9.0
    uniform = torch.zeros(6, e)
    flat = float(train_moe.per_layer_balance_loss((collapsed, uniform), e, 1))
    early = float(train_moe.per_layer_balance_loss((collapsed, uniform), e, 1, depth_ratio=0.25))
    late = float(train_moe.per_layer_balance_loss((collapsed, uniform), e, 1, depth_ratio=4.0))
    assert early > flat > late


def test_stick_loss_is_zero_for_constant_routing_and_one_for_disjoint_neighbours(train_moe) -> None:  # noqa: ANN001
    import torch

    e, batch, seq = 4, 2, 5
    same = torch.randn(1, 1, e).expand(batch, seq, e).reshape(-1, e)
    assert float(train_moe.router_stick_loss((same,), e, batch)) == pytest.approx(0.0, abs=1e-6)
    alt = torch.full((batch, seq, e), -30.0)
    alt[:, 0::2, 0] = 30.0
    alt[:, 1::2, 1] = 30.0
    assert float(train_moe.router_stick_loss((alt.reshape(-1, e), same), e, batch)) == pytest.approx(0.5, rel=1e-4)
    # pairs never cross sequences: sequence 0 on expert 0, sequence 1 on expert 1, each constant
    split = torch.full((batch, seq, e), -30.0)
    split[0, :, 0] = 30.0
    split[1, :, 1] = 30.0
    assert float(train_moe.router_stick_loss((split.reshape(-1, e),), e, batch)) == pytest.approx(0.0, abs=1e-6)


def test_stick_and_depth_options_train_and_are_logged(train_moe, tmp_path: Path) -> None:  # noqa: ANN001
    data = _packed(tmp_path / "data.npz")
    out = tmp_path / "run"
    assert train_moe.main(["--data", str(data), "--out", str(out), "--device", "cpu", "--moe-impl", "dense", "--batch-size", "2",
                           "--seq-len", "32", "--eval-windows", "1", "--eval-every", "0", "--warmup-steps", "1", "--log-every", "1",
                           "--steps", "3", "--aux-per-layer", "--aux-depth-ratio", "0.2", "--stick-coef", "0.5", *TINY]) == 0
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["stick_loss"] <= 1.0 for r in recs)
    args = json.loads((out / "eval.json").read_text())["args"]
    assert args["stick_coef"] == "0.5" and args["aux_depth_ratio"] == "0.2"


def test_full_softmax_stickiness_rewards_flat_routers_and_the_top_k_one_does_not(train_moe) -> None:  # noqa: ANN001
    """Why the v2 sibling's router went flat: shrinking the router logits drives the full-softmax distance to 0
    while the top-k picks stay what they were; the top-k distance (renormalised gate weights) stays at
    1 - the shared mass, and is exactly 0 / 1 for identical / disjoint top-k sets."""
    import torch

    e, k, batch = 16, 4, 1
    torch.manual_seed(0)
    logits = torch.randn(2, e) * 3
    full = [float(train_moe.router_stick_loss((logits * s,), e, batch)) for s in (1.0, 0.1, 0.001)]
    topk = [float(train_moe.router_stick_loss((logits * s,), e, batch, top_k=k)) for s in (1.0, 0.1, 0.001)]
    assert full[0] > full[1] > full[2] and full[2] < 0.01
    sets = [set(torch.topk(logits[i], k).indices.tolist()) for i in range(2)]
    assert topk[2] == pytest.approx(1 - len(sets[0] & sets[1]) / k, abs=0.02) and topk[2] > 0.25
    same = logits[:1].expand(2, e)
    assert float(train_moe.router_stick_loss((same,), e, batch, top_k=k)) == pytest.approx(0.0, abs=1e-6)
    disjoint = torch.full((2, e), -5.0)
    disjoint[0, :k] = 5.0
    disjoint[1, k:2 * k] = 5.0
    assert float(train_moe.router_stick_loss((disjoint,), e, batch, top_k=k)) == pytest.approx(1.0, abs=1e-6)


def test_stick_warmup_and_top_k_options_train(train_moe, tmp_path: Path) -> None:  # noqa: ANN001
    import argparse

    ns = argparse.Namespace(stick_coef=0.5, stick_warmup_steps=3)
    assert [train_moe.stick_weight(s, ns) for s in range(5)] == [0.0, 0.0, 0.0, 0.5, 0.5]
    assert train_moe.stick_weight(0, argparse.Namespace(stick_coef=0.5)) == 0.5  # callers without the option
    data = _packed(tmp_path / "data.npz")
    out = tmp_path / "run"
    assert train_moe.main(["--data", str(data), "--out", str(out), "--device", "cpu", "--moe-impl", "dense", "--batch-size", "2",
                           "--seq-len", "32", "--eval-windows", "1", "--eval-every", "0", "--warmup-steps", "1", "--log-every", "1",
                           "--steps", "3", "--aux-per-layer", "--stick-coef", "0.5", "--stick-topk", "--stick-warmup-steps", "2",
                           *TINY]) == 0
    recs = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["stick_loss"] <= 1.0 for r in recs)
    assert recs[0]["loss"] == pytest.approx(recs[0]["lm_loss"] + 0.01 * recs[0]["aux_loss"], rel=1e-5)  # no stickiness yet
    args = json.loads((out / "eval.json").read_text())["args"]
    assert args["stick_topk"] == "True" and args["stick_warmup_steps"] == "2"
