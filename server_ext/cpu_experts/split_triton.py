"""The CPU expert path's per-step device work as two Triton programs (split semantics: ``split.plan_split``).

Why: ``plan_split`` in torch ops is ~30 small kernels per MoE layer step; on the H200 24 layers of
them cost ~3.9 ms per decode step (graph replay), more than the CPU path saves at batch 1.

* ``split_and_stage`` (one program): the split, the GPU's ids, the staging of ids / mask / routing
  weights / hidden states for the host, the counters, and -- when the CPU got any pair -- the post
  of the step to the CPU team's mailbox (job address into the ring, a system-wide fence, then the
  new sequence number, counted from the team's device copy of the last one so that nothing is read
  over PCIe; ``native_experts.c`` describes the team). It is on the critical path of every layer
  step (the team starts when it posts), so its tables are in pair space, and the stores only the
  device reads come after the post. Costs are float64 (a [4] device
  tensor: Python floats would reach Triton as float32), the same formula as ``plan_split``; ties:
  fewest CPU experts, then the CPU takes the experts with the fewest missed pairs, then the lowest id.
  A step past ``max_tokens`` (``CostModel.budgeted``) comes with its pair budget (``pair_limit``: the
  prefix of CPU candidates holds at most that many missed pairs) and, with priorities, orders the
  candidates by missed pairs first (``PAIRS_FIRST``), as ``plan_split`` does.
* ``wait_and_merge`` (one program per (token, k)): a CPU pair's program polls the mailbox's
  ``done`` until its step is finished, then copies the CPU's output row over the fused kernel's
  per-k row, in place, right before vLLM's ``moe_sum``; other programs do nothing. The poll is
  bounded: past ``WAIT_LIMIT`` reads it gives up (a dead team must not hang the GPU), counts a
  timeout, raises the host-visible flag the worker logs from, and **recomputes the pair on the
  device** from the staged hidden state and the expert's host row read over the link (UVA), with the
  CPU kernel's arithmetic -- the team's output row, unfinished, is never merged. While the team is
  still behind a step that timed out (``stalled``), later pairs are recomputed at once instead of
  waiting again; the team's own outputs are merged again once it has caught up.

Imported only where Triton runs (CUDA, or CPU tests under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from .quant import ExpertQuant

from .team import MAILBOX_WORDS, WAIT_POLLS

__all__ = ["MAILBOX_WORDS", "Post", "Recompute", "scratch_words", "split_and_stage", "wait_and_merge"]


# int64 words of native_experts.c's reap_mailbox: seq, done, ring[RING]
MAILBOX_SEQ, MAILBOX_DONE, MAILBOX_RING, RING = tl.constexpr(0), tl.constexpr(8), tl.constexpr(16), tl.constexpr(64)
SPLIT_WARPS, SPLIT_BLOCK_X = 4, 4096  # launch shape of the split (one program; scripts/gpu_split_bench.py)
BIG_STEP_PAIRS, BIG_STEP_WARPS = 64, 16  # past 64 pairs the [P, P] tables get more threads (to be timed: gpu_split_bench.py)
# One warp per merge program: its volatile reads of ``done`` are one transaction for all lanes, so
# the wait-or-recompute decision is the same in every thread (two warps could read ``done`` on
# either side of the team's store, split the branches and meet the recompute's barrier apart).
MERGE_WARPS = 1
WAIT_LIMIT = WAIT_POLLS  # past it a step counts as timed out (one constant with the path's wait_limit)
# FENCE: ``v`` after a system-scope fence (PTX ``fence.sc.sys``): the host sees stores before it before stores that use v.


def _split_kernel(  # type: ignore[no-untyped-def]
    ids_ptr, phys_ptr, w_ptr, cost_ptr, valid_ptr, gpu_ids_ptr, cpu_pairs_ptr, st_ids_ptr, st_mask_ptr, st_w_ptr, counters_ptr,
    x_ptr, st_x_ptr, mailbox_ptr, expected_ptr, posted_ptr, job_address, prio_ptr,
    scratch_ptr, n_pairs, top_k, host_offset, filler, E, n_x, pair_limit, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_X: tl.constexpr, POST: tl.constexpr, FENCE: tl.constexpr, SEQ_ON_DEVICE: tl.constexpr, HAS_PRIO: tl.constexpr,
    PAIRS_FIRST: tl.constexpr, EXPERT_SPACE: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # Pair space: a step routes to at most n_pairs distinct experts, so every table is [P, P] or
    # [N, P] (N <= P + 1), not [E, E] -- at E = 128, batch 1 that is 64 compares instead of 16K.
    p = tl.arange(0, BLOCK_P)
    pm = p < n_pairs
    ids = tl.load(ids_ptr + p, mask=pm, other=0).to(tl.int32)
    phys = tl.load(phys_ptr + p, mask=pm, other=0)
    w = tl.load(w_ptr + p, mask=pm, other=0.0).to(tl.float32)
    real = (p // top_k) < tl.load(valid_ptr)  # rows past the step's real count are graph padding
    missed = (phys >= host_offset) & pm & real
    elig = missed & (ids >= 0) & (ids < E)
    link_per = tl.load(cost_ptr + 0)
    fixed = tl.load(cost_ptr + 1)
    per_expert = tl.load(cost_ptr + 2)
    per_pair = tl.load(cost_ptr + 3)
    if EXPERT_SPACE:
        # A big step (past BIG_STEP_PAIRS): [E] tables instead of [P, P]. Each candidate expert gets one
        # int64 key that sorts in the candidates' order -- (missed pairs, id), (score, missed pairs, id) or,
        # PAIRS_FIRST, (missed pairs, score, id) -- so the order is one sort and the pairs' prefix one scan.
        # The scratch's first BLOCK_E words count missed pairs per expert, the next BLOCK_E hold the keys,
        # which the pairs gather back by id (one program: a barrier orders the stores before the loads).
        e = tl.arange(0, BLOCK_E)
        tl.store(scratch_ptr + e, tl.zeros([BLOCK_E], dtype=tl.int64))
        tl.debug_barrier()
        tl.atomic_add(scratch_ptr + ids, tl.full([BLOCK_P], 1, tl.int64), mask=elig)
        tl.debug_barrier()
        pairs_e = tl.load(scratch_ptr + e, volatile=True)
        cand = pairs_e > 0
        m = tl.sum(cand.to(tl.int32), axis=0)
        key_e = (pairs_e << 20) | e.to(tl.int64)  # pairs < 2^10, ids < 2^20 (split_and_stage checks)
        if HAS_PRIO:
            pr_e = tl.load(prio_ptr + e, mask=e < E, other=0.0).to(tl.float32)
            bits = tl.where(pr_e == 0.0, 0.0, pr_e).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF  # -0.0 as 0.0
            ordered = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)  # float order as unsigned order
            if PAIRS_FIRST:
                key_e = (pairs_e << 52) | (ordered << 20) | e.to(tl.int64)
            else:
                key_e = (ordered << 30) | key_e
        key_e = tl.where(cand, key_e, 0x7FFFFFFFFFFFFFFF)  # non-candidates sort last
        srt = tl.sort(key_e)
        if HAS_PRIO and PAIRS_FIRST:
            s_pairs = srt >> 52
        else:
            s_pairs = (srt >> 20) & 1023
        j = e + 1  # the curve's n = j: the first j candidates go to the CPU
        prefix = tl.cumsum(tl.where(j <= m, s_pairs, 0), axis=0)
        nf = j.to(tl.float64)
        cpu = fixed + nf * per_expert + prefix.to(tl.float64) * per_pair
        link = tl.maximum(m.to(tl.float64) - nf, 0.0) * link_per
        step = tl.where((j <= m) & (prefix <= pair_limit), tl.maximum(cpu, link), float("inf"))
        low = tl.min(step, axis=0)
        best = tl.where(m.to(tl.float64) * link_per <= low, 0, tl.min(tl.where(step == low, j, BLOCK_E + 1), axis=0))  # first minimum
        kth = tl.sum(tl.where(j == best, srt, 0), axis=0)  # the last CPU candidate's key (0 when best == 0)
        tl.store(scratch_ptr + BLOCK_E + e, key_e)
        tl.debug_barrier()
        key_p = tl.load(scratch_ptr + BLOCK_E + ids, mask=elig, other=0x7FFFFFFFFFFFFFFF, volatile=True)
        cpu_pair = elig & (best > 0) & (key_p <= kth)
    else:
        same = (ids[:, None] == ids[None, :]) & elig[:, None] & elig[None, :]  # [P, P]: pairs of one missed expert
        pairs = tl.sum(same.to(tl.int32), axis=1)  # missed pairs of pair p's expert
        first = elig & (tl.sum((same & (p[None, :] < p[:, None])).to(tl.int32), axis=1) == 0)  # one pair stands for its expert
        m = tl.sum(first.to(tl.int32), axis=0)
        key = pairs * E + ids  # CPU candidates by (missed pairs, id): unique per expert
        before = key[None, :] < key[:, None]
        if HAS_PRIO:  # the composed mode: lowest cache score first, then (missed pairs, id)
            pr = tl.load(prio_ptr + ids, mask=elig, other=0.0).to(tl.float32)
            if PAIRS_FIRST:  # a budgeted step: (missed pairs, score, id)
                by_prio = (pr[None, :] < pr[:, None]) | ((pr[None, :] == pr[:, None]) & (ids[None, :] < ids[:, None]))
                before = (pairs[None, :] < pairs[:, None]) | ((pairs[None, :] == pairs[:, None]) & by_prio)
            else:
                before = (pr[None, :] < pr[:, None]) | ((pr[None, :] == pr[:, None]) & before)
        rank = tl.sum((first[None, :] & before).to(tl.int32), axis=1)
        n = tl.arange(0, BLOCK_N)
        prefix = tl.sum(tl.where((rank[None, :] < n[:, None]) & first[None, :], pairs[None, :], 0), axis=1)
        nf = n.to(tl.float64)
        cpu = tl.where(n > 0, fixed, 0.0) + nf * per_expert + prefix.to(tl.float64) * per_pair
        link = tl.maximum(m.to(tl.float64) - nf, 0.0) * link_per
        step = tl.where((n <= m) & (prefix <= pair_limit), tl.maximum(cpu, link), float("inf"))  # the pair budget
        best = tl.min(tl.where(step == tl.min(step, axis=0), n, BLOCK_N), axis=0)  # first minimum
        cpu_pair = elig & (rank < best)
    # the host's inputs first, then the post (the team starts on it), then what only the device reads
    tl.store(st_ids_ptr + p, tl.where(cpu_pair, phys - host_offset, ids).to(tl.int32), mask=pm)  # a CPU pair: its host row
    tl.store(st_mask_ptr + p, cpu_pair.to(tl.uint8), mask=pm)
    tl.store(st_w_ptr + p, w, mask=pm)
    if POST:
        if best > 0:
            for x0 in range(0, n_x, BLOCK_X):
                xo = x0 + tl.arange(0, BLOCK_X)
                tl.store(st_x_ptr + xo, tl.load(x_ptr + xo, mask=xo < n_x), mask=xo < n_x)
            if SEQ_ON_DEVICE:
                seq = tl.load(posted_ptr) + 1
            else:
                seq = tl.load(mailbox_ptr + MAILBOX_SEQ, volatile=True) + 1
            tl.store(mailbox_ptr + MAILBOX_RING + seq % RING, job_address)
            tl.debug_barrier()  # every thread's staging stores precede the fence below
            if FENCE:
                seq = tl.inline_asm_elementwise("fence.sc.sys;\n mov.b64 $0, $1;", "=l,l", [seq], dtype=tl.int64, is_pure=False, pack=1)
            tl.store(mailbox_ptr + MAILBOX_SEQ, seq)
            tl.store(expected_ptr, seq)
            if SEQ_ON_DEVICE:
                tl.store(posted_ptr, seq)
    tl.store(gpu_ids_ptr + p, tl.where(cpu_pair, filler, phys).to(gpu_ids_ptr.dtype.element_ty), mask=pm)
    tl.store(cpu_pairs_ptr + p, cpu_pair.to(tl.int1), mask=pm)
    tl.store(counters_ptr + 0, tl.load(counters_ptr + 0) + m.to(tl.int64))
    tl.store(counters_ptr + 1, tl.load(counters_ptr + 1) + best.to(tl.int64))
    tl.store(counters_ptr + 2, tl.load(counters_ptr + 2) + tl.sum(missed.to(tl.int32), axis=0).to(tl.int64))
    tl.store(counters_ptr + 3, tl.load(counters_ptr + 3) + tl.sum(cpu_pair.to(tl.int32), axis=0).to(tl.int64))


def _wait_merge_kernel(  # type: ignore[no-untyped-def]
    per_k_ptr, cpu_out_ptr, cpu_pairs_ptr, mailbox_ptr, expected_ptr, timeouts_ptr, flag_ptr, stalled_ptr,
    x_ptr, ids_ptr, w_ptr, w13_ptr, w2_ptr, scratch_ptr, s13, s2, row_offset, top_k, I,
    H, limit, q13_ptr, q2_ptr, q13_row, q2_row, bn13, bk13, nbk13, bn2, bk2, nbk2,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FENCE: tl.constexpr, FP8: tl.constexpr,
):
    p = tl.program_id(0)
    if tl.load(cpu_pairs_ptr + p) != 0:
        want = tl.load(expected_ptr)
        polls = 0
        # one read of the mapped ``done`` word when the team already finished (each is a PCIe round trip)
        done = tl.load(mailbox_ptr + MAILBOX_DONE, volatile=True)
        # behind a step that already timed out: do not wait again, recompute
        budget = tl.where(done < tl.load(stalled_ptr, volatile=True), 0, limit)
        while (done < want) & (polls < budget):
            done = tl.load(mailbox_ptr + MAILBOX_DONE, volatile=True)
            polls += 1
        if done < want:
            tl.atomic_add(timeouts_ptr, 1)
            tl.atomic_max(stalled_ptr, want)
            tl.store(flag_ptr, 1)  # host-visible: the worker logs the timeout after the step
            # The pair from its host row over the link, as the CPU kernel computes it:
            # h = bf16(x W13^T), a = bf16(bf16(silu(h_gate)) * h_up), y = bf16(fp32(a W2^T) * w).
            e = tl.load(ids_ptr + p).to(tl.int64)
            wt = tl.load(w_ptr + p).to(tl.float32)
            tok = p // top_k
            base13 = w13_ptr + (row_offset + e) * s13
            base2 = w2_ptr + (row_offset + e) * s2
            for i0 in range(0, I, BLOCK_R):
                r = i0 + tl.arange(0, BLOCK_R)
                rm = r < I
                g = tl.zeros([BLOCK_R], dtype=tl.float32)
                u = tl.zeros([BLOCK_R], dtype=tl.float32)
                for h0 in range(0, H, BLOCK_C):
                    c = h0 + tl.arange(0, BLOCK_C)
                    cm = c < H
                    xv = tl.load(x_ptr + tok * H + c, mask=cm, other=0.0, volatile=True).to(tl.float32)
                    m2 = rm[:, None] & cm[None, :]
                    if FP8:  # uint8 rows: e4m3fn decoded exactly, times the scale of each weight's [bn, bk] block
                        q13 = q13_ptr + (row_offset + e) * q13_row + (c // bk13)[None, :]
                        b = tl.load(base13 + r[:, None] * H + c[None, :], mask=m2, other=0).to(tl.int32)
                        ex = ((b >> 3) & 15).to(tl.float32)
                        mt = (b & 7).to(tl.float32)
                        mag = tl.where(ex > 0, (8.0 + mt) * tl.exp2(ex - 10.0), mt * 0.001953125)  # (1+m/8)2^(e-7); m 2^-9
                        wg = tl.where((b & 128) != 0, -mag, mag) * tl.load(q13 + (r // bn13)[:, None] * nbk13, mask=m2, other=0.0)
                        b = tl.load(base13 + (r[:, None] + I) * H + c[None, :], mask=m2, other=0).to(tl.int32)
                        ex = ((b >> 3) & 15).to(tl.float32)
                        mt = (b & 7).to(tl.float32)
                        mag = tl.where(ex > 0, (8.0 + mt) * tl.exp2(ex - 10.0), mt * 0.001953125)
                        wu = tl.where((b & 128) != 0, -mag, mag) * tl.load(q13 + ((r + I) // bn13)[:, None] * nbk13, mask=m2, other=0.0)
                    else:
                        wg = tl.load(base13 + r[:, None] * H + c[None, :], mask=m2, other=0.0).to(tl.float32)
                        wu = tl.load(base13 + (r[:, None] + I) * H + c[None, :], mask=m2, other=0.0).to(tl.float32)
                    g += tl.sum(wg * xv[None, :], axis=1)
                    u += tl.sum(wu * xv[None, :], axis=1)
                g = g.to(tl.bfloat16).to(tl.float32)
                u = u.to(tl.bfloat16).to(tl.float32)
                a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32) * u
                tl.store(scratch_ptr + p * I + r, a.to(tl.bfloat16).to(tl.float32), mask=rm)
            tl.debug_barrier()  # the whole activation row is in scratch before the second product reads it
            for h0 in range(0, H, BLOCK_R):
                o = h0 + tl.arange(0, BLOCK_R)
                om = o < H
                acc = tl.zeros([BLOCK_R], dtype=tl.float32)
                for i0 in range(0, I, BLOCK_C):
                    c = i0 + tl.arange(0, BLOCK_C)
                    cm = c < I
                    av = tl.load(scratch_ptr + p * I + c, mask=cm, other=0.0)
                    mo = om[:, None] & cm[None, :]
                    if FP8:
                        b = tl.load(base2 + o[:, None] * I + c[None, :], mask=mo, other=0).to(tl.int32)
                        ex = ((b >> 3) & 15).to(tl.float32)
                        mt = (b & 7).to(tl.float32)
                        mag = tl.where(ex > 0, (8.0 + mt) * tl.exp2(ex - 10.0), mt * 0.001953125)
                        wv = tl.where((b & 128) != 0, -mag, mag) * tl.load(q2_ptr + (row_offset + e) * q2_row + (o // bn2)[:, None] * nbk2 + (c // bk2)[None, :], mask=mo, other=0.0)
                    else:
                        wv = tl.load(base2 + o[:, None] * I + c[None, :], mask=mo, other=0.0).to(tl.float32)
                    acc += tl.sum(wv * av[None, :], axis=1)
                tl.store(per_k_ptr + p * H + o, (acc * wt).to(tl.bfloat16), mask=om)
        else:
            if FENCE:  # the outputs are read after the poll saw them done
                want = tl.inline_asm_elementwise("fence.sc.sys;\n mov.b64 $0, $1;", "=l,l", [want], dtype=tl.int64, is_pure=False, pack=1)
            for h0 in range(0, H, BLOCK_H):
                ho = h0 + tl.arange(0, BLOCK_H)
                row = tl.load(cpu_out_ptr + p * H + ho, mask=ho < H, volatile=True)
                tl.store(per_k_ptr + p * H + ho, row, mask=ho < H)


@functools.lru_cache(maxsize=4)
def jitted(name: str, interpret: bool) -> Any:
    """Wrapped on first use: Triton decides between compiling and interpreting when it wraps."""
    return triton.jit(_split_kernel if name == "split" else _wait_merge_kernel)


def _interpreted() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def split_and_stage(
    topk_ids: torch.Tensor, phys: torch.Tensor, topk_weights: torch.Tensor, cost: torch.Tensor, valid_rows: torch.Tensor,
    host_offset: int, filler: int, num_experts: int, gpu_ids: torch.Tensor, cpu_pairs: torch.Tensor, st_ids: torch.Tensor,
    st_mask: torch.Tensor, st_weights: torch.Tensor, counters: torch.Tensor,
    post: "Post | None" = None, *, priority: torch.Tensor | None = None, pair_limit: int | None = None,
    pairs_first: bool = False, num_warps: int | None = None, block_x: int = SPLIT_BLOCK_X,
    scratch: torch.Tensor | None = None, expert_space: bool | None = None,
) -> None:
    """One launch: ``gpu_ids`` [T, K], ``cpu_pairs`` [T, K] bool, the host's staged ids / mask / weights, counters += step's.

    ``valid_rows`` [1] int32 on the device: the step's real token rows; padding rows never count as
    misses (the CPU computes nothing for them, the GPU keeps their ids). With ``post``, a step that
    gave the CPU any pair also stages ``post.x`` and posts ``post.job_address`` to the team.
    ``priority`` [E] float32 (the online cache's scores): the CPU takes the lowest first (``plan_split``'s rule).
    ``pair_limit`` (``CostModel.pair_limit``; None: every pair) bounds the CPU's missed pairs; ``pairs_first``
    (``CostModel.budgeted``) orders prioritised candidates by missed pairs first.
    Steps of more than ``BIG_STEP_PAIRS`` pairs (or ``expert_space=True``) take the expert-space program:
    it needs ``scratch``, int64 on the device with ``scratch_words(num_experts)`` words (``None``: allocated
    here, which a captured graph should not do on every launch).
    """
    n_pairs = topk_ids.numel()
    limit = n_pairs if pair_limit is None else max(0, min(int(pair_limit), n_pairs))
    if expert_space is None:
        expert_space = n_pairs > BIG_STEP_PAIRS
    words = scratch_words(num_experts)  # 2 x BLOCK_E
    if expert_space:
        if n_pairs >= 1 << 10 or num_experts >= 1 << 20:
            raise ValueError(f"the expert-space split keys hold < 1024 pairs and < 2^20 experts, got {n_pairs} and {num_experts}")
        if scratch is None:
            scratch = torch.empty(words, dtype=torch.int64, device=topk_ids.device)
        if scratch.dtype != torch.int64 or scratch.numel() < words or scratch.device != topk_ids.device:
            raise ValueError(f"the split's scratch must be int64 on {topk_ids.device} with {words} words, "
                             f"got {scratch.dtype} {scratch.numel()} on {scratch.device}")
    if num_warps is None:
        num_warps = SPLIT_WARPS if n_pairs <= BIG_STEP_PAIRS or expert_space else BIG_STEP_WARPS
    if block_x < 16 or block_x & (block_x - 1):
        raise ValueError(f"block_x={block_x} must be a power of two >= 16")
    interpret = _interpreted()
    kernel = jitted("split", interpret)
    p = post or Post.none(topk_ids.device)
    posted = p.expected if p.posted is None else p.posted  # without a device seq the kernel never touches posted_ptr
    kernel[(1,)](
        topk_ids, phys, topk_weights, cost, valid_rows, gpu_ids, cpu_pairs, st_ids, st_mask, st_weights, counters,
        p.x, p.staged_x, p.mailbox, p.expected, posted, p.job_address, priority if priority is not None else cost,
        scratch if expert_space else counters, n_pairs, topk_ids.shape[1], host_offset, filler, num_experts, p.x.numel(), limit,
        # n = 0..min(pairs, E, limit): every CPU expert holds at least one of the limit's pairs
        BLOCK_P=triton.next_power_of_2(max(n_pairs, 2)), BLOCK_N=triton.next_power_of_2(max(min(n_pairs, num_experts, limit) + 1, 2)),
        BLOCK_X=block_x, POST=post is not None, FENCE=not interpret, SEQ_ON_DEVICE=p.posted is not None,
        HAS_PRIO=priority is not None, PAIRS_FIRST=bool(pairs_first) and priority is not None,
        EXPERT_SPACE=bool(expert_space), BLOCK_E=words // 2, num_warps=num_warps,
    )


def scratch_words(num_experts: int) -> int:
    """int64 words of the expert-space split's scratch: per expert, its missed pairs and its key."""
    return 2 * triton.next_power_of_2(max(num_experts, 2))


