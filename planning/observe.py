"""``reap-swap observe``: REAP observation of an MoE model over a calibration corpus.

Runs the model in HF transformers. A forward pre-hook on every MoE block
reads the block's input, recomputes the router's top-k exactly as the model
does, and runs each chosen expert on its tokens to get ``||E_j(x)||``. Per
sample it records, for every layer and expert, the summed gate weight, the
routed-token count and the summed gate x output norm (REAP saliency is the
latter over the count); per chunk, the token-level co-activation counts.

Long runs checkpoint: every ``checkpoint_every`` batches the finished samples
become a chunk and the manifest is committed, so a crash loses at most that
many batches and the next run resumes with the samples not yet committed.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reap_swap.cli import HelpFormatter
from reap_swap.models import hf_moe
from reap_swap.models.families import MoELayout, layout_for, read_config
from reap_swap.plan import canonical_sha256

from .corpus import CorpusError, Sample, corpus_sha256, read_corpus
from .observations import (
    FORMAT_VERSION,
    ObservationError,
    append_rows,
    atomic_write,
    committed_rows,
    discard_uncommitted,
    file_sha256,
    read_manifest,
    write_manifest,
)


class LayerStats:
    """Accumulators for one batch."""

    def __init__(self, batch: int, layers: int, experts: int):
        self.mass = np.zeros((batch, layers, experts), np.float64)
        self.freq = np.zeros((batch, layers, experts), np.int64)
        self.saliency = np.zeros((batch, layers, experts), np.float64)
        self.coact = np.zeros((layers, experts, experts), np.int64)


def observe_block(
    block: torch.nn.Module, hidden: torch.Tensor, owner: torch.Tensor, layout: MoELayout, li: int, stats: LayerStats
) -> None:
    """Accumulate one MoE layer's routing for the valid tokens ``hidden`` [T, H] of samples ``owner`` [T]."""
    routing = hf_moe.route(block, hidden, layout.top_k, layout.norm_topk_prob)
    ids, w = routing.ids, routing.weights.to(torch.float64)
    e = layout.num_experts
    onehot = torch.zeros(hidden.shape[0], e, dtype=torch.int64)
    onehot.scatter_(1, ids.cpu(), 1)
    stats.coact[li] += (onehot.T @ onehot).numpy()
    own = owner.cpu().numpy()
    for expert in torch.unique(ids).tolist():
        rows, ks = torch.nonzero(ids == expert, as_tuple=True)
        norms = hf_moe.expert_output(block, expert, hidden[rows]).float().norm(dim=-1).to(torch.float64)
        g = w[rows, ks]
        o = own[rows.cpu().numpy()]
        np.add.at(stats.mass[:, li, expert], o, g.cpu().numpy())
        np.add.at(stats.freq[:, li, expert], o, 1)
        np.add.at(stats.saliency[:, li, expert], o, (g * norms).cpu().numpy())


@torch.no_grad()
def observe_batch(model: torch.nn.Module, layout: MoELayout, input_ids: list[list[int]], device: str) -> LayerStats:
    """Run one right-padded batch; pad positions are excluded from every statistic."""
    b = len(input_ids)
    width = max(len(x) for x in input_ids)
    ids = torch.zeros(b, width, dtype=torch.long)
    mask = torch.zeros(b, width, dtype=torch.long)
    for i, x in enumerate(input_ids):
        ids[i, : len(x)] = torch.tensor(x)
        mask[i, : len(x)] = 1
    valid = mask.bool().reshape(-1).to(device)
    owner = torch.arange(b).repeat_interleave(width).to(device)[valid]
    stats = LayerStats(b, layout.num_moe_layers, layout.num_experts)
    handles = []
    for li, layer in enumerate(layout.moe_layers):
        block = hf_moe.moe_block(model, layout, layer)

        def hook(module: torch.nn.Module, args: tuple[Any, ...], li: int = li) -> None:
            hidden = args[0].reshape(-1, args[0].shape[-1])[valid]
            observe_block(module, hidden, owner, layout, li, stats)

        handles.append(block.register_forward_pre_hook(hook))
    try:
        model(input_ids=ids.to(device), attention_mask=mask.to(device), **_no_logits(model))
    finally:
        for h in handles:
            h.remove()
    return stats


