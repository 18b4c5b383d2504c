"""How a Qwen3-MoE routes each domain: entropy, concentration, domain x expert usage.

Why: the point of training our own MoE is routing that is *learned* (experts
specialise by domain and token type). This report measures it on per-domain
held-out tokens and contrasts a trained model with a random-init one of the
same config, per layer:

- ``H(mean p)``: entropy (bits) of the domain-averaged router distribution
  (high = load spread over experts);
- ``mean H(p)``: mean per-token router entropy (low = confident routing);
- ``top share``: share of top-k assignments taken by the busiest expert;
- ``MI(domain; expert)``: mutual information (bits) between a token's domain
  and the experts it is routed to (0 = routing ignores domain);
- the domain x expert usage matrix (fractions of top-k slots).

    python routing_report.py --model DIR --data moe_data.npz.xz [--compare DIR | --random] \
        --out report.json [--png heatmap.png]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe_io import load_packed  # noqa: E402


def load_model(path: str | None, like: str | None = None, seed: int = 0) -> torch.nn.Module:
    """A trained model from ``path``, or (path None) a random-init model with ``like``'s config."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    major = int(transformers.__version__.split(".")[0])
    dtype_kw = {"dtype" if major >= 5 else "torch_dtype": torch.float32}
    if path is not None:
        return AutoModelForCausalLM.from_pretrained(path, **dtype_kw).eval()
    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(like)
    return AutoModelForCausalLM.from_config(cfg, **dtype_kw).eval()


