"""Host-row ownership for RAM-complement mode (pure logic, no torch).

In complement mode a layer's host bank has only ``E - S + K`` rows: one per
expert that is not on the GPU plus ``K`` spares. ``host_slot[e]`` says which
row holds expert ``e``; an expert in a GPU slot owns no row. An exchange
writes the evicted expert GPU -> a spare row and hands the promoted expert's
old row to the spare pool (rotation: ownership moves, no host memcpy, row
addresses never change, so CUDA graphs stay valid).

Spares are handed out as ``SpareRow`` handles naming their layer and block
size; giving a handle to another layer, or one of another block size, is
refused before anything changes. ``HostRegions`` refuses overlapping byte
ranges and freezes once serving starts (a live pool cannot grow: its rows
may already hold experts).
"""

from __future__ import annotations

from dataclasses import dataclass

BlockSize = tuple[int, ...]
"""Bytes of one expert row of every per-expert parameter of a layer, in parameter order."""


class HostRowError(ValueError):
    pass


@dataclass(frozen=True)
class SpareRow:
    """A free host row of one layer; only that layer's exchanges may fill it."""

    layer: int
    block: BlockSize
    row: int


class LayerHostRows:
    """Which host row holds which expert of one layer, and which rows are spare."""

    def __init__(self, layer: int, num_experts: int, num_rows: int, block: BlockSize, owners: list[int]):
        if num_experts <= 0 or num_rows <= 0:
            raise HostRowError(f"layer {layer}: need positive expert and row counts, got {num_experts}, {num_rows}")
        if not block or any(b <= 0 for b in block):
            raise HostRowError(f"layer {layer}: bad block size {block}")
        if len(owners) != num_rows:
            raise HostRowError(f"layer {layer}: {len(owners)} owners for {num_rows} rows")
        self.layer = layer
        self.num_experts = num_experts
        self.num_rows = num_rows
        self.block = tuple(block)
        self._owner = [-1] * num_rows
        self._row_of = [-1] * num_experts
        for row, e in enumerate(owners):
            if e == -1:
                continue
            if not 0 <= e < num_experts:
                raise HostRowError(f"layer {layer}: owner {e} of row {row} out of range")
            if self._row_of[e] >= 0:
                raise HostRowError(f"layer {layer}: expert {e} owns rows {self._row_of[e]} and {row}")
            self._owner[row] = e
            self._row_of[e] = row
        self._spares = [r for r in reversed(range(num_rows)) if self._owner[r] < 0]

    @property
    def block_bytes(self) -> int:
        return sum(self.block)

    @property
    def spare_count(self) -> int:
        return len(self._spares)

    def row_of(self, expert: int) -> int:
        """The host row of ``expert``, -1 while it sits in a GPU slot."""
        return self._row_of[expert]

    def owner(self, row: int) -> int:
        return self._owner[row]

    def owners(self) -> tuple[int, ...]:
        return tuple(self._owner)

    def spares(self) -> tuple[int, ...]:
        return tuple(sorted(self._spares))

    def take_spare(self) -> SpareRow:
        if not self._spares:
            raise HostRowError(f"layer {self.layer}: no spare host row left (reserve more spares)")
        return SpareRow(self.layer, self.block, self._spares.pop())

    def give_back(self, spare: SpareRow) -> None:
        """Return an unused handle (an exchange that did not need it)."""
        self._check_handle(spare)
        if spare.row in self._spares:
            raise HostRowError(f"layer {self.layer}: row {spare.row} is already spare")
        self._spares.append(spare.row)

    def reclaim_spares(self) -> list[int]:
        """Rows that no expert owns but that are missing from the spare pool (a handle lost by a
        failure) become spares again; a row listed twice is listed once. Returns the rows reclaimed."""
        pool = set(self._spares)
        lost = [r for r in range(self.num_rows) if self._owner[r] < 0 and r not in pool]
        self._spares = [r for r in reversed(range(self.num_rows)) if self._owner[r] < 0]
        return lost

    def _check_handle(self, spare: SpareRow) -> None:
        if spare.layer != self.layer:
            raise HostRowError(f"spare row of layer {spare.layer} offered to layer {self.layer}")
        if spare.block != self.block:
            raise HostRowError(f"layer {self.layer}: spare of block size {spare.block} offered, rows here are {self.block}")
        if not 0 <= spare.row < self.num_rows:
            raise HostRowError(f"layer {self.layer}: row {spare.row} out of range [0, {self.num_rows})")
        if self._owner[spare.row] != -1:
            raise HostRowError(f"layer {self.layer}: row {spare.row} is owned by expert {self._owner[spare.row]}")

    def adopt(self, expert: int, spare: SpareRow) -> None:
        """``expert`` (evicted from the GPU, bytes already in ``spare``) now owns that row."""
        self._check_handle(spare)
        if not 0 <= expert < self.num_experts:
            raise HostRowError(f"layer {self.layer}: expert {expert} out of range")
        if self._row_of[expert] >= 0:
            raise HostRowError(f"layer {self.layer}: expert {expert} already owns row {self._row_of[expert]}")
        self._owner[spare.row] = expert
        self._row_of[expert] = spare.row

    def release(self, expert: int) -> int:
        """``expert`` (now served from its GPU slot) gives up its row; the row becomes a spare."""
        if not 0 <= expert < self.num_experts:
            raise HostRowError(f"layer {self.layer}: expert {expert} out of range")
        row = self._row_of[expert]
        if row < 0:
            raise HostRowError(f"layer {self.layer}: expert {expert} owns no host row")
        self._owner[row] = -1
        self._row_of[expert] = -1
        self._spares.append(row)
        return row

    def check(self, resident: set[int]) -> list[str]:
        """Ownership invariants against the resident set (empty when all hold)."""
        problems = []
        for e in range(self.num_experts):
            row = self._row_of[e]
            if (row >= 0) == (e in resident):
                problems.append(f"expert {e}: resident={e in resident} but host row {row}")
            if row >= 0 and self._owner[row] != e:
                problems.append(f"expert {e}: row {row} is owned by {self._owner[row]}")
        owned = [r for r in range(self.num_rows) if self._owner[r] >= 0]
        if sorted(owned + self._spares) != list(range(self.num_rows)):
            problems.append("rows are neither owned nor spare exactly once")
        return problems


