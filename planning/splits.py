"""Which observed samples train and which are held out (pure).

The planner, the classifier and the evaluation must agree on the split, or a
"held-out" score is measured on samples the plan or the classifier learnt
from. Specs:

* ``test`` (default): samples from a corpus file named ``test.jsonl``; a stable
  20 % hash of the sample ids when no such file was observed (or nothing else was);
* ``file:NAME``: samples from corpus file ``NAME`` (its stem);
* ``tag:TAG``: samples carrying tag ``TAG`` (``tag:cross:test`` is the example
  corpus' cross-source split: held-out origins, worded differently);
* ``source:A,B``: samples whose ``source`` is one of these;
* ``hash`` or ``hash:F``: a stable share ``F`` (default 0.2) by id hash;
* ``none``: nothing held out (everything trains; for a production plan).
"""

from __future__ import annotations

import hashlib
from typing import Protocol, Sequence

import numpy as np

DEFAULT_HOLDOUT = 0.2


class SplitError(ValueError):
    pass


class Samples(Protocol):
    sample_ids: list[str]
    files: list[str]
    tags: list[tuple[str, ...]]
    sources: list[str]


def id_hash_share(sample_id: str) -> float:
    return int(hashlib.sha1(sample_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def held_mask(obs: Samples, spec: str) -> np.ndarray:
    """[N] bool: True where a sample is held out under ``spec``."""
    n = len(obs.sample_ids)
    spec = (spec or "none").strip()
    kind, _, arg = spec.partition(":")
    if kind == "none":
        return np.zeros(n, dtype=bool)
    if kind == "test" and not arg:
        files = np.array(obs.files)
        if (files == "test").any() and not (files == "test").all():
            return files == "test"
        kind, arg = "hash", ""
    if kind == "hash":
        try:
            share = float(arg) if arg else DEFAULT_HOLDOUT
        except ValueError:
            raise SplitError(f"split {spec!r}: hash share must be a number, e.g. hash:0.2") from None
        if not 0 < share < 1:
            raise SplitError(f"split {spec!r}: hash share must be in (0, 1)")
        return np.array([id_hash_share(s) < share for s in obs.sample_ids])
    if not arg:
        raise SplitError(f"split {spec!r}: expected test, file:NAME, tag:TAG, source:A,B, hash[:F] or none")
    if kind == "file":
        return np.array([f == arg for f in obs.files])
    if kind == "tag":
        return np.array([arg in t for t in obs.tags])
    if kind == "source":
        wanted = set(arg.split(","))
        return np.array([s in wanted for s in obs.sources])
    raise SplitError(f"split {spec!r}: unknown kind {kind!r} (test, file:, tag:, source:, hash, none)")


def split_indices(obs: Samples, spec: str = "test", require_heldout: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices of ``obs`` under ``spec``."""
    held = held_mask(obs, spec)
    train, test = np.nonzero(~held)[0], np.nonzero(held)[0]
    if len(train) == 0 or (require_heldout and len(test) == 0):
        raise SplitError(f"split {spec!r} leaves {len(train)} training and {len(test)} held-out samples")
    return train, test


def ids_sha256(ids: Sequence[str]) -> str:
    """Identity of a set of samples (order-free): what a plan or classifier records it learnt from."""
    h = hashlib.sha256()
    for s in sorted(ids):
        h.update(s.encode() + b"\0")
    return h.hexdigest()
