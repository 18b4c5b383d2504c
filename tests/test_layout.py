"""The server_ext rooms keep their floors: rules read from the imports (ast), not from docs.

1. ``step/`` and ``cache/`` import nothing from ``control/``;
2. ``bank/`` imports none of the other rooms (nor the glue above them);
3. nothing under ``control/`` imports torch (or triton, vLLM), directly or through what it imports.

Imports inside functions count (they run when called); imports under ``if TYPE_CHECKING:`` do not.
The checker runs on the real tree and, to show it can fail, on small trees with a violation.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("bank", "step", "cache", "cpu_experts", "control")
HEAVY = ("torch", "triton", "vllm")


@dataclass
class ModuleGraph:
    """Project modules (dotted name -> file), their project imports and their outside imports."""

    files: dict[str, Path]
    packages: set[str]
    internal: dict[str, set[str]] = field(default_factory=dict)
    external: dict[str, set[str]] = field(default_factory=dict)

    def closure(self, name: str) -> set[str]:
        """Every project module that importing ``name`` runs, its parent packages included."""
        seen: set[str] = set()
        todo = [name]
        while todo:
            cur = todo.pop()
            parts = cur.split(".")
            for i in range(1, len(parts) + 1):
                mod = ".".join(parts[:i])
                if mod in self.files and mod not in seen:
                    seen.add(mod)
                    todo.extend(self.internal.get(mod, ()))
        return seen


def package_dirs(repo: Path) -> dict[str, Path]:
    """pyproject's package-dir: dotted package -> folder."""
    cfg = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {pkg: repo / path for pkg, path in cfg["package-dir"].items()}


def discover(roots: dict[str, Path]) -> ModuleGraph:
    files: dict[str, Path] = {}
    packages: set[str] = set()
    for pkg, folder in roots.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("").parts
            if rel[-1] == "__init__":
                name = ".".join((pkg, *rel[:-1]))
                packages.add(name)
            else:
                name = ".".join((pkg, *rel))
            files.setdefault(name, path)
    graph = ModuleGraph(files, packages)
    for name, path in files.items():
        graph.internal[name], graph.external[name] = imports_of(name, path, graph)
    return graph


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports_of(name: str, path: Path, graph: ModuleGraph) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = _type_checking_lines(tree)
    base = name.split(".") if name in graph.packages else name.split(".")[:-1]
    internal: set[str] = set()
    external: set[str] = set()

    def add(target: str) -> None:
        if target in graph.files:
            internal.add(target)
        elif target.split(".")[0] == "reap_swap":
            raise AssertionError(f"{path}: imports {target}, which is not a module of this project")
        else:
            external.add(target.split(".")[0])

    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                pkg = ".".join(base[: len(base) - node.level + 1])
                mod = f"{pkg}.{node.module}" if node.module else pkg
            else:
                mod = node.module or ""
            add(mod)
            for alias in node.names:  # ``from pkg import submodule``
                if f"{mod}.{alias.name}" in graph.files:
                    internal.add(f"{mod}.{alias.name}")
    return internal, external


def room_of(name: str, top: str) -> str | None:
    """``bank``, ``step``, … for a module of a room; ``glue`` for server_ext's own modules; None outside."""
    if not name.startswith(top + ".") and name != top:
        return None
    rest = name[len(top) + 1:].split(".") if name != top else []
    if rest and rest[0] in ROOMS:
        return rest[0]
    return "glue"


def violations(graph: ModuleGraph, top: str = "reap_swap.server_ext") -> list[str]:
    found: list[str] = []
    for name in sorted(graph.files):
        room = room_of(name, top)
        if room in (None, "glue"):
            continue
        if room in ("step", "cache"):
            for dep in sorted(graph.internal[name]):
                if room_of(dep, top) == "control":
                    found.append(f"{name} imports {dep}: step/ and cache/ import nothing from control/")
        if room == "bank":
            for dep in sorted(graph.internal[name]):
                other = room_of(dep, top)
                if other not in (None, "bank") and dep != top:
                    found.append(f"{name} imports {dep}: bank/ imports none of the other rooms")
        if room == "control":
            for dep in sorted(graph.closure(name)):
                heavy = sorted(graph.external.get(dep, set()) & set(HEAVY))
                if heavy:
                    via = "" if dep == name else f" through {dep}"
                    found.append(f"{name} imports {', '.join(heavy)}{via}: nothing under control/ imports torch")
    return found


def test_the_rooms_exist_as_packages():
    graph = discover(package_dirs(REPO))
    for room in ROOMS:
        assert f"reap_swap.server_ext.{room}" in graph.packages, f"server_ext/{room}/ is not a package in pyproject"
        doc = ast.get_docstring(ast.parse(graph.files[f"reap_swap.server_ext.{room}"].read_text()))
        assert doc and len(doc.splitlines()) <= 3, f"server_ext/{room}/__init__.py: a docstring of at most three lines says what the room holds"


def test_import_rules_hold_on_the_tree():
    graph = discover(package_dirs(REPO))
    assert len([n for n in graph.files if room_of(n, "reap_swap.server_ext") == "control"]) >= 8
    assert violations(graph) == []