@dataclass(frozen=True)
class Region:
    layer: int
    block: BlockSize
    spans: tuple[tuple[int, int], ...]
    """[start, stop) byte ranges of the layer's host rows (one per parameter)."""
    spares: int

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.spans)


class HostRegions:
    """Every layer's host-row byte ranges and spare reservation, by block size.

    Registration checks that ranges do not overlap (two layers, or two
    parameters, must never share host bytes) and stops once ``freeze`` is
    called: capacity is reserved up front, a live pool does not grow.
    """

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self.frozen = False

    def register(self, layer: int, block: BlockSize, spans: list[tuple[int, int]], spares: int) -> Region:
        """``spans``: (start address, byte count) of each parameter's host rows."""
        if self.frozen:
            raise HostRowError(f"layer {layer}: the spare pools are live; growing them is refused")
        if layer in self._regions:
            raise HostRowError(f"layer {layer} is already registered")
        if not spans or spares < 0 or any(start < 0 or n <= 0 for start, n in spans):
            raise HostRowError(f"layer {layer}: bad region spans={spans} spares={spares}")
        ranges = tuple((start, start + n) for start, n in spans)
        taken = [(a, b, r.layer) for r in self._regions.values() for a, b in r.spans]
        for i, (a, b) in enumerate(ranges):
            taken_here = taken + [(x, y, layer) for x, y in ranges[:i]]
            for x, y, other in taken_here:
                if a < y and x < b:
                    raise HostRowError(f"layer {layer}: host bytes [{a}, {b}) overlap layer {other}'s [{x}, {y})")
        new = Region(layer, tuple(block), ranges, spares)
        self._regions[layer] = new
        return new

    def freeze(self) -> None:
        self.frozen = True

    def spares_by_size(self) -> dict[int, int]:
        """Reserved spare rows per block size in bytes (each size keeps its count)."""
        out: dict[int, int] = {}
        for r in self._regions.values():
            out[sum(r.block)] = out.get(sum(r.block), 0) + r.spares
        return dict(sorted(out.items()))

    def spare_bytes(self) -> int:
        return sum(sum(r.block) * r.spares for r in self._regions.values())

    def host_bytes(self) -> int:
        return sum(r.nbytes for r in self._regions.values())


def complement_owners(num_experts: int, resident: set[int] | tuple[int, ...], num_rows: int) -> list[int]:
    """Start-up owners: every non-resident expert in id order, then spare rows (-1)."""
    rest = [e for e in range(num_experts) if e not in set(resident)]
    if len(rest) > num_rows:
        raise HostRowError(f"{len(rest)} non-resident experts do not fit {num_rows} host rows")
    return rest + [-1] * (num_rows - len(rest))