def moe_gates(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router module of every sparse MoE block, in layer order (HF 4.x or 5.x)."""
    return [m.gate for m in model.modules() if m.__class__.__name__.endswith("SparseMoeBlock")]


@torch.no_grad()
def routing_stats(model: torch.nn.Module, tokens: dict[str, np.ndarray], seq_len: int, top_k: int) -> dict:
    """Per layer: per-domain mean router probs, mean token entropy and top-k usage counts."""
    gates = moe_gates(model)
    n_exp = int(model.config.num_experts)
    captured: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda m, i, o: captured.append(o[0] if isinstance(o, tuple) else o))
             for g in gates]
    per_dom: dict[str, dict[str, np.ndarray]] = {}
    try:
        for dom, arr in tokens.items():
            n_win = max(1, arr.size // seq_len)
            acc = {"prob_sum": np.zeros((len(gates), n_exp)), "ent_sum": np.zeros(len(gates)),
                   "usage": np.zeros((len(gates), n_exp)), "n": 0}
            for i in range(0, n_win, 32):
                rows = [arr[j * seq_len:(j + 1) * seq_len] for j in range(i, min(n_win, i + 32))]
                rows = [r for r in rows if r.size == seq_len]
                if not rows:
                    continue
                captured.clear()
                model(input_ids=torch.from_numpy(np.stack(rows).astype(np.int64)), use_cache=False)
                for li, logits in enumerate(captured):
                    p = torch.softmax(logits.float().reshape(-1, n_exp), dim=-1)
                    acc["prob_sum"][li] += p.sum(0).numpy()
                    acc["ent_sum"][li] += float(-(p * torch.log2(p.clamp_min(1e-12))).sum(-1).sum())
                    ids = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
                    acc["usage"][li] += np.bincount(ids.numpy(), minlength=n_exp)
                acc["n"] += len(rows) * seq_len
            per_dom[dom] = acc
    finally:
        for h in hooks:
            h.remove()
    return {"n_layers": len(gates), "n_experts": n_exp, "domains": per_dom}


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def summarize(stats: dict) -> dict:
    """Turn raw sums into the report's per-layer metrics and usage matrices."""
    doms = sorted(stats["domains"])
    layers = []
    for li in range(stats["n_layers"]):
        usage = np.stack([stats["domains"][d]["usage"][li] for d in doms])
        usage_frac = usage / usage.sum(1, keepdims=True)
        n_tok = sum(stats["domains"][d]["n"] for d in doms)
        mean_p = sum(stats["domains"][d]["prob_sum"][li] for d in doms) / n_tok
        mean_h = sum(stats["domains"][d]["ent_sum"][li] for d in doms) / n_tok
        overall = usage_frac.mean(0)  # domains weighted equally
        mi = _entropy(overall) - float(np.mean([_entropy(u) for u in usage_frac]))
        layers.append({
            "layer": li,
            "entropy_mean_probs_bits": _entropy(mean_p),
            "mean_token_entropy_bits": mean_h,
            "top_expert_share": float(overall.max()),
            "mi_domain_expert_bits": mi,
            "per_domain": {d: {"entropy_usage_bits": _entropy(usage_frac[k]), "top_expert": int(usage_frac[k].argmax()),
                               "top_expert_share": float(usage_frac[k].max())} for k, d in enumerate(doms)},
            "usage_matrix": usage_frac.round(5).tolist(),
        })
    return {"domains": doms, "n_experts": stats["n_experts"], "max_entropy_bits": math.log2(stats["n_experts"]),
            "tokens_per_domain": {d: stats["domains"][d]["n"] for d in doms}, "layers": layers}


def print_table(reports: dict[str, dict]) -> None:
    names = list(reports)
    first = reports[names[0]]
    print(f"max entropy log2(E) = {first['max_entropy_bits']:.2f} bits; tokens/domain {first['tokens_per_domain']}")
    print(f"{'layer':>5} {'model':>10} {'H(mean p)':>10} {'mean H(p)':>10} {'top share':>10} {'MI(dom;exp)':>12}")
    for li in range(len(first["layers"])):
        for name in names:
            r = reports[name]["layers"][li]
            print(f"{li:>5} {name:>10} {r['entropy_mean_probs_bits']:>10.3f} {r['mean_token_entropy_bits']:>10.3f} "
                  f"{r['top_expert_share']:>10.3f} {r['mi_domain_expert_bits']:>12.4f}")


def heatmap(reports: dict[str, dict], path: Path) -> bool:
    """One row of per-layer domain x expert heatmaps per model (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = list(reports)
    n_layers = len(reports[names[0]]["layers"])
    fig, axes = plt.subplots(len(names), n_layers, figsize=(2.6 * n_layers, 2.4 * len(names) + 0.6), squeeze=False)
    for r, name in enumerate(names):
        rep = reports[name]
        for li in range(n_layers):
            ax = axes[r][li]
            m = np.array(rep["layers"][li]["usage_matrix"])
            ax.imshow(m, aspect="auto", cmap="viridis", vmin=0, vmax=max(0.25, m.max()))
            ax.set_title(f"{name} L{li} MI={rep['layers'][li]['mi_domain_expert_bits']:.2f}", fontsize=7)
            ax.set_yticks(range(len(rep["domains"])))
            ax.set_yticklabels(rep["domains"] if li == 0 else [], fontsize=6)
            ax.set_xticks([])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", type=Path, required=True, help="moe_data.npz.xz with heldout__<domain> arrays")
    ap.add_argument("--compare", default=None, help="second model dir")
    ap.add_argument("--random", action="store_true", help="compare with a random-init model of the same config")
    ap.add_argument("--tokens-per-domain", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("routing_report.json"))
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=12345, help="init seed of the --random model (train_moe uses 0)")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    arrays, meta = load_packed(args.data)
    tokens = {d: arrays[f"heldout__{d}"][: args.tokens_per_domain] for d in meta["domains"]}
    models = {"trained": load_model(args.model)}
    if args.compare:
        models["compare"] = load_model(args.compare)
    if args.random:
        models["random"] = load_model(None, like=args.model, seed=args.seed)
    reports = {}
    for name, model in models.items():
        stats = routing_stats(model, tokens, args.seq_len, int(model.config.num_experts_per_tok))
        reports[name] = summarize(stats)
    print_table(reports)
    args.out.write_text(json.dumps({"models": {"trained": args.model, "compare": args.compare,
                                               "random": bool(args.random)}, "reports": reports}, indent=1) + "\n")
    print(f"wrote {args.out}")
    if args.png and heatmap(reports, args.png):
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
