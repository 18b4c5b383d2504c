"""RAM-complement expert banks on real tensors (CPU backing; CUDA uses the same row copies)."""

from __future__ import annotations

import random

import pytest
import torch

from reap_swap.server_ext.bank.bank import ComplementSpec, ExpertBank, PlainBacking
from reap_swap.server_ext.bank.slots import SlotError

E, S, K = 10, 4, 2


def make(complement: ComplementSpec | None, backing: object | None = None) -> tuple[ExpertBank, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    originals = {"w13_weight": torch.randn(E, 6, 4, generator=gen), "w2_weight": torch.randn(E, 4, 3, generator=gen)}
    params = {k: torch.nn.Parameter(v.clone(), requires_grad=False) for k, v in originals.items()}
    bank = ExpertBank(0, params, torch.zeros(E, dtype=torch.int32), S, backing or PlainBacking(torch.device("cpu")), complement)
    return bank, originals


def routed(bank: ExpertBank, name: str) -> torch.Tensor:
    return bank.params[name].data[bank.phys_map.long()]


def test_complement_keeps_only_non_residents_plus_spares() -> None:
    full, _ = make(None)
    bank, orig = make(ComplementSpec(K, (1, 5)))
    assert bank.params["w13_weight"].shape[0] == S + (E - S + K)
    assert bank.host_bytes == (E - S + K) * bank.expert_bytes < full.host_bytes
    assert bank.resident() == (1, 5)  # S - K = 2 residents let the other 8 fit 8 of the 8 + K rows
    empty, _ = make(ComplementSpec(K, ()))
    assert empty.resident() == (0, 1)  # padded with the lowest ids so the rest fit
    for name, t in orig.items():
        assert torch.equal(routed(bank, name), t)
    assert bank.verify() == []


def test_random_swaps_keep_every_expert_and_count_rotations() -> None:
    bank, orig = make(ComplementSpec(K, ()))
    rng = random.Random(3)
    pairs = 0
    for _ in range(300):
        target = tuple(rng.sample(range(E), rng.randint(0, S)))
        before = bank.counters.as_dict()
        stats = bank.swap(target)
        delta = {k: v - before[k] for k, v in bank.counters.as_dict().items()}
        assert set(target) <= set(bank.resident())
        for name, t in orig.items():
            assert torch.equal(routed(bank, name), t)
        assert bank.verify() == []
        assert stats.bytes_copied == delta["h2d_bytes"] == stats.experts_loaded * bank.expert_bytes
        assert delta["d2h_bytes"] == stats.experts_evicted * bank.expert_bytes
        assert delta["memcpy_bytes_avoided"] == delta["rotated_blocks"] * bank.expert_bytes
        pairs += delta["exchanges"]
    assert pairs > 100 and bank.counters.exchanges == pairs
    for e in bank.resident():  # slot rows hold the real bytes
        assert torch.equal(bank.slot_row("w2_weight", bank.table.slot_of(e)), orig["w2_weight"][e])


def test_refused_swap_changes_nothing() -> None:
    bank, _ = make(ComplementSpec(K, (0, 1, 2)))
    before = bank.phys_map.clone()
    with pytest.raises(SlotError):
        bank.swap((0, 1, 2, 3, 4))
    with pytest.raises(SlotError):
        bank.swap((42,))
    assert torch.equal(bank.phys_map, before)


def test_zero_spares_is_refused() -> None:
    with pytest.raises(ValueError, match="spare"):
        make(ComplementSpec(0, ()))


class FailingSecondAllocation(PlainBacking):
    """Pinning/mapping failure (cannot be caused on CPU): the 2nd region fails."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.calls = 0

    def allocate(self, *args: object, **kw: object) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("cannot pin")
        return super().allocate(*args, **kw)  # type: ignore[arg-type]


def test_failed_allocation_leaves_the_loaded_weights_untouched() -> None:
    gen = torch.Generator().manual_seed(1)
    params = {"w13_weight": torch.nn.Parameter(torch.randn(E, 6, 4, generator=gen), requires_grad=False),
              "w2_weight": torch.nn.Parameter(torch.randn(E, 4, 3, generator=gen), requires_grad=False)}
    before = {k: (p.data_ptr(), p.shape) for k, p in params.items()}
    with pytest.raises(RuntimeError, match="cannot pin"):
        ExpertBank(0, params, torch.zeros(E, dtype=torch.int32), S, FailingSecondAllocation(), ComplementSpec(K, ()))
    assert all((params[k].data_ptr(), params[k].shape) == before[k] for k in params)  # the copy path can still be built from them


def test_cuda_vmm_complement_random_swaps() -> None:
    """The same exchanges on the CUDA-VMM range (slot rows in HBM, host rows pinned HOST_NUMA pages).

    Not run in this session (no GPU time); it is the GPU check of issue 13's storage test.
    """
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from reap_swap.server_ext.bank.cuda_vmm import VmmBacking, cu

    if cu is None:
        pytest.skip("needs cuda-bindings")
    dev = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(5)
    originals = {"w13_weight": torch.randn(E, 512, 256, generator=gen), "w2_weight": torch.randn(E, 256, 256, generator=gen)}
    params = {k: torch.nn.Parameter(v.to(dev), requires_grad=False) for k, v in originals.items()}
    bank = ExpertBank(0, params, torch.zeros(E, dtype=torch.int32, device=dev), S, VmmBacking(dev), ComplementSpec(K, ()))
    assert bank.host_rows == E - S + K
    rng = random.Random(11)
    for _ in range(200):
        bank.swap(tuple(rng.sample(range(E), rng.randint(0, S))))
        for name, t in originals.items():
            assert torch.equal(routed(bank, name).cpu(), t)
        assert bank.verify() == []
    assert bank.counters.exchanges > 50
    assert bank.counters.memcpy_bytes_avoided == bank.counters.rotated_blocks * bank.expert_bytes