def _no_logits(model: torch.nn.Module) -> dict[str, int]:
    """Ask for the last position's logits only: nothing here reads them, and the LM head over every
    position ([T, vocab]) took a third of the small MoE's observation time on CPU (11.7 of 38.7 s)."""
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def load_model(model_dir: Path, device: str) -> tuple[torch.nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = read_config(model_dir)
    dtype = getattr(torch, str(cfg.get("torch_dtype") or "float32").replace("torch.", ""), torch.float32)
    if device == "cpu" and dtype == torch.float16:
        dtype = torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except TypeError:  # transformers 4.x spells it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=dtype)
    return model.to(device).eval(), tok


def observe(
    model_dir: Path,
    corpus: list[Path],
    out_dir: Path,
    max_samples: int | None = None,
    max_tokens: int = 512,
    device: str = "cpu",
    batch_size: int = 8,
    progress: bool = True,
    checkpoint_every: int = 32,
) -> dict[str, Any]:
    """Observe the corpus samples not yet in ``out_dir``; returns the updated manifest.

    Commits a chunk every ``checkpoint_every`` batches (at least one batch).
    """
    cfg = read_config(model_dir)
    layout = layout_for(cfg)
    config_sha = canonical_sha256(cfg)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out_dir)
    params = {"max_tokens": max_tokens}
    if manifest is not None:
        if manifest["model"]["config_sha256"] != config_sha:
            raise ObservationError(f"{out_dir} holds observations of another model (config sha256 differs); use a new --out")
        if manifest["params"] != params:
            raise ObservationError(f"{out_dir} was observed with {manifest['params']}; rerun with the same --max-tokens")
    model, tok = load_model(model_dir, device)

    def render(messages: list[dict[str, str]]) -> str:
        return str(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))

    samples, cstats = read_corpus(corpus, render, max_samples)
    discard_uncommitted(out_dir, manifest)  # what a crashed run wrote after its last commit
    known = {row["id"] for row in committed_rows(out_dir, manifest)[0]}
    todo = [s for s in samples if s.sample_id not in known]
    if manifest is None:
        manifest = {
            "format_version": FORMAT_VERSION,
            "model": {
                "path": str(model_dir), "model_type": layout.model_type, "config_sha256": config_sha,
                "moe_layers": list(layout.moe_layers), "num_experts": layout.num_experts, "top_k": layout.top_k,
                "dtype": layout.dtype,
            },
            "params": params,
            "corpus": {"files": [], "sha256": []},
            "chunks": [],
            "samples": 0,
            "tokens": 0,
        }
    manifest["corpus"]["files"] = sorted(set(manifest["corpus"]["files"]) | {str(p) for p in corpus})
    manifest["corpus"].setdefault("skipped", {})
    for k, v in cstats.skipped.items():
        manifest["corpus"]["skipped"][k] = manifest["corpus"]["skipped"].get(k, 0) + v
    manifest["new_samples"] = len(todo)
    from tqdm import tqdm

    per_chunk = max(1, checkpoint_every) * batch_size
    with tqdm(total=len(todo), desc="observe", unit="sample", disable=not progress, file=sys.stderr) as bar:
        for start in range(0, len(todo), per_chunk):
            part = todo[start : start + per_chunk]
            chunk = _observe_chunk(model, tok, layout, part, out_dir, len(manifest["chunks"]), max_tokens, device, batch_size, bar)
            manifest["chunks"].append(chunk)
            manifest["corpus"]["sha256"].append(corpus_sha256(part))
            manifest["samples"] += chunk["samples"]
            manifest["tokens"] += chunk["tokens"]
            write_manifest(out_dir, manifest)
    if not todo:
        write_manifest(out_dir, manifest)
    return manifest


def _observe_chunk(
    model: torch.nn.Module, tok: Any, layout: MoELayout, todo: list[Sample], out_dir: Path, index: int,
    max_tokens: int, device: str, batch_size: int, bar: Any,
) -> dict[str, Any]:
    """Observe ``todo`` and write it as chunk ``index`` (npz, then its rows); the caller commits it."""
    encoded = [tok(s.text, add_special_tokens=False, truncation=True, max_length=max_tokens)["input_ids"] for s in todo]
    n, L, E = len(todo), layout.num_moe_layers, layout.num_experts
    mass = np.zeros((n, L, E), np.float32)
    freq = np.zeros((n, L, E), np.int32)
    sal = np.zeros((n, L, E), np.float32)
    coact = np.zeros((L, E, E), np.int64)
    t0 = time.perf_counter()
    by_length = sorted(range(n), key=lambda i: len(encoded[i]))  # batches of like lengths: little padding to compute
    for start in range(0, n, batch_size):
        rows = by_length[start : start + batch_size]
        st = observe_batch(model, layout, [encoded[i] for i in rows], device)
        mass[rows], freq[rows], sal[rows] = st.mass, st.freq, st.saliency
        coact += st.coact
        bar.update(len(rows))
    name = f"chunk-{index:04d}.npz"
    atomic_write(out_dir / name, lambda fh: np.savez_compressed(fh, sample_mass=mass, sample_freq=freq, sample_saliency=sal, coact=coact))
    append_rows(out_dir, [
        {"id": s.sample_id, "source": s.source, "tags": list(s.tags), "tokens": len(ids), "prompt": s.prompt, "file": s.file, "chunk": name}
        for s, ids in zip(todo, encoded)
    ])
    tokens = int(sum(len(x) for x in encoded))
    return {"file": name, "samples": n, "tokens": tokens, "sha256": file_sha256(out_dir / name),
            "seconds": round(time.perf_counter() - t0, 2)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap observe", description="REAP observation over a calibration corpus (HF transformers).", formatter_class=HelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="HF model directory (an MoE family reap-swap knows)")
    p.add_argument("--corpus", type=Path, nargs="+", required=True, help="ai-data-extraction JSONL, {text} JSONL or .txt")
    p.add_argument("--out", type=Path, required=True, help="observation directory (created, or extended with new samples)")
    p.add_argument("--max-samples", type=int, help="observe at most this many corpus samples (default: all)")
    p.add_argument("--max-tokens", type=int, default=512, help="token cap per sample")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    p.add_argument("--batch-size", type=int, default=8, help="samples per forward pass")
    p.add_argument("--checkpoint-every", type=int, default=32, help="commit a chunk every N batches (a crash loses at most N)")
    a = p.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but no CUDA device is available")
    if a.max_tokens < 8 or a.batch_size < 1 or a.checkpoint_every < 1:
        p.error("--max-tokens must be >= 8, --batch-size and --checkpoint-every >= 1")
    try:
        m = observe(a.model, a.corpus, a.out, a.max_samples, a.max_tokens, a.device, a.batch_size, checkpoint_every=a.checkpoint_every)
    except (CorpusError, ObservationError, ValueError) as exc:
        print(f"reap-swap observe: error: {exc}", file=sys.stderr)
        return 2
    skipped = m["corpus"].get("skipped", {})
    print(f"observed {m['new_samples']} new sample(s); {a.out} now holds {m['samples']} samples, {m['tokens']} tokens "
          f"(skipped lines: {skipped or 'none'}); sha256 {m['content_sha256'][:16]}")
    return 0
