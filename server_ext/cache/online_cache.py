"""Online expert cache of one MoE layer: promote on miss, inside the forward, on the device.

Why here: at batch 1 a missed expert's bytes cross the host link anyway (the
fused kernel reads its host row over UVA), so copying them into a slot first
costs no extra link bytes and every later hit is free. The policy is capped
LFRU, the best online rule on our traces (``planning/cache_policies.LFRU``
with ``cap`` is this code rule for rule; ``reap-swap simulate`` scores it as
``lfru_cap``).

Per step, with the step's routed ids ``[T, K]`` (logical ids, rows past
``valid_rows`` are CUDA-graph padding and ignored):

1. ``score = score * decay + routed`` (routed: the expert is routed by at least
   one row of the step);
2. candidates: routed experts that are not resident, highest score first
   (ties: lower id), at most ``C``;
3. victims: free slots first, then residents the step does not route and that
   are not ``protected``, lowest score first (ties: lower id);
4. pair ``i`` is taken while ``cand > victim + hysteresis`` (``None``: always);
5. the copy kernel moves each taken pair's host row into its slot, then the
   routing table and slot owners change (``commit``); the caller remaps the
   step's ids from the new table before the fused kernel runs.

RAM-complement mode (``host_rows``: the bank has only ``R`` host rows, one per
non-resident expert plus spares): an evicted expert has no host copy, so each
evicting pair also takes the lowest free spare row (``row_owner[r] == -1`` at
the start of the step), the eviction copy writes the victim's slot into it
(device -> host, before the promotion copies overwrite that slot), and the
promoted expert's old row becomes a spare from the next step on (rotation: no
host memcpy; rows a step frees are never written in that step). A layer needs
at least ``C`` spares; the pool never shrinks below its start count.

Everything is tensor ops of fixed shape (``C``, ``S``, ``E``), with no host
synchronization and no Python branch on a tensor value, so the same code runs
on CPU (CI) and inside CUDA graphs. On CUDA the same step runs by default as
one Triton program per layer (``policy_triton.py``: steps 1-4, the table
update and the remap; then the copy), bit-identical to these torch ops (CI
compares them under Triton's interpreter). An expert the step routes is never a
victim, so the fused kernel never reads a slot that changed under it; in
full-copy mode an evicted expert's bytes already live in its host row, so
eviction only repoints its table entry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .promote import copy_rows, exchange_rows, exchange_rows_reference

NEG_INF = float("-inf")
POS_INF = float("inf")


@dataclass(frozen=True)
class CacheParams:
    cap: int
    """Promotions per layer per step (C)."""
    decay: float = 0.9
    hysteresis: float | None = None
    """Promote only while candidate score > victim score + this; None: always (LFRU)."""
    prior_weight: float = 1.0
    """A control-plane swap's set enters the scores at this share of an always-routed expert's steady score."""
    fused: bool = True
    """On CUDA, run the step as one Triton program (``policy_triton.py``) instead of ~70 small torch kernels."""

    @property
    def steady(self) -> float:
        """Steady-state score of an expert routed every step: 1 / (1 - decay)."""
        return 1.0 / (1.0 - self.decay)


@dataclass
class Pairs:
    """One step's promotion pairs (all [C])."""

    valid: torch.Tensor  # bool
    cand: torch.Tensor  # int64 logical expert promoted
    slot: torch.Tensor  # int64 slot it goes to (meaningful where valid)
    victim: torch.Tensor  # int64 logical expert evicted, -1 for a free slot or an invalid pair
    src: torch.Tensor  # int64 host row the candidate is read from (its id in full-copy mode), 0 where invalid
    dst: torch.Tensor  # int64 host row the victim goes to (its id in full-copy mode, a spare in complement mode), -1: none


CopyFn = Callable[[Sequence[torch.Tensor], torch.Tensor, torch.Tensor, int, torch.Tensor, int], None]
"""``copy_rows(rows, valid, src, src_offset, dst, dst_offset)`` (``promote.py``)."""


