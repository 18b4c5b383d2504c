"""The expert scorer: a scikit-learn estimator from prompt features to per-expert mass.

Targets are, per sample, the share of each layer's gate mass that fell on
each of that layer's experts (one output per expert, layers concatenated), so
selection can fill a layer's slots expert by expert. ``output_groups`` gives
the number of outputs per layer; ``predict_proba`` turns predicted shares into
a distribution within each layer. The model behind it (``method``) is picked
by measured coverage in ``train.py``. Nothing here is specific to experts: it
is a multi-output regressor of grouped shares.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, RegressorMixin
from sklearn.neighbors import KNeighborsRegressor
from sklearn.neural_network import MLPRegressor
from sklearn.utils.validation import check_is_fitted, validate_data

METHODS = ("ridge", "knn", "mlp")


def ridge_solve(X: Any, Y: np.ndarray, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """Exact ridge with an unpenalized intercept: (coef [d, k], intercept [k]).

    With fewer samples than features (sparse token bags) it solves the centred
    n x n kernel system, which is much faster than sklearn's iterative sparse
    solvers for many outputs; otherwise the d x d normal equations.
    """
    n, d = X.shape
    x_mean = np.asarray(X.mean(axis=0), dtype=np.float64).ravel()
    y_mean = Y.mean(axis=0)
    Yc = Y - y_mean
    if n <= d:
        K = X @ X.T
        K = np.asarray(K.toarray() if hasattr(K, "toarray") else K, dtype=np.float64)
        row = K.mean(axis=0)
        Kc = K - row[None, :] - row[:, None] + K.mean()
        A = np.linalg.solve(Kc + alpha * np.eye(n), Yc)
        coef = np.asarray(X.T @ A) - np.outer(x_mean, A.sum(axis=0))
    else:
        Xd = X.toarray() if hasattr(X, "toarray") else np.asarray(X, dtype=np.float64)
        Xc = Xd - x_mean
        coef = np.linalg.solve(Xc.T @ Xc + alpha * np.eye(d), Xc.T @ Yc)
    return coef, y_mean - x_mean @ coef


class ExpertScorer(RegressorMixin, BaseEstimator):
    """Multi-output regressor of per-expert gate-mass shares.

    Parameters
    ----------
    method : {"ridge", "knn", "mlp"}
        Ridge regression (exact, kernel form when features outnumber samples),
        cosine kNN (distance-weighted), or a one-layer MLP.
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
        if self.method == "knn":
            return KNeighborsRegressor(n_neighbors=max(1, min(self.n_neighbors, n_samples)), weights="distance", metric="cosine", algorithm="brute")
        if self.method == "mlp":
            return MLPRegressor(hidden_layer_sizes=(self.hidden_units,), alpha=self.alpha, max_iter=self.max_iter,
                                random_state=self.random_state, early_stopping=False)
        raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")

    def fit(self, X: Any, y: Any) -> "ExpertScorer":
        X, y = validate_data(self, X, y, multi_output=True, y_numeric=True, accept_sparse="csr")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        self.n_outputs_ = 1 if y.ndim == 1 else y.shape[1]
        if self.output_groups is not None and sum(self.output_groups) != self.n_outputs_:
            raise ValueError(f"output_groups sum to {sum(self.output_groups)} but y has {self.n_outputs_} outputs")
        if self.method == "ridge":
            coef, intercept = ridge_solve(X, np.asarray(y, dtype=np.float64).reshape(X.shape[0], -1), self.alpha)
            self.coef_ = coef[:, 0] if y.ndim == 1 else coef
            self.intercept_ = intercept[0] if y.ndim == 1 else intercept
            self.n_iter_ = 1
            return self
        self.estimator_ = self._make(X.shape[0]).fit(X, y)
        n_iter = getattr(self.estimator_, "n_iter_", None)
        self.n_iter_ = int(np.max(n_iter)) if n_iter is not None else 1
        return self

    def predict(self, X: Any) -> np.ndarray:
        check_is_fitted(self)
        X = validate_data(self, X, reset=False, accept_sparse="csr")
        if self.method == "ridge":
            return np.asarray(X @ self.coef_) + self.intercept_
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
