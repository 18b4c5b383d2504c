"""The slice scorer: a scikit-learn estimator from prompt features to slice scores.

Targets are, per sample, the share of each layer's gate mass that fell on
each of that layer's slices (one output per slice, layers concatenated).
``output_groups`` gives the number of outputs per layer; ``predict_proba``
turns predicted shares into a distribution within each layer. The model
behind it (``method``) is picked by measured coverage in ``train.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.linear_model import Ridge
from sklearn.neighbors import KNeighborsRegressor
from sklearn.neural_network import MLPRegressor
from sklearn.utils.validation import check_is_fitted, validate_data

METHODS = ("ridge", "knn", "mlp")


class SliceScorer(RegressorMixin, BaseEstimator):
    """Multi-output regressor of per-slice gate-mass shares.

    Parameters
    ----------
    method : {"ridge", "knn", "mlp"}
        Ridge regression, cosine kNN (distance-weighted), or a one-layer MLP.
    alpha : float
        Ridge / MLP L2 penalty.
    n_neighbors : int
        Neighbours for ``knn`` (capped at the number of training samples).
    hidden_units : int
        Width of the MLP's hidden layer.
    max_iter : int
        MLP training epochs.
    output_groups : tuple of int or None
        Outputs per layer, for ``predict_proba``; None = one group.
    random_state : int
        Seed of the MLP.
    """

    def __init__(
        self,
        method: str = "ridge",
        alpha: float = 1.0,
        n_neighbors: int = 10,
        hidden_units: int = 256,
        max_iter: int = 300,
        output_groups: tuple[int, ...] | None = None,
        random_state: int = 0,
    ):
        self.method = method
        self.alpha = alpha
        self.n_neighbors = n_neighbors
        self.hidden_units = hidden_units
        self.max_iter = max_iter
        self.output_groups = output_groups
        self.random_state = random_state

    def __sklearn_tags__(self) -> Any:
        tags = super().__sklearn_tags__()
        tags.input_tags.sparse = True
        tags.target_tags.multi_output = True
        tags.target_tags.single_output = True
        return tags

    def _make(self, n_samples: int) -> Any:
        if self.method == "ridge":
            return Ridge(alpha=self.alpha)
        if self.method == "knn":
            return KNeighborsRegressor(n_neighbors=max(1, min(self.n_neighbors, n_samples)), weights="distance", metric="cosine", algorithm="brute")
        if self.method == "mlp":
            return MLPRegressor(hidden_layer_sizes=(self.hidden_units,), alpha=self.alpha, max_iter=self.max_iter,
                                random_state=self.random_state, early_stopping=False)
        raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")

    def fit(self, X: Any, y: Any) -> "SliceScorer":
        X, y = validate_data(self, X, y, multi_output=True, y_numeric=True, accept_sparse="csr")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        self.n_outputs_ = 1 if y.ndim == 1 else y.shape[1]
        if self.output_groups is not None and sum(self.output_groups) != self.n_outputs_:
            raise ValueError(f"output_groups sum to {sum(self.output_groups)} but y has {self.n_outputs_} outputs")
        self.estimator_ = self._make(X.shape[0]).fit(X, y)
        n_iter = getattr(self.estimator_, "n_iter_", None)
        self.n_iter_ = int(np.max(n_iter)) if n_iter is not None else 1
        return self

    def predict(self, X: Any) -> np.ndarray:
        check_is_fitted(self, "estimator_")
        X = validate_data(self, X, reset=False, accept_sparse="csr")
        return np.asarray(self.estimator_.predict(X))

    def predict_proba(self, X: Any) -> np.ndarray:
        """Predicted shares clipped at 0 and normalized within each output group (layer)."""
        pred = self.predict(X)
        scores = np.clip(pred, 0.0, None).reshape(pred.shape[0], -1)
        groups = self.output_groups or (scores.shape[1],)
        out = np.empty_like(scores, dtype=np.float64)
        start = 0
        for g in groups:
            block = scores[:, start : start + g]
            tot = block.sum(axis=1, keepdims=True)
            out[:, start : start + g] = np.divide(block, tot, out=np.full_like(block, 1.0 / max(g, 1), dtype=np.float64), where=tot > 0)
            start += g
        return out
