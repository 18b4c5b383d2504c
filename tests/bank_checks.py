"""Checks shared by the bank tests of each weight scheme (bf16, FP8 scales, 4-bit packed + side tensors)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from reap_swap.server_ext.bank.bank import ExpertBank


def check_random_swaps(bank: ExpertBank, experts: int, slots: int, reads_logical: Callable[[], None], rounds: int = 12, seed: int = 1) -> None:
    """Swap to ``rounds`` random resident sets of 0..slots experts; after each, the resident set is the
    target, the bytes copied are whole experts (side tensors included), ``reads_logical`` holds (what the
    kernel reads at ``phys_map[e]`` is expert e) and the bank verifies clean."""
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        target = tuple(sorted(int(x) for x in rng.choice(experts, size=int(rng.integers(0, slots + 1)), replace=False)))
        stats = bank.swap(target)
        assert set(bank.resident()) == set(target)
        assert stats.bytes_copied == stats.experts_loaded * bank.expert_bytes
        reads_logical()
        assert bank.verify() == []
