"""``TRITON_INTERPRET=1 python -m tests.split_triton_check``: the one-program CUDA split
(``split_triton.py``) against ``plan_split`` (torch) on random steps and the tie cases, its post to
the team's mailbox (only steps with CPU pairs; ring entry, sequence number, staged hidden states),
budgeted steps past ``max_tokens`` up to 256 pairs (issue 26: the pair budget, fewest missed pairs first),
and the wait-and-merge program (CPU rows replaced in place once ``done`` reaches the step, the
others untouched; a step never finished counts a timeout and is recomputed from the host rows). Prints ``split_triton == plan_split``
when every check passes."""

from __future__ import annotations

import os

import torch

from reap_swap.server_ext.cpu_experts.split import CostModel, SplitResult, plan_split
from reap_swap.server_ext.cpu_experts.split_triton import MAILBOX_WORDS, Post, Recompute, split_and_stage, wait_and_merge


def check(ids: torch.Tensor, resident: torch.Tensor, cost: CostModel, expert_bytes: int, e: int, host_offset: int, valid: int | None = None,
          device_seq: bool = False, prio: torch.Tensor | None = None) -> SplitResult:
    t, k = ids.shape
    valid = t if valid is None else valid
    # host rows permuted (RAM complement: a missed expert's row is where the table points, not its id)
    rows = torch.randperm(e) if prio is not None else torch.arange(e)
    phys = torch.where(resident[ids], ids % 3, rows[ids] + host_offset)
    w = torch.rand(t, k, dtype=torch.float32)
    real = (torch.arange(t) < valid).view(-1, 1)
    want = plan_split(ids, (phys >= host_offset) & real, e, expert_bytes, cost, priority=prio)  # padding rows are never missed
    for space in (False, True):  # the pair-space program and the expert-space one (big steps' default) alike
        _run_split(ids, phys, w, want, cost, expert_bytes, e, host_offset, valid, device_seq, prio, space)
    return want


