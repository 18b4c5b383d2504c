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

A wrapped document takes one of three shapes (by a hash of its key): one
exchange, a multi-turn exchange (the excerpt pasted in two or three parts,
follow-up asks between the assistant turns), or, for code and config, a
pasted failure log around the excerpt's own lines (``example/realistic/logs.py``)
with the fix-it ask. Users send all three; a model that only saw the first
routes the others as if they were one long paste.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from pathlib import Path
from typing import Iterable, Iterator

REALISTIC_DIR = Path(__file__).resolve().parents[2] / "example" / "realistic"

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


FOLLOW_UPS: tuple[str, ...] = (
    "Thanks. And this next part?", "ok, what about the rest:", "Now this bit confuses me:", "Same question for this:",
    "Can you go on?", "and here's the continuation", "What changes if I add this?", "Keep going, and explain this too:",
)
FIX_ASKS: tuple[str, ...] = (
    "I'm getting this error, any idea why?", "This fails in CI:", "Why does this crash?", "Build broke after updating, log below:",
    "Got this when running it. Is it my code or the library?", "help, this keeps failing",
)
SHAPES: tuple[str, ...] = ("single", "multi", "log")
LOG_DOMAINS = {"code-python": "code-python", "code-c": "code-c", "code-js": "code-js", "code-rust": "code-rust", "shell-config": "ops"}


def turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


def _cut(text: str, at: int) -> int:
    """A cut near ``at``, moved to the next line break when one is close."""
    at = max(1, min(len(text) - 1, at))
    nl = text.find("\n", at)
    return nl + 1 if 0 < nl < at + 400 else at


def shape_of(key: str, domain: str) -> str:
    """The chat shape of a wrapped document: single 50 %, multi 30 %, log 20 % (code and config only)."""
    r = _pick(key, "shape") % 100
    if r < 20 and domain in LOG_DOMAINS:
        return "log"
    return "multi" if r < 50 else "single"


def pasted_log(text: str, domain: str, key: str) -> str | None:
    """A failure log composed around the excerpt's real lines (tool formats from example/realistic/logs.py)."""
    if str(REALISTIC_DIR) not in sys.path:
        sys.path.insert(0, str(REALISTIC_DIR))
    try:
        from logs import log_for  # type: ignore[import-not-found]
        from snippets import Snippet  # type: ignore[import-not-found]
    except ImportError:
        return None
    dom = LOG_DOMAINS.get(domain)
    if dom is None:
        return None
    lines = text.split("\n")[:60]
    sn = Snippet(dom, key, "", key.split("#", 1)[0], "\n".join(lines), "", "", 1 + _pick(key, "line") % 200)
    try:
        return log_for(sn, random.Random(_pick(key, "log")))
    except (IndexError, ValueError):
        return None


def as_chat(text: str, domain: str, key: str, shape: str | None = None) -> str:
    """The document as a chat of the given shape (default: ``shape_of``); every shape keeps all of the text."""
    shape = shape or shape_of(key, domain)
    asks = ASKS.get(domain, ("Explain this:",))
    ask = asks[_pick(key, "ask") % len(asks)]
    if shape == "multi" and len(text) > 600:
        parts = 2 + _pick(key, "parts") % 2  # exchanges
        bounds = [0] + [_cut(text, len(text) * i // (2 * parts)) for i in range(1, 2 * parts)] + [len(text)]
        bounds = sorted(set(bounds))
        pieces = [text[a:b].strip() for a, b in zip(bounds, bounds[1:]) if text[a:b].strip()]
        out = []
        for i in range(0, len(pieces), 2):
            lead = ask if i == 0 else FOLLOW_UPS[_pick(key, f"fu{i}") % len(FOLLOW_UPS)]
            out.append(turn("user", f"{lead}\n\n{pieces[i]}"))
            if i + 1 < len(pieces):
                out.append(turn("assistant", pieces[i + 1]))
        return "".join(out)
    if shape == "log":
        log = pasted_log(text, domain, key)
        if log:
            cut = _cut(text, len(text) // 3)
            fix = FIX_ASKS[_pick(key, "fix") % len(FIX_ASKS)]
            return turn("user", f"{fix}\n\n```\n{log.strip()}\n```\n\nThe code:\n\n{text[:cut].rstrip()}") + turn("assistant", text[cut:].strip() or text.strip())
    cut = _cut(text, len(text) // 3)
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


def test_split_paths(test_jsonl: Path) -> set[str]:
    """Every excerpt path the benchmark workload (the realistic test split) quotes: generated chats avoid them."""
    out: set[str] = set()
    if test_jsonl.is_file():
        with test_jsonl.open(encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    out |= {str(p.get("path")) for p in json.loads(line).get("provenance") or []}
    return out


def generated_conversations(seed: int, per_domain: int, avoid_paths: set[str]) -> Iterator[tuple[str, str, str, str, str]]:
    """(id, rendered chat, shape tag, origin, licence) of conversations from the realistic generator, another seed.

    More chat turns, multi-turn, pasted-log and editor shapes than the 1,120 of the train split, from the
    same licence-checked excerpts; conversations quoting a file the test split quotes are dropped, so the
    benchmark workload stays unseen.
    """
    import importlib.util

    if str(REALISTIC_DIR) not in sys.path:
        sys.path.insert(0, str(REALISTIC_DIR))
    spec = importlib.util.spec_from_file_location("realistic_build", REALISTIC_DIR / "build.py")
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rows, _ = mod.build(seed, per_domain)
    for row in rows:
        prov = row.get("provenance") or []
        if any(str(p.get("path")) in avoid_paths for p in prov if not str(p.get("origin", "")).startswith("math:")):
            continue
        text = render_messages(row.get("messages") or [])
        if text:
            first = prov[0] if prov else {}
            yield (f"gen{seed}:{row['id']}", text, str(row["tags"][1]), str(first.get("origin", "")), str(first.get("licence", "")))
