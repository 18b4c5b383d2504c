"""One conversation from snippets: styles, user turns, assistant turns (ai-data-extraction rows).

Styles: ``short`` (a one-line question, nothing pasted), ``paste`` (code, config or
docs pasted with a question), ``log`` (a failure pasted), ``long`` (context,
requirements, code and the docs that go with it), ``multi`` (2-3 user turns,
sometimes switching domain), ``editor`` (Cursor-style code_context selection
and an answer with a suggested diff). Assistant turns lean on the source's own
text: docstrings, doc comments, the next paragraph, the computed solution.
"""

from __future__ import annotations

import difflib
import random
import re
from typing import Any, Callable

from phrasing import BANK, OTHER_LANG, lang_of, pick, tic
from snippets import Snippet
from logs import log_for

Turn = dict[str, Any]
Getter = Callable[[str], Snippet]
STYLES = ("short", "paste", "log", "long", "multi", "editor")
STYLE_WEIGHTS = {"code-python": (3, 4, 2, 2, 2, 2), "code-c": (3, 4, 2, 2, 2, 2), "code-js": (3, 4, 2, 2, 2, 2),
                 "code-rust": (3, 4, 2, 2, 2, 2), "ops": (3, 4, 2, 2, 2, 0), "prose": (4, 5, 0, 2, 2, 0), "math": (5, 3, 0, 2, 2, 0)}


def fenced(sn: Snippet, text: str | None = None, max_chars: int = 1800) -> str:
    body = (text or sn.text)[:max_chars]
    return f"```{sn.fence}\n{body.rstrip()}\n```" if sn.domain != "prose" else body


def slots(sn: Snippet, rng: random.Random) -> dict[str, str]:
    pkg = sn.origin.split(":", 1)[-1]
    return {"name": sn.name, "path": sn.path, "lang": lang_of(sn.domain, sn.path), "pkg": pkg,
            "other": rng.choice(OTHER_LANG.get(sn.domain, ("plain English",)))}


def first_sentences(text: str, n: int = 2, max_chars: int = 500) -> str:
    parts = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    return " ".join(parts[:n])[:max_chars]


def _code_lines(sn: Snippet) -> list[str]:
    return [ln.strip() for ln in sn.text.split("\n") if len(ln.strip()) > 8 and not ln.strip().startswith(("#", "//", "*", "/*"))]


def answer(sn: Snippet, rng: random.Random, focus: str = "explain") -> str:
    """An assistant turn built on the snippet's own material."""
    if sn.domain == "math":
        return sn.notes
    if sn.domain == "prose":
        gist = first_sentences(sn.text, 2)
        more = first_sentences(sn.notes, 2) if sn.notes else ""
        return f"In short: {gist}" + (f"\n\nThe docs go on: {more}" if more else "") + \
            rng.choice(("\n\nIn practice, follow the recommended path and only deviate when you can say why.",
                        "\n\nSo the main point is the first sentence; the rest explains the exceptions.", ""))
    lines = _code_lines(sn) or [sn.text.split("\n")[0]]
    doc = first_sentences(sn.notes, 3) if sn.notes else ""
    out = []
    if focus == "log":
        out.append(f"The failure surfaces in `{sn.path}`, in `{sn.name}`, at the line `{rng.choice(lines)[:120]}`.")
    else:
        out.append(f"`{sn.name}` ({sn.path}): " + (doc or f"it works through {len(sn.text.splitlines())} lines of {lang_of(sn.domain, sn.path)}."))
    picked = rng.sample(lines, min(len(lines), rng.randint(2, 4)))
    out.append("\n".join(f"- `{ln[:100]}`: {rng.choice(('this is where the input is checked', 'the main work happens here', 'note the order of operations', 'this is the case that usually bites', 'the result is built here'))}." for ln in picked))
    if focus == "log":
        out.append(rng.choice(("Check what you pass in first: the library assumes the documented types.",
                               "Pin the version you tested against; the behaviour changed between releases.",
                               "A minimal reproduction with the same arguments will confirm it.")))
    if rng.random() < 0.5:
        out.append(fenced(sn, "\n".join(sn.text.split("\n")[: rng.randint(4, 14)]), 900))
    return "\n\n".join(out)


def user_paste(sn: Snippet, bank: str, rng: random.Random) -> str:
    s = slots(sn, rng)
    if sn.domain == "math":
        return tic(rng, bank, pick(rng, bank, "math", {"statement": sn.text}))
    if sn.domain == "prose":
        return tic(rng, bank, f"{pick(rng, bank, 'prose_lead', s)}\n\n{fenced(sn)}\n\n{pick(rng, bank, 'prose_ask', s)}")
    return tic(rng, bank, f"{pick(rng, bank, 'lead', s)}\n\n{fenced(sn)}\n\n{pick(rng, bank, ask_key(sn), s)}")