def test_control_runs_without_torch():
    """The rule holds at run time too: importing every control module loads no torch."""
    graph = discover(package_dirs(REPO))
    control = sorted(n for n in graph.files if room_of(n, "reap_swap.server_ext") == "control")
    code = "import sys\n" + "".join(f"import {n}\n" for n in control) + (
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in %r)\nprint(heavy)\nassert not heavy, heavy\n" % (HEAVY,))
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _tree(tmp_path: Path, sources: dict[str, str]) -> ModuleGraph:
    root = tmp_path / "server_ext"
    for rel, text in {"__init__.py": "", **{f"{r}/__init__.py": "" for r in ROOMS}, **sources}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return discover({"reap_swap.server_ext": root})


@pytest.mark.parametrize(
    ("sources", "expected"),
    [
        ({"step/kernels.py": "from ..control import auth\n", "control/auth.py": ""}, "step/ and cache/ import nothing from control/"),
        ({"cache/policy.py": "def f():\n    from reap_swap.server_ext.control.http import X\n", "control/http.py": ""},
         "step/ and cache/ import nothing from control/"),
        ({"bank/bank.py": "from ..step.arena import Arena\n", "step/arena.py": ""}, "bank/ imports none of the other rooms"),
        ({"bank/bank.py": "from .. import layer\n", "layer.py": ""}, "bank/ imports none of the other rooms"),
        ({"control/http.py": "import torch\n"}, "nothing under control/ imports torch"),
        ({"control/http.py": "from .. import config\n", "config.py": "from .step import misses\n",
          "step/misses.py": "import torch.nn\n"}, "through reap_swap.server_ext.step.misses"),
        ({"control/metrics.py": "def f():\n    import triton\n"}, "nothing under control/ imports torch"),
    ],
)
def test_the_checker_finds_a_violation(tmp_path, sources, expected):
    found = violations(_tree(tmp_path, sources))
    assert any(expected in v for v in found), found


def test_the_checker_passes_type_checking_imports(tmp_path):
    src = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
    assert violations(_tree(tmp_path, {"control/http.py": src})) == []


def readme_layout_rows(readme: str) -> dict[str, str]:
    """The README's code-layout table: folder -> its row's text."""
    rows: dict[str, str] = {}
    for line in readme.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`") and cells[0].endswith("/`") and cells[1].startswith("`reap_swap"):
            rows[cells[0].strip("`")] = cells[2]
    return rows


def test_readme_layout_table_matches_the_tree():
    import re

    rows = readme_layout_rows((REPO / "README.md").read_text())
    dirs = package_dirs(REPO)
    listed = {str(path.relative_to(REPO)) + "/" for pkg, path in dirs.items()}
    assert set(rows) == listed, f"README layout table folders {sorted(rows)} != packages {sorted(listed)}"
    for folder, text in rows.items():
        for name in re.findall(r"`([\w/]+\.(?:py|c))`", text):
            assert (REPO / folder / name).exists(), f"README layout table: {folder}{name} does not exist"
    for room in ROOMS:
        modules = sorted(p.name for p in (REPO / "server_ext" / room).glob("*.py") if p.name != "__init__.py")
        named = set(re.findall(r"`([\w]+\.py)`", rows[f"server_ext/{room}/"]))
        unnamed = [m for m in modules if m not in named]
        assert not unnamed, f"README layout table: server_ext/{room}/ leaves out {unnamed}"


def test_vllm_class_paths_resolve():
    """The classes ``serve`` hands vLLM, and the middleware's path from before the rooms, resolve as vLLM resolves them."""
    import importlib

    from reap_swap.server_ext import launcher

    def resolve(qualname: str) -> object:
        module, _, attr = qualname.rpartition(".")
        return getattr(importlib.import_module(module), attr)

    middleware = resolve(launcher.MIDDLEWARE)
    assert launcher.MIDDLEWARE == "reap_swap.server_ext.control.http.ReapControlMiddleware"
    assert resolve("reap_swap.server_ext.http.ReapControlMiddleware") is middleware
    assert resolve(launcher.WORKER_EXTENSION).__name__ == "RepairingWorkerExtension"
    readme = (REPO / "README.md").read_text()
    assert launcher.MIDDLEWARE in readme and launcher.WORKER_EXTENSION in readme


def unresolved_names(graph: ModuleGraph) -> list[str]:
    """``from <project module> import name`` where the module has no such name (lazy imports included)."""
    import importlib

    missing: list[str] = []
    for name, path in sorted(graph.files.items()):
        base = name.split(".") if name in graph.packages else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                pkg = ".".join(base[: len(base) - node.level + 1])
                mod = f"{pkg}.{node.module}" if node.module else pkg
            else:
                mod = node.module or ""
            if mod not in graph.files:
                continue
            module = importlib.import_module(mod)
            for alias in node.names:
                if alias.name != "*" and not hasattr(module, alias.name) and f"{mod}.{alias.name}" not in graph.files:
                    missing.append(f"{path.relative_to(REPO)}:{node.lineno}: {mod} has no {alias.name}")
    return missing


def test_every_project_import_resolves():
    """After a move, an import that only runs on CUDA (a lazy one) must still name a real thing."""
    code = ("import sys; sys.path.insert(0, %r)\nfrom test_layout import REPO, discover, package_dirs, unresolved_names\n"
            "missing = unresolved_names(discover(package_dirs(REPO)))\nprint('\\n'.join(missing))\nsys.exit(1 if missing else 0)\n"
            % str(REPO / "tests"))
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
