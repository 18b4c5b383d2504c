"""Excerpts of real, permissively licensed local files, as a user would paste them.

The candidates (and their licence checks) come from the model-training corpus
builder (``models/train/corpus_sources.py``), so this corpus draws on exactly
the sources that one vetted. From each file we cut what people actually paste
into a chat: one function or struct, a config block, a few paragraphs of docs;
plus the text an answer would lean on (the docstring, the doc comment, the next
paragraph). Logs are assembled around those real lines (see ``logs.py``).
"""

from __future__ import annotations

import ast
import random
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

TRAIN_DIR = Path(__file__).resolve().parents[2] / "models" / "train"
sys.path.insert(0, str(TRAIN_DIR))

from corpus_sources import Candidate  # noqa: E402
from corpus_text import extract, long_docstrings, mdbook_page, read_plain  # noqa: E402

FENCE = {"code-python": "python", "code-c": "c", "code-js": "js", "code-rust": "rust", "ops": "", "prose": "", "math": ""}
MAX_LINES = 45


@dataclass(frozen=True)
class Snippet:
    """One excerpt with where it came from (for the licence record) and answer material."""

    domain: str
    origin: str
    licence: str
    path: str
    text: str
    name: str
    notes: str
    start_line: int

    @property
    def fence(self) -> str:
        return FENCE.get(self.domain, "")


def display_path(c: Candidate) -> str:
    """A short path as it shows in logs and editor context: from the package root down."""
    p = c.path.split("::", 1)[0]
    for marker in ("site-packages/", "lib/python3.11/", "node_modules/", "html/src/", "share/doc/rust/html/", ".pyenv/"):
        if marker in p:
            return p.rsplit(marker, 1)[1].removesuffix(".html")
    return Path(p).name


def origin_of(c: Candidate) -> str:
    """The origin a cross-source split holds out: the package, or the crate/module for Rust std."""
    pkg = c.package.removesuffix(":docstrings")
    if pkg == "rust-std":
        parts = display_path(c).split("/")
        return "rust-std:" + "/".join(parts[:2] if len(parts) > 2 else parts[:1])
    return pkg


def _block_end(lines: list[str], start: int, limit: int = 60) -> int | None:
    """Index after the line that closes the first brace opened at or after ``start``."""
    depth, opened = 0, False
    for i in range(start, min(len(lines), start + limit)):
        code = re.sub(r'"(\\.|[^"\\])*"|\'(\\.|[^\'\\])*\'|//.*$', "", lines[i])
        depth += code.count("{") - code.count("}")
        opened = opened or "{" in code
        if opened and depth <= 0:
            return i + 1
    return None


def _comment_above(lines: list[str], start: int) -> str:
    out: list[str] = []
    i = start - 1
    while i >= 0 and re.match(r"\s*(///?|\*|/\*\*|\*/|#)", lines[i]) and len(out) < 20:
        out.append(re.sub(r"^\s*(///?|/\*\*|\*/|\*|#)\s?", "", lines[i]).rstrip())
        i -= 1
    return "\n".join(reversed([x for x in out if x.strip()]))


_BRACE_DEF = {
    "code-c": re.compile(r"^(static |inline |extern |typedef |template|struct |enum |class |[A-Za-z_][\w:<>\*& ]*\s+\**[A-Za-z_][\w:]*\s*\()"),
    "code-js": re.compile(r"^\s*(export\s+)?(async\s+)?(function\s*\*?\s*\w+|class\s+\w+|(const|let|var)\s+\w+\s*=\s*(async\s*)?(function|\([^)]*\)\s*=>)|\w+\s*\([^)]*\)\s*\{)"),
    "code-rust": re.compile(r"^\s*(pub(\([^)]*\))?\s+)?(const\s+)?(unsafe\s+)?(fn|impl|struct|enum|trait)\b"),
}
_NAME = re.compile(r"(?:fn|function|class|struct|enum|trait|impl(?:<[^>]*>)?)\s+([A-Za-z_]\w*)|([A-Za-z_]\w*)\s*(?:=|\()")


def brace_snippet(domain: str, text: str, rng: random.Random) -> tuple[str, str, str, int] | None:
    """(excerpt, name, comment above, first line) of one braced definition, or a window of lines."""
    lines = text.split("\n")
    starts = [i for i, ln in enumerate(lines) if _BRACE_DEF[domain].match(ln) and not ln.rstrip().endswith(";")]
    rng.shuffle(starts)
    for s in starts[:25]:
        end = _block_end(lines, s)
        if end is None or end - s < 4:
            continue
        body = lines[s : min(end, s + MAX_LINES)]
        m = _NAME.search(lines[s])
        name = next((g for g in (m.groups() if m else ()) if g), "") or "this"
        return "\n".join(body), name, _comment_above(lines, s), s + 1
    code = [i for i, ln in enumerate(lines) if ln.strip() and not re.match(r"\s*(//|/\*|\*|#)", ln)]
    if len(code) < 8:
        return None
    s = rng.choice(code[: max(1, len(code) - 8)])
    n = rng.randint(8, 24)
    words = re.findall(r"[A-Za-z_]\w{3,}", "\n".join(lines[s : s + n]))
    return "\n".join(lines[s : s + n]), (rng.choice(words) if words else "this"), _comment_above(lines, s), s + 1