def ask_key(sn: Snippet) -> str:
    return {"prose": "prose_ask", "ops": "ops_ask"}.get(sn.domain, "ask")


def user_short(sn: Snippet, bank: str, rng: random.Random) -> str:
    if sn.domain == "math":
        return tic(rng, bank, sn.text)
    return tic(rng, bank, pick(rng, bank, {"prose": "prose_short", "ops": "ops_short"}.get(sn.domain, "short"), slots(sn, rng)))


def editor_turns(sn: Snippet, bank: str, rng: random.Random) -> list[Turn]:
    lines = sn.text.split("\n")
    i = rng.randrange(len(lines))
    s = slots(sn, rng)
    ctx = [{"file": sn.path, "code": sn.text, "range": {"selectionStartLineNumber": sn.start_line + max(0, i - 3),
                                                         "selectionEndLineNumber": sn.start_line + min(len(lines) - 1, i + 3)}}]
    indent = re.match(r"\s*", lines[i]).group(0)  # type: ignore[union-attr]
    mark = {"code-python": "#", "ops": "#"}.get(sn.domain, "//")
    new = lines[:i] + [f"{indent}{mark} NOTE: {rng.choice(('guard against empty input here', 'keep in sync with the caller', 'this branch is hot'))}"] + lines[i:]
    diff = "\n".join(difflib.unified_diff(lines, new, f"a/{sn.path}", f"b/{sn.path}", lineterm="", n=2))
    user = {"role": "user", "content": tic(rng, bank, pick(rng, bank, ask_key(sn), s)), "code_context": ctx}
    return [user, {"role": "assistant", "content": answer(sn, rng), "suggested_diffs": [{"file": sn.path, "diff": diff}]}]


def long_ask(sn: Snippet, doc: Snippet | None, bank: str, rng: random.Random) -> str:
    s = slots(sn, rng)
    math = sn.domain == "math"
    parts = [pick(rng, bank, "math_context" if math else "context", s)]
    if math:
        parts.append(sn.text)
    else:
        lead = "prose_lead" if sn.domain == "prose" else "lead"
        parts.append(f"{pick(rng, bank, lead, s)}\n\n{fenced(sn, max_chars=3000)}")
        if doc is not None:
            parts.append(f"{pick(rng, bank, 'prose_lead', slots(doc, rng))}\n\n{doc.text[:1500]}")
        parts.append(pick(rng, bank, ask_key(sn), s))
    reqs = rng.sample(list(BANK[bank]["math_require" if math else "require"]), 2)
    parts.append("\n".join(f"- {r}" for r in reqs))
    return tic(rng, bank, "\n\n".join(parts))


def conversation(domain: str, style: str, bank: str, rng: random.Random, get: Getter) -> tuple[list[Turn], list[Snippet], list[str]]:
    """Messages, the snippets used and extra tags of one conversation."""
    sn = get(domain)
    used, tags = [sn], []
    if style == "short":
        msgs = [{"role": "user", "content": user_short(sn, bank, rng)}, {"role": "assistant", "content": answer(sn, rng)}]
    elif style == "paste":
        msgs = [{"role": "user", "content": user_paste(sn, bank, rng)}, {"role": "assistant", "content": answer(sn, rng)}]
    elif style == "log":
        log = log_for(sn, rng) or sn.text
        s = slots(sn, rng)
        text = f"{pick(rng, bank, 'log_lead', s)}\n\n```\n{log}\n```\n\n{pick(rng, bank, 'log_ask', s)}"
        msgs = [{"role": "user", "content": tic(rng, bank, text)}, {"role": "assistant", "content": answer(sn, rng, "log")}]
    elif style == "long":
        doc = get("prose") if domain.startswith("code") and rng.random() < 0.6 else None
        if doc is not None:
            used.append(doc)
            tags.append("code+prose")
        msgs = [{"role": "user", "content": long_ask(sn, doc, bank, rng)}, {"role": "assistant", "content": answer(sn, rng)}]
    elif style == "editor":
        msgs = editor_turns(sn, bank, rng)
    else:  # multi
        msgs = [{"role": "user", "content": rng.choice((user_short, user_paste))(sn, bank, rng)}, {"role": "assistant", "content": answer(sn, rng)}]
        for _ in range(rng.randint(1, 2)):
            other = domain if rng.random() < 0.6 else rng.choice([d for d in STYLE_WEIGHTS if d != domain])
            nxt = get(other)
            used.append(nxt)
            if other != domain and f"mixed:{other}" not in tags:
                tags.append(f"mixed:{other}")
            follow = pick(rng, bank, "follow", {})
            msgs += [{"role": "user", "content": follow + " " + rng.choice((user_short, user_paste))(nxt, bank, rng)},
                     {"role": "assistant", "content": answer(nxt, rng)}]
    return msgs, used, tags
