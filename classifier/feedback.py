"""Online correction of predictions from the routing of finished requests.

A scorer trained on some sources is biased on new ones (other code bases,
other phrasing). After a request ends the proxy can read what it really routed
(``GET /router_misses/{id}``: per layer, the gate mass on every expert). The
memory keeps, for the last ``size`` requests, their feature row and the
residual (observed share - predicted share); a new prompt's prediction is
corrected by the residuals of its ``k`` most similar remembered prompts
(cosine, weights ``similarity ** power``), times ``beta``. Similar prompts from
a new source share its bias, so the correction learns the source online;
unrelated prompts get (almost) no weight. ``beta = 0`` turns it off.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.sparse import csr_matrix, vstack


@dataclass(frozen=True)
class FeedbackParams:
    k: int = 5
    beta: float = 0.0
    power: float = 4.0
    size: int = 512

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def unit_rows(x: Any) -> csr_matrix:
    """Rows scaled to unit L2 norm (zero rows stay zero)."""
    x = csr_matrix(x, dtype=np.float64)
    norms = np.sqrt(np.asarray(x.multiply(x).sum(axis=1)).ravel())
    inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    return csr_matrix(x.multiply(inv[:, None]))


class FeedbackMemory:
    """Bounded memory of (normalized features, residual [L, E]) of finished requests; thread-safe."""

    def __init__(self, params: FeedbackParams):
        self.params = params
        self._rows: deque[csr_matrix] = deque(maxlen=params.size)
        self._residuals: deque[np.ndarray] = deque(maxlen=params.size)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, features: Any, residual: np.ndarray) -> None:
        if self.params.beta <= 0:
            return
        with self._lock:
            self._rows.append(unit_rows(features))
            self._residuals.append(np.asarray(residual, dtype=np.float64))

    def correction(self, features: Any) -> np.ndarray | None:
        """beta x the similarity-weighted mean residual of the nearest remembered requests, or None."""
        if self.params.beta <= 0:
            return None
        with self._lock:
            if not self._rows:
                return None
            mem = vstack(list(self._rows)).tocsr()
            res = np.stack(list(self._residuals))
        sims = np.asarray((mem @ unit_rows(features).T).todense()).ravel()
        top = np.argsort(-sims, kind="stable")[: self.params.k]
        w = np.clip(sims[top], 0.0, None) ** self.params.power
        if w.sum() <= 0:
            return None
        return self.params.beta * np.tensordot(w, res[top], axes=1) / w.sum()

    def clear(self) -> None:
        with self._lock:
            self._rows.clear()
            self._residuals.clear()


def online_predictions(features: Any, raw: np.ndarray, observed: np.ndarray, order: np.ndarray, params: FeedbackParams) -> np.ndarray:
    """Corrected predictions [N, L, E] when the requests arrive in ``order`` and each reports its routing after.

    ``raw`` and ``observed`` are [N, L, E]; the memory starts empty.
    """
    memory = FeedbackMemory(params)
    out = np.array(raw, dtype=np.float64)
    x = csr_matrix(features)
    for s in order:
        corr = memory.correction(x[s])
        if corr is not None:
            out[s] = raw[s] + corr
        memory.add(x[s], observed[s] - raw[s])
    return out
