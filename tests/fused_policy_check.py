"""``TRITON_INTERPRET=1 python -m tests.fused_policy_check``: the fused Triton step (``policy_triton.py``,
interpreted) against the torch core, step by step, every state tensor bit-identical (run by
``test_online_cache.test_fused_triton_step_equals_the_torch_core``)."""

from __future__ import annotations

import os

import numpy as np
import torch

from tests.test_online_cache import Layer

CASES = [(16, 5, 2, None, torch.int32), (128, 38, 4, 0.5, torch.int64), (12, 12, 3, None, torch.int32), (64, 19, 1, 0.0, torch.int32)]
COMPLEMENT_CASES = [(16, 5, 2, None, torch.int32, 2), (128, 38, 4, 0.5, torch.int64, 4), (12, 12, 3, None, torch.int32, 5), (64, 19, 1, 0.0, torch.int32, 1)]
"""(..., spares): RAM-complement mode; the start set fills all but ``spares`` slots so the bank fits."""


def check(e: int, s: int, cap: int, hyst: float | None, ids_dtype: torch.dtype, spares: int | None = None, steps: int = 60,
          cpu: bool = False) -> int:
    """``cpu``: the composed mode -- some missed pairs go to the CPU first (per expert, as the split gives them)."""
    from tests.test_online_cache_complement import RamLayer

    rng = np.random.default_rng(e + cap)
    if spares is None:
        start = tuple(int(x) for x in rng.permutation(e)[: s // 2])
        a = Layer(e, s, pad=2, cap=cap, hysteresis=hyst, start=start, protected=start[:1])
        b = Layer(e, s, pad=2, cap=cap, hysteresis=hyst, start=start, protected=start[:1])
    else:
        start = tuple(int(x) for x in rng.permutation(e)[: max(s // 2, s - spares)])
        a = RamLayer(e, s, spares, pad=2, cap=cap, hysteresis=hyst, start=start, protected=start[:1])
        b = RamLayer(e, s, spares, pad=2, cap=cap, hysteresis=hyst, start=start, protected=start[:1])
    for step in range(steps):
        t = int(rng.integers(1, 6))
        hot = rng.permutation(e)[: max(4, e // 3)]  # skewed routing, so scores tie and differ
        ids = torch.tensor(np.stack([rng.permutation(hot)[:4] for _ in range(t)]), dtype=ids_dtype)
        vr = torch.tensor([int(rng.integers(1, t + 1))], dtype=torch.int32) if step % 3 else None
        ta, tb = torch.full((cap,), 9, dtype=torch.int32), torch.full((cap,), 9, dtype=torch.int32)
        pairs = None
        if cpu:
            missed = a.cache.phys_map[ids.long()] >= a.cache.host_row_offset
            taken = torch.tensor(rng.random(e) < 0.5)[ids.long()]  # per expert
            real = torch.arange(t).view(-1, 1) < (vr if vr is not None else t)
            pairs = (missed & taken & real).contiguous()
        oa = a.cache.step(ids, a.rows, vr, ta, cpu_pairs=pairs, filler=s)
        ob = b.cache.step_fused(ids, b.rows, vr, tb, cpu_pairs=pairs, filler=s)
        if pairs is not None:
            assert (oa[pairs] == s).all() and not (a.cache.phys_map[ids.long()][pairs] < a.cache.host_row_offset).any(), \
                "a CPU pair's expert was promoted or its pair not sent to the filler row"
        where = f"case {(e, s, cap, hyst)} step {step}"
        assert ob.dtype == ids_dtype and torch.equal(oa, ob), where
        assert torch.equal(ta, tb), f"{where}: trigger rows {ta.tolist()} vs {tb.tolist()}"
        for name in ("score", "expert_in_slot", "phys_map", "counts", "row_owner"):
            assert torch.equal(getattr(a.cache, name), getattr(b.cache, name)), f"{where}: {name}"
    for ra, rb in zip(a.rows, b.rows):
        assert torch.equal(ra, rb)
    b.check()
    return int(b.cache.promotions)


def untaken_pair_after_an_eviction() -> None:
    """A pair not taken after an eviction once named the victim's new host row as its slot: the reference
    copy wrote that row onto itself from its old bytes and lost the victim (found in review)."""
    from tests.test_online_cache_complement import RamLayer

    for fused in (False, True):
        lay = RamLayer(4, 2, spares=2, pad=1, cap=2, start=(0, 1), protected=(1,))
        ids = torch.tensor([[2, 3]], dtype=torch.int32)
        (lay.cache.step_fused if fused else lay.cache.step)(ids, lay.rows, None, None)
        lay.check()
        assert lay.resident() == {1, 2}, lay.resident()


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    untaken_pair_after_an_eviction()
    promoted = [check(*case) for case in CASES + COMPLEMENT_CASES]
    composed = [check(*case, cpu=True) for case in CASES] + [check(*case, cpu=True) for case in COMPLEMENT_CASES]
    assert all(p > 3 for p in promoted + composed), (promoted, composed)
    print(f"fused == core: {len(CASES)} full-copy and {len(COMPLEMENT_CASES)} RAM-complement cases, promotions {promoted}; "
          f"composed with the CPU split: promotions {composed}")


if __name__ == "__main__":
    main()
