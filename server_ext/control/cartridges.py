"""Named active sets ("cartridges"): the plan's ``cartridges`` section or ``REAP_CARTRIDGE_DIR/{id}.json``.

Loaded cartridges stay in a bounded LRU (``REAP_MAX_LOADED_CARTRIDGES``).
Ids are checked before any path is built: a leading dot, a slash or anything
outside ``[A-Za-z0-9_.-]`` is refused, so no id can name a file outside the
folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from cachetools import LRUCache

from reap_swap.plan import Plan

from .errors import HTTPError

CARTRIDGE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
MAX_CARTRIDGE_BYTES = 1 << 20
ActiveSet = dict[str, Any]


class _TrackingLRU(LRUCache):  # type: ignore[type-arg]
    """An LRU cache that remembers what it evicted (reported to the caller)."""

    def __init__(self, maxsize: int):
        super().__init__(maxsize)
        self.evicted: list[str] = []

    def popitem(self) -> tuple[Any, Any]:
        key, value = super().popitem()
        self.evicted.append(key)
        return key, value


def check_id(cartridge_id: str) -> None:
    if not CARTRIDGE_ID.match(cartridge_id):
        raise HTTPError(400, "cartridge id must match [A-Za-z0-9][A-Za-z0-9_.-]{0,127}", "invalid_value", "cartridge_id")


class CartridgeStore:
    def __init__(self, max_loaded: int, folder: str | None):
        self.folder = Path(folder) if folder else None
        self._cache = _TrackingLRU(max_loaded)

    @property
    def loaded(self) -> list[str]:
        return list(self._cache.keys())

    def load(self, cartridge_id: str, plan: Plan) -> tuple[ActiveSet, bool, list[str]]:
        """(active set, cache hit, ids evicted to make room)."""
        check_id(cartridge_id)
        if cartridge_id in self._cache:
            return self._cache[cartridge_id], True, []
        found: Any = None
        section = plan.raw.get("cartridges")
        if isinstance(section, Mapping) and cartridge_id in section:
            found = section[cartridge_id]
        elif self.folder is not None:
            path = self.folder / f"{cartridge_id}.json"
            if path.is_file():
                if path.stat().st_size > MAX_CARTRIDGE_BYTES:
                    raise HTTPError(422, f"cartridge {cartridge_id!r} is larger than {MAX_CARTRIDGE_BYTES} bytes", "invalid_cartridge")
                try:
                    found = json.loads(path.read_text())
                except (ValueError, RecursionError) as exc:
                    raise HTTPError(422, f"cartridge {cartridge_id!r} is not valid JSON: {exc}", "invalid_cartridge") from None
        if found is None:
            raise HTTPError(404, f"unknown cartridge {cartridge_id!r}", "unknown_cartridge", "cartridge_id")
        active = found.get("active_set", found) if isinstance(found, Mapping) else None
        if not isinstance(active, Mapping):
            raise HTTPError(422, f"cartridge {cartridge_id!r} has no active_set object", "invalid_cartridge")
        self._cache.evicted = []
        self._cache[cartridge_id] = dict(active)
        return self._cache[cartridge_id], False, list(self._cache.evicted)
