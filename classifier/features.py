"""Prompt features: a sentence embedding plus the served model's own tokens.

Experts specialise by token type more than by topic, so the strongest
cheap signal of where a prompt will route is which of *the served model's*
tokens it contains: a bag of model tokens (log counts, L2-normalized). The
sentence embedding adds the topic; it reads only the prompt's end (the
user's request), which also keeps embedding latency low on a CPU.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy.sparse import csr_matrix, hstack

from .embedder import Embedder


@dataclass(frozen=True)
class FeatureSpec:
    embed_weight: float = 0.5
    embed_chars: int = 240
    embed_max_tokens: int = 24


def tokenizer_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class FeatureBuilder:
    def __init__(self, embedder: Embedder, tokenizer_json: Path, spec: FeatureSpec = FeatureSpec()):
        from tokenizers import Tokenizer

        self.embedder = embedder
        self.spec = spec
        self.tokenizer_json = tokenizer_json
        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.embedder.model.max_seq_length = spec.embed_max_tokens

    @property
    def dim(self) -> int:
        return self.embedder.dim + self.vocab

    def token_bag(self, texts: Sequence[str]) -> csr_matrix:
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        for i, enc in enumerate(self.tokenizer.encode_batch(list(texts), add_special_tokens=False)):
            ids, counts = np.unique(np.asarray(enc.ids, dtype=np.int64), return_counts=True)
            v = np.log1p(counts.astype(np.float64))
            norm = np.linalg.norm(v)
            rows.append(np.full(len(ids), i))
            cols.append(ids)
            vals.append(v / norm if norm > 0 else v)
        if not rows:
            return csr_matrix((len(texts), self.vocab))
        return csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(len(texts), self.vocab))

    def transform(self, texts: Sequence[str]) -> csr_matrix:
        emb = self.embedder.embed([t[-self.spec.embed_chars :] for t in texts]) * self.spec.embed_weight
        return hstack([csr_matrix(emb.astype(np.float64)), self.token_bag(texts)]).tocsr()
