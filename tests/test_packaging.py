"""Packaging: every package folder is declared in pyproject.toml, and the wheel builds without a
setuptools warning and ships every file of every package folder (modules, the bundled models, the
example corpora, the CPU kernel's C source).

The top-level folders install as ``reap_swap.*`` through ``package-dir``, so setuptools cannot
discover packages: a folder left out of ``packages`` is silently missing from an installed copy.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGE_DIR: dict[str, str] = CONFIG["package-dir"]
PACKAGES: list[str] = CONFIG["packages"]
SKIP_DIRS = {"__pycache__"}


def folder_of(package: str) -> Path:
    """Where setuptools reads ``package`` from: its longest ``package-dir`` prefix, then the dotted rest."""
    root = max((k for k in PACKAGE_DIR if package == k or package.startswith(k + ".")), key=len)
    rest = package[len(root):].lstrip(".")
    return REPO / PACKAGE_DIR[root] / Path(*rest.split(".")) if rest else REPO / PACKAGE_DIR[root]


def shipped_files(folder: Path) -> list[Path]:
    """The files directly in a package folder that belong to the project (git's list where there is one)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--", "."], cwd=folder, capture_output=True, text=True, check=True).stdout
        names = [n for n in out.split("\0") if n and "/" not in n]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: what is on disk
        names = [p.name for p in folder.iterdir() if p.is_file() and p.suffix != ".pyc"]
    return sorted(folder / n for n in names)


def test_every_package_folder_is_declared_and_every_declared_package_exists() -> None:
    for package in PACKAGES:
        assert folder_of(package).is_dir(), f"{package}: {folder_of(package)} does not exist"
    declared = set(PACKAGES)
    for root in PACKAGE_DIR:
        base = REPO / PACKAGE_DIR[root]
        for init in base.rglob("__init__.py"):
            if SKIP_DIRS & set(init.relative_to(base).parts):
                continue
            rel = init.parent.relative_to(base).parts
            name = ".".join((root, *rel))
            assert name in declared, f"{init.parent} holds a package ({name}) that pyproject.toml's packages do not list"
    for package, patterns in CONFIG.get("package-data", {}).items():
        assert package in declared, f"package-data for {package}, which packages do not list"
        for pattern in patterns:
            assert list(folder_of(package).glob(pattern)), f"package-data {package}: {pattern!r} matches no file"


def _setuptools_version() -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return (0,)


@pytest.mark.skipif(_setuptools_version() < (77,), reason="building offline needs setuptools >= 77 here (pyproject's build requirement)")
def test_wheel_builds_without_warnings_and_ships_every_package_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, src / name)
    expected: dict[str, Path] = {}
    for package in PACKAGES:
        folder = folder_of(package)
        for f in shipped_files(folder):
            dest = src / f.relative_to(REPO)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
            expected["/".join((*package.split("."), f.name))] = f
    out = tmp_path / "wheel"
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(out), str(src)],
                       capture_output=True, text=True, timeout=600)
    log = (p.stdout + p.stderr).replace(str(tmp_path), "<tmp>")  # this test's own name says "warnings"
    assert p.returncode == 0, log
    warnings = [line for line in log.splitlines() if "warn" in line.lower()]  # as `grep -i warn`
    assert not warnings, "\n".join(warnings)
    (wheel,) = out.glob("reap_swap-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(set(expected) - names)
    assert not missing, f"not in the wheel: {missing}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata
