"""Per-layer slot counts chosen by cross-validated coverage (pure numpy).

A split that maximises coverage of the samples it was computed on can lose to
the plain even split on new samples: a flat layer's top experts change from
sample to sample, so the marginal-gain rule (which trusts the training mass)
starves it. Each rule is therefore judged by K-fold cross-validation: fit on
K-1 folds (counts and expert ranking), measure the static top-k coverage of the
held-out fold. Rules:

* ``even``: ``T // L`` slots per layer, remainder where one more expert gains most;
* ``marginal_gain``: greedy marginal gain on the training mean shares;
* ``cv_dp``: the split that maximises *inner* cross-validated coverage curves,
  found exactly by dynamic programming over layers.

The chosen rule is the best by CV, except that a rule must beat ``even`` by
more than three standard errors of the paired per-sample difference (each
sample's held-out coverage under the rule minus under ``even``), else ``even``
is kept: the planner never trades the robust split for a gain it cannot show.
Three, not two: samples of one source or template are not independent, so the
i.i.d. standard error is optimistic (on the template corpus and the random
tiny model a 2.2-SE CV gain of marginal-gain turned into a 0.13-point held-out
loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .budget import allocate_slots
from .coverage import even_counts, topk_coverage

RULES = ("even", "marginal_gain", "cv_dp")


def kfold(n: int, k: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Deterministic K folds over ``n`` samples: (train, validation) index pairs."""
    k = max(2, min(k, n))
    perm = np.random.default_rng(seed).permutation(n)
    parts = np.array_split(perm, k)
    return [(np.sort(np.concatenate(parts[:i] + parts[i + 1 :])), np.sort(parts[i])) for i in range(k)]


def cv_curves(share: np.ndarray, folds: int, seed: int = 1) -> np.ndarray:
    """[L, E+1]: mean held-out coverage of each layer's top-k experts (ranked on the other folds), k = 0..E."""
    n, num_layers, num_experts = share.shape
    curve = np.zeros((num_layers, num_experts + 1))
    splits = kfold(n, folds, seed)
    for tr, va in splits:
        mean = share[tr].mean(axis=0)
        order = np.lexsort((np.broadcast_to(np.arange(num_experts), mean.shape), -mean), axis=-1)
        ranked = np.take_along_axis(share[va], order[None], axis=2)  # [v, L, E] in training order
        curve[:, 1:] += np.cumsum(ranked, axis=2).mean(axis=0)
    return curve / len(splits)


def dp_split(curve: np.ndarray, total: int, minimum: int = 1) -> np.ndarray:
    """[L] counts in [minimum, E] summing to ``total`` that maximise sum_l curve[l, k_l] (exact)."""
    num_layers, width = curve.shape
    num_experts = width - 1
    neg = -np.inf
    best = np.full((num_layers + 1, total + 1), neg)
    take = np.zeros((num_layers + 1, total + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for li in range(num_layers):
        for used in range(total + 1):
            if best[li, used] == neg:
                continue
            for k in range(minimum, min(num_experts, total - used) + 1):
                v = best[li, used] + curve[li, k]
                if v > best[li + 1, used + k] + 1e-15:
                    best[li + 1, used + k] = v
                    take[li + 1, used + k] = k
    if best[num_layers, total] == neg:
        raise ValueError(f"cannot place {total} slots in {num_layers} layers of {num_experts} experts")
    counts = np.zeros(num_layers, dtype=np.int64)
    used = total
    for li in range(num_layers, 0, -1):
        counts[li - 1] = take[li, used]
        used -= counts[li - 1]
    return counts


def apply_rule(rule: str, share: np.ndarray, total: int, inner_folds: int) -> np.ndarray:
    """Slot counts the rule gives when fitted on ``share`` [N, L, E]."""
    mean = share.mean(axis=0)
    if rule == "even":
        return even_counts(mean, total)
    if rule == "marginal_gain":
        return allocate_slots(mean, total)
    if rule == "cv_dp":
        return dp_split(cv_curves(share, inner_folds), total)
    raise ValueError(f"unknown allocation rule {rule!r} (one of {RULES})")


@dataclass
class SplitChoice:
    """The chosen per-layer counts, and every rule's train and cross-validated coverage."""

    rule: str
    counts: list[int]
    table: list[dict[str, Any]] = field(default_factory=list)
    folds: int = 5

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "counts": self.counts, "folds": self.folds, "candidates": self.table,
                "selection": f"best cross-validated static top-k coverage; a rule must beat 'even' by more than {MARGIN_SE:g} "
                             "standard errors of the paired per-sample difference, else 'even' is kept"}


MARGIN_SE = 3.0


def sample_coverage(share: np.ndarray, ranking: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[N] mean over layers of each sample's coverage by the top ``counts`` experts of ``ranking``."""
    out = np.zeros(share.shape[0])
    for li in range(share.shape[1]):
        order = np.lexsort((np.arange(ranking.shape[1]), -ranking[li]))[: int(counts[li])]
        out += share[:, li, order].sum(axis=1)
    return out / share.shape[1]


def cv_score(fit: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]], share: np.ndarray, folds: int) -> np.ndarray:
    """[N] each sample's held-out coverage (fitted on the folds without it) of a (counts, ranking) rule."""
    out = np.zeros(share.shape[0])
    for tr, va in kfold(share.shape[0], folds, seed=0):
        counts, ranking = fit(share[tr])
        out[va] = sample_coverage(share[va], ranking, counts)
    return out


def choose_split(share: np.ndarray, total: int, folds: int = 5, rules: tuple[str, ...] = RULES) -> SplitChoice:
    """Pick the per-layer split of ``total`` slots by cross-validated coverage of ``share`` [N, L, E]."""
    if share.shape[0] < 4:
        counts = apply_rule("even", share, total, folds)
        return SplitChoice("even", counts.tolist(), [{"rule": "even", "note": "fewer than 4 samples: no cross-validation"}], folds)
    per_sample: dict[str, np.ndarray] = {}
    table = []
    for rule in rules:
        per_sample[rule] = cv_score(lambda s, r=rule: (apply_rule(r, s, total, folds), s.mean(axis=0)), share, folds)
        counts = apply_rule(rule, share, total, folds)
        train = float(topk_coverage(share, share.mean(axis=0), counts).mean())
        table.append({"rule": rule, "counts": counts.tolist(), "train_coverage": train, "cv_coverage": float(per_sample[rule].mean())})
    base = per_sample["even"]
    for row in table:
        diff = per_sample[row["rule"]] - base
        row["cv_gain_vs_even"] = float(diff.mean())
        row["cv_gain_se"] = float(diff.std(ddof=1) / np.sqrt(len(diff)))
    eligible = [r for r in table if r["rule"] == "even" or r["cv_gain_vs_even"] > max(MARGIN_SE * r["cv_gain_se"], 1e-9)]
    best = max(eligible, key=lambda r: (r["cv_coverage"], r["rule"] == "even"))
    return SplitChoice(best["rule"], best["counts"], table, folds)
