"""Find the local, permissively licensed files each corpus domain draws from.

Every candidate carries its package and licence so the manifest can say where
each domain's text came from. Walks are sorted, so the same machine always
yields the same candidate list in the same order.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata as md
from pathlib import Path
from typing import Iterator

from corpus_licences import (
    Verdict,
    vendored,
    licence_file_verdict,
    npm_verdict,
    python_dist_verdict,
    rust_toolchain_verdict,
)

DOMAINS: tuple[str, ...] = ("code-python", "code-c", "code-js", "code-rust", "prose", "shell-config", "math", "code-other")

C_EXT = {".h", ".hpp", ".hh", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".cu", ".cuh"}
JS_EXT = {".js", ".mjs", ".cjs", ".ts", ".mts", ".cts", ".jsx", ".tsx"}
PROSE_EXT = {".md", ".rst", ".markdown"}
CONFIG_EXT = {".sh", ".bash", ".zsh", ".mk", ".yaml", ".yml", ".toml", ".ini", ".cfg", ".conf", ".json", ".def"}
# Languages this machine holds a little of (Cython, protobuf, Fortran, CMake, TableGen, SQL, HTML/CSS/XML, Perl,
# awk, m4, ...): one "code-other" domain, so routing also sees code that is none of the four big languages.
OTHER_EXT = {".pyx", ".pxd", ".pxi", ".proto", ".f90", ".f", ".f95", ".cmake", ".td", ".sql", ".html", ".htm", ".css",
             ".xml", ".pl", ".pm", ".awk", ".m4", ".go", ".java", ".rb", ".lua", ".tex", ".r", ".jl", ".scala", ".kt"}
CONFIG_NAMES = {"Makefile", "GNUmakefile", "makefile", "Setup", "Setup.local", "Setup.stdlib", "Setup.bootstrap"}
SKIP_NAMES = {"LICENSE", "LICENCE", "COPYING", "NOTICE", "AUTHORS", "RECORD", "WHEEL", "INSTALLER"}
# Rust books whose pages are English prose with examples (mdBook output).
RUST_BOOKS = (
    "book", "reference", "nomicon", "edition-guide", "embedded-book", "cargo", "rustc",
    "rustdoc", "clippy", "style-guide", "error_codes", "rust-by-example",
)
OWN_PROJECT = {"reap-swap", "reap_swap"}


@dataclass(frozen=True)
class Candidate:
    """One source file (or one extraction from a file) for one domain."""

    domain: str
    path: str
    package: str
    licence: str
    kind: str = "text"  # text|rust-src-html|mdbook-html|mdbook-shell|md-shell|docstrings|metadata[-shell]


@dataclass
class SourceReport:
    """Packages seen, with the verdict, for the manifest."""

    used: dict[str, Verdict]
    skipped: dict[str, Verdict]
    notes: list[str]


def domain_for_file(path: Path) -> str | None:
    """The domain a plain file belongs to, by name and extension (None: not used)."""
    name, suffix = path.name, path.suffix.lower()
    stem = name.split(".")[0].upper()
    if stem in SKIP_NAMES or name.endswith((".min.js", ".map", ".lock")) or name == "package-lock.json":
        return None
    if suffix == ".py":
        return "code-python"
    if suffix in C_EXT:
        return "code-c"
    if suffix in JS_EXT:
        return "code-js"
    if suffix in PROSE_EXT:
        return "prose"
    if suffix == ".txt" and stem.startswith(("README", "CHANGES", "HISTORY", "NEWS", "CHANGELOG")):
        return "prose"
    if suffix in CONFIG_EXT or name in CONFIG_NAMES:
        return "shell-config"
    if suffix in OTHER_EXT or name == "CMakeLists.txt":
        return "code-other"
    return None


def _sorted_walk(root: Path, prune: frozenset[str] = frozenset()) -> Iterator[Path]:
    """Files under root in a stable order, skipping pruned directory names and caches."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in prune and d != "__pycache__")
        for fn in sorted(filenames):
            p = Path(dirpath) / fn
            if p.is_file() and not p.is_symlink():
                yield p


