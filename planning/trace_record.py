"""``reap-swap record-traces``: record a model's routing, token by token, into a routing trace.

HF transformers runs each request as a chat (the corpus sample's prompt as
the user turn), prefill then generation with the KV cache; a forward
pre-hook on every MoE block recomputes the block's routing from its input
exactly as the model does (``models.hf_moe.route``). Greedy decoding of a
small model loops, which flatters any cache: record sampled decoding too
(``--temperature 0.8``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reap_swap.cli import HelpFormatter
from reap_swap.models.families import layout_for, read_config
from reap_swap.models.hf_moe import moe_block, route

from .corpus import CorpusError, read_corpus
from .observe import load_model
from .traces import DECODE, PREFILL, RequestRoute, RoutingTrace, TraceError, build, save


def _prompt_ids(tok: Any, prompt: str, max_prompt_tokens: int) -> list[int]:
    messages = [{"role": "user", "content": prompt}]
    try:
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
    except (ValueError, AttributeError):  # no chat template
        ids = tok(prompt)["input_ids"]
    return list(ids)[-max_prompt_tokens:]


def record_request(model: Any, layout: Any, input_ids: list[int], max_new_tokens: int, temperature: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(phase [T], ids [T, L, K], weights [T, L, K]) of one request's prefill + decode forwards."""
    captured: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {layer: [] for layer in layout.moe_layers}
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    handles = []
    for layer in layout.moe_layers:
        block = moe_block(model, layout, layer)

        def hook(module: torch.nn.Module, args: tuple[Any, ...], layer: int = layer, block: torch.nn.Module = block) -> None:
            hidden = args[0].reshape(-1, args[0].shape[-1])
            r = route(block, hidden, layout.top_k, norm)
            captured[layer].append((r.ids.to(torch.int64), r.weights.float()))  # stays on the device: no sync per layer

        handles.append(block.register_forward_pre_hook(hook))
    try:
        torch.manual_seed(seed)
        x = torch.tensor([input_ids], device=next(model.parameters()).device)
        kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "use_cache": True, "pad_token_id": 0}
        kwargs.update({"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {"do_sample": False})
        with torch.no_grad():
            model.generate(x, **kwargs)
    finally:
        for h in handles:
            h.remove()
    ids = np.stack([torch.cat([c[0] for c in captured[layer]]).cpu().numpy() for layer in layout.moe_layers], axis=1)
    weights = np.stack([torch.cat([c[1] for c in captured[layer]]).cpu().numpy() for layer in layout.moe_layers], axis=1)
    phase = np.full(ids.shape[0], DECODE, dtype=np.uint8)
    phase[: len(input_ids)] = PREFILL
    return phase, ids, weights


def domain_of(sample: Any) -> str:
    """A sample's domain: its first tag, else its source (as ``reap-swap locality`` groups requests)."""
    return str((list(sample.tags) or [sample.source])[0])


def shape_of(sample: Any) -> str:
    """A sample's chat shape: its ``style:`` tag (paste, short, multi, long, log, editor), else ``plain``."""
    return next((t.split(":", 1)[1] for t in sample.tags if str(t).startswith("style:")), "plain")


def _round_robin(queues: list[list[Any]], n: int) -> list[Any]:
    out: list[Any] = []
    queues = [list(q) for q in queues]
    while len(out) < n and any(queues):
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0))
    return out


def stratified(samples: list[Any], n: int) -> list[Any]:
    """Up to ``n`` samples taking domains in turn and, within a domain, chat shapes in turn (file order in each).

    Corpus files are often sorted by domain; their first ``n`` lines would be one domain, and one shape
    (the most common, a paste) would dominate each domain's share.
    """
    by_domain: dict[str, dict[str, list[Any]]] = {}
    for s in samples:
        by_domain.setdefault(domain_of(s), {}).setdefault(shape_of(s), []).append(s)
    per_domain = [_round_robin(list(shapes.values()), len(samples)) for shapes in by_domain.values()]
    return _round_robin(per_domain, n)


def per_file_counts(per_file: int | list[int] | None, files: int) -> list[int] | None:
    """``--per-file`` as one count per corpus file: one value for every file, or one value each."""
    if not per_file:
        return None
    counts = [int(per_file)] * files if isinstance(per_file, int) else [int(n) for n in per_file]
    if len(counts) == 1:
        counts *= files
    if len(counts) != files or min(counts) < 1:
        raise ValueError(f"--per-file needs one count, or one per corpus file ({files}), each >= 1: {per_file}")
    return counts


