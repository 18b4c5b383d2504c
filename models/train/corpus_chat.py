"""Conversation-shaped training text: the proxy serves chats, so the model should see chat turns.

Two sources, both rendered with the project's chat template markers
(``<|im_start|>role\\n ... <|im_end|>\\n``, ``reap_swap.models.tokenizer``):

* a share of every domain's documents is wrapped as a chat (a user ask + the
  excerpt, the assistant continuing it), chosen by a hash of the document key,
  so routing sees each domain both raw and inside chat turns; the domain label
  is unchanged;
* the example corpus' *train* split (``example/realistic/train.jsonl``) as its
  own ``chat`` domain. The test split is never read: the benchmark workload
  and the routing traces use it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator

ASKS: dict[str, tuple[str, ...]] = {
    "code-python": ("What does this Python code do?", "Can you review this function?", "Explain this module:", "Why would this fail?"),
    "code-c": ("What does this C code do?", "Is this header correct?", "Explain this C function:", "Can you simplify this?"),
    "code-js": ("What does this JavaScript do?", "Review this script please:", "Explain this module:", "Can you refactor this?"),
    "code-rust": ("Explain this Rust code:", "What does this impl do?", "Is this unsafe block sound?", "Review this Rust function:"),
    "prose": ("Summarise this text:", "What is this documentation about?", "Explain this passage:", "Rewrite this more clearly:"),
    "shell-config": ("What does this config do?", "Explain this script:", "Why does this build file fail?", "Review this configuration:"),
    "math": ("Solve this:", "Show the steps for these problems:", "Check my work:", "Work through this worksheet:"),
}


def _pick(key: str, salt: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{salt}:{key}".encode()).digest()[:8], "big")


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def as_chat(text: str, domain: str, key: str) -> str:
    """The document as one exchange: a user ask with the first part pasted, the assistant continuing it."""
    asks = ASKS.get(domain, ("Explain this:",))
    ask = asks[_pick(key, "ask") % len(asks)]
    cut = max(1, len(text) // 3)
    nl = text.find("\n", cut)
    cut = nl + 1 if 0 < nl < cut + 400 else cut
    return turn("user", f"{ask}\n\n{text[:cut].rstrip()}") + turn("assistant", text[cut:].strip() or text.strip())


def wrapped(key: str, share: float, seed: int) -> bool:
    """Whether the document with this key is rendered as a chat (deterministic)."""
    return (_pick(key, f"wrap:{seed}") % 10_000) < share * 10_000


def render_messages(messages: Iterable[dict]) -> str:
    return "".join(turn(str(m.get("role", "user")), str(m.get("content", ""))) for m in messages if m.get("content"))


def conversations(path: Path) -> Iterator[tuple[str, str]]:
    """(conversation id, rendered chat) for each conversation of an ai-data-extraction JSONL file."""
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            row = json.loads(line)
            text = render_messages(row.get("messages") or [])
            if text:
                yield str(row.get("id")), text