class LayerCache:
    """Device state of one layer: scores, slot owners, protection, counters; and its step."""

    def __init__(self, num_experts: int, num_slots: int, host_row_offset: int, phys_map: torch.Tensor, params: CacheParams,
                 host_rows: int | None = None):
        """``host_rows``: RAM-complement mode with that many host rows (None: full host copy, row e = expert e)."""
        if not 0 < num_slots <= num_experts:
            raise ValueError(f"online cache needs 1..{num_experts} slots, got {num_slots}")
        if params.cap < 1 or not 0.0 < params.decay < 1.0:
            raise ValueError(f"online cache: cap must be >= 1 and decay in (0, 1), got {params.cap}, {params.decay}")
        dev = phys_map.device
        self.num_experts, self.num_slots, self.host_row_offset = num_experts, num_slots, host_row_offset
        self.cap = min(params.cap, num_slots)
        self.params = params
        self.phys_map = phys_map
        self.score = torch.zeros(num_experts, dtype=torch.float32, device=dev)
        self.expert_in_slot = torch.full((num_slots,), -1, dtype=torch.int32, device=dev)
        self.protected = torch.zeros(num_experts, dtype=torch.bool, device=dev)
        self.counts = torch.zeros(3, dtype=torch.int64, device=dev)  # promotions, evictions, steps
        self.promotions, self.evictions, self.steps = self.counts[0:1], self.counts[1:2], self.counts[2:3]
        self.fused = dev.type == "cuda" and params.fused
        self._hyst = NEG_INF if params.hysteresis is None else float(params.hysteresis)
        self._free_key = torch.tensor([NEG_INF, POS_INF], dtype=torch.float32, device=dev)
        self.complement = host_rows is not None
        if host_rows is not None and not num_experts - num_slots < host_rows <= num_experts:
            raise ValueError(f"RAM complement: {host_rows} host rows for {num_experts} experts in {num_slots} slots")
        self.num_rows = int(host_rows or 0)
        # never empty: the fused kernel takes its pointer in both modes (an empty CUDA tensor has none)
        self.row_owner = torch.full((max(1, self.num_rows),), -1, dtype=torch.int32, device=dev)
        """Complement mode: the expert each host row holds, -1 for a spare (one unused entry in full-copy mode)."""

    # ------------------------------------------------------------ per step (device, captured)

    def observe(self, ids: torch.Tensor, valid_rows: torch.Tensor | None) -> torch.Tensor:
        """Decay the scores and add this step's routed indicator; returns routed [E] bool."""
        e = self.num_experts
        t, k = ids.shape
        flat = ids.reshape(-1).to(torch.int64)
        if valid_rows is not None:
            row = torch.arange(t * k, device=ids.device) // k
            flat = torch.where(row < valid_rows, flat, e)  # padding rows go to a dummy entry
        ind = torch.zeros(e + 1, dtype=torch.float32, device=ids.device).index_fill_(0, flat, 1.0)[:e]
        self.score.mul_(self.params.decay).add_(ind)
        self.steps.add_(1)
        return ind > 0

    def select(self, routed: torch.Tensor, on_cpu: torch.Tensor | None = None) -> Pairs:
        """Candidates, victims and their pairing, from the updated scores (no state changes).

        ``on_cpu`` [E] bool (composed mode): experts the CPU computes this step; never candidates."""
        s, c = self.num_slots, self.cap
        resident = self.phys_map < self.host_row_offset
        wanted = routed & ~resident if on_cpu is None else routed & ~resident & ~on_cpu
        cand_key = torch.where(wanted, self.score, NEG_INF)
        cv, ci = torch.sort(cand_key, descending=True, stable=True)
        cv, ci = cv[:c], ci[:c]
        free_key = self._free_key[(self.expert_in_slot >= 0).to(torch.int64)]  # -inf free, +inf taken
        eligible = resident & ~routed & ~self.protected
        exp_key = torch.where(eligible, self.score, POS_INF)
        vk, vi = torch.sort(torch.cat([free_key, exp_key]), stable=True)
        vk, vi = vk[:c], vi[:c]
        is_free = vi < s
        victim = torch.where(is_free, -1, vi - s)
        slot = torch.where(is_free, vi, self.phys_map.index_select(0, victim.clamp(min=0)).to(torch.int64))
        valid = (cv > NEG_INF) & (vk < POS_INF) & (cv > vk + self._hyst)
        if self.complement:  # each evicting pair takes the next spare row; none left: the pair is not taken
            evict = valid & ~is_free
            r = self.num_rows
            key = torch.where(self.row_owner < 0, torch.arange(r, device=slot.device), r)
            spares = torch.cat([torch.sort(key).values, key.new_full((c,), r)])
            rank = (torch.cumsum(evict.to(torch.int64), 0) - 1).clamp(min=0)
            row = spares.index_select(0, rank)
            valid = valid & ~(evict & (row >= r))
            dst = torch.where(valid & ~is_free, row, -1)
        else:
            dst = torch.where(valid & ~is_free, victim, -1)
        src = torch.where(valid, self.phys_map.index_select(0, ci).to(torch.int64) - self.host_row_offset, 0)
        # a pair not taken names slot 0 and host row 0: the reference copies it onto itself, never onto a taken pair's rows
        return Pairs(valid, ci, torch.where(valid, slot, 0), torch.where(valid, victim, -1), src, dst)

    def commit(self, p: Pairs) -> None:
        """Publish the pairs: victims to their host rows, candidates to their slots, slot owners."""
        e, s, h = self.num_experts, self.num_slots, self.host_row_offset
        pm = torch.cat([self.phys_map, self.phys_map.new_zeros(1)])  # index e: a dummy for masked writes
        out = torch.where(p.victim >= 0, p.victim, e)
        pm.index_put_((out,), (p.dst + h).to(pm.dtype))
        pm.index_put_((torch.where(p.valid, p.cand, e),), p.slot.to(pm.dtype))
        self.phys_map.copy_(pm[:e])
        owners = torch.cat([self.expert_in_slot, self.expert_in_slot.new_full((1,), -1)])
        owners.index_put_((torch.where(p.valid, p.slot, s),), p.cand.to(owners.dtype))
        self.expert_in_slot.copy_(owners[:s])
        if self.complement:  # the victim owns its spare row; the promoted expert's row is a spare from now on
            r = self.num_rows
            own = torch.cat([self.row_owner, self.row_owner.new_full((1,), -1)])
            own.index_put_((torch.where(p.victim >= 0, p.dst, r),), p.victim.to(own.dtype))
            own.index_put_((torch.where(p.valid, p.src, r),), own.new_full((p.src.shape[0],), -1))
            self.row_owner.copy_(own[:r])
        self.promotions.add_(p.valid.sum())
        self.evictions.add_((p.victim >= 0).sum())

    def trigger_rows(self, ids: torch.Tensor, p: Pairs) -> torch.Tensor:
        """[C] int32: the first token row that routed each promoted expert, -1 where no promotion."""
        t = ids.shape[0]
        hit = (ids.reshape(1, t, -1) == p.cand.view(-1, 1, 1).to(ids.dtype)).any(dim=2)  # [C, T]
        first = torch.argmax(hit.to(torch.int32), dim=1)
        return torch.where(p.valid, first, -1).to(torch.int32)

    def step(
        self,
        ids: torch.Tensor,
        rows: Sequence[torch.Tensor],
        valid_rows: torch.Tensor | None = None,
        trigger_out: torch.Tensor | None = None,
        copy: CopyFn = copy_rows,
        cpu_pairs: torch.Tensor | None = None,
        filler: int = 0,
    ) -> torch.Tensor:
        """Run one step and return ``ids`` remapped to physical rows after the promotions.

        ``rows``: the bank tensors of every per-expert parameter ([H + E, ...]). ``cpu_pairs``
        [T, K] bool (composed mode, the CPU split ran first): those pairs' experts are not promoted
        and the pairs remap to ``filler`` (a slot row the fused kernel may read; the merge replaces
        its output).
        """
        if self.fused:
            return self.step_fused(ids, rows, valid_rows, trigger_out, copy, cpu_pairs, filler)
        routed = self.observe(ids, valid_rows)
        on_cpu = None
        if cpu_pairs is not None:
            flat = torch.where(cpu_pairs.reshape(-1), ids.reshape(-1).to(torch.int64), self.num_experts)
            on_cpu = torch.zeros(self.num_experts + 1, dtype=torch.bool, device=ids.device).index_fill_(0, flat, True)[: self.num_experts]
        pairs = self.select(routed, on_cpu)
        self._move_rows(rows, pairs.valid, pairs.victim >= 0, pairs.src, pairs.slot, pairs.dst, copy)
        self.commit(pairs)  # after the copy, same stream: the fused kernel reads the landed slot
        if trigger_out is not None:
            trigger_out.copy_(self.trigger_rows(ids, pairs))
        out = self.phys_map.index_select(0, ids.reshape(-1)).view(ids.shape).to(ids.dtype)
        return out if cpu_pairs is None else torch.where(cpu_pairs, torch.full_like(out, filler), out)

    def step_fused(
        self,
        ids: torch.Tensor,
        rows: Sequence[torch.Tensor],
        valid_rows: torch.Tensor | None = None,
        trigger_out: torch.Tensor | None = None,
        copy: CopyFn = copy_rows,
        cpu_pairs: torch.Tensor | None = None,
        filler: int = 0,
    ) -> torch.Tensor:
        """``step`` as one Triton program, then the copy. The program publishes the table before
        the copy runs; no reader sits between them (the fused MoE kernel comes after both)."""
        from . import policy_triton

        kernel = policy_triton.jitted(os.environ.get("TRITON_INTERPRET", "0") == "1")
        ids = ids if ids.is_contiguous() else ids.contiguous()
        t, k = ids.shape
        c, dev = self.cap, ids.device
        out = torch.empty_like(ids)
        valid, evict = (torch.empty(c, dtype=torch.uint8, device=dev) for _ in range(2))
        cand, slot, victim, src, dst = (torch.empty(c, dtype=torch.int64, device=dev) for _ in range(5))
        block_e = triton_next_pow2(self.num_experts)
        kernel[(1,)](
            ids, out, t * k, valid_rows if valid_rows is not None else self.counts, self.score, self.phys_map, self.expert_in_slot,
            self.protected.view(torch.uint8), self.row_owner, valid, cand, slot, victim, src, dst, evict,
            trigger_out if trigger_out is not None else self.counts,
            self.counts, cpu_pairs.view(torch.uint8) if cpu_pairs is not None else self.counts, self.params.decay, self._hyst,
            self.host_row_offset, self.num_experts, self.num_slots, self.num_rows, filler, K=k, C=c, BLOCK_E=block_e, BLOCK_S=triton_next_pow2(self.num_slots), BLOCK_R=triton_next_pow2(max(1, self.num_rows)),
            BLOCK_T=max(16, 8192 // block_e), HAS_VALID=valid_rows is not None, HAS_TRIG=trigger_out is not None,
            COMPLEMENT=self.complement, HAS_CPU=cpu_pairs is not None, num_warps=4, enable_fp_fusion=False,
        )
        self._move_rows(rows, valid.view(torch.bool), evict.view(torch.bool), src, slot, dst, copy)
        return out

    def _move_rows(self, rows: Sequence[torch.Tensor], valid: torch.Tensor, evict: torch.Tensor, src: torch.Tensor, slot: torch.Tensor,
                   dst: torch.Tensor, copy: CopyFn) -> None:
        """The step's copies. Full copy: promotions only. Complement: victims' bytes out to their spare rows
        before the promotions overwrite the slots, as one fused exchange (CUDA) unless a test injected ``copy``."""
        if not self.complement:
            copy(rows, valid, src, self.host_row_offset, slot, 0)
        elif copy is copy_rows:
            exchange_rows(rows, self.host_row_offset, valid, evict, src, slot, dst)
        else:
            exchange_rows_reference(rows, self.host_row_offset, valid, evict, src, slot, dst, copy)

    # ------------------------------------------------------------ control plane (host, between steps)

    def install(self, owners: Sequence[int], prior: Sequence[int] = (), protected: Sequence[int] = (),
                row_owners: Sequence[int] | None = None) -> None:
        """Adopt a slot assignment (the bank's table after a swap) and reset the scores.

        The prior (a control-plane swap's set) enters the scores at ``prior_weight`` of the
        steady score of an expert routed every step, so it decays like any usage and the
        conversation overrides it within tens of steps; ``protected`` (the plan's core) is
        never evicted. The routing table itself is the bank's (it already matches ``owners``).
        """
        if len(owners) != self.num_slots:
            raise ValueError(f"{len(owners)} slot owners for {self.num_slots} slots")
        if self.complement:
            if row_owners is None or len(row_owners) != self.num_rows:
                raise ValueError(f"RAM complement: the owners of all {self.num_rows} host rows are needed")
            self.row_owner.copy_(torch.tensor(list(row_owners), dtype=torch.int32).to(self.row_owner.device))
        dev = self.score.device
        self.expert_in_slot.copy_(torch.tensor(list(owners), dtype=torch.int32).to(dev))
        score = torch.zeros(self.num_experts, dtype=torch.float32)
        if prior:
            score[list(prior)] = self.params.prior_weight * self.params.steady
        self.score.copy_(score.to(dev))
        mask = torch.zeros(self.num_experts, dtype=torch.bool)
        if protected:
            mask[list(protected)] = True
        self.protected.copy_(mask.to(dev))

    def reset_counters(self) -> None:
        for t in (self.promotions, self.evictions, self.steps):
            t.zero_()

    def read_owners(self) -> list[int]:
        """Slot owners as the device holds them (synchronizes: control plane only)."""
        return [int(x) for x in self.expert_in_slot.cpu().tolist()]

    def read_row_owners(self) -> list[int]:
        """Complement mode: the expert each host row holds (-1: spare), read back (control plane only)."""
        return [int(x) for x in self.row_owner.cpu().tolist()]

    def counters(self) -> dict[str, int]:
        vals = torch.cat([self.promotions, self.evictions, self.steps]).cpu().tolist()
        return {"promotions": int(vals[0]), "evictions": int(vals[1]), "steps": int(vals[2])}


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_bijection(owners: Sequence[int], phys_map: Sequence[int], host_row_offset: int, row_owners: Sequence[int] | None = None) -> list[str]:
    """Problems with a (slot owners, routing table[, host-row owners]) state; empty when they agree exactly.

    Full copy: a non-resident expert ``x`` reads host row ``x``. RAM complement
    (``row_owners``): it reads the one row it owns, and residents own none."""
    problems = []
    e = len(phys_map)
    seen = [x for x in owners if x >= 0]
    if len(seen) != len(set(seen)):
        problems.append(f"an expert owns two slots: {sorted(seen)}")
    for slot, x in enumerate(owners):
        if x >= e:
            problems.append(f"slot {slot} owned by expert {x} >= {e}")
        elif x >= 0 and phys_map[x] != slot:
            problems.append(f"slot {slot} owned by expert {x} but its table entry is {phys_map[x]}")
    owned = set(seen)
    row_of: dict[int, int] = {}
    if row_owners is not None:
        for row, x in enumerate(row_owners):
            if not -1 <= x < e:
                problems.append(f"host row {row} owned by expert {x}, outside [-1, {e})")
            elif x >= 0:
                if x in row_of or x in owned:
                    problems.append(f"expert {x} owns host row {row} and {'row ' + str(row_of[x]) if x in row_of else 'a slot'}")
                row_of[x] = row
    for x, row in enumerate(phys_map):
        if x in owned:
            continue
        want = host_row_offset + (row_of.get(x, -1) if row_owners is not None else x)
        if row != want or want < host_row_offset:
            problems.append(f"expert {x} is not resident but its table entry is {row} (its host row: {want - host_row_offset})")
    return problems
