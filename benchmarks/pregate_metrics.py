"""Recall maths of expert-routing predictions (pure numpy; ``pregate_accuracy`` feeds it).

A prefetch that guesses layer L+d's experts early fetches a ranked list of experts; what matters is
how many of the token's actual top-k it covers (recall) and how much of the token's routing weight
those carry (mass share: a miss on a low-weight expert costs the same bytes but matters less to a
policy that may skip it). Fetching 2k instead of k shows what extra bytes buy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def coverage(pred_ranked: np.ndarray, actual_ids: np.ndarray, actual_w: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Per row: (|top-m of ``pred_ranked`` ∩ actual| / k, share of actual weight on those experts).

    ``pred_ranked`` [T, M >= m] expert ids best first (a row may repeat no id); ``actual_ids`` and
    ``actual_w`` [T, k] the experts a token was routed to and their gate weights.
    """
    if pred_ranked.ndim != 2 or actual_ids.shape != actual_w.shape or pred_ranked.shape[0] != actual_ids.shape[0]:
        raise ValueError(f"shapes: pred {pred_ranked.shape}, ids {actual_ids.shape}, weights {actual_w.shape}")
    if not 0 < m <= pred_ranked.shape[1]:
        raise ValueError(f"m={m} outside 1..{pred_ranked.shape[1]}")
    top = pred_ranked[:, :m]
    hit = (actual_ids[:, :, None] == top[:, None, :]).any(axis=2)  # [T, k]
    k = actual_ids.shape[1]
    w = actual_w.astype(np.float64)
    total = w.sum(axis=1)
    mass = np.where(total > 0, (w * hit).sum(axis=1) / np.where(total > 0, total, 1.0), 0.0)
    return hit.sum(axis=1) / k, mass


@dataclass
class RecallTally:
    """Running sums of one predictor at one target layer: recall and mass share at k and 2k."""

    rows: int = 0
    recall_k: float = 0.0
    recall_2k: float = 0.0
    mass_k: float = 0.0
    mass_2k: float = 0.0

    def add(self, pred_ranked: np.ndarray, actual_ids: np.ndarray, actual_w: np.ndarray) -> None:
        """Score rows; ``pred_ranked`` needs at least 2k columns."""
        k = actual_ids.shape[1]
        r1, m1 = coverage(pred_ranked, actual_ids, actual_w, k)
        r2, m2 = coverage(pred_ranked, actual_ids, actual_w, 2 * k)
        self.rows += int(actual_ids.shape[0])
        self.recall_k += float(r1.sum())
        self.recall_2k += float(r2.sum())
        self.mass_k += float(m1.sum())
        self.mass_2k += float(m2.sum())

    def summary(self) -> dict[str, float]:
        """Means over the rows scored (NaN with none)."""
        n = self.rows or float("nan")
        return {"recall_k": self.recall_k / n, "recall_2k": self.recall_2k / n, "mass_k": self.mass_k / n, "mass_2k": self.mass_2k / n,
                "rows": self.rows}


METRICS = ("recall_k", "recall_2k", "mass_k", "mass_2k")


def mean_over_layers(per_layer: list[dict[str, float]]) -> dict[str, float]:
    """Unweighted mean of each metric over layers (every layer scores the same rows)."""
    if not per_layer:
        return {m: float("nan") for m in METRICS}
    return {m: float(np.mean([s[m] for s in per_layer])) for m in METRICS}


def frequency_ranking(counts: np.ndarray, m: int) -> np.ndarray:
    """The ``m`` most frequent experts, most frequent first (ties: lower id first)."""
    return np.argsort(-counts, kind="stable")[:m]


def expert_counts(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """How often each expert appears in ``ids`` (any shape)."""
    return np.bincount(ids.reshape(-1), minlength=num_experts).astype(np.int64)


def static_ranked(total_counts: np.ndarray, own_counts: np.ndarray, rows: int, m: int) -> np.ndarray:
    """[rows, m] static prediction for one request: top-m by frequency in every *other* request.

    Leave-one-request-out so the static baseline is not scored on the routing it was counted from.
    """
    return np.broadcast_to(frequency_ranking(total_counts - own_counts, m), (rows, m))


def previous_token(ranked: np.ndarray) -> np.ndarray:
    """The ranking of token t-1 as the prediction for token t, for rows 1.. (row 0 has no predecessor)."""
    return ranked[:-1]
