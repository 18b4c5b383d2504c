"""Core size chosen by cross-validated coverage of core + predicted experts.

The core is never swapped: a large core moves fewer bytes per request and is
a safe fallback, but it takes slots a per-request prediction could fill
better. Which wins depends on how predictable requests are, so the planner
measures it: a reference predictor (linear kernel ridge on the bag of the
served model's tokens in each prompt, the classifier's cheapest feature) is
cross-validated, and for each candidate core fraction the held-out coverage
of core + its top predicted experts is computed. The largest core within one
standard error of the best is chosen (the one-standard-error rule: prefer the
simpler, more stable plan when the data cannot tell them apart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .allocation import kfold

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
RIDGE_ALPHA = 0.3


def token_bag(texts: Sequence[str], tokenizer_json: Path) -> Any:
    """[n, V] sparse, L2-normalized log counts of the model's tokens (scipy csr)."""
    from scipy.sparse import csr_matrix
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    rows, cols, vals = [], [], []
    for i, enc in enumerate(tok.encode_batch(list(texts), add_special_tokens=False)):
        ids, counts = np.unique(np.asarray(enc.ids, dtype=np.int64), return_counts=True)
        v = np.log1p(counts.astype(np.float64))
        norm = np.linalg.norm(v)
        rows.append(np.full(len(ids), i))
        cols.append(ids)
        vals.append(v / norm if norm > 0 else v)
    if not rows:
        return csr_matrix((len(texts), vocab))
    return csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(texts), vocab))


def kernel_ridge(x_train: Any, y_train: np.ndarray, x_test: Any, alpha: float = RIDGE_ALPHA) -> np.ndarray:
    """Linear-kernel ridge (dual form, centred targets): exact and fast for a few thousand samples."""
    k = (x_train @ x_train.T).toarray()
    mean = y_train.mean(axis=0)
    coef = np.linalg.solve(k + alpha * np.eye(k.shape[0]), y_train - mean)
    return np.asarray((x_test @ x_train.T).toarray() @ coef + mean)


def core_coverage(share: np.ndarray, pred: np.ndarray, ranking: np.ndarray, counts: Sequence[int], n_core: Sequence[int]) -> float:
    """Mean coverage of core (top ``n_core`` by ``ranking``) + top predicted experts, ``counts`` slots per layer."""
    total = 0.0
    n, num_layers, num_experts = share.shape
    for li in range(num_layers):
        core = np.lexsort((np.arange(num_experts), -ranking[li]))[: int(n_core[li])]
        p = pred[:, li].copy()
        p[:, core] = np.inf
        pick = np.argsort(-p, axis=1, kind="stable")[:, : int(counts[li])]
        total += np.take_along_axis(share[:, li], pick, axis=1).sum(axis=1).mean()
    return total / num_layers


def core_counts(fraction: float, counts: Sequence[int]) -> list[int]:
    """Core experts per layer for a fraction of its slots (at least one slot stays specialist when possible)."""
    return [min(c, int(round(fraction * c))) for c in counts]


@dataclass
class CoreChoice:
    fraction: float
    table: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "candidates": self.table, "note": self.note,
                "selection": "largest core fraction whose cross-validated coverage (core + reference-predicted experts) "
                             "is within one standard error of the best"}


def choose_core(share: np.ndarray, prompts: Sequence[str], tokenizer_json: Path | None, counts: Sequence[int],
                folds: int = 5, fractions: Sequence[float] = FRACTIONS, fallback: float = 0.5) -> CoreChoice:
    """Cross-validate each core fraction with the reference predictor; ``fallback`` when it cannot run."""
    if tokenizer_json is None or not tokenizer_json.is_file():
        return CoreChoice(fallback, [], f"no tokenizer.json next to the model: core fraction fixed at {fallback}")
    if share.shape[0] < 10 or not any(p.strip() for p in prompts):
        return CoreChoice(fallback, [], f"fewer than 10 samples with prompts: core fraction fixed at {fallback}")
    try:
        x = token_bag(prompts, tokenizer_json)
    except ImportError:
        return CoreChoice(fallback, [], f"scipy is not installed (classifier extra): core fraction fixed at {fallback}")
    n, num_layers, num_experts = share.shape
    y = share.reshape(n, -1)
    per_fold: dict[float, list[float]] = {f: [] for f in fractions}
    for tr, va in kfold(n, folds, seed=0):
        pred = kernel_ridge(x[tr], y[tr], x[va]).reshape(len(va), num_layers, num_experts)
        ranking = share[tr].mean(axis=0)
        for f in fractions:
            per_fold[f].append(core_coverage(share[va], pred, ranking, counts, core_counts(f, counts)))
    table = []
    for f in fractions:
        v = np.array(per_fold[f])
        table.append({"fraction": f, "core_per_layer": core_counts(f, counts), "cv_coverage": float(v.mean()),
                      "cv_se": float(v.std(ddof=1) / np.sqrt(len(v)))})
    best = max(table, key=lambda r: r["cv_coverage"])
    diffs = {r["fraction"]: np.array(per_fold[best["fraction"]]) - np.array(per_fold[r["fraction"]]) for r in table}
    for r in table:
        d = diffs[r["fraction"]]
        r["cv_loss_vs_best"] = float(d.mean())
        r["cv_loss_se"] = float(d.std(ddof=1) / np.sqrt(len(d)))
    ok = [r for r in table if r["cv_loss_vs_best"] <= max(r["cv_loss_se"], 1e-12)]
    chosen = max(ok, key=lambda r: r["fraction"])
    return CoreChoice(float(chosen["fraction"]), table, "fraction 1.0 is the static top-k set (no prediction)")