class Post:
    """Where a step is posted: hidden states to stage, the team's mailbox (device view), the step's expected seq.

    ``posted`` (optional, [1] int64 on the device, one per mailbox): the last posted seq kept on the
    device, so the post needs no read of host memory; whoever else posts must keep it current.
    """

    def __init__(self, x: torch.Tensor, staged_x: torch.Tensor, mailbox: torch.Tensor, expected: torch.Tensor, job_address: int,
                 posted: torch.Tensor | None = None):
        if x.shape != staged_x.shape or x.dtype != staged_x.dtype or not (x.is_contiguous() and staged_x.is_contiguous()):
            raise ValueError(f"hidden states {tuple(x.shape)} {x.dtype} do not fit the staging {tuple(staged_x.shape)} {staged_x.dtype}")
        if posted is not None and posted.device != x.device:
            raise ValueError(f"the team's posted seq lives on {posted.device}, the step runs on {x.device}: one team serves one device")
        self.x, self.staged_x, self.mailbox, self.expected, self.job_address = x, staged_x, mailbox, expected, job_address
        self.posted = posted

    @staticmethod
    def none(device: torch.device) -> "Post":
        z = torch.zeros(1, dtype=torch.int64, device=device)
        return Post(z, z, z, z, 0)


@dataclass(frozen=True)
class Recompute:
    """What a timed-out CPU pair is recomputed from on the device: the step's staged hidden states
    ``x`` [T, H] bf16, ids [T*K] int32 and routing weights [T*K] fp32 (device views of the staging),
    the bank ``w13`` [R, 2I, H] / ``w2`` [R, H, I] (host rows read over the link; FP8 rows with ``quant``,
    their scales per bank row on the device), ``scratch``
    [T*K, I] fp32 on the device, ``flag`` [1] int32 the host can read without a sync (mapped), and
    ``stalled`` [1] int64 on the device: the latest step that timed out (shared by a team's layers)."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    row_offset: int
    top_k: int
    scratch: torch.Tensor
    flag: torch.Tensor
    stalled: torch.Tensor
    quant: ExpertQuant | None = None

    def check(self, n: int, h: int) -> None:
        i = int(self.w2.shape[2])
        if (self.x.shape[1] != h or self.x.shape[0] * self.top_k < n or self.ids.numel() < n or self.weights.numel() < n
                or self.scratch.numel() < n * i or self.w13.shape[1:] != (2 * i, h) or self.w13[0].stride() != (h, 1)
                or self.w2[0].stride() != (i, 1) or not (self.x.is_contiguous() and self.scratch.is_contiguous())):
            raise ValueError(f"recompute buffers x {tuple(self.x.shape)} ids {self.ids.numel()} scratch {tuple(self.scratch.shape)} "
                             f"bank {tuple(self.w13.shape)} / {tuple(self.w2.shape)} do not fit {n} pairs of hidden size {h}")


def wait_and_merge(per_k: torch.Tensor, cpu_out: torch.Tensor, cpu_pairs: torch.Tensor, mailbox: torch.Tensor,
                   expected: torch.Tensor, timeouts: torch.Tensor, recompute: Recompute, limit: int = WAIT_LIMIT) -> None:
    """In place: the CPU pairs' rows of ``per_k`` [T*K, H] become the team's outputs once it has
    finished the step, or, past ``limit`` polls, the pair recomputed on the device (``Recompute``)."""
    n, h = per_k.shape
    if cpu_out.shape[1] != h or cpu_out.shape[0] < n or cpu_pairs.numel() != n or not per_k.is_contiguous():
        raise ValueError(f"per-k rows {tuple(per_k.shape)} do not fit CPU outputs {tuple(cpu_out.shape)} / pairs {cpu_pairs.numel()}")
    recompute.check(n, h)
    r = recompute
    q = r.quant
    w13, w2 = (r.w13.view(torch.uint8), r.w2.view(torch.uint8)) if q is not None else (r.w13, r.w2)
    q13, q2 = (q.w13.scales, q.w2.scales) if q is not None else (r.scratch, r.scratch)  # unread without FP8
    blocks = (q.w13.bn, q.w13.bk, q.w13.scales.shape[2], q.w2.bn, q.w2.bk, q.w2.scales.shape[2]) if q is not None else (1,) * 6
    jitted("merge", _interpreted())[(n,)](
        per_k, cpu_out, cpu_pairs, mailbox, expected, timeouts, r.flag, r.stalled,
        r.x, r.ids, r.weights, w13, w2, r.scratch, r.w13.stride(0), r.w2.stride(0), r.row_offset, r.top_k, int(r.w2.shape[2]),
        h, limit, q13, q2, q13.stride(0), q2.stride(0), *blocks,
        BLOCK_H=min(triton.next_power_of_2(h), 4096), BLOCK_R=32, BLOCK_C=64, FENCE=not _interpreted(), FP8=q is not None,
        num_warps=MERGE_WARPS)
