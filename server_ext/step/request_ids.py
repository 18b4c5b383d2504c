"""Exact matching of vLLM engine request ids to the client id they decorate (pure).

vLLM 0.32 turns a client's ``X-Request-Id: abc`` into

* completions: ``cmpl-abc-<prompt index>-<8 hex>``
* chat, responses, generate-tokens: ``chatcmpl-abc-<8 hex>`` (``resp-``, ``generate-tokens-``)
* the engine directly (no OpenAI prefix): ``abc-<8 hex>`` or ``abc``
* with ``n > 1``, each of the n child requests: ``<index>_`` before any of the above

Each prefix has exactly one suffix grammar, so ``abc`` never matches the ids
of client ``abc-1`` (``chatcmpl-abc-1-1a2b3c4d`` is chat: ``-1-1a2b3c4d`` is
not ``-<8 hex>``). A loose "any of the suffixes" rule would match it.
"""

from __future__ import annotations

import re

_HEX8 = r"-[0-9a-f]{8}"
_CHILD = re.compile(r"\d+_")
_GRAMMAR: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("cmpl-", re.compile(rf"-\d+{_HEX8}")),
    ("chatcmpl-", re.compile(_HEX8)),
    ("resp-", re.compile(_HEX8)),
    ("generate-tokens-", re.compile(_HEX8)),
    ("", re.compile(rf"(?:{_HEX8})?")),
)


def engine_id_matches_exact(engine_id: str, client_id: str) -> bool:
    """True iff ``engine_id`` is vLLM's decoration of exactly ``client_id``."""
    if not client_id:
        return False
    child = _CHILD.match(engine_id)
    if child and not _CHILD.match(client_id):  # parallel sampling: "3_cmpl-abc-0-1a2b3c4d"
        engine_id = engine_id[child.end() :]
    if engine_id == client_id:
        return True
    for prefix, suffix in _GRAMMAR:
        if prefix == "" and any(engine_id.startswith(p) for p, _ in _GRAMMAR[:-1]):
            return False  # an OpenAI-decorated id is matched by its own prefix's grammar only
        head = prefix + client_id
        if engine_id.startswith(head) and suffix.fullmatch(engine_id[len(head) :]):
            return True
    return False
