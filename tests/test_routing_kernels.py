"""The routing kernels: Triton (under its interpreter, on CPU) equals the torch reference,
and the reference equals a brute-force loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reap_swap.server_ext.step import routing_kernels as rk

triton = pytest.importorskip("triton")


@pytest.fixture()
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _routing(n: int, k: int, e: int, seed: int, ids_dtype: torch.dtype = torch.int32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).to(ids_dtype)
    w = torch.rand(n, k, generator=gen)
    return ids, w


def _phys_map(e: int, slots: int, host_offset: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    resident = torch.randperm(e, generator=gen)[:slots]
    table = host_offset + torch.arange(e)
    table[resident] = torch.randperm(slots, generator=gen)
    return table.to(torch.int32)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 3, 200])
def test_remap_capture_triton_equals_reference(interpret: None, n: int, ids_dtype: torch.dtype) -> None:
    e, k, slots, h = 24, 4, 9, 10
    ids, w = _routing(n, k, e, seed=n, ids_dtype=ids_dtype)
    pm = _phys_map(e, slots, h, seed=7)
    outs = []
    for fn in (rk.remap_and_capture_reference, rk.remap_and_capture_triton):
        codes = torch.full((256, k), 99, dtype=torch.int32)
        capw = torch.full((256, k), -1.0)
        out = fn(ids, w, pm, h, codes, capw)
        outs.append((out, codes, capw))
    (o1, c1, w1), (o2, c2, w2) = outs
    assert o1.dtype == o2.dtype == ids_dtype
    assert torch.equal(o1, o2) and torch.equal(c1, c2) and torch.equal(w1, w2)
    assert torch.equal(o1, pm[ids.long()].to(ids_dtype))
    assert (c1[n:] == 99).all(), "rows past the step must not be written"
    ids_back, missed = rk.decode_codes(c1[:n])
    assert torch.equal(ids_back, ids.to(torch.int32))
    assert torch.equal(missed, pm[ids.long()] >= h)


def _step(layers: int, rows: int, k: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.stack([torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(rows)]) for _ in range(layers)]).to(torch.int32)
    flip = torch.rand(codes.shape, generator=gen) < 0.4
    codes = torch.where(flip, -1 - codes, codes)
    return codes, torch.rand(codes.shape, generator=gen)


def test_accumulate_reference_equals_brute_force() -> None:
    arena_layers, max_rows, k, e = 5, 32, 3, 7
    codes, w = _step(arena_layers, max_rows, k, e, seed=3)
    layer_rows = torch.tensor([1, 2, 4])
    counts = [5, 1, 7]
    slots = [2, 0, 3]
    row_slot = torch.tensor(np.repeat(slots, counts), dtype=torch.int32)
    t = sum(counts)
    acc = torch.zeros(5, arena_layers, rk.COMPONENTS, e, dtype=torch.float64)
    rk.accumulate_step_reference(codes, w, layer_rows, row_slot, t, acc)
    want = torch.zeros_like(acc)
    for arena_row in layer_rows.tolist():
        i = arena_row
        for row in range(t):
            s = int(row_slot[row])
            for j in range(k):
                c = int(codes[arena_row, row, j])
                ex, miss = (-1 - c, True) if c < 0 else (c, False)
                ww = float(w[arena_row, row, j])
                want[s, i, rk.ROUTED, ex] += 1
                want[s, i, rk.MASS, ex] += ww
                if miss:
                    want[s, i, rk.MISSED, ex] += 1
                    want[s, i, rk.MISSED_MASS, ex] += ww
    torch.testing.assert_close(acc, want)
    assert acc[1].abs().sum() == 0 and acc[4].abs().sum() == 0, "slots without rows stay zero"
    assert acc[:, [0, 3]].abs().sum() == 0, "layers without a bank stay zero"


@pytest.mark.parametrize("rows", [1, 13, 300])
def test_accumulate_triton_equals_reference(interpret: None, rows: int) -> None:
    arena_layers, max_rows, k, e, slots = 4, 320, 8, 16, 6
    codes, w = _step(arena_layers, max_rows, k, e, seed=rows)
    layer_rows = torch.tensor([0, 1, 3], dtype=torch.int32)
    row_slot = torch.randint(0, slots, (max_rows,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    a = torch.zeros(slots, arena_layers, rk.COMPONENTS, e)
    b = torch.zeros_like(a)
    rk.accumulate_step_reference(codes, w, layer_rows.long(), row_slot, rows, a)
    rk.accumulate_step_triton(codes, w, layer_rows, row_slot, rows, b)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert a[:, :, rk.ROUTED].sum() == 3 * rows * k
    assert a[:, 2].abs().sum() == 0


@pytest.mark.parametrize("cap,rows", [(1, 3), (4, 13), (5, 300)])
def test_promotion_booking_triton_equals_reference(interpret: None, cap: int, rows: int) -> None:
    from reap_swap.server_ext.step.accounting import accumulate_promotions_reference, accumulate_promotions_triton

    arena_layers, max_rows, slots = 4, 320, 6
    gen = torch.Generator().manual_seed(cap * 1000 + rows)
    # first routing row of each promotion, -1 where none; some past the step's real rows (graph padding)
    promo_rows = torch.randint(-1, rows + 4, (arena_layers, cap), dtype=torch.int32, generator=gen)
    layer_rows = torch.tensor([0, 1, 3], dtype=torch.int32)
    row_slot = torch.randint(0, slots, (max_rows,), dtype=torch.int32, generator=gen)
    a = torch.zeros(slots, arena_layers)
    b = torch.zeros_like(a)
    for _ in range(2):  # accumulates across steps
        accumulate_promotions_reference(promo_rows, layer_rows, row_slot, rows, a)
        accumulate_promotions_triton(promo_rows, layer_rows, row_slot, rows, b)
    torch.testing.assert_close(a, b)
    want = torch.zeros_like(a)
    for layer in (0, 1, 3):
        for r in promo_rows[layer].tolist():
            if 0 <= r < rows:
                want[int(row_slot[r]), layer] += 2
    torch.testing.assert_close(a, want)
    assert a[:, 2].abs().sum() == 0, "a layer without a bank books nothing"
