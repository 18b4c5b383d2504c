"""Router-miss accounting that never stops the GPU: sums stay on the device per request slot.

After each step, one kernel adds every captured (token, k) pair of every
banked layer to its request's slot in ``arena.acc`` (``routing_kernels``).
The host work per step is building the step's token-row -> slot map and one
asynchronous copy of it from a pinned ring buffer; nothing waits for the GPU.
A slot is read back (``drain``) only when its request finishes, when its slot
is needed by another request, or when a report is asked for (a one-request
report drains that request's slots only, ``flush_request``): an asynchronous
copy into pinned memory plus an event, booked into the ``MissLedger`` once
the event has completed (checked without blocking after each step; a report
blocks until everything is booked).

Prefill staging (``cache/prefill_staging.py``) leaves the captured pairs as routed: a staged pair
is still a missed pair. Each staged expert of a layer step is booked once, to the request of the
first token row that routed it (``arena.stage_rows``, the same kernel as the cache's promotions),
as ``staged`` [L]: staged experts x expert bytes is what staging moved over the link, each expert
once per layer step, where the kernel's host reads would have re-read it once per M-block.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import torch

from .arena import RoutingArena
from .capture import StepLayout
from .misses import ALL_REQUESTS, MissLedger, RequestMisses, engine_id_matches
from .request_slots import RequestSlots
from .routing_kernels import MASS, MISSED, MISSED_MASS, ROUTED, accumulate_step

def accumulate_promotions(promo_rows: torch.Tensor, layer_rows: torch.Tensor, row_slot: torch.Tensor, num_rows: int, promo_acc: torch.Tensor) -> None:
    """promo_acc[slot, layer] += online-cache promotions of the step, each booked to the request of
    the first token row that routed the promoted expert (``online_cache.LayerCache.trigger_rows``).
    No host synchronization; on CUDA one Triton launch (the torch form costs ~30 small launches a step)."""
    fn = accumulate_promotions_triton if promo_acc.is_cuda else accumulate_promotions_reference
    fn(promo_rows, layer_rows, row_slot, num_rows, promo_acc)


def accumulate_promotions_reference(promo_rows: torch.Tensor, layer_rows: torch.Tensor, row_slot: torch.Tensor, num_rows: int, promo_acc: torch.Tensor) -> None:
    rows = promo_rows.index_select(0, layer_rows.to(torch.int64)).to(torch.int64)  # [L, C]
    ok = (rows >= 0) & (rows < num_rows)
    slot = row_slot.index_select(0, rows.clamp(0, row_slot.shape[0] - 1).reshape(-1)).view(rows.shape).to(torch.int64)
    layer = layer_rows.to(torch.int64).view(-1, 1).expand_as(rows)
    promo_acc.index_put_((slot, layer), ok.to(promo_acc.dtype), accumulate=True)


def accumulate_promotions_triton(promo_rows: torch.Tensor, layer_rows: torch.Tensor, row_slot: torch.Tensor, num_rows: int, promo_acc: torch.Tensor) -> None:
    from . import routing_triton

    c = int(promo_rows.shape[1])
    if c == 0 or layer_rows.numel() == 0:
        return
    kernel = routing_triton.jitted_promotions(os.environ.get("TRITON_INTERPRET", "0") == "1")
    block = max(2, 1 << (c - 1).bit_length())
    kernel[(int(layer_rows.shape[0]),)](
        promo_rows, layer_rows, row_slot, promo_acc, promo_rows.stride(0), num_rows, row_slot.shape[0], promo_acc.shape[1], c,
        BLOCK_C=block, num_warps=1,
    )


_STAGE_RING = 8


@dataclass
class _Drain:
    request_id: str
    tokens: int
    steps: int
    event: Any  # torch.cuda.Event


class RoutingAccounting:
    def __init__(self, arena: RoutingArena, layer_rows: list[int], ledger: MissLedger):
        self.arena = arena
        self.device = arena.acc.device
        self.cuda = self.device.type == "cuda"
        self.layer_rows = list(layer_rows)
        self._layer_rows_dev = torch.tensor(self.layer_rows, dtype=torch.int32, device=self.device)
        self.ledger = ledger
        self.slots = RequestSlots(arena.request_slots)
        self.enabled = True
        self.steps_recorded = 0
        self.steps_skipped = 0
        self.drains = 0
        self._tally: dict[str, list[int]] = {}  # request -> [tokens, steps] since its last drain
        self._pending: dict[int, _Drain] = {}  # slot -> drain whose copy may still be in flight
        self._ring = 0
        self.promotions = arena.promo_cap > 0
        self.staging = arena.stage_cap > 0
        if self.cuda:
            self._stage = torch.zeros(_STAGE_RING, arena.max_tokens, dtype=torch.int32, pin_memory=True)
            self._stage_events = [torch.cuda.Event() for _ in range(_STAGE_RING)]
            self._mirror = torch.zeros(arena.acc.shape, dtype=arena.acc.dtype, pin_memory=True)
            self._promo_mirror = torch.zeros(arena.promo_acc.shape, dtype=arena.promo_acc.dtype, pin_memory=self.promotions)
            self._stage_mirror = torch.zeros(arena.stage_acc.shape, dtype=arena.stage_acc.dtype, pin_memory=self.staging)

    @property
    def pinned_bytes(self) -> int:
        if not self.cuda:
            return 0
        return sum(t.numel() * t.element_size() for t in (self._stage, self._mirror, self._promo_mirror, self._stage_mirror))

    def record_step(self, layout: StepLayout) -> None:
        """Queue the accumulation of the step that just ran (its capture rows are in the arena)."""
        t = layout.total
        if not self.enabled or t == 0:
            return
        if t > self.arena.max_tokens:
            self.steps_skipped += 1
            return
        slots = np.empty(len(layout.request_ids), dtype=np.int32)
        for i, (rid, n) in enumerate(zip(layout.request_ids, layout.num_tokens)):
            slot, evicted = self.slots.acquire(rid)
            if evicted is not None:  # its sums are copied out before this step's are added
                self._drain(*evicted)
            slots[i] = slot
            tally = self._tally.setdefault(rid, [0, 0])
            tally[0] += int(n)
            tally[1] += 1
        rows = torch.from_numpy(np.repeat(slots, layout.num_tokens))
        if self.cuda:
            i = self._ring = (self._ring + 1) % _STAGE_RING
            if not self._stage_events[i].query():  # the copy issued _STAGE_RING steps ago is long done
                self._stage_events[i].synchronize()
            self._stage[i, :t].copy_(rows)
            self.arena.row_slot[:t].copy_(self._stage[i, :t], non_blocking=True)
            self._stage_events[i].record()
        else:
            self.arena.row_slot[:t].copy_(rows)
        accumulate_step(self.arena.codes, self.arena.weights, self._layer_rows_dev, self.arena.row_slot, t, self.arena.acc)
        if self.promotions:
            accumulate_promotions(self.arena.promo_rows, self._layer_rows_dev, self.arena.row_slot, t, self.arena.promo_acc)
        if self.staging:
            accumulate_promotions(self.arena.stage_rows, self._layer_rows_dev, self.arena.row_slot, t, self.arena.stage_acc)
        self.steps_recorded += 1

    def finish(self, request_ids: Iterable[str]) -> None:
        """Read back the slots of requests vLLM reports finished."""
        for rid in request_ids:
            slot = self.slots.release(rid)
            if slot is not None:
                self._drain(rid, slot)

    def poll(self) -> None:
        """Book drains whose copies have landed; never blocks."""
        for slot, d in list(self._pending.items()):
            if d.event.query():
                self._book_slot(slot, landed=True)

    def flush(self) -> None:
        """Book everything so far, live requests included (blocks; for reports, not per step)."""
        for rid, slot in self.slots.live():
            self._drain(rid, slot)
        for slot in list(self._pending):
            self._book_slot(slot)

    def flush_request(self, client_id: str) -> int:
        """Book one client's sums so far (its live slots, its copies in flight) and nobody else's: what
        ``/router_misses/{id}`` needs, at the cost of that request's rows only (one copy + event each)
        instead of every live request's. Others' device rows and pending copies are left alone; their
        sums are booked when they finish or are read. Returns the drains issued. ``__all__``: ``flush``."""
        before = self.drains
        if client_id == ALL_REQUESTS:
            self.flush()
            return self.drains - before
        for rid, slot in self.slots.live():
            if engine_id_matches(rid, client_id):
                self._drain(rid, slot)
        for slot, d in list(self._pending.items()):
            if engine_id_matches(d.request_id, client_id):
                self._book_slot(slot)
        return self.drains - before

    def _drain(self, request_id: str, slot: int) -> None:
        tokens, steps = self._tally.pop(request_id, (0, 0))
        if steps == 0:
            # Nothing was added to the slot since its last drain (its sums are zero): booking it would
            # re-create a zero entry for a request a report has just reset, since vLLM reports a request
            # finished one step after its last one (issue 31). No step, no booking.
            return
        self.drains += 1
        if not self.cuda:
            sums = self.arena.acc[slot].numpy().copy()
            promo = self.arena.promo_acc[slot].numpy().copy()
            staged = self.arena.stage_acc[slot].numpy().copy()
            self.arena.acc[slot].zero_()
            self.arena.promo_acc[slot].zero_()
            self.arena.stage_acc[slot].zero_()
            self._book(request_id, sums, tokens, steps, promo, staged)
            return
        if slot in self._pending:  # the mirror row is about to be reused
            self._book_slot(slot)
        self._mirror[slot].copy_(self.arena.acc[slot], non_blocking=True)
        self.arena.acc[slot].zero_()
        if self.promotions:
            self._promo_mirror[slot].copy_(self.arena.promo_acc[slot], non_blocking=True)
            self.arena.promo_acc[slot].zero_()
        if self.staging:
            self._stage_mirror[slot].copy_(self.arena.stage_acc[slot], non_blocking=True)
            self.arena.stage_acc[slot].zero_()
        event = torch.cuda.Event()
        event.record()
        self._pending[slot] = _Drain(request_id, tokens, steps, event)

    def _book_slot(self, slot: int, landed: bool = False) -> None:
        d = self._pending.pop(slot)
        if not landed and not d.event.query():
            d.event.synchronize()
        self._book(d.request_id, self._mirror[slot].numpy(), d.tokens, d.steps, self._promo_mirror[slot].numpy(),
                   self._stage_mirror[slot].numpy())

    def _book(self, request_id: str, sums: np.ndarray, tokens: int, steps: int, promo: np.ndarray, staged: np.ndarray) -> None:
        s = sums[self.layer_rows].astype(np.float64)  # [L, COMPONENTS, E]
        promoted = np.rint(promo[self.layer_rows]).astype(np.int64) if promo.size else np.zeros(len(self.layer_rows), np.int64)
        staged_l = np.rint(staged[self.layer_rows]).astype(np.int64) if staged.size else np.zeros(len(self.layer_rows), np.int64)
        self.ledger.add(
            request_id,
            RequestMisses(
                observed=s[:, MASS].sum(axis=1),
                inactive=s[:, MISSED_MASS].sum(axis=1),
                hits=np.rint(s[:, ROUTED]).astype(np.int64),
                miss_hits=np.rint(s[:, MISSED]).astype(np.int64),
                expert_mass=s[:, MASS].copy(),
                tokens=tokens,
                steps=steps,
                promoted=promoted,
                staged=staged_l,
            ),
        )
