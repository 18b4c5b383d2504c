"""Training targets for the expert scorer, from observations and a plan (pure numpy).

The target of a sample is its per-expert share of each layer's gate mass,
layers concatenated ([L * E]): what the selection fills the slots with. Slice
targets (the share on each slice) remain for code that ranks slices.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from reap_swap.plan import Plan
from reap_swap.planning.observations import Observations
from reap_swap.planning.splits import SplitError, split_indices as _split_indices


class DatasetError(ValueError):
    pass


@dataclass(frozen=True)
class SliceLayout:
    """Where each layer's slices sit in a flat slice-score vector."""

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


def expert_targets(obs: Observations, plan: Plan) -> np.ndarray:
    """[N, L * E] per-sample share of each layer's gate mass on each expert (plan layer order)."""
    check_compatible(obs, plan)
    share = obs.mass_share()
    order = [obs.layer_ids.index(layer) for layer in plan.layer_ids()]
    return share[:, order, :].reshape(obs.num_samples, -1)


def slice_targets(obs: Observations, plan: Plan) -> np.ndarray:
    """[N, sum of slices] per-sample share of each layer's mass on each slice."""
    check_compatible(obs, plan)
    share = obs.mass_share()
    cols = []
    for li, layer in enumerate(obs.layer_ids):
        for s in plan.layers[layer].slices:
            cols.append(share[:, li, list(s.experts)].sum(axis=1))
    return np.stack(cols, axis=1) if cols else np.zeros((obs.num_samples, 0))


def split_indices(obs: Observations, split: str = "test") -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) indices under a split spec (see ``reap_swap.planning.splits``)."""
    try:
        return _split_indices(obs, split)
    except SplitError as exc:
        raise DatasetError(str(exc)) from None


def data_hash(obs: Observations, index: np.ndarray) -> str:
    h = hashlib.sha256(obs.sha256.encode())
    for i in index:
        h.update(obs.sample_ids[i].encode() + b"\0")
    return h.hexdigest()
