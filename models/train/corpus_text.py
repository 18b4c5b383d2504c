"""Turn candidate files into clean, size-capped text documents.

Extraction is per kind (plain file, rustdoc source page, mdBook page, Python
docstrings, dist-info long description); filters drop binary, minified,
non-English-heavy and copyleft-headed text so every domain stays what its name
says; long files are split at line boundaries so no document dominates.
"""

from __future__ import annotations

import ast
import html
import re
import warnings
from importlib import metadata as md
from pathlib import Path

from corpus_licences import FILE_COPYLEFT
from corpus_sources import Candidate

MAX_FILE_BYTES = 2_000_000  # larger files are generated data, not text worth reading
_TAG = re.compile(r"<[^>]+>")
_RUST_LINE_ANCHOR = re.compile(r"<a href=#\d+ id=\d+ data-nosnippet>\d+</a>")
_RUST_CODE = re.compile(r'<pre class="rust"><code>(.*?)</code></pre>', re.S)
_MAIN = re.compile(r"<main>(.*?)</main>", re.S)
_DROP_BLOCKS = re.compile(r"<(script|style|nav|noscript)\b.*?</\1>", re.S | re.I)
_BLOCK_BREAK = re.compile(r"</?(p|div|h[1-6]|li|ul|ol|pre|table|tr|blockquote|section|br)\b[^>]*>", re.I)
_BLANKS = re.compile(r"\n{3,}")
_SHELL_BLOCK = re.compile(
    r'<code class="language-(toml|console|bash|shell|sh|yaml|yml|json|ini)[^"]*">(.*?)</code>', re.S
)


def read_plain(path: Path) -> str | None:
    """UTF-8 text of a file, or None for binary/oversized/undecodable files."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        raw = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in raw:
        return None
    try:
        return raw.decode("utf-8").replace("\r\n", "\n")
    except UnicodeDecodeError:
        return None


def rust_src_page(page: str) -> str | None:
    """The Rust source inside a rustdoc ``src/*.rs.html`` page, line numbers removed."""
    m = _RUST_CODE.search(page)
    if not m:
        return None
    body = _RUST_LINE_ANCHOR.sub("", m.group(1))
    return html.unescape(_TAG.sub("", body))


def mdbook_page(page: str) -> str | None:
    """The readable text of an mdBook page's <main>: headings, paragraphs and code."""
    m = _MAIN.search(page)
    if not m:
        return None
    body = _DROP_BLOCKS.sub("", m.group(1))
    body = _BLOCK_BREAK.sub("\n", body)
    text = html.unescape(_TAG.sub("", body))
    lines = [ln.rstrip() for ln in text.split("\n")]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def mdbook_shell_blocks(page: str) -> str | None:
    """The shell/TOML/YAML code blocks of an mdBook page, joined (Cargo.toml files, commands)."""
    blocks = [html.unescape(_TAG.sub("", m.group(2))).strip("\n") for m in _SHELL_BLOCK.finditer(page)]
    blocks = [b for b in blocks if b.strip()]
    return "\n\n".join(blocks) + "\n" if blocks else None


_MD_FENCE = re.compile(
    r"^```(toml|console|bash|shell|sh|yaml|yml|ini|cfg|dockerfile|make|json)[^\n]*\n(.*?)^```", re.S | re.M
)


def markdown_shell_blocks(text: str) -> str | None:
    """Fenced shell/config blocks of a Markdown document (install commands, YAML, TOML)."""
    blocks = [m.group(2).strip("\n") for m in _MD_FENCE.finditer(text)]
    blocks = [b for b in blocks if b.strip()]
    return "\n\n".join(blocks) + "\n" if blocks else None


def long_docstrings(source: str, min_chars: int = 300) -> str | None:
    """Module/class/function docstrings of at least ``min_chars``, joined: English prose in code."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return None
    docs: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            doc = _drop_doctests(doc) if doc else doc
            if doc and len(doc) >= min_chars:
                docs.append(doc)
    return "\n\n".join(docs) if docs else None


def _drop_doctests(doc: str) -> str:
    """Remove ``>>>`` examples and their output so docstring prose stays prose."""
    out: list[str] = []
    in_example = False
    for line in doc.split("\n"):
        stripped = line.strip()
        if stripped.startswith(">>>"):
            in_example = True
        elif in_example and not stripped:
            in_example = False
        if not in_example:
            out.append(line)
    return _BLANKS.sub("\n\n", "\n".join(out)).strip()


def dist_description(dist_name: str) -> str | None:
    """The long description (README) a wheel carries in its METADATA."""
    try:
        meta = md.metadata(dist_name)
    except md.PackageNotFoundError:
        return None
    body = meta.get_payload() if hasattr(meta, "get_payload") else None
    body = body or meta.get("Description") or ""
    return str(body).strip() or None


def extract(c: Candidate) -> str | None:
    """Raw text of one candidate, by its kind."""
    if c.kind in ("metadata", "metadata-shell"):
        desc = dist_description(c.path.split("::", 1)[0])
        return markdown_shell_blocks(desc) if desc and c.kind == "metadata-shell" else desc
    text = read_plain(Path(c.path))
    if text is None:
        return None
    if c.kind == "rust-src-html":
        return rust_src_page(text)
    if c.kind == "mdbook-html":
        return mdbook_page(text)
    if c.kind == "mdbook-shell":
        return mdbook_shell_blocks(text)
    if c.kind == "docstrings":
        return long_docstrings(text)
    if c.kind == "md-shell":
        return markdown_shell_blocks(text)
    return text


def acceptable(text: str, domain: str, min_chars: int) -> bool:
    """Quality gate: long enough, mostly ASCII, not minified, no copyleft header."""
    if len(text.strip()) < min_chars:
        return False
    if FILE_COPYLEFT.search(text[:8000]):
        return False
    sample = text[:20000]
    # Typographic punctuation (U+2000-U+206F: quotes, dashes) is normal in English docs.
    non_ascii = sum(1 for ch in sample if ord(ch) > 127 and not 0x2000 <= ord(ch) <= 0x206F)
    if non_ascii > 0.03 * len(sample):
        return False
    controls = sum(1 for ch in sample if ord(ch) < 32 and ch not in "\n\t")
    if controls > 0.001 * len(sample) + 2:
        return False
    lines = sample.split("\n")
    longest = max(len(ln) for ln in lines)
    mean = len(sample) / max(1, len(lines))
    if domain == "prose":
        return longest <= 8000
    return longest <= 1000 and mean <= 120


def chunks(text: str, max_chars: int, max_chunks: int) -> list[str]:
    """Split at line boundaries into pieces of at most ``max_chars``; keep the first few."""
    text = text.strip("\n") + "\n"
    if len(text) <= max_chars:
        return [text]
    out: list[str] = []
    cur: list[str] = []
    size = 0
    for line in text.split("\n"):
        line_len = len(line) + 1
        if size + line_len > max_chars and cur:
            out.append("\n".join(cur) + "\n")
            if len(out) >= max_chunks:
                return out
            cur, size = [], 0
        cur.append(line[:max_chars])
        size += min(line_len, max_chars)
    if cur and len(out) < max_chunks:
        out.append("\n".join(cur).rstrip("\n") + "\n")
    return out