def _run_split(ids: torch.Tensor, phys: torch.Tensor, w: torch.Tensor, want: SplitResult, cost: CostModel, expert_bytes: int, e: int,
               host_offset: int, valid: int, device_seq: bool, prio: torch.Tensor | None, expert_space: bool) -> None:
    t, k = ids.shape
    real = (torch.arange(t) < valid).view(-1, 1)
    b = expert_bytes
    cost_t = torch.tensor([b / (cost.link_GBps * 1e9), cost.cpu_fixed_s, cost.cpu_per_expert_s + b / (cost.cpu_GBps * 1e9),
                           cost.cpu_per_pair_s], dtype=torch.float64)
    gpu_ids, cpu_pairs = torch.empty_like(phys), torch.zeros(t, k, dtype=torch.bool)
    st_ids, st_mask, st_w = torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, k, dtype=torch.uint8), torch.zeros(t, k)
    counters = torch.full((4,), 5, dtype=torch.int64)
    x = torch.randn(t, 24).to(torch.bfloat16)
    staged_x = torch.zeros_like(x)
    mailbox = torch.zeros(MAILBOX_WORDS, dtype=torch.int64)
    mailbox[0] = seq0 = int(torch.randint(0, 1000, (1,)))
    expected = torch.full((1,), -1, dtype=torch.int64)
    # device_seq: the last posted seq read from a device counter (the team keeps it), not the mailbox
    posted = torch.tensor([seq0 if device_seq else -5], dtype=torch.int64)
    if device_seq:
        mailbox[0] = -7  # stale on purpose: the post must take the device's count
    post = Post(x, staged_x, mailbox, expected, 0xABC0 + t, posted if device_seq else None)
    split_and_stage(ids, phys, w, cost_t, torch.tensor([valid], dtype=torch.int32), host_offset, 1, e, gpu_ids, cpu_pairs, st_ids, st_mask,
                    st_w, counters, post, priority=prio, pair_limit=cost.pair_limit(t, k), pairs_first=cost.budgeted(t),
                    expert_space=expert_space)
    if int(want.n_cpu) > 0:  # posted: the job's address in the ring, then the next sequence number
        assert int(mailbox[0]) == seq0 + 1 and int(expected) == seq0 + 1 and torch.equal(staged_x, x)
        assert int(mailbox[16 + (seq0 + 1) % 64]) == 0xABC0 + t
        assert int(posted) == (seq0 + 1 if device_seq else -5)
    else:  # nothing for the CPU: nothing posted, nothing staged
        assert int(mailbox[0]) == (-7 if device_seq else seq0) and int(expected) == -1 and not staged_x.any() and not mailbox[16:].any()
        assert int(posted) == (seq0 if device_seq else -5)
    assert torch.equal(cpu_pairs, want.cpu_pairs), (ids, want.cpu_pairs, cpu_pairs)
    assert torch.equal(gpu_ids, torch.where(want.cpu_pairs, torch.ones_like(phys), phys))
    assert torch.equal(st_ids, torch.where(want.cpu_pairs, phys - host_offset, ids).to(torch.int32)) and torch.equal(st_mask, want.cpu_pairs.to(torch.uint8)) and torch.equal(st_w, w)
    missed = (phys >= host_offset) & real
    expect = torch.tensor([int((want.cpu_experts | want.link_experts).sum()), int(want.n_cpu), int(missed.sum()), int(want.cpu_pairs.sum())]) + 5
    assert torch.equal(counters, expect), (counters, expect)
    assert int(want.cpu_pairs.sum()) <= cost.pair_limit(t, k)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(0)
    cases = nonzero = 0
    for e, k in ((16, 4), (128, 8), (40, 6)):
        for t in (1, 3, 8):
            for _ in range(12):
                ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
                resident = torch.rand(e, generator=g) < 0.3
                cost = CostModel(link_GBps=float(torch.empty(1).uniform_(20, 80, generator=g)), cpu_GBps=float(torch.empty(1).uniform_(10, 120, generator=g)),
                                 cpu_fixed_s=float(torch.empty(1).uniform_(0, 4e-4, generator=g)), cpu_per_pair_s=float(torch.empty(1).uniform_(0, 2e-5, generator=g)))
                valid = int(torch.randint(0, t + 1, (1,), generator=g)) if t > 1 else None  # captured-graph padding
                nonzero += int(check(ids, resident, cost, 9_437_184, e, 64, valid, device_seq=cases % 2 == 1).n_cpu) > 0
                cases += 1
    # the composed mode: the cache's scores order the CPU's candidates (lowest first); whole-number
    # scores make ties, which fall back to (missed pairs, id)
    for e, k in ((16, 4), (128, 8)):
        for t in (1, 4):
            for tie in (False, True):
                for _ in range(8):
                    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
                    resident = torch.rand(e, generator=g) < 0.3
                    prio = torch.rand(e, generator=g) * 10
                    prio = prio.floor() if tie else prio
                    cost = CostModel(link_GBps=50, cpu_GBps=float(torch.empty(1).uniform_(20, 120, generator=g)))
                    nonzero += int(check(ids, resident, cost, 9_437_184, e, 256, None, prio=prio).n_cpu) > 0
                    cases += 1
    big, bound = check_budgeted_steps(g)
    cases += big
    # exact ties: equal pipes, no overheads (the torch tests' cases)
    for m in range(1, 9):
        ids = torch.arange(m).view(1, m)
        check(ids, torch.zeros(16, dtype=torch.bool), CostModel(link_GBps=50, cpu_GBps=50), 1 << 20, 16, 64)
        check(ids, torch.zeros(16, dtype=torch.bool), CostModel(link_GBps=50, cpu_GBps=25), 1 << 20, 16, 64)
    # the CPU takes every missed expert (best == m) with min(pairs, E) a power of two: BLOCK_N must reach m
    assert int(check(torch.randperm(128, generator=g)[:8].view(1, 8), torch.zeros(128, dtype=torch.bool),
                     CostModel(link_GBps=1, cpu_GBps=1000), 9_437_184, 128, 256).n_cpu) == 8
    # tie rule 2 with duplicates across tokens: expert 0 has 2 missed pairs, experts 1 and 2 one each
    ids = torch.tensor([[0, 1], [0, 2]])
    for cpu_gbps in (50, 25, 100):
        check(ids, torch.zeros(16, dtype=torch.bool), CostModel(link_GBps=50, cpu_GBps=cpu_gbps), 1 << 20, 16, 64)
    check_ids_out_of_range()
    check_program_choice(g)
    merges = check_wait_and_merge(g) + check_fp8_recompute(g)
    print(f"split_triton == plan_split on {cases} random steps ({nonzero} with CPU experts; {big} budgeted, {bound} held by "
          f"their budget) and 21 tie / edge cases, the program choice and its refusals; {merges} merges")


