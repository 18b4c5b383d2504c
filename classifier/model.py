"""A trained classifier: embedder + slice scorer + the plan it was trained for.

Saved as ``classifier.json`` (metadata, plan sha256, embedder id, training
data hash, per-expert priors) and ``scorer.skops`` (the scikit-learn
estimator, loaded with an explicit allow-list of types: no arbitrary pickle).
Loading against another plan or embedder is refused.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reap_swap.plan import Plan
from reap_swap.selection import select_active_set

from .dataset import SliceLayout
from .embedder import Embedder
from .features import FeatureBuilder, FeatureSpec, tokenizer_sha256
from .scorer import SliceScorer

FORMAT_VERSION = 1
TRUSTED_TYPES = [
    "reap_swap.classifier.scorer.SliceScorer",
    "sklearn.linear_model._ridge.Ridge",
    "sklearn.neighbors._regression.KNeighborsRegressor",
    "sklearn.neural_network._multilayer_perceptron.MLPRegressor",
    "sklearn.neighbors._kd_tree.KDTree",
    "sklearn.neighbors._ball_tree.BallTree",
    "sklearn.neural_network._stochastic_optimizers.AdamOptimizer",
    "sklearn.neural_network._stochastic_optimizers.SGDOptimizer",
    "numpy.random._mt19937.MT19937",
    "numpy.random.mtrand.RandomState",
    "builtins.slice",
    "scipy.sparse._csr.csr_matrix",  # kNN keeps its (sparse) training features
    "sklearn.utils._bunch.Bunch",
]


class ClassifierError(ValueError):
    pass


@dataclass
class Selection:
    """What the classifier chose for one prompt."""

    active: dict[int, list[int]]
    slices: dict[int, list[str]]
    scores: dict[int, list[float]]
    embed_ms: float
    predict_ms: float
    timings: dict[str, float] = field(default_factory=dict)


class SliceClassifier:
    def __init__(self, plan: Plan, scorer: SliceScorer, features: FeatureBuilder, expert_prior: np.ndarray, meta: dict[str, Any]):
        self.plan = plan
        self.scorer = scorer
        self.features = features
        self.layout = SliceLayout.of(plan)
        self.expert_prior = expert_prior  # [L, E] mean training share: orders experts of partly fitting slices
        self.meta = meta

    def score_texts(self, texts: list[str]) -> np.ndarray:
        if not texts or any(not isinstance(t, str) for t in texts):
            raise ClassifierError("need a non-empty list of strings")
        return self.scorer.predict(self.features.transform(texts)).reshape(len(texts), -1)

    def select(self, text: str) -> Selection:
        if not isinstance(text, str) or not text.strip():
            raise ClassifierError("cannot classify an empty prompt")
        t0 = time.perf_counter()
        x = self.features.transform([text])
        t1 = time.perf_counter()
        row = self.scorer.predict(x).reshape(1, -1)[0]
        scores = self.layout.split(row)
        prior = {layer: self.expert_prior[i] for i, layer in enumerate(self.layout.layer_ids)}
        active, slices = select_active_set(self.plan, scores, prior)
        t2 = time.perf_counter()
        return Selection(active, slices, {k: [float(x) for x in v] for k, v in scores.items()}, (t1 - t0) * 1e3, (t2 - t1) * 1e3)

    def save(self, out: Path) -> None:
        import skops.io as sio

        out.mkdir(parents=True, exist_ok=True)
        sio.dump(self.scorer, out / "scorer.skops")
        np.save(out / "expert_prior.npy", self.expert_prior)
        tok = out / "tokenizer.json"
        if self.features.tokenizer_json.resolve() != tok.resolve():
            tok.write_bytes(self.features.tokenizer_json.read_bytes())
        meta = dict(self.meta, format_version=FORMAT_VERSION, plan_sha256=self.plan.sha256, embedder_id=self.features.embedder.id,
                    embedder_dtype=self.features.embedder.dtype,
                    tokenizer_sha256=tokenizer_sha256(tok), features=self.features.spec.__dict__,
                    slice_counts=list(self.layout.counts), layer_ids=list(self.layout.layer_ids))
        (out / "classifier.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path, plan: Plan, embedder: Embedder | None = None) -> "SliceClassifier":
        import skops.io as sio

        meta_path = path / "classifier.json"
        if not meta_path.is_file():
            raise ClassifierError(f"{path}: no classifier.json (train one with reap-swap train)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ClassifierError(f"{path}: unsupported classifier format {meta.get('format_version')!r}")
        if meta["plan_sha256"] != plan.sha256:
            raise ClassifierError(
                f"{path} was trained for plan {meta['plan_sha256'][:16]}, not {plan.sha256[:16]} ({plan.source}); retrain it for this plan"
            )
        embedder = embedder or Embedder(meta.get("embedder_path") or None, dtype=meta.get("embedder_dtype", "auto"))
        if meta["embedder_id"] != embedder.id:
            raise ClassifierError(f"{path} was trained with embedder {meta['embedder_id']}, not {embedder.id}")
        tok = path / "tokenizer.json"
        if not tok.is_file() or tokenizer_sha256(tok) != meta["tokenizer_sha256"]:
            raise ClassifierError(f"{path}/tokenizer.json is missing or not the one the classifier was trained with")
        untrusted = [t for t in sio.get_untrusted_types(file=path / "scorer.skops") if t not in TRUSTED_TYPES]
        if untrusted:
            raise ClassifierError(f"{path}/scorer.skops contains types outside the allow-list: {untrusted}")
        scorer = sio.load(path / "scorer.skops", trusted=[t for t in TRUSTED_TYPES])
        if not isinstance(scorer, SliceScorer):
            raise ClassifierError(f"{path}/scorer.skops does not hold a SliceScorer")
        layout = SliceLayout.of(plan)
        if list(layout.counts) != meta["slice_counts"] or getattr(scorer, "n_outputs_", None) != layout.width:
            raise ClassifierError(f"{path}: slice layout does not match the plan")
        prior = np.load(path / "expert_prior.npy", allow_pickle=False)
        return cls(plan, scorer, FeatureBuilder(embedder, tok, FeatureSpec(**meta["features"])), prior, meta)
