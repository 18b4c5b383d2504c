"""CMake arguments that let llama.cpp's CUDA build find cuBLAS and libcuda where a toolkit assembled
from pip wheels leaves them (issue 28; used by scripts/gpu_peers.sh build).

Why: FindCUDAToolkit looks for cublas_v2.h / libcublas.so / libcuda.so only inside the toolkit's
folders. A toolkit put together from NVIDIA's pip wheels (this CPU box's /usr/local/cuda is one,
and the H200 image lists the wheels nvidia-cublas, cuda-toolkit) has no cuBLAS there: it lives in
site-packages/nvidia/cu13/{include,lib} as libcublas.so.13 (no unversioned name, so find_library
misses it too), and the driver's libcuda.so.1 sits in a system folder. For each piece missing from
the toolkit this prints the cache entry that names it (one argument a line); nothing when the
toolkit is whole. Headers go through a folder of links to the cublas headers alone, so that the
wheels' other CUDA headers never shadow the toolkit's. The last line, ``#LD <dir>:<dir>``, lists
the library folders used, for the caller's LD_LIBRARY_PATH when llama-bench runs.

    python3 scripts/peers_cuda_args.py NVCC LINKDIR [SITE_DIR ...]
"""

from __future__ import annotations

import glob
import os
import site
import subprocess
import sys
import sysconfig


def _first(patterns: list[str]) -> str | None:
    for p in patterns:
        hits = sorted(glob.glob(p))
        if hits:
            return hits[0]
    return None


def site_dirs(extra: list[str]) -> list[str]:
    dirs = list(extra)
    for d in [sysconfig.get_paths().get("purelib"), sysconfig.get_paths().get("platlib"), *getattr(site, "getsitepackages", lambda: [])()]:
        if d and d not in dirs:
            dirs.append(d)
    return dirs


def _ldconfig(name: str) -> str | None:
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.strip().startswith(name + " ") and "=>" in line and "x86-64" in line:
            return line.split("=>", 1)[1].strip()
    return None


def cmake_args(nvcc: str, linkdir: str, sites: list[str], system_libdirs: tuple[str, ...] = (
        "/usr/lib/x86_64-linux-gnu", "/usr/local/nvidia/lib64", "/usr/lib64", "/usr/local/nvidia/lib")) -> tuple[list[str], list[str]]:
    """(cmake -D arguments, library folders for LD_LIBRARY_PATH)."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    tk = [root, os.path.join(root, "targets", "x86_64-linux")]
    args: list[str] = []
    libdirs: list[str] = []
    if not _first([os.path.join(t, "include", "cublas_v2.h") for t in tk]):
        h = _first([os.path.join(s, "nvidia", "*", "include", "cublas_v2.h") for s in sites])
        if h:
            os.makedirs(linkdir, exist_ok=True)
            for f in glob.glob(os.path.join(os.path.dirname(h), "cublas*.h")) + glob.glob(os.path.join(os.path.dirname(h), "nvblas*.h")):
                dst = os.path.join(linkdir, os.path.basename(f))
                if not os.path.lexists(dst):
                    os.symlink(f, dst)
            args += [f"-DCMAKE_CUDA_FLAGS=-I{linkdir}", f"-DCMAKE_CXX_FLAGS=-I{linkdir}"]
    for lib in ("cublas", "cublasLt"):
        if _first([os.path.join(t, d, f"lib{lib}.so") for t in tk for d in ("lib64", "lib")]):
            continue
        p = _first([os.path.join(s, "nvidia", "*", "lib", f"lib{lib}.so*") for s in sites])
        if p:
            args.append(f"-DCUDA_{lib}_LIBRARY={p}")
            if os.path.dirname(p) not in libdirs:
                libdirs.append(os.path.dirname(p))
    stub = [os.path.join(t, d, "stubs", "libcuda.so") for t in tk for d in ("lib64", "lib")]
    if not _first(stub + [os.path.join(t, d, "libcuda.so") for t in tk for d in ("lib64", "lib")]
                  + [os.path.join(d, "libcuda.so") for d in system_libdirs]):
        p = _first([os.path.join(d, "libcuda.so.1") for d in system_libdirs]) or _ldconfig("libcuda.so.1")
        if p:
            args.append(f"-DCUDA_cuda_driver_LIBRARY={p}")
    return args, libdirs


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    args, libdirs = cmake_args(argv[0], argv[1], site_dirs(argv[2:]))
    for a in args:
        print(a)
    print("#LD " + ":".join(libdirs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
