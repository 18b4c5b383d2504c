"""The online cache's step fused into one Triton program per layer (semantics: ``online_cache.LayerCache``'s torch code).

Why: the torch core is ~70 tiny kernels per layer per step; at 48 layers that is
thousands of graph nodes per decode step. This program does observe + select +
commit (host-row rotation too, in RAM-complement mode) + trigger rows + the final
remap in one launch (E, S and C fit one program: E <= 1024). Composed with the
CPU path (``HAS_CPU``), the experts the split gave the CPU are no candidates and
their pairs remap to the filler row. Kept bit-identical to the torch core: the
score update runs with floating-point contraction off (``enable_fp_fusion=False``),
selections break ties to the lower index as the core's stable sorts do. CI runs it
under ``TRITON_INTERPRET=1`` against the core.

Imported only where Triton is used; wrapped with ``triton.jit`` on first use.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl


def _policy_kernel(  # type: ignore[no-untyped-def]
    ids_ptr, out_ptr, n_elem, valid_ptr, score_ptr, pm_ptr, owners_ptr, prot_ptr, rowown_ptr,
    pair_valid_ptr, pair_cand_ptr, pair_slot_ptr, pair_victim_ptr, pair_src_ptr, pair_dst_ptr, pair_evict_ptr, trig_ptr, counts_ptr,
    cpu_ptr, decay, hyst, host_row_offset, num_experts, num_slots, num_rows, filler,
    K: tl.constexpr, C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_TRIG: tl.constexpr, COMPLEMENT: tl.constexpr, HAS_CPU: tl.constexpr,
):
    big = 1 << 30
    ninf = float("-inf")
    pinf = float("inf")
    e_r = tl.arange(0, BLOCK_E)
    emask = e_r < num_experts
    s_r = tl.arange(0, BLOCK_S)
    smask = s_r < num_slots
    n_rows = n_elem // K
    if HAS_VALID:
        n_rows = tl.minimum(tl.load(valid_ptr), n_rows)
    # 1. routed indicator and the first real row routing each expert; the CPU's experts of the step (composed mode)
    first = tl.full([BLOCK_E], big, tl.int32)
    on_cpu = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, n_elem, BLOCK_T):
        offs = start + tl.arange(0, BLOCK_T)
        row = (offs // K).to(tl.int32)
        m = (offs < n_elem) & (row < n_rows)
        x = tl.load(ids_ptr + offs, mask=m, other=-1).to(tl.int32)
        hit = (x[None, :] == e_r[:, None]) & m[None, :]
        first = tl.minimum(first, tl.min(tl.where(hit, row[None, :], big), axis=1))
        if HAS_CPU:
            xc = tl.load(cpu_ptr + offs, mask=m, other=0) != 0
            on_cpu += tl.sum((hit & xc[None, :]).to(tl.int32), axis=1)
    routed = first < big
    # 2. scores (fp contraction is off at launch: mul, then add, as the core rounds)
    s = tl.load(score_ptr + e_r, mask=emask, other=0.0)
    s = s * decay + tl.where(routed, 1.0, 0.0)
    tl.store(score_ptr + e_r, s, mask=emask)
    # 3. candidates, victims, pairs
    pm = tl.load(pm_ptr + e_r, mask=emask, other=0)
    resident = pm < host_row_offset
    prot = tl.load(prot_ptr + e_r, mask=emask, other=1) != 0
    ckey = tl.where(routed & ~resident & (on_cpu == 0) & emask, s, ninf)
    ekey = tl.where(resident & ~routed & ~prot & emask, s, pinf)
    own = tl.load(owners_ptr + s_r, mask=smask, other=0)
    free = (own < 0) & smask
    # complement mode: host-row owners; spares are the rows free at the start of the step
    r_r = tl.arange(0, BLOCK_R)
    rmask = r_r < num_rows
    rown = tl.load(rowown_ptr + r_r, mask=rmask, other=0)
    spare = (rown < 0) & rmask
    promoted = 0
    evicted = 0
    for i in tl.static_range(C):
        cv = tl.max(ckey, axis=0)
        ci = tl.min(tl.where(ckey == cv, e_r, big), axis=0)
        ckey = tl.where(e_r == ci, ninf, ckey)
        fs = tl.min(tl.where(free, s_r, big), axis=0)
        has_free = fs < big
        free = free & (s_r != fs)
        vm = tl.min(ekey, axis=0)
        vi = tl.min(tl.where(ekey == vm, e_r, big), axis=0)
        # scalar conditions select an index (-1: none) rather than broadcast a scalar bool
        ekey = tl.where(e_r == tl.where(has_free, -1, vi), pinf, ekey)
        vk = tl.where(has_free, ninf, vm)
        ok = (cv > ninf) & (vk < pinf) & (cv > tl.where(vk < pinf, vk, 0.0) + hyst)  # no inf - inf
        slot = tl.where(has_free, fs, tl.sum(tl.where(e_r == vi, pm, 0), axis=0))
        if COMPLEMENT:  # an evicting pair takes the lowest spare row; none left: not taken
            sp = tl.min(tl.where(spare, r_r, big), axis=0)
            ok = ok & (has_free | (sp < big))
            evict = ok & ~has_free
            dst = tl.where(evict, sp, -1)
            spare = spare & (r_r != dst)
        else:
            evict = ok & ~has_free
            dst = tl.where(evict, vi, -1)
        victim = tl.where(evict, vi, -1)
        src = tl.where(ok, tl.sum(tl.where(e_r == ci, pm, 0), axis=0) - host_row_offset, 0)  # before ci moves
        pm = tl.where(e_r == victim, host_row_offset + dst, pm)
        pm = tl.where(e_r == tl.where(ok, ci, -1), slot, pm)
        if COMPLEMENT:  # rotation: the victim owns its spare, the promoted expert's row is spare from the next step
            rown = tl.where(r_r == dst, victim, rown)
            rown = tl.where(r_r == tl.where(ok, src, -1), -1, rown)
        own = tl.where(s_r == tl.where(ok, slot, -1), ci, own)
        promoted += ok.to(tl.int64)
        evicted += evict.to(tl.int64)
        tl.store(pair_valid_ptr + i, ok.to(tl.uint8))
        tl.store(pair_cand_ptr + i, ci.to(tl.int64))
        tl.store(pair_slot_ptr + i, tl.where(ok, slot, 0).to(tl.int64))  # a pair not taken names slot 0 (copied onto itself)
        tl.store(pair_victim_ptr + i, victim.to(tl.int64))
        tl.store(pair_src_ptr + i, src.to(tl.int64))
        tl.store(pair_dst_ptr + i, dst.to(tl.int64))
        tl.store(pair_evict_ptr + i, evict.to(tl.uint8))
        if HAS_TRIG:
            tl.store(trig_ptr + i, tl.where(ok, tl.sum(tl.where(e_r == ci, first, 0), axis=0), -1))
    # 4. commit: routing table, slot owners, counters
    tl.store(pm_ptr + e_r, pm, mask=emask)
    tl.store(owners_ptr + s_r, own, mask=smask)
    if COMPLEMENT:
        tl.store(rowown_ptr + r_r, rown, mask=rmask)
    tl.store(counts_ptr + 0, tl.load(counts_ptr + 0) + promoted)
    tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + evicted)
    tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + 1)
    tl.debug_barrier()  # the table stores above are visible to every thread of this program
    # 5. the step's ids (padding rows too) from the updated table
    for start in range(0, n_elem, BLOCK_T):
        offs = start + tl.arange(0, BLOCK_T)
        m = offs < n_elem
        x = tl.load(ids_ptr + offs, mask=m, other=0)
        v = tl.load(pm_ptr + x, mask=m, other=0)
        if HAS_CPU:  # the CPU's pairs read the filler row (HBM): their experts' bytes never cross the link
            v = tl.where(tl.load(cpu_ptr + offs, mask=m, other=0) != 0, filler, v)
        tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=m)


@functools.lru_cache(maxsize=2)
def jitted(interpret: bool) -> Any:
    """The fused policy kernel; cached per interpreter mode."""
    return triton.jit(_policy_kernel)