def python_snippet(text: str, rng: random.Random) -> tuple[str, str, str, int] | None:
    """One function or class (docstring removed from the excerpt, kept as notes)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError):
        return None
    lines = text.split("\n")
    nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             and n.end_lineno is not None and 4 <= n.end_lineno - n.lineno <= 80]
    if not nodes:
        return None
    node = rng.choice(nodes)
    assert node.end_lineno is not None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    doc = ast.get_docstring(node, clean=True) or ""
    body = lines[start - 1 : node.end_lineno]
    if doc and node.body and isinstance(node.body[0], ast.Expr):
        d0, d1 = node.body[0].lineno - start, (node.body[0].end_lineno or node.body[0].lineno) - start
        if len(body) - (d1 - d0 + 1) >= 3:
            body = body[:d0] + body[d1 + 1 :]
    return "\n".join(body[:MAX_LINES]), node.name, doc, start


def paragraphs(text: str, min_chars: int = 120) -> list[str]:
    """Prose paragraphs (no code blocks, no tables, no headings)."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        p = " ".join(para.split())
        if len(p) >= min_chars and not re.search(r"[{};]\s*$|^\W|\|.*\|", p) and sum(c.isalpha() for c in p) > 0.7 * len(p):
            out.append(p)
    return out


def prose_snippet(c: Candidate, raw: str, rng: random.Random) -> tuple[str, str, str, int] | None:
    """1-3 consecutive paragraphs; the next paragraph is the answer's material."""
    text = mdbook_page(raw) if c.kind == "mdbook-html" else (long_docstrings(raw) if c.kind == "docstrings" else raw)
    if not text:
        return None
    paras = paragraphs(text)
    if len(paras) < 2:
        return None
    k = rng.randint(1, min(3, len(paras) - 1))
    s = rng.randrange(0, len(paras) - k)
    heading = next((ln.strip("# ").strip() for ln in text.split("\n") if 8 < len(ln.strip("# ").strip()) < 70), "")
    return "\n\n".join(paras[s : s + k]), heading or display_path(c), " ".join(paras[s + k : s + k + 2]), 1


def ops_snippet(c: Candidate, raw: str, rng: random.Random) -> tuple[str, str, str, int] | None:
    """A window of a config file or script (or a doc page's shell blocks)."""
    lines = [ln.rstrip() for ln in raw.split("\n")]
    nonblank = [i for i, ln in enumerate(lines) if ln.strip()]
    if len(nonblank) < 4:
        return None
    s = rng.choice(nonblank[: max(1, len(nonblank) - 6)]) if len(nonblank) > 30 else 0
    n = rng.randint(6, 30)
    body = "\n".join(lines[s : s + n]).strip("\n")
    comments = "\n".join(ln.lstrip("# ").strip() for ln in lines[max(0, s - 6) : s + n] if ln.lstrip().startswith("#"))
    keys = re.findall(r'^\s*"?([A-Za-z_][\w.-]*)"?\s*[:=]', body, re.M) or re.findall(r"^\s*([a-z][\w-]{2,})\s", body, re.M)
    return body, (rng.choice(keys) if keys else Path(display_path(c)).name), comments, s + 1


def snippet(c: Candidate, domain: str, rng: random.Random) -> Snippet | None:
    """One excerpt of candidate ``c`` for corpus domain ``domain``, or None if it has nothing usable."""
    raw = read_plain(Path(c.path)) if c.kind in ("text", "mdbook-html", "docstrings") else extract(c)
    if not raw or len(raw) < 200:
        return None
    if domain == "code-python":
        cut = python_snippet(raw, rng)
    elif domain in _BRACE_DEF:
        cut = brace_snippet(domain, raw, rng)
    elif domain == "prose":
        cut = prose_snippet(c, raw, rng)
    else:
        cut = ops_snippet(c, raw, rng)
    if cut is None:
        return None
    text, name, notes, start = cut
    if len(text.strip()) < 60 or len(text) > 6000 or sum(1 for ch in text if ord(ch) > 127) > 0.02 * len(text):
        return None
    return Snippet(domain, origin_of(c), c.licence, display_path(c), text.strip("\n"), name, notes.strip(), start)
