"""Per-request attribution of one step's routing equals a brute-force loop."""

from __future__ import annotations

import numpy as np
import torch

from reap_swap.server_ext.capture import StepLayout, attribute_step


def test_attribution_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(1)
    L, E, K, cap = 3, 10, 4, 64
    layout = StepLayout(["a", "b", "c"], [5, 1, 7])
    T = layout.total
    ids = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(cap)]).to(torch.int32) for _ in range(L)]
    w = [torch.rand(cap, K, generator=gen) for _ in range(L)]
    resident = torch.rand(L, E, generator=gen) > 0.5
    out = attribute_step(ids, w, resident, layout)

    owner = np.repeat(np.arange(3), layout.num_tokens)
    for l in range(L):
        for r in range(3):
            obs = ina = 0.0
            hits = np.zeros(E, np.int64)
            miss = np.zeros(E, np.int64)
            mass = np.zeros(E)
            for t in range(T):
                if owner[t] != r:
                    continue
                for k in range(K):
                    e = int(ids[l][t, k])
                    obs += float(w[l][t, k])
                    mass[e] += float(w[l][t, k])
                    hits[e] += 1
                    if not resident[l, e]:
                        ina += float(w[l][t, k])
                        miss[e] += 1
            assert np.isclose(out["observed"][l, r], obs)
            assert np.isclose(out["inactive"][l, r], ina)
            assert (out["hits"][l, r] == hits).all()
            assert (out["miss_hits"][l, r] == miss).all()
            np.testing.assert_allclose(out["expert_mass"][l, r], mass)
    assert out["tokens"].tolist() == [5, 1, 7]


def test_padding_rows_are_ignored() -> None:
    ids = [torch.zeros(8, 2, dtype=torch.int32)]
    w = [torch.ones(8, 2)]
    out = attribute_step(ids, w, torch.zeros(1, 4, dtype=torch.bool), StepLayout(["x"], [3]))
    assert out["observed"][0, 0] == 6.0 and out["inactive"][0, 0] == 6.0
