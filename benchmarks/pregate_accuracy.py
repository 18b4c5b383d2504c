"""``reap-swap pregate-accuracy``: how well the hidden state at layer L predicts layer L+d's experts.

A promotion copy issued while layer L runs overlaps compute only if layer L+d's experts are known
early. Pre-gating (ProMoE, FATE, ...) applies layer L+d's router to a hidden state available at
layer L. This measures that guess on an HF checkpoint, teacher-forced over held-out text (the
requests and tokenizer handling of ``record-traces``), for every MoE layer L and lookahead d:

* ``moe_input``: layer L+d's router on layer L's MoE-block input (already normed by L's
  post-attention norm);
* ``residual_normed``: layer L's output residual (what enters layer L+1) through layer L+d's
  ``post_attention_layernorm`` (the norm L+d's router really sees), then L+d's router;
* baselines: ``previous_token`` (token t-1's actual ranking at L+d: temporal reuse),
  ``static_frequency`` (top experts of L+d by frequency in the *other* requests),
  ``random_router`` (a random matrix on the ``residual_normed`` input: chance level);
* ``self_check``: each layer's router on its own MoE input against what the model's gate
  module returned (must be 1.0: the hooks read the right tensors).

Scored per token row from each request's second token on: recall (share of the actual top-k
that the predicted top-k, or top-2k, holds) and mass share (the actual gate weight on them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from reap_swap.cli import HelpFormatter
from reap_swap.models.families import MoELayout, layout_for, read_config
from reap_swap.models.hf_moe import gate_weight, moe_block
from reap_swap.paths import example_dir
from reap_swap.planning.corpus import CorpusError
from reap_swap.planning.observe import load_model
from reap_swap.planning.trace_record import _prompt_ids, request_meta, workload

from .pregate_metrics import RecallTally, expert_counts, mean_over_layers, previous_token, static_ranked

PREDICTORS = ("moe_input", "residual_normed", "previous_token", "static_frequency", "random_router")
METHODS = {
    "moe_input": "router of L+d on layer L's MoE-block input (post-attention-normed by layer L)",
    "residual_normed": "router of L+d on layer L's output residual passed through layer L+d's post_attention_layernorm",
    "previous_token": "token t-1's actual router ranking at layer L+d (temporal reuse)",
    "static_frequency": "layer L+d's most frequent experts over every other request (leave-one-request-out)",
    "random_router": "a random Gaussian matrix in place of the router, on the residual_normed input (chance control)",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PregateError(ValueError):
    """A model or workload this measurement cannot run on (the CLI's exit 2)."""


def decoder_layer(model: torch.nn.Module, layout: MoELayout, layer: int) -> torch.nn.Module:
    """The decoder layer holding MoE layer ``layer`` (the block's parent's parent: layers.{L}.mlp)."""
    return model.get_submodule(layout.hf_experts_path.format(layer=layer).rsplit(".", 2)[0])


def _first(out: Any) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


@contextmanager
def captured(model: torch.nn.Module, layout: MoELayout) -> Iterator[dict[str, dict[int, torch.Tensor]]]:
    """Hooks filling, per forward, ``moe_in[L]`` (the MoE block's input), ``resid[L]`` (the decoder
    layer's output) and ``logits[L]`` / ``ids[L]`` (what the model's own gate module computed)."""
    store: dict[str, dict[int, torch.Tensor]] = {"moe_in": {}, "resid": {}, "logits": {}, "ids": {}}
    handles = []
    for layer in layout.moe_layers:
        block = moe_block(model, layout, layer)

        def pre(module: torch.nn.Module, args: tuple[Any, ...], layer: int = layer) -> None:
            store["moe_in"][layer] = args[0].reshape(-1, args[0].shape[-1])

        def gate(module: torch.nn.Module, args: tuple[Any, ...], out: Any, layer: int = layer) -> None:
            store["logits"][layer] = _first(out).reshape(-1, _first(out).shape[-1])
            if isinstance(out, tuple) and len(out) >= 3:  # HF 5.x router: (logits, weights, ids)
                store["ids"][layer] = out[2].reshape(-1, out[2].shape[-1])

        def post(module: torch.nn.Module, args: tuple[Any, ...], out: Any, layer: int = layer) -> None:
            store["resid"][layer] = _first(out).reshape(-1, _first(out).shape[-1])

        handles += [block.register_forward_pre_hook(pre), block.gate.register_forward_hook(gate),
                    decoder_layer(model, layout, layer).register_forward_hook(post)]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def ranked(logits: torch.Tensor, k: int) -> np.ndarray:
    """[T, 2k] experts best first, ranked as Qwen3-MoE's router ranks them (fp32 softmax, then top-k).

    The first k are ``topk(probs, k)`` itself, then the rest of ``topk(probs, 2k)``: with tied bf16
    logits the first k of a top-2k may break ties unlike the router's own top-k call.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    first, wide = torch.topk(probs, k, dim=-1).indices, torch.topk(probs, 2 * k, dim=-1).indices
    cand = torch.cat([first, wide], dim=1)  # [T, 3k]
    dup = torch.cat([torch.zeros_like(first, dtype=torch.bool), (wide[:, :, None] == first[:, None, :]).any(-1)], dim=1)
    key = torch.arange(3 * k, device=cand.device) + 3 * k * dup.long()  # duplicates of the first k go last
    order = torch.sort(key, dim=1, stable=True).indices[:, : 2 * k]
    return cand.gather(1, order).cpu().numpy()


def actual_routing(logits: torch.Tensor, ids: torch.Tensor | None, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [T, k], gate probabilities on them [T, k]) of what the model routed."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top = ids.to(torch.int64) if ids is not None else torch.topk(probs, k, dim=-1).indices
    return top.cpu().numpy(), probs.gather(1, top).cpu().numpy()


def check_model(model: torch.nn.Module, layout: MoELayout) -> None:
    """Refuse a model whose MoE layers lack what the hooks read (a gate module, a post-attention norm)."""
    for layer in layout.moe_layers:
        try:
            block, dec = moe_block(model, layout, layer), decoder_layer(model, layout, layer)
        except AttributeError as exc:
            raise PregateError(f"layer {layer}: no MoE block where the {layout.model_type} layout expects one ({exc})") from None
        if not hasattr(block, "gate") or not hasattr(dec, "post_attention_layernorm"):
            raise PregateError(f"layer {layer}: needs a router `gate` and a `post_attention_layernorm` (Qwen3-MoE layout)")


def pairs(layout: MoELayout, lookaheads: list[int]) -> dict[int, list[tuple[int, int]]]:
    """Per lookahead d, the (source L, target L+d) layer pairs where both are MoE layers."""
    moe = set(layout.moe_layers)
    return {d: [(L, L + d) for L in layout.moe_layers if L + d in moe] for d in lookaheads}


def random_routers(layout: MoELayout, hidden: int, seed: int, device: torch.device, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """One seeded Gaussian [E, H] matrix per MoE layer (the chance control)."""
    g = torch.Generator().manual_seed(seed)
    return {t: torch.randn(layout.num_experts, hidden, generator=g).to(device=device, dtype=dtype) for t in layout.moe_layers}


@torch.no_grad()
def measure(model: torch.nn.Module, layout: MoELayout, token_lists: list[list[int]], lookaheads: list[int], seed: int = 0,
            budget_s: float = 0.0) -> dict[str, Any]:
    """Score every predictor at every (L, L+d) pair over the teacher-forced requests (rows 1.. of each).

    With ``budget_s`` > 0 no request starts after that many seconds (a capped GPU step still writes its
    JSON); ``requests_measured`` says how many ran.
    """
    k, e = layout.top_k, layout.num_experts
    if 2 * k > e:
        raise PregateError(f"top-2k ({2 * k}) needs at least that many experts, the model has {e}")
    device = next(model.parameters()).device
    layer_pairs = pairs(layout, lookaheads)
    tallies = {d: {pair: {p: RecallTally() for p in PREDICTORS} for pair in ps} for d, ps in layer_pairs.items()}
    self_tally = {t: RecallTally() for t in layout.moe_layers}
    rand = random_routers(layout, int(model.config.hidden_size), seed, device, next(model.parameters()).dtype)
    norms = {t: decoder_layer(model, layout, t).post_attention_layernorm for t in layout.moe_layers}
    per_request: list[dict[int, tuple[np.ndarray, np.ndarray]]] = []  # actual routing, rows 1.., for the static baseline
    start, measured = time.perf_counter(), 0
    for ids in token_lists:
        if budget_s > 0 and time.perf_counter() - start > budget_s:
            break
        measured += 1
        if len(ids) < 2:
            continue
        with captured(model, layout) as store:
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
        actual = {t: actual_routing(store["logits"][t], store["ids"].get(t), k) for t in layout.moe_layers}
        rows = {t: (a[0][1:], a[1][1:]) for t, a in actual.items()}
        per_request.append(rows)
        for t in layout.moe_layers:
            self_tally[t].add(ranked(F.linear(store["moe_in"][t], gate_weight(moe_block(model, layout, t))), k)[1:], *rows[t])
        for d, ps in layer_pairs.items():
            for L, t in ps:
                w_t = gate_weight(moe_block(model, layout, t))
                normed = norms[t](store["resid"][L])
                preds = {
                    "moe_input": ranked(F.linear(store["moe_in"][L], w_t), k)[1:],
                    "residual_normed": ranked(F.linear(normed, w_t), k)[1:],
                    "random_router": ranked(F.linear(normed, rand[t]), k)[1:],
                    "previous_token": previous_token(ranked(store["logits"][t], k)),
                }
                for name, pred in preds.items():
                    tallies[d][(L, t)][name].add(pred, *rows[t])
    if not per_request:
        raise PregateError("no request has two tokens or more: nothing to score")
    totals = {t: sum(expert_counts(r[t][0], e) for r in per_request) for t in layout.moe_layers}
    for r in per_request:
        for d, ps in layer_pairs.items():
            for L, t in ps:
                own = expert_counts(r[t][0], e)
                tallies[d][(L, t)]["static_frequency"].add(static_ranked(totals[t], own, r[t][0].shape[0], 2 * k), *r[t])
    return report(tallies, self_tally, layout) | {"requests_measured": measured, "stopped_by_budget": measured < len(token_lists)}


def report(tallies: dict[int, dict[tuple[int, int], dict[str, RecallTally]]], self_tally: dict[int, RecallTally], layout: MoELayout) -> dict[str, Any]:
    """The JSON body: per layer pair and averaged over layers, per lookahead; the hooks' self-check."""
    out: dict[str, Any] = {"lookahead": {}}
    for d, by_pair in tallies.items():
        per_layer = [{"from_layer": L, "target_layer": t, "methods": {p: tl.summary() for p, tl in tallies_.items()}}
                     for (L, t), tallies_ in by_pair.items()]
        mean = {p: mean_over_layers([row["methods"][p] for row in per_layer]) for p in PREDICTORS}
        out["lookahead"][str(d)] = {"per_layer": per_layer, "mean": mean}
    checks = [{"layer": t, **tl.summary()} for t, tl in self_tally.items()]
    out["self_check"] = {"what": "each layer's router on its own captured MoE input vs the ids its gate module returned",
                         "per_layer": checks, "mean": mean_over_layers(checks)}
    out["rows_scored"] = next(iter(self_tally.values())).rows if self_tally else 0
    k, e = layout.top_k, layout.num_experts
    out["chance"] = {"recall_k": k / e, "recall_2k": 2 * k / e}
    return out


def request_tokens(tok: Any, samples: list[Any], text: str, max_tokens: int) -> list[list[int]]:
    """Token ids per request: ``prompt`` = the user turn as ``record-traces`` feeds it (chat template,
    generation prompt, last ``max_tokens``); ``conversation`` = the whole rendered chat, answers
    included, as ``observe`` tokenizes it (first ``max_tokens``)."""
    if text == "prompt":
        return [_prompt_ids(tok, s.prompt, max_tokens) for s in samples]
    return [list(tok(s.text, add_special_tokens=False, truncation=True, max_length=max_tokens)["input_ids"]) for s in samples]


def run(model_dir: Path, corpus: list[Path], per_file: list[int] | None, max_requests: int | None, lookaheads: list[int],
        text: str = "conversation", max_tokens: int = 256, device: str = "cpu", dtype: str = "auto", dense_moe: bool = False, seed: int = 0,
        budget_s: float = 0.0) -> dict[str, Any]:
    """Load the model, pick the requests, measure; the whole result JSON."""
    if not model_dir.is_dir():
        raise PregateError(f"model directory not found: {model_dir}")
    layout = layout_for(read_config(model_dir))  # UnsupportedModelError for a model that is not MoE
    if layout.num_moe_layers < 2:
        raise PregateError(f"{model_dir}: {layout.num_moe_layers} MoE layer(s); a lookahead needs two or more")
    bad = [d for d in lookaheads if not 1 <= d < layout.num_moe_layers]
    if bad:
        raise PregateError(f"--lookahead {bad}: each must lie in 1..{layout.num_moe_layers - 1} (this model has {layout.num_moe_layers} MoE layers)")
    t0 = time.perf_counter()
    model, tok = load_model(model_dir, device)
    if dtype != "auto":
        model = model.to(DTYPES[dtype])
    if dense_moe:
        from reap_swap.models.train.moe_dense import patch_dense_moe

        patch_dense_moe(model)
    check_model(model, layout)
    render = lambda msgs: str(tok.apply_chat_template(msgs, tokenize=False))  # noqa: E731 - as record-traces renders
    samples = workload(corpus, render, per_file, max_requests)
    if not samples:
        raise PregateError(f"no requests in {[str(p) for p in corpus]}")
    tokens = request_tokens(tok, samples, text, max_tokens)
    t1 = time.perf_counter()
    body = measure(model, layout, tokens, sorted(set(lookaheads)), seed, budget_s)
    return {
        "what": "pre-gating accuracy: layer L+d's router on hidden states available at layer L, vs L+d's actual top-k",
        "model": {"path": str(model_dir), "model_type": layout.model_type, "moe_layers": list(layout.moe_layers),
                  "num_experts": layout.num_experts, "top_k": layout.top_k},
        "run": {"device": device, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "dense_moe": dense_moe, "seed": seed, "budget_s": budget_s,
                "load_s": round(t1 - t0, 2), "measure_s": round(time.perf_counter() - t1, 2),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
        "workload": {"corpus": [str(p) for p in corpus], "per_file": per_file, "max_requests": max_requests, "text": text, "max_tokens": max_tokens,
                     "requests": [request_meta(s, len(t), 0) | {"id": s.sample_id} for s, t in zip(samples, tokens)],
                     "tokens": int(sum(len(t) for t in tokens))},
        "rows": "each request's tokens from the second on (previous_token needs one before); every method scores the same rows",
        "metrics": {"recall_k": "|predicted top-k ∩ actual top-k| / k", "recall_2k": "|predicted top-2k ∩ actual top-k| / k",
                    "mass_k": "share of the actual top-k gate weight on experts in the predicted top-k", "mass_2k": "the same for the predicted top-2k"},
        "methods": METHODS,
        **body,
    }


def table(result: dict[str, Any]) -> str:
    """Mean over layers per lookahead and method, the self-check and chance level."""
    lines = [f"{'lookahead':>9}  {'method':<17} {'recall@k':>8} {'recall@2k':>9} {'mass@k':>7} {'mass@2k':>8}"]
    for d, block in result["lookahead"].items():
        for name, s in block["mean"].items():
            lines.append(f"{d:>9}  {name:<17} {s['recall_k']:8.3f} {s['recall_2k']:9.3f} {s['mass_k']:7.3f} {s['mass_2k']:8.3f}")
    s = result["self_check"]["mean"]
    lines.append(f"{'0':>9}  {'self_check':<17} {s['recall_k']:8.3f} {s['recall_2k']:9.3f} {s['mass_k']:7.3f} {s['mass_2k']:8.3f}")
    c = result["chance"]
    lines.append(f"chance: recall@k {c['recall_k']:.3f}, recall@2k {c['recall_2k']:.3f}; {result['rows_scored']} rows per layer, "
                 f"{result['requests_measured']} of {len(result['workload']['requests'])} requests"
                 + (" (stopped by --budget-s)" if result["stopped_by_budget"] else ""))
    return "\n".join(lines)


def default_out(model_dir: Path) -> Path:
    return Path(__file__).resolve().parent / "results" / f"pregate_accuracy_{model_dir.name}.json"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap pregate-accuracy", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="HF Qwen3-MoE checkpoint directory")
    p.add_argument("--corpus", type=Path, nargs="+", help="held-out JSONL files (default: example/realistic/test.jsonl and example/corpus/test.jsonl)")
    p.add_argument("--per-file", type=int, nargs="+", default=[28, 12],
                   help="N requests of each corpus file (or one N per file), domains and chat shapes in turn, as record-traces takes them; 0: file order with --max-requests")
    p.add_argument("--max-requests", type=int, help="with --per-file 0: the first N requests")
    p.add_argument("--lookahead", type=int, nargs="+", default=[1, 2], help="layer distances d to predict (each 1 .. MoE layers - 1)")
    p.add_argument("--text", choices=("conversation", "prompt"), default="conversation",
                   help="conversation: the whole rendered chat (answers included, teacher-forced); prompt: the user turn as record-traces feeds it")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per request (conversation: the first N; prompt: the last N)")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: the checkpoint's (float16 becomes float32 on CPU)")
    p.add_argument("--dense-moe", action="store_true", help="run every expert as two GEMMs (same outputs; fast on a GPU, Qwen3-MoE only)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random-router control")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no request after this many seconds of measuring (0: no limit); the JSON says how many ran")
    p.add_argument("--out", type=Path, help="result JSON (default: benchmarks/results/pregate_accuracy_<model dir name>.json)")
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2")
    per_file = None if args.per_file == [0] else args.per_file
    corpus = args.corpus or [example_dir() / "realistic" / "test.jsonl", example_dir() / "corpus" / "test.jsonl"]
    try:
        result = run(args.model, corpus, per_file, args.max_requests, args.lookahead, args.text, args.max_tokens, args.device, args.dtype, args.dense_moe, args.seed, args.budget_s)
    except (CorpusError, FileNotFoundError, ValueError) as exc:  # PregateError, UnsupportedModelError, bad --per-file counts
        print(f"reap-swap pregate-accuracy: error: {exc}", file=sys.stderr)
        return 2
    out = args.out or default_out(args.model)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, allow_nan=True) + "\n")
    print(table(result))
    print(f"wrote {out}")
    return 0