def python_install(report: SourceReport) -> Iterator[Candidate]:
    """The running interpreter's stdlib and C headers (PSF licence, from its LICENSE.txt)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    verdict = licence_file_verdict(stdlib / "LICENSE.txt")
    if not verdict.ok:
        report.notes.append(f"python stdlib skipped: {verdict.reason}")
        return
    report.used["cpython-stdlib"] = verdict
    for p in _sorted_walk(stdlib, frozenset({"site-packages", "dist-packages"})):
        dom = domain_for_file(p)
        if dom is None and p.suffix == "" and _shebang_shell(p):
            dom = "shell-config"
        if dom in ("code-python", "shell-config", "prose"):
            yield Candidate(dom, str(p), "cpython-stdlib", verdict.licence)
            yield from _derived(dom, p, "cpython-stdlib", verdict.licence)
    include = Path(sysconfig.get_paths()["include"])
    for p in _sorted_walk(include):
        if p.suffix.lower() in C_EXT:
            yield Candidate("code-c", str(p), "cpython-include", verdict.licence)


def _shebang_shell(p: Path) -> bool:
    try:
        with open(p, "rb") as fh:
            head = fh.read(64)
    except OSError:
        return False
    return head.startswith(b"#!") and any(s in head.split(b"\n")[0] for s in (b"sh", b"bash", b"zsh"))


def _derived(domain: str, p: Path, package: str, licence: str) -> Iterator[Candidate]:
    """Second views of one file: a .py file's long docstrings are prose, a Markdown
    file's fenced shell/YAML/TOML blocks are shell-config."""
    if domain == "code-python":
        yield Candidate("prose", str(p), package + ":docstrings", licence, kind="docstrings")
    elif domain == "prose" and p.suffix.lower() in (".md", ".markdown"):
        yield Candidate("shell-config", str(p), package, licence, kind="md-shell")


def python_dists(report: SourceReport) -> Iterator[Candidate]:
    """Files of site-packages distributions whose metadata licence is permissive."""
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    seen: set[str] = set()
    dists = sorted(md.distributions(path=sorted(set(site))), key=lambda d: (d.metadata["Name"] or "").lower())
    for dist in dists:
        name = (dist.metadata["Name"] or "").lower()
        if not name or name in seen:
            continue
        seen.add(name)
        if name in OWN_PROJECT:
            continue
        verdict = python_dist_verdict(dist.metadata)
        if not verdict.ok:
            report.skipped[f"pypi:{name}"] = verdict
            continue
        report.used[f"pypi:{name}"] = verdict
        yield Candidate("prose", f"{name}::METADATA", f"pypi:{name}", verdict.licence, kind="metadata")
        yield Candidate("shell-config", f"{name}::METADATA", f"pypi:{name}", verdict.licence, kind="metadata-shell")
        for rel in sorted(str(f) for f in (dist.files or [])):
            if ".dist-info/" in rel or "__pycache__" in rel:
                continue
            p = Path(dist.locate_file(rel))
            if vendored(rel):
                continue
            dom = domain_for_file(p)
            if dom and p.is_file() and not p.is_symlink():
                yield Candidate(dom, str(p), f"pypi:{name}", verdict.licence)
                yield from _derived(dom, p, f"pypi:{name}", verdict.licence)


def npm_global(report: SourceReport) -> Iterator[Candidate]:
    """JS/TS, docs and package.json files from npm's global node_modules, per package licence."""
    npm = shutil.which("npm")
    if not npm:
        report.notes.append("npm not found: code-js has no npm sources")
        return
    root = Path(subprocess.run([npm, "root", "-g"], capture_output=True, text=True, check=True).stdout.strip())
    for pkg_json in sorted(root.rglob("package.json")):
        pkg_dir = pkg_json.parent
        parent = pkg_dir.parent
        is_root = parent == root or parent.name == "node_modules" or (
            parent.name.startswith("@") and parent.parent.name == "node_modules"
        ) or (parent.name.startswith("@") and parent.parent == root)
        if not is_root:
            continue
        try:
            name = json.loads(pkg_json.read_text(encoding="utf-8")).get("name") or pkg_dir.name
        except (OSError, ValueError):
            continue
        key = f"npm:{name}@{pkg_dir.relative_to(root)}"
        verdict = npm_verdict(pkg_json)
        if not verdict.ok:
            report.skipped[key] = verdict
            continue
        report.used[key] = verdict
        for p in _sorted_walk(pkg_dir, frozenset({"node_modules"})):
            dom = domain_for_file(p)
            if dom:
                yield Candidate(dom, str(p), f"npm:{name}", verdict.licence)
                yield from _derived(dom, p, f"npm:{name}", verdict.licence)


