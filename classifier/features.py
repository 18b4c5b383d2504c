"""Prompt features: the served model's own tokens, their routing, optionally a sentence embedding.

Experts specialise by token type more than by topic, so the strongest cheap
signal of where a prompt will route is which of *the served model's* tokens
it contains: a bag of model tokens (log counts, L2-normalized). ``routing``
adds the mean over the prompt's tokens of each token's own routing in the
served model (``routing_table.py``), which carries over to tokens no training
prompt contained. Both cost about a millisecond and no torch. A sentence
embedding adds the topic; it reads only the prompt's end and costs a
transformer forward, so training keeps it only when cross-validation shows it
pays (``train.py``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy.sparse import csr_matrix, hstack

from .embedder import Embedder

FEATURE_SETS = ("tokens", "tokens+routing", "tokens+embedding", "tokens+routing+embedding")


@dataclass(frozen=True)
class FeatureSpec:
    embed_weight: float = 0.5
    embed_chars: int = 240
    embed_max_tokens: int = 24
    use_embedding: bool = True
    use_routing: bool = False
    routing_weight: float = 2.0

    @property
    def name(self) -> str:
        return "tokens" + ("+routing" if self.use_routing else "") + ("+embedding" if self.use_embedding else "")

    @classmethod
    def named(cls, name: str) -> "FeatureSpec":
        if name not in FEATURE_SETS:
            raise ValueError(f"feature set must be one of {FEATURE_SETS}, got {name!r}")
        return cls(use_embedding="embedding" in name, use_routing="routing" in name)


def tokenizer_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FeatureBuilder:
    """Prompt text -> sparse feature rows. ``embedder`` / ``routing`` ([V, L, E]) only when the spec uses them."""

    def __init__(self, embedder: Embedder | None, tokenizer_json: Path, spec: FeatureSpec = FeatureSpec(),
                 routing: np.ndarray | None = None):
        from tokenizers import Tokenizer

        if spec.use_embedding and embedder is None:
            raise ValueError("this feature spec needs an embedder")
        if spec.use_routing and routing is None:
            raise ValueError("this feature spec needs a routing table")
        self.embedder = embedder if spec.use_embedding else None
        self.routing_table = routing if spec.use_routing else None  # [V, L, E] as stored
        self.routing = routing.reshape(routing.shape[0], -1).astype(np.float32) if spec.use_routing and routing is not None else None
        self.spec = spec
        self.tokenizer_json = tokenizer_json
        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if self.embedder is not None:
            self.embedder.model.max_seq_length = spec.embed_max_tokens

    @property
    def dim(self) -> int:
        return (self.embedder.dim if self.embedder is not None else 0) + self.vocab + (self.routing.shape[1] if self.routing is not None else 0)

    def token_features(self, texts: Sequence[str]) -> csr_matrix:
        """Bag of model tokens, then (with a routing table) the mean routing of the prompt's tokens."""
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        sketch = np.zeros((len(texts), self.routing.shape[1] if self.routing is not None else 0), np.float64)
        for i, enc in enumerate(self.tokenizer.encode_batch(list(texts), add_special_tokens=False)):
            all_ids = np.asarray(enc.ids, dtype=np.int64)
            if self.routing is not None and len(all_ids):
                sketch[i] = self.routing[all_ids[all_ids < self.routing.shape[0]]].mean(axis=0) * self.spec.routing_weight
            ids, counts = np.unique(all_ids, return_counts=True)
            v = np.log1p(counts.astype(np.float64))
            norm = np.linalg.norm(v)
            rows.append(np.full(len(ids), i))
            cols.append(ids)
            vals.append(v / norm if norm > 0 else v)
        bag = csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(texts), self.vocab)) \
            if rows else csr_matrix((len(texts), self.vocab))
        return hstack([bag, csr_matrix(sketch)]).tocsr() if self.routing is not None else bag

    def embedding(self, texts: Sequence[str]) -> np.ndarray:
        assert self.embedder is not None
        return self.embedder.embed([t[-self.spec.embed_chars :] for t in texts]) * self.spec.embed_weight

    def transform(self, texts: Sequence[str], embedded: np.ndarray | None = None) -> csr_matrix:
        """Feature rows; ``embedded`` reuses precomputed ``embedding(texts)`` (training tries several specs)."""
        bag = self.token_features(texts)
        if self.embedder is None:
            return bag.tocsr()
        emb = self.embedding(texts) if embedded is None else embedded
        return hstack([csr_matrix(emb.astype(np.float64)), bag]).tocsr()