def _skewed(g: torch.Generator, t: int, k: int, e: int) -> torch.Tensor:
    """[T, K] distinct experts per token, a few hot experts and a long tail (batch-32 decode's shape)."""
    weights = (torch.arange(1, e + 1, dtype=torch.float64) ** -1.2)[torch.randperm(e, generator=g)]
    return torch.stack([torch.multinomial(weights, k, replacement=False, generator=g) for _ in range(t)])


def check_budgeted_steps(g: torch.Generator) -> tuple[int, int]:
    """Steps past max_tokens up to 256 pairs (32 tokens x top-8): the pair budget and, with scores, fewest
    missed pairs first; padded graphs and the budget's extremes. Returns (cases, cases the budget held back)."""
    cases = bound = 0
    for e, k, t in ((128, 8, 32), (128, 8, 16), (128, 8, 9), (64, 4, 24), (16, 2, 12), (40, 6, 16), (100, 8, 12)):
        for mode in ("plain", "prio", "tie"):
            for budget in (1, k + 3, 8 * k, t * k):
                ids = _skewed(g, t, k, e)
                resident = torch.rand(e, generator=g) < 0.3
                # scores of either sign (the expert-space program orders float bits), ties, and -0.0 beside 0.0
                prio = None if mode == "plain" else torch.rand(e, generator=g) * 10 - 3
                if mode == "tie":
                    prio = prio.floor()
                    prio[(prio == 0) & (torch.arange(e) % 2 == 1)] = -0.0
                cost = CostModel(link_GBps=float(torch.empty(1).uniform_(30, 60, generator=g)), cpu_GBps=float(torch.empty(1).uniform_(40, 200, generator=g)),
                                 cpu_fixed_s=25e-6, cpu_per_pair_s=float(torch.empty(1).uniform_(0, 1e-5, generator=g)),
                                 max_tokens=8, max_step_tokens=32, pair_budget=budget)
                valid = int(torch.randint(9, t + 1, (1,), generator=g)) if cases % 3 == 2 and t > 9 else None
                want = check(ids, resident, cost, 9_437_184, e, 256, valid, device_seq=cases % 2 == 1, prio=prio)
                free = plan_split(ids, (ids >= 0) & ~resident[ids] & (torch.arange(t) < (valid or t)).view(-1, 1), e, 9_437_184,
                                  CostModel(**{**cost.__dict__, "pair_budget": t * k}), priority=prio)
                bound += int(free.cpu_pairs.sum()) > budget
                cases += 1
    assert bound > 0, "no case where the budget held the CPU back"
    return cases, bound


def check_ids_out_of_range() -> None:
    """Ids outside 0..E-1 (an expert-parallel map's -1, a corrupt id) count as missed but never go to the CPU."""
    e, host_offset = 16, 64
    ids = torch.tensor([[-1, 3, 16, 5], [3, 20, 7, -1]])
    phys = torch.full_like(ids, host_offset + 1)  # every pair missed
    w = torch.rand(2, 4)
    valid_id = (ids >= 0) & (ids < e)
    cost = CostModel(link_GBps=1, cpu_GBps=1000)
    want = plan_split(ids.clamp(0, e - 1), valid_id, e, 1 << 20, cost)
    b = 1 << 20
    cost_t = torch.tensor([b / (cost.link_GBps * 1e9), cost.cpu_fixed_s, cost.cpu_per_expert_s + b / (cost.cpu_GBps * 1e9),
                           cost.cpu_per_pair_s], dtype=torch.float64)
    for space in (False, True):
        gpu_ids, cpu_pairs = torch.empty_like(phys), torch.zeros(2, 4, dtype=torch.bool)
        counters = torch.zeros(4, dtype=torch.int64)
        split_and_stage(ids, phys, w, cost_t, torch.tensor([2], dtype=torch.int32), host_offset, 1, e, gpu_ids, cpu_pairs,
                        torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.uint8), torch.zeros(2, 4), counters,
                        expert_space=space)
        assert torch.equal(cpu_pairs, want.cpu_pairs) and not cpu_pairs[~valid_id].any(), (space, cpu_pairs, want.cpu_pairs)
        assert torch.equal(gpu_ids, torch.where(want.cpu_pairs, torch.ones_like(phys), phys))
        assert counters.tolist() == [3, int(want.n_cpu), 8, int(want.cpu_pairs.sum())], counters