def rust_toolchain(report: SourceReport) -> Iterator[Candidate]:
    """Rust std sources (rustdoc's rendered src pages) and the Rust books, from one toolchain."""
    tc_root = Path.home() / ".rustup" / "toolchains"
    docs = sorted(tc_root.glob("*/share/doc/rust")) if tc_root.is_dir() else []
    docs.sort(key=lambda d: (not d.parts[-4].startswith("stable"), str(d)))
    rust_src = sorted(tc_root.glob("*/lib/rustlib/src/rust/library")) if tc_root.is_dir() else []
    registry = Path.home() / ".cargo" / "registry" / "src"
    if not docs:
        report.notes.append("no Rust toolchain docs under ~/.rustup: code-rust skipped")
        return
    doc = docs[0]
    verdict = rust_toolchain_verdict(doc)
    if not verdict.ok:
        report.notes.append(f"Rust toolchain skipped: {verdict.reason}")
        return
    report.used[f"rust-toolchain:{doc.parts[-4]}"] = verdict
    if rust_src:
        for p in _sorted_walk(rust_src[0]):
            if p.suffix == ".rs":
                yield Candidate("code-rust", str(p), "rust-std", verdict.licence)
    else:
        report.notes.append(
            "no rust-src component; Rust std sources taken from rustdoc's rendered source pages "
            f"({doc / 'html' / 'src'})"
        )
        for p in _sorted_walk(doc / "html" / "src"):
            if p.name.endswith(".rs.html"):
                yield Candidate("code-rust", str(p), "rust-std", verdict.licence, kind="rust-src-html")
    if registry.is_dir():
        report.notes.append(f"cargo registry at {registry} not used (per-crate licences not checked)")
    for book in RUST_BOOKS:
        for p in _sorted_walk(doc / "html" / book):
            if p.suffix == ".html" and p.name not in ("print.html", "toc.html", "404.html"):
                yield Candidate("prose", str(p), f"rust-book:{book}", verdict.licence, kind="mdbook-html")
                yield Candidate("shell-config", str(p), f"rust-book:{book}", verdict.licence, kind="mdbook-shell")


def pyenv_tree(report: SourceReport) -> Iterator[Candidate]:
    """pyenv's own shell scripts and docs (MIT), when the interpreter lives under pyenv."""
    root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    if not Path(sys.base_prefix).is_relative_to(root):
        return
    verdict = licence_file_verdict(root / "LICENSE")
    if not verdict.ok:
        report.notes.append(f"pyenv skipped: {verdict.reason}")
        return
    report.used["pyenv"] = verdict
    for p in _sorted_walk(root, frozenset({"versions", "shims", "cache", "sources", ".git"})):
        rel = p.relative_to(root).parts
        pkg = "pyenv-definitions" if "share" in rel and "python-build" in rel else "pyenv"
        dom = domain_for_file(p)
        if dom is None and (p.suffix in ("", ".bats") and _shebang_shell(p) or pkg == "pyenv-definitions"):
            dom = "shell-config"
        if p.suffix == ".bats":
            dom = "shell-config"
        if dom in ("shell-config", "prose"):
            yield Candidate(dom, str(p), pkg, verdict.licence)


def all_candidates() -> tuple[list[Candidate], SourceReport]:
    """Every candidate from every source, in a fixed order."""
    report = SourceReport(used={}, skipped={}, notes=[])
    cands: list[Candidate] = []
    for source in (python_install, python_dists, npm_global, rust_toolchain, pyenv_tree):
        cands.extend(source(report))
    return cands, report
