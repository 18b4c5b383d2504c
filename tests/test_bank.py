"""Expert bank swaps on real tensors (CPU backing; the GPU uses the same logic)."""

from __future__ import annotations

import pytest
import torch

from reap_swap.server_ext.bank.bank import ExpertBank, PlainBacking
from reap_swap.server_ext.bank.slots import SlotError

E, S = 8, 3


def make_bank() -> tuple[ExpertBank, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    originals = {"w13_weight": torch.randn(E, 6, 4, generator=gen), "w2_weight": torch.randn(E, 4, 3, generator=gen)}
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in originals.items()}
    phys_map = torch.zeros(E, dtype=torch.int32)
    return ExpertBank(0, params, phys_map, S, PlainBacking(torch.device("cpu"))), originals


def expert_rows(bank: ExpertBank, name: str) -> torch.Tensor:
    """What the kernel reads for each logical expert through the routing table."""
    return bank.params[name].data[bank.phys_map.long()]


def test_layout_and_initial_routing() -> None:
    bank, orig = make_bank()
    assert bank.params["w13_weight"].shape == (S + E, 6, 4)
    assert bank.phys_map.tolist() == list(range(S, S + E))
    for name, t in orig.items():
        assert torch.equal(expert_rows(bank, name), t)


def test_swap_moves_bytes_and_keeps_every_expert_identical() -> None:
    bank, orig = make_bank()
    stats = bank.swap((1, 4, 6))
    assert stats.experts_loaded == 3 and stats.experts_evicted == 0
    assert stats.bytes_copied == 3 * (6 * 4 + 4 * 3) * 4
    assert sorted(bank.phys_map[[1, 4, 6]].tolist()) == [0, 1, 2]
    for name, t in orig.items():
        assert torch.equal(expert_rows(bank, name), t)
    assert bank.verify() == []
    stats = bank.swap((1, 2, 7))
    assert (stats.experts_loaded, stats.experts_evicted) == (2, 2)
    assert bank.resident() == (1, 2, 7)
    assert bank.phys_map[4].item() == S + 4 and bank.phys_map[6].item() == S + 6
    for name, t in orig.items():
        assert torch.equal(expert_rows(bank, name), t)


def test_slot_rows_really_hold_the_resident_experts() -> None:
    bank, orig = make_bank()
    bank.swap((5,))
    slot = bank.table.slot_of(5)
    assert torch.equal(bank.params["w2_weight"].data[slot], orig["w2_weight"][5])


def test_noop_and_refusal_leave_state_unchanged() -> None:
    bank, _ = make_bank()
    bank.swap((0, 1))
    before = bank.phys_map.clone()
    assert bank.swap((1, 0)).bytes_copied == 0
    with pytest.raises(SlotError):
        bank.swap((0, 1, 2, 3))
    assert torch.equal(bank.phys_map, before)
    assert bank.resident() == (0, 1)


def test_resident_mask() -> None:
    bank, _ = make_bank()
    bank.swap((2, 7))
    assert bank.resident_mask().nonzero().flatten().tolist() == [2, 7]
