"""Start and stop the project's servers as child processes, leaving nothing behind.

Used by the tests, the benchmarks and the demo. Each server runs in its own
process group (vLLM spawns an engine core and workers), so stopping it ends
the whole tree; ``ServerProcess`` is a context manager and stops on errors
and Ctrl-C too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    """A child server: started, health-checked, then stopped with its process group."""

    def __init__(
        self,
        argv: Sequence[str],
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        health_path: str = "/health",
        name: str = "server",
    ):
        self.argv = list(argv)
        self.port = port
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.health_path = health_path
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(f"{self.name} not healthy after {timeout:.0f}s; log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 20.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Grandchildren that outlived the leader share its group: end them too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "ServerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def reap_swap_argv(*args: str) -> list[str]:
    """Run the CLI with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "reap_swap.cli", *args]


def stock_vllm_argv(model: str | Path, *args: str) -> list[str]:
    """vLLM's own OpenAI server, no extension (the reference for token identity)."""
    code = (
        "import importlib.util, runpy, sys\n"
        "mods = ('vllm.entrypoints.launchers.api_server.entry', 'vllm.entrypoints.openai.api_server')\n"
        "mod = next(m for m in mods if importlib.util.find_spec(m))\n"
        "sys.argv = [mod, *sys.argv[1:]]\n"
        "if __name__ == '__main__':\n"
        "    runpy.run_module(mod, run_name='__main__', alter_sys=True)\n"
    )
    return [sys.executable, "-c", code, "--model", str(model), *args]