def workload(corpus: list[Path], render: Any, per_file: int | list[int] | None, max_requests: int | None) -> list[Any]:
    """The requests to record: with ``per_file``, each file stratified, then the files taken in turn."""
    counts = per_file_counts(per_file, len(corpus))
    if counts:
        return _round_robin([stratified(read_corpus([path], render)[0], n) for path, n in zip(corpus, counts)], sum(counts))
    return read_corpus(corpus, render, max_requests)[0]


def request_meta(sample: Any, prompt_tokens: int, decode_tokens: int) -> dict[str, Any]:
    """What a recorded request is: its domain, chat shape, tags, file and lengths (trace ``meta.requests``)."""
    return {"source": sample.source, "tags": list(sample.tags), "split": sample.file, "domain": domain_of(sample), "shape": shape_of(sample),
            "prompt_tokens": int(prompt_tokens), "decode_tokens": int(decode_tokens)}


def generate_batch(model: Any, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int, pad_id: int, eos_ids: set[int]) -> list[list[int]]:
    """Each prompt's generated ids, all requests decoded together (left padding); cut after the first EOS."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    x = torch.full((len(prompts), width), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros_like(x)
    for i, p in enumerate(prompts):
        x[i, width - len(p) :] = torch.tensor(p, device=device)
        mask[i, width - len(p) :] = 1
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "use_cache": True, "pad_token_id": pad_id, "attention_mask": mask}
    kwargs.update({"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": 0} if temperature > 0 else {"do_sample": False})
    with torch.no_grad():
        out = model.generate(x, **kwargs)[:, width:].tolist()
    gens = []
    for row in out:
        cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
        gens.append(row[:cut])
    return gens


def route_sequence(model: Any, layout: Any, prompt: list[int], generated: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(phase, ids, weights) of prompt + generated tokens fed back, from one teacher-forced forward.

    A causal model routes token t from tokens <= t only, so this equals the routing of the
    incremental decode that produced ``generated`` (up to floating-point order).
    """
    fed = prompt + generated[:-1]  # the last generated token is never fed back
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    norm = bool(getattr(model.config, "norm_topk_prob", True))
    handles = []
    for layer in layout.moe_layers:
        block = moe_block(model, layout, layer)

        def hook(module: torch.nn.Module, args: tuple[Any, ...], layer: int = layer, block: torch.nn.Module = block) -> None:
            r = route(block, args[0].reshape(-1, args[0].shape[-1]), layout.top_k, norm)
            captured[layer] = (r.ids.to(torch.int64), r.weights.float())

        handles.append(block.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([fed], device=next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    ids = np.stack([captured[layer][0].cpu().numpy() for layer in layout.moe_layers], axis=1)
    weights = np.stack([captured[layer][1].cpu().numpy() for layer in layout.moe_layers], axis=1)
    phase = np.full(len(fed), DECODE, dtype=np.uint8)
    phase[: len(prompt)] = PREFILL
    return phase, ids, weights


def record(
    model_dir: Path,
    corpus: list[Path],
    max_requests: int | None,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    max_prompt_tokens: int = 512,
    device: str = "cpu",
    per_file: int | list[int] | None = None,
    dense_moe: bool = False,
    batch: int = 0,
) -> RoutingTrace:
    cfg = read_config(model_dir)
    layout = layout_for(cfg)
    model, tok = load_model(model_dir, device)
    if dense_moe:
        # HF's eager MoE syncs per expert; every expert as two GEMMs gives the same outputs (the
        # routing hooks recompute the router's choice either way) at GPU speed.
        from reap_swap.models.train.moe_dense import patch_dense_moe

        patch_dense_moe(model)
    render = lambda m: str(tok.apply_chat_template(m, tokenize=False))  # noqa: E731
    samples = workload(corpus, render, per_file, max_requests)
    routes = []
    prompts = [_prompt_ids(tok, s.prompt, max_prompt_tokens) for s in samples]
    gens: list[list[int]] = []
    if batch > 0:
        eos = model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        pad = model.generation_config.pad_token_id if model.generation_config.pad_token_id is not None else 0
        for start in range(0, len(prompts), batch):
            gens += generate_batch(model, prompts[start : start + batch], max_new_tokens, temperature, seed + start, pad, eos_ids)
    for i, s in enumerate(samples):
        if batch > 0:
            phase, ids, weights = route_sequence(model, layout, prompts[i], gens[i])
        else:
            phase, ids, weights = record_request(model, layout, prompts[i], max_new_tokens, temperature, seed + i)
        routes.append(RequestRoute(s.sample_id, phase, ids, weights, request_meta(s, int((phase == PREFILL).sum()), int((phase == DECODE).sum()))))
    meta = {
        "model": {"path": str(model_dir), "model_type": layout.model_type},
        "moe_layers": list(layout.moe_layers),
        "num_experts": layout.num_experts,
        "top_k": layout.top_k,
        "expert_bytes": layout.bytes_per_expert,
        "decoding": {"temperature": temperature, "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "seed": seed,
                     "batched": batch, "dense_moe": dense_moe},
        "corpus": [str(p) for p in corpus],
        "workload": {
            "order": "per file: domains in turn, chat shapes in turn within a domain; files in turn" if per_file else "file then line order",
            "per_file": per_file,
            "domains": dict(sorted(Counter(domain_of(s) for s in samples).items())),
            "shapes": dict(sorted(Counter(shape_of(s) for s in samples).items())),
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return build(meta, routes)


def fit_size(trace: RoutingTrace, out: Path, max_mb: float) -> RoutingTrace:
    """Re-save the first requests only until the file is at most ``max_mb`` MB (decimal); meta.subset says so."""
    n = trace.num_requests
    while out.stat().st_size > max_mb * 1e6 and n > 1:
        n = max(1, min(n - 1, int(n * max_mb * 1e6 / out.stat().st_size * 0.98)))
        reqs = [trace.request(i) for i in range(n)]
        meta = {k: v for k, v in trace.meta.items() if k not in ("requests", "format")}
        meta["subset"] = {"of_requests": trace.num_requests, "kept": f"the first {n} (round-robin order)", "why": f"file kept under {max_mb} MB"}
        smaller = build(meta, reqs)
        save(smaller, out)
        if out.stat().st_size <= max_mb * 1e6:
            return smaller
    return trace


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap record-traces", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="HF model directory (an MoE family reap-swap knows)")
    p.add_argument("--corpus", type=Path, nargs="+", required=True, help="ai-data-extraction JSONL files")
    p.add_argument("--out", type=Path, required=True, help="trace file to write (.npz)")
    p.add_argument("--max-requests", type=int, help="first N samples only")
    p.add_argument("--per-file", type=int, nargs="+",
                   help="N samples of each corpus file (or one N per file), domains (first tag) and chat shapes (style: tag) taken in turn, files in turn")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens generated per request")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; e.g. 0.8 to avoid greedy loops")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts keep their last this many tokens")
    p.add_argument("--device", default="cpu", help="torch device the model runs on (cpu, cuda, cuda:1, ...)")
    p.add_argument("--dense-moe", action="store_true", help="run every expert as two GEMMs (same outputs; fast on a GPU, Qwen3-MoE only)")
    p.add_argument("--max-mb", type=float, default=0.0,
                   help="keep the file under this many MB: drop requests from the end (the order is round-robin, so the mix stays) and say so in meta.subset")
    p.add_argument("--batch", type=int, default=0,
                   help="decode N requests together, then capture routing with one teacher-forced forward per request (fast; 0: one request at a time)")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or args.max_prompt_tokens < 1:
        p.error("--max-new-tokens and --max-prompt-tokens must be >= 1, --temperature >= 0")
    try:
        trace = record(
            args.model, args.corpus, args.max_requests, args.max_new_tokens, args.temperature, args.seed, args.max_prompt_tokens, args.device, args.per_file, args.dense_moe, args.batch
        )
    except (CorpusError, TraceError, FileNotFoundError, ValueError) as exc:
        print(f"reap-swap record-traces: error: {exc}", file=sys.stderr)
        return 2
    save(trace, args.out)
    if args.max_mb > 0:
        trace = fit_size(trace, args.out, args.max_mb)
    decode = int((trace.phase == DECODE).sum())
    print(f"wrote {args.out}: {trace.num_requests} requests, {trace.phase.shape[0]} token rows ({decode} decode), "
          f"{trace.num_layers} MoE layers x top-{trace.top_k} of {trace.num_experts}, {args.out.stat().st_size / 1e6:.2f} MB")
    return 0
