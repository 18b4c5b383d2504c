"""scripts/device_shim.sh, the GPU machine's import shim: sourced twice, it must not pull the shim from under a job.

Why: a device chain ran the CPU-path check in the background while the bench's session script sourced the shim
again; the old script deleted and rebuilt /tmp/shim every time, and the check died with "No module named
'reap_swap'". Each test sources the real script with bash into its own REAP_SHIM_DIR.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "device_shim.sh"


def _source(shim_dir: Path, repo: Path, then: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["REAP_SHIM_DIR"] = str(shim_dir)
    return subprocess.run(["bash", "-c", f'R="{repo}"; source "{SCRIPT}" && {then}'], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=60)


def _module_file(shim_dir: Path, repo: Path, module: str, cwd: Path) -> str:
    done = _source(shim_dir, repo, f'"{sys.executable}" -c "import {module} as m; print(m.__file__)"', cwd)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_imports_resolve_through_the_shim(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    path = _module_file(shim, REPO, "reap_swap.planning.step_time", tmp_path)
    assert path == str(shim / "reap_swap" / "planning" / "step_time.py")
    assert (shim.stat().st_mode & 0o777) == 0o755  # readable by any user, not mktemp's 0700


def test_a_second_source_keeps_the_shim_in_place(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    _module_file(shim, REPO, "reap_swap", tmp_path)
    inode = shim.stat().st_ino
    marker = shim / "reap_swap" / "in_use"  # stands for a job's open view of the folder
    marker.write_text("x")
    _module_file(shim, REPO, "reap_swap", tmp_path)
    assert shim.stat().st_ino == inode and marker.exists()
    assert not list(tmp_path.glob("shim.*")), "a build folder was left behind"


def test_a_new_module_in_the_checkout_rebuilds_it(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    (checkout / "reap_swap").mkdir(parents=True)
    shutil.copy(REPO / "reap_swap" / "__init__.py", checkout / "reap_swap" / "__init__.py")
    for entry in REPO.iterdir():  # the rest of the checkout as it is: the script picks the folders it maps
        if entry.name not in ("reap_swap", ".git"):
            (checkout / entry.name).symlink_to(entry)
    shim, cwd = tmp_path / "shim", tmp_path / "elsewhere"
    cwd.mkdir()
    _module_file(shim, checkout, "reap_swap", cwd)
    (checkout / "reap_swap" / "added_later.py").write_text("VALUE = 7\n")
    assert _module_file(shim, checkout, "reap_swap.added_later", cwd) == str(shim / "reap_swap" / "added_later.py")