def check_program_choice(g: torch.Generator) -> None:
    """Steps past 64 pairs take the expert-space program (it writes its scratch), smaller ones the pair-space
    one (the scratch untouched); keys hold < 1024 pairs and < 2^20 experts, refused before any launch."""
    import pytest

    from reap_swap.server_ext.cpu_experts.split_triton import scratch_words

    e, k, host_offset = 128, 8, 256
    cost_t = torch.tensor([1e-3, 1e-6, 1e-6, 0.0], dtype=torch.float64)  # a cheap CPU: every step has CPU pairs
    for t, expert_space in ((8, False), (9, True)):
        ids = _skewed(g, t, k, e)
        phys = ids + host_offset  # every pair missed
        scratch = torch.full((scratch_words(e),), -3, dtype=torch.int64)
        split_and_stage(ids, phys, torch.rand(t, k), cost_t, torch.tensor([t], dtype=torch.int32), host_offset, 1, e,
                        torch.empty_like(phys), torch.zeros(t, k, dtype=torch.bool), torch.zeros(t, k, dtype=torch.int32),
                        torch.zeros(t, k, dtype=torch.uint8), torch.zeros(t, k), torch.zeros(4, dtype=torch.int64), scratch=scratch)
        assert bool((scratch != -3).any()) == expert_space, (t, scratch[:8])
    for t, k, e in ((128, 8, 128), (2, 8, 1 << 20)):  # 1024 pairs; 2^20 experts
        ids = torch.zeros(t, k, dtype=torch.int64)
        with pytest.raises(ValueError, match="expert-space split keys"):
            split_and_stage(ids, ids, torch.rand(t, k), cost_t, torch.tensor([t], dtype=torch.int32), 1, 0, e, torch.empty_like(ids),
                            torch.zeros(t, k, dtype=torch.bool), torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, k, dtype=torch.uint8),
                            torch.zeros(t, k), torch.zeros(4, dtype=torch.int64), expert_space=True)


def _pair_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """Each pair's output, the CPU kernel's arithmetic (kernel.py): [T*K, H] bf16."""
    from reap_swap.server_ext.cpu_experts.kernel import silu_and_mul_bf16

    xs = x.float().repeat_interleave(k, 0)
    h = torch.einsum("ph,pnh->pn", xs, w13[ids.long()].float()).to(torch.bfloat16)
    a = silu_and_mul_bf16(h)
    return (torch.einsum("pi,phi->ph", a.float(), w2[ids.long()].float()) * w.view(-1, 1)).to(torch.bfloat16)


def check_wait_and_merge(g: torch.Generator) -> int:
    """Finished steps merge the team's rows; a step never finished is recomputed from the host rows
    (never the team's unfinished rows), counted, flagged for the host, and marks the team stalled so
    the next step's pairs are recomputed without waiting again."""
    n = 0
    for t, k, h, i in ((1, 8, 64, 48), (3, 4, 40, 24), (8, 8, 32, 160)):
        e, off = 12, 3
        w13 = (torch.randn(off + e, 2 * i, h, generator=g) / h**0.5).to(torch.bfloat16)
        w2 = (torch.randn(off + e, h, i, generator=g) / i**0.5).to(torch.bfloat16)
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, e, (t * k,), generator=g).to(torch.int32)
        w = torch.rand(t * k, generator=g)
        per_k = torch.randn(t * k, h, generator=g).to(torch.bfloat16)
        cpu_out = torch.randn(t * k, h, generator=g).to(torch.bfloat16)  # what an unfinished team left
        pairs = torch.rand(t * k, generator=g) < 0.5
        pairs[0] = True
        mailbox = torch.zeros(MAILBOX_WORDS, dtype=torch.int64)
        timeouts = torch.zeros(1, dtype=torch.int64)
        flag, stalled = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
        rc = Recompute(x, ids, w, w13, w2, off, k, torch.zeros(t * k, i), flag, stalled)
        want = _pair_reference(x, w13[off:], w2[off:], ids, w, k)
        scale = float(want.float().abs().max())
        mailbox[8] = 7
        rows = per_k.clone()
        wait_and_merge(rows, cpu_out, pairs, mailbox, torch.tensor([7]), timeouts, rc, 1 << 24)  # finished: the team's rows
        assert torch.equal(rows, torch.where(pairs[:, None], cpu_out, per_k)) and int(timeouts) == 0 and int(flag) == 0
        n += 1
        mailbox[8] = 6
        rows = per_k.clone()
        wait_and_merge(rows, cpu_out, pairs, mailbox, torch.tensor([7]), timeouts, rc, 3)  # never finished
        assert torch.equal(rows[~pairs], per_k[~pairs])
        err = float((rows[pairs].float() - want[pairs].float()).abs().max())
        assert err <= 2**-5 * scale, (err, scale)  # recomputed from the host rows (bf16 roundings of fp32 sums in another order), not the leftovers
        assert int(timeouts) == int(pairs.sum()) and int(flag) == 1 and int(stalled) == 7  # each waiting program counts once
        n += 1
        rows = per_k.clone()  # next step (seq 8) while the team is still behind 7: recomputed at once (limit ignored)
        wait_and_merge(rows, cpu_out, pairs, mailbox, torch.tensor([8]), timeouts, rc, 1 << 30)
        assert float((rows[pairs].float() - want[pairs].float()).abs().max()) <= 2**-5 * scale
        assert int(timeouts) == 2 * int(pairs.sum()) and int(stalled) == 8
        n += 1
        mailbox[8] = 8  # the team caught up: its rows are merged again
        rows = per_k.clone()
        wait_and_merge(rows, cpu_out, pairs, mailbox, torch.tensor([8]), timeouts, rc, 3)
        assert torch.equal(rows, torch.where(pairs[:, None], cpu_out, per_k)) and int(timeouts) == 2 * int(pairs.sum())
        n += 1
    return n


