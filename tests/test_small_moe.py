"""The trained small MoE: committed files, and the training pipeline on CPU for a few steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from reap_swap.models.families import layout_for
from reap_swap.paths import bundled_model_dir

REPO = Path(__file__).resolve().parents[1]


def test_committed_model_is_small_qwen3_moe_and_generates() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = bundled_model_dir()
    assert (d / "model.safetensors").stat().st_size <= 8 * 1024 * 1024
    lay = layout_for(d)
    assert lay.family == "qwen3_moe" and lay.num_moe_layers == 6 and lay.num_experts == 16 and lay.top_k == 4
    card = (d / "README.md").read_text()
    for needle in ("Held-out perplexity by domain", "Routing is learned", "Training"):
        assert needle in card
    eval_json = json.loads((d / "eval.json").read_text())
    assert eval_json["eval"]["all"]["ppl"] < 20
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    ids = tok("def add(a, b):\n    return", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8


def test_training_pipeline_runs_on_cpu(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "models" / "train"))
    from corpus_tokenize import DATA_FILE, tokenize_corpus

    texts = {
        "code-python": ["def f(x):\n    return x * 2\n" * 5, "import os\nprint(os.getcwd())\n" * 5],
        "math": ["12 + 30 = 42. 7 * 6 = 42. " * 10, "x^2 - 4 = 0 so x = 2 or x = -2. " * 10],
        "prose": ["The quick brown fox jumps over the lazy dog. " * 10, "A river runs through the old town. " * 10],
    }
    out = tmp_path / "corpus"
    out.mkdir()
    with open(out / "train-0.jsonl", "w") as fh:
        for dom, docs in texts.items():
            for t in docs * 20:
                fh.write(json.dumps({"text": t, "domain": dom}) + "\n")
    with open(out / "heldout.jsonl", "w") as fh:
        for dom, docs in texts.items():
            fh.write(json.dumps({"text": docs[0], "domain": dom}) + "\n")
    (out / "manifest.json").write_text(json.dumps({"train_shards": ["train-0.jsonl"], "heldout": "heldout.jsonl"}))
    meta = tokenize_corpus(out, vocab_size=400)
    assert meta["train_tokens"] > 1000 and meta["domains"] == ["code-python", "math", "prose"]
    model_out = tmp_path / "model"
    r = subprocess.run(
        [sys.executable, str(REPO / "models" / "train" / "train_moe.py"), "--data", str(out / DATA_FILE), "--out", str(model_out),
         "--device", "cpu", "--steps", "3", "--batch-size", "4", "--seq-len", "64", "--eval-windows", "2", "--eval-every", "0"],
        capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    log = [json.loads(x) for x in (model_out / "train_log.jsonl").read_text().splitlines()]
    assert any("lm_loss" in row for row in log)
    assert json.loads((model_out / "eval.json").read_text())["eval"]["all"]["loss"] > 0
    lay = layout_for(model_out)
    assert lay.num_experts == 16 and lay.num_moe_layers == 6
