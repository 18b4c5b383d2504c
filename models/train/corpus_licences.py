"""Licence checks for the local corpus: only clearly permissive sources go in.

The corpus is built from what this machine already holds, so every file must
come from a package whose own metadata says it is MIT/BSD/Apache/PSF/ISC (or a
close, equally permissive variant). Anything unknown, copyleft or proprietary
is skipped, and the reason is kept for the manifest.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# SPDX ids we accept. BSL-1.0 (Boost) is in for torch's vendored headers; MIT-CMU is
# Pillow's MIT-style licence. Everything else (MPL, LGPL, GPL, Unlicense, CC-*, BlueOak,
# Artistic, proprietary) is skipped.
PERMISSIVE_SPDX: frozenset[str] = frozenset(
    {
        "MIT", "MIT-0", "MIT-CMU", "0BSD", "BSD-2-Clause", "BSD-3-Clause", "BSD",
        "Apache-2.0", "PSF-2.0", "Python-2.0", "ISC", "BSL-1.0",
    }
)
PERMISSIVE_EXCEPTIONS: frozenset[str] = frozenset({"LLVM-exception"})

# Free-text "License:" fields and trove classifiers, mapped to an SPDX-ish family.
_FREE_TEXT: tuple[tuple[str, str], ...] = (
    (r"^(the )?mit( license)?$", "MIT"),
    (r"^mit or apache[- ]2\.0$", "MIT"),
    (r"^(new |modified |revised )?bsd( license)?$", "BSD"),
    (r"^bsd[- ]?[23][- ]clause( license)?$", "BSD"),
    (r"^[23][- ]clause bsd( license)?$", "BSD"),
    (r"^bsd 3-clause license$", "BSD"),
    (r"^apache( software)?( license)?[ ,-]*(version )?2(\.0)?( license)?$", "Apache-2.0"),
    (r"^apache software license$", "Apache-2.0"),
    (r"^psf(-2\.0)?$", "PSF-2.0"),
    (r"^python software foundation license$", "PSF-2.0"),
    (r"^isc( license)?( \(iscl\))?$", "ISC"),
)
_CLASSIFIERS: dict[str, str] = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: MIT No Attribution License (MIT-0)": "MIT-0",
    "License :: OSI Approved :: BSD License": "BSD",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
    "License :: OSI Approved :: Python Software Foundation License": "PSF-2.0",
    "License :: OSI Approved :: ISC License (ISCL)": "ISC",
}
_COPYLEFT = re.compile(r"\b(A?GPL|LGPL|GNU|MPL|Mozilla Public|EUPL|CDDL|Proprietary|Commercial)\b", re.I)
# A file that carries its own copyleft or proprietary header is skipped even inside a
# permissive package (e.g. NVIDIA SDK headers bundled in wheels keep NVIDIA's licence).
FILE_COPYLEFT = re.compile(
    r"GNU (Lesser |Library |Affero )?General Public License|\bSPDX-License-Identifier:\s*(L|A)?GPL"
    r"|NOTICE TO LICENSEE|Licensed Deliverables|retain all intellectual property\s+(\*\s+)?and proprietary rights"
    r"|PROPRIETARY and\s+(\*\s+)?CONFIDENTIAL",
    re.I,
)
# Vendored trees carry their own licences, which the package metadata does not describe.
VENDORED_DIRS: frozenset[str] = frozenset(
    {"_vendor", "vendor", "vendored", "third_party", "third-party", "3rdparty", "thirdparty"}
)
# Vendor SDK headers bundled inside permissive wheels (CUDA/HIP/CUPTI in triton, cuda_fp16 in numba).
VENDOR_SDK_PATHS: tuple[str, ...] = ("triton/backends/nvidia/include/", "triton/backends/amd/include/",
                                     "numba/cuda/cuda_fp16", "numba/cuda/cuda_bf16")


def vendored(path: str) -> bool:
    """True for files in vendored trees or bundled vendor SDKs (their licence is not the package's)."""
    parts = path.replace("\\", "/").split("/")
    return any(p in VENDORED_DIRS for p in parts) or any(s in path for s in VENDOR_SDK_PATHS)


@dataclass(frozen=True)
class Verdict:
    """Whether a package may be used, and the licence summary to record."""

    ok: bool
    licence: str
    reason: str


def spdx_ok(expr: str) -> bool:
    """True when an SPDX expression is satisfiable with permissive terms only.

    OR alternatives: any one all-permissive branch suffices. AND: every term must be
    permissive. Mixed nesting with parentheses is judged conservatively (all terms).
    """
    expr = expr.strip()
    if not expr:
        return False
    nested = "(" in expr and " OR " in expr and " AND " in expr
    flat = expr.replace("(", " ").replace(")", " ")
    branches = [flat] if nested else re.split(r"\s+OR\s+", flat)
    for branch in branches:
        terms = re.split(r"\s+(?:AND|OR)\s+", branch.strip())
        if terms and all(_term_ok(t) for t in terms):
            return True
    return False


def _term_ok(term: str) -> bool:
    parts = re.split(r"\s+WITH\s+", term.strip())
    if parts[0].strip().rstrip("+") not in PERMISSIVE_SPDX:
        return False
    return all(p.strip() in PERMISSIVE_EXCEPTIONS for p in parts[1:])


def free_text_family(text: str) -> str | None:
    """Map a short free-text licence name to a family, or None when unsure."""
    t = " ".join(text.strip().lower().split())
    for pattern, family in _FREE_TEXT:
        if re.match(pattern, t):
            return family
    return None


def python_dist_verdict(metadata: Any) -> Verdict:
    """Judge a Python distribution from its dist-info METADATA (email.Message-like)."""
    expr = (metadata.get("License-Expression") or "").strip()
    if expr:
        ok = spdx_ok(expr)
        return Verdict(ok, expr, "License-Expression" + ("" if ok else " not permissive"))
    text = (metadata.get("License") or "").strip()
    classifiers = [c for c in (metadata.get_all("Classifier") or []) if c.startswith("License ::")]
    if text and "\n" not in text and len(text) <= 80:
        if _COPYLEFT.search(text):
            return Verdict(False, text, "License field names a copyleft/proprietary licence")
        family = free_text_family(text)
        if family:
            return Verdict(True, family, "License field")
        if spdx_ok(text):
            return Verdict(True, text, "License field (SPDX)")
    if text and not _COPYLEFT.search(text[:4000]):
        first = text.lstrip().split("\n", 1)[0].strip()
        if "Permission is hereby granted, free of charge" in text[:4000] and free_text_family(first) == "MIT":
            return Verdict(True, "MIT", "License field holds the MIT licence text")
    if text and _COPYLEFT.search(text[:2000]) and "BSD" not in text[:200]:
        return Verdict(False, text[:60], "License text mentions a copyleft/proprietary licence")
    fams = [_CLASSIFIERS.get(c) for c in classifiers]
    if fams and all(fams):
        return Verdict(True, "/".join(sorted(set(f for f in fams if f))), "trove classifiers")
    return Verdict(False, (text[:60] or ";".join(classifiers) or "none"), "licence unknown or not permissive")


def npm_verdict(package_json: Path) -> Verdict:
    """Judge an npm package from its package.json ``license``/``licenses`` field."""
    try:
        data = json.loads(package_json.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return Verdict(False, "unreadable", "package.json unreadable")
    lic: Any = data.get("license")
    if lic is None and isinstance(data.get("licenses"), list):
        types = [x.get("type", "") if isinstance(x, dict) else str(x) for x in data["licenses"]]
        lic = " OR ".join(types)
    if isinstance(lic, dict):
        lic = lic.get("type", "")
    lic = str(lic or "").strip()
    family = free_text_family(lic)
    if family:
        return Verdict(True, family, "package.json")
    ok = spdx_ok(lic)
    return Verdict(ok, lic or "none", "package.json" + ("" if ok else " licence not permissive/unknown"))


def rust_toolchain_verdict(doc_dir: Path) -> Verdict:
    """The Rust toolchain's COPYRIGHT says the project is dual MIT/Apache-2.0."""
    for name in ("COPYRIGHT.html", "COPYRIGHT.md", "COPYRIGHT"):
        p = doc_dir / name
        if p.is_file():
            text = p.read_text(encoding="utf-8", errors="replace")
            if re.search(r"dual-licensed under Apache 2\.0 and MIT", text):
                return Verdict(True, "Apache-2.0 OR MIT", f"{name}: 'dual-licensed under Apache 2.0 and MIT'")
    return Verdict(False, "unknown", "no COPYRIGHT file stating MIT/Apache")


def licence_file_verdict(path: Path) -> Verdict:
    """A bare LICENSE file (pyenv, CPython) judged by its opening words."""
    if not path.is_file():
        return Verdict(False, "none", f"{path} missing")
    head = path.read_text(encoding="utf-8", errors="replace")[:6000]
    if "Permission is hereby granted, free of charge" in head:
        return Verdict(True, "MIT", f"{path.name}: MIT permission notice")
    if "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in head:
        return Verdict(True, "PSF-2.0", f"{path.name}: PSF licence v2")
    return Verdict(False, "unknown", f"{path.name}: not recognised")