def check_fp8_recompute(g: torch.Generator) -> int:
    """FP8 host rows (issue 27): a timed-out pair is recomputed from the e4m3fn bytes times their block's
    scale -- every byte value but NaN, per-tensor, per-shard and [bn, bk] block scales."""
    from reap_swap.server_ext.cpu_experts.quant import expert_quant

    n = 0
    for t, k, h, i, layout in ((1, 8, 64, 48, "tensor"), (3, 4, 96, 40, "shard"), (2, 4, 72, 80, "block")):
        e, off = 10, 2
        raw = [torch.randint(0, 256, shape, generator=g, dtype=torch.int32) for shape in ((off + e, 2 * i, h), (off + e, h, i))]
        w13, w2 = (torch.where((b & 0x7F) == 0x7F, b - 1, b).to(torch.uint8).view(torch.float8_e4m3fn) for b in raw)
        rows = off + e
        if layout == "block":
            scales = {"w13_weight_scale_inv": torch.rand(rows, -(-2 * i // 32), -(-h // 24), generator=g) * 1e-3 + 1e-4,
                      "w2_weight_scale_inv": torch.rand(rows, -(-h // 32), -(-i // 24), generator=g) * 1e-3 + 1e-4}
        else:
            scales = {"w13_weight_scale": torch.rand(rows, *((2,) if layout == "shard" else ()), generator=g) * 1e-3 + 1e-4,
                      "w2_weight_scale": torch.rand(rows, generator=g) * 1e-3 + 1e-4}
        quant = expert_quant(w13, w2, scales, (32, 24) if layout == "block" else None)
        d13 = torch.stack([quant.dequantize("w13", w13, r) for r in range(off, rows)])
        d2 = torch.stack([quant.dequantize("w2", w2, r) for r in range(off, rows)])
        x = torch.randn(t, h, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, e, (t * k,), generator=g).to(torch.int32)
        w = torch.rand(t * k, generator=g)
        per_k = torch.randn(t * k, h, generator=g).to(torch.bfloat16)
        pairs = torch.rand(t * k, generator=g) < 0.6
        pairs[0] = True
        mailbox, timeouts = torch.zeros(MAILBOX_WORDS, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        flag, stalled = torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
        rc = Recompute(x, ids, w, w13, w2, off, k, torch.zeros(t * k, i), flag, stalled, quant)
        want = _pair_reference(x, d13, d2, ids, w, k)
        out = per_k.clone()
        wait_and_merge(out, torch.zeros_like(per_k), pairs, mailbox, torch.tensor([1]), timeouts, rc, 3)  # never finished
        scale = float(want.float().abs().max())
        assert scale > 0 and torch.equal(out[~pairs], per_k[~pairs])
        err = float((out[pairs].float() - want[pairs].float()).abs().max())
        assert err <= 2**-5 * scale, (layout, err, scale)
        n += 1
    return n


if __name__ == "__main__":
    main()
