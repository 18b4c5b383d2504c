"""Training targets for the slice scorer, from observations and a plan (pure numpy).

For every observed sample and every slice of the plan: the share of the
sample's gate mass in that slice's layer that fell on the slice's experts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from reap_swap.plan import Plan
from reap_swap.planning.observations import Observations


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class SliceLayout:
    """Where each layer's slices sit in the flat output vector."""

    layer_ids: tuple[int, ...]
    counts: tuple[int, ...]

    @classmethod
    def of(cls, plan: Plan) -> "SliceLayout":
        ids = tuple(plan.layer_ids())
        return cls(ids, tuple(len(plan.layers[i].slices) for i in ids))

    @property
    def width(self) -> int:
        return sum(self.counts)

    def split(self, row: np.ndarray) -> dict[int, np.ndarray]:
        out, start = {}, 0
        for layer, n in zip(self.layer_ids, self.counts):
            out[layer] = row[start : start + n]
            start += n
        return out


def check_compatible(obs: Observations, plan: Plan) -> None:
    if sorted(obs.layer_ids) != plan.layer_ids():
        raise DatasetError(f"observations cover layers {obs.layer_ids[:6]}..., the plan {plan.layer_ids()[:6]}...")
    for layer in plan.layer_ids():
        if plan.layers[layer].num_experts != obs.num_experts:
            raise DatasetError(f"layer {layer}: plan has {plan.layers[layer].num_experts} experts, observations {obs.num_experts}")


def slice_targets(obs: Observations, plan: Plan) -> np.ndarray:
    """[N, sum of slices] per-sample share of each layer's mass on each slice."""
    check_compatible(obs, plan)
    share = obs.mass_share()
    cols = []
    for li, layer in enumerate(obs.layer_ids):
        for s in plan.layers[layer].slices:
            cols.append(share[:, li, list(s.experts)].sum(axis=1))
    return np.stack(cols, axis=1) if cols else np.zeros((obs.num_samples, 0))


def split_indices(obs: Observations, split: str = "test", holdout: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices: by corpus file name when a ``split`` file exists, else a stable id hash."""
    files = np.array(obs.files)
    if split and (files == split).any():
        held = files == split
    else:
        held = np.array([int(hashlib.sha1(s.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF < holdout for s in obs.sample_ids])
    train, test = np.nonzero(~held)[0], np.nonzero(held)[0]
    if len(train) == 0 or len(test) == 0:
        raise DatasetError(f"split {split!r} leaves {len(train)} training and {len(test)} held-out samples")
    return train, test


def data_hash(obs: Observations, index: np.ndarray) -> str:
    h = hashlib.sha256(obs.sha256.encode())
    for i in index:
        h.update(obs.sample_ids[i].encode() + b"\0")
    return h.hexdigest()
