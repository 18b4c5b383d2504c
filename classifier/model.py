"""A trained classifier: features + expert scorer + the plan it was trained for.

Saved as ``classifier.json`` (metadata, plan sha256, embedder id when the
features use one, training data hash, per-expert priors) and ``scorer.skops``
(the scikit-learn estimator, loaded with an explicit allow-list of types: no
arbitrary pickle). Loading against another plan or embedder is refused.

``select`` predicts each layer's per-expert mass for a prompt and fills the
plan's slots with core + the best experts. ``select_within`` bounds the wait:
past the time budget it answers with the prior (core + the training set's
heaviest experts), the set a proxy should install when classification is slow.
``feedback`` takes a finished request's observed routing; later predictions
for similar prompts are corrected by it (``feedback.py``).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor, TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from reap_swap.plan import Plan
from reap_swap.planning.expert_select import select_active_experts, slice_scores

from .dataset import SliceLayout
from .embedder import Embedder
from .feedback import FeedbackMemory, FeedbackParams
from .features import FeatureBuilder, FeatureSpec, tokenizer_sha256
from .routing_table import table_sha256
from .scorer import ExpertScorer

FORMAT_VERSION = 2
TRUSTED_TYPES = [
    "reap_swap.classifier.scorer.ExpertScorer",
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
    """What the classifier chose for one prompt.

    ``active``: per layer, the experts to make resident (core + predicted).
    ``expert_scores``: per layer, the predicted share of each expert.
    ``scores``: per layer, each slice's summed predicted share (for slice-ranking policies).
    ``slices``: per layer, the slices the active set touches.
    ``fallback``: why the prior was used instead of a prediction ("" when predicted).
    """

    active: dict[int, list[int]]
    slices: dict[int, list[str]]
    scores: dict[int, list[float]]
    embed_ms: float
    predict_ms: float
    expert_scores: dict[int, list[float]] = field(default_factory=dict)
    fallback: str = ""
    timings: dict[str, float] = field(default_factory=dict)


class SliceClassifier:
    """Prompt -> per-expert mass -> active set (the name is kept for the proxy's imports)."""

    def __init__(self, plan: Plan, scorer: ExpertScorer, features: FeatureBuilder, expert_prior: np.ndarray, meta: dict[str, Any]):
        self.plan = plan
        self.scorer = scorer
        self.features = features
        self.layout = SliceLayout.of(plan)
        self.num_experts = plan.layers[plan.layer_ids()[0]].num_experts
        self.expert_prior = expert_prior  # [L, E] mean training share: the fallback's scores
        self.meta = meta
        self.memory = FeedbackMemory(FeedbackParams(**meta.get("feedback", {}).get("params", {})))
        self._pool: ThreadPoolExecutor | None = None

    def score_texts(self, texts: list[str]) -> np.ndarray:
        """[n, L, E] predicted per-expert shares (plan layer order)."""
        if not texts or any(not isinstance(t, str) for t in texts):
            raise ClassifierError("need a non-empty list of strings")
        pred = self.scorer.predict(self.features.transform(texts))
        return np.asarray(pred).reshape(len(texts), len(self.layout.layer_ids), self.num_experts)

    def _selection(self, scores: np.ndarray, embed_ms: float, predict_ms: float, fallback: str = "") -> Selection:
        by_layer = {layer: scores[i] for i, layer in enumerate(self.layout.layer_ids)}
        active, touched = select_active_experts(self.plan, by_layer)
        return Selection(active, touched, {l: slice_scores(self.plan.layers[l], s) for l, s in by_layer.items()}, embed_ms, predict_ms,
                         {l: [float(x) for x in s] for l, s in by_layer.items()}, fallback)

    def prior_selection(self, why: str = "prior") -> Selection:
        """Core + the training set's heaviest experts: the answer when there is no usable prediction."""
        return self._selection(self.expert_prior, 0.0, 0.0, why)

    def select(self, text: str) -> Selection:
        if not isinstance(text, str) or not text.strip():
            raise ClassifierError("cannot classify an empty prompt")
        t0 = time.perf_counter()
        x = self.features.transform([text])
        t1 = time.perf_counter()
        row = np.asarray(self.scorer.predict(x)).reshape(len(self.layout.layer_ids), self.num_experts)
        corr = self.memory.correction(x)
        if corr is not None:
            row = row + corr
        t2 = time.perf_counter()
        sel = self._selection(row, (t1 - t0) * 1e3, (t2 - t1) * 1e3)
        sel.timings["select_ms"] = (time.perf_counter() - t2) * 1e3
        return sel

    def feedback(self, text: str, expert_mass: dict[int, Any] | np.ndarray) -> None:
        """Remember what a finished request routed: per layer, gate mass per expert ({layer: [E]} or [L, E])."""
        if not isinstance(text, str) or not text.strip():
            return
        if isinstance(expert_mass, dict):
            missing = [l for l in self.layout.layer_ids if l not in expert_mass]
            if missing:
                raise ClassifierError(f"feedback lacks layers {missing[:4]}")
            mass = np.array([np.asarray(expert_mass[l], dtype=np.float64) for l in self.layout.layer_ids])
        else:
            mass = np.asarray(expert_mass, dtype=np.float64)
        if mass.shape != (len(self.layout.layer_ids), self.num_experts):
            raise ClassifierError(f"feedback mass has shape {mass.shape}, expected {(len(self.layout.layer_ids), self.num_experts)}")
        tot = mass.sum(axis=1, keepdims=True)
        if (tot <= 0).any():
            return  # a layer saw no routed token (nothing was generated): nothing to learn
        share = mass / tot
        x = self.features.transform([text])
        raw = np.asarray(self.scorer.predict(x)).reshape(share.shape)
        self.memory.add(x, share - raw)

    def select_within(self, text: str, budget_ms: float) -> Selection:
        """``select`` bounded in wall time: past ``budget_ms`` the prior's selection is returned.

        The prediction runs on this classifier's own single worker thread (one OpenMP team, as the
        proxy needs); a late prediction is dropped, and later calls queue behind it.
        """
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reap-select")
        t0 = time.perf_counter()
        future = self._pool.submit(self.select, text)
        try:
            return future.result(timeout=max(budget_ms, 0.0) / 1e3)
        except FutureTimeout:
            sel = self.prior_selection(f"over the {budget_ms:g} ms budget")
            sel.timings["waited_ms"] = (time.perf_counter() - t0) * 1e3
            return sel

    def save(self, out: Path) -> None:
        import skops.io as sio

        out.mkdir(parents=True, exist_ok=True)
        sio.dump(self.scorer, out / "scorer.skops")
        np.save(out / "expert_prior.npy", self.expert_prior)
        tok = out / "tokenizer.json"
        if self.features.tokenizer_json.resolve() != tok.resolve():
            tok.write_bytes(self.features.tokenizer_json.read_bytes())
        emb = self.features.embedder
        routing = self.features.routing_table
        if routing is not None:
            np.save(out / "token_routing.npy", routing)
        meta = dict(self.meta, format_version=FORMAT_VERSION, plan_sha256=self.plan.sha256,
                    routing_sha256=table_sha256(routing) if routing is not None else None,
                    embedder_id=emb.id if emb is not None else None, embedder_dtype=emb.dtype if emb is not None else None,
                    tokenizer_sha256=tokenizer_sha256(tok), features=self.features.spec.__dict__,
                    num_experts=self.num_experts, layer_ids=list(self.layout.layer_ids))
        (out / "classifier.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: Path, plan: Plan, embedder: Embedder | None = None) -> "SliceClassifier":
        import skops.io as sio

        meta_path = path / "classifier.json"
        if not meta_path.is_file():
            raise ClassifierError(f"{path}: no classifier.json (train one with reap-swap train)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format_version") != FORMAT_VERSION:
            raise ClassifierError(f"{path}: classifier format {meta.get('format_version')!r}, this version reads {FORMAT_VERSION}; "
                                  "retrain it with reap-swap train")
        if meta["plan_sha256"] != plan.sha256:
            raise ClassifierError(
                f"{path} was trained for plan {meta['plan_sha256'][:16]}, not {plan.sha256[:16]} ({plan.source}); retrain it for this plan"
            )
        spec = FeatureSpec(**meta["features"])
        if spec.use_embedding:
            embedder = embedder or Embedder(meta.get("embedder_path") or None, dtype=meta.get("embedder_dtype") or "auto")
            if meta["embedder_id"] != embedder.id:
                raise ClassifierError(f"{path} was trained with embedder {meta['embedder_id']}, not {embedder.id}")
        tok = path / "tokenizer.json"
        if not tok.is_file() or tokenizer_sha256(tok) != meta["tokenizer_sha256"]:
            raise ClassifierError(f"{path}/tokenizer.json is missing or not the one the classifier was trained with")
        routing = None
        if spec.use_routing:
            table = path / "token_routing.npy"
            routing = np.load(table, allow_pickle=False) if table.is_file() else None
            if routing is None or table_sha256(routing) != meta.get("routing_sha256"):
                raise ClassifierError(f"{path}/token_routing.npy is missing or not the one the classifier was trained with")
        untrusted = [t for t in sio.get_untrusted_types(file=path / "scorer.skops") if t not in TRUSTED_TYPES]
        if untrusted:
            raise ClassifierError(f"{path}/scorer.skops contains types outside the allow-list: {untrusted}")
        scorer = sio.load(path / "scorer.skops", trusted=list(TRUSTED_TYPES))
        if not isinstance(scorer, ExpertScorer):
            raise ClassifierError(f"{path}/scorer.skops does not hold an ExpertScorer")
        num_experts = plan.layers[plan.layer_ids()[0]].num_experts
        width = len(plan.layer_ids()) * num_experts
        if meta.get("layer_ids") != plan.layer_ids() or meta.get("num_experts") != num_experts or getattr(scorer, "n_outputs_", None) != width:
            raise ClassifierError(f"{path}: expert layout does not match the plan")
        prior = np.load(path / "expert_prior.npy", allow_pickle=False)
        return cls(plan, scorer, FeatureBuilder(embedder if spec.use_embedding else None, tok, spec, routing), prior, meta)
