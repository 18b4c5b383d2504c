"""Start and stop the project's servers as child processes, leaving nothing behind.

Used by the tests, the benchmarks and the demo. Each server runs in its own
process group (vLLM spawns an engine core and workers), so stopping it ends
the whole tree; ``ServerProcess`` is a context manager, and a start-up that
fails, times out or is interrupted (Ctrl-C, SIGTERM) stops the group before
the exception goes on.

Ports: ``free_port`` binds port 0 and *keeps* the socket (SO_REUSEADDR, not
listening) until the server that was given the port is up: the kernel hands
that port to nobody else meanwhile, while the server (which binds with
SO_REUSEADDR, as vLLM and uvicorn do) can still take it. Health: a 200 only
counts once the port's listening socket is known to belong to the child's
process group, so a stranger on the port is never mistaken for our server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import httpx
import psutil

CPU_SERVER_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache; vLLM's default (4) is more than a small MoE on a CI box needs
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # share the cores with whatever else runs (tests, a proxy, a second server)
    # vllm-cpu 0.32 on torch 2.13 saves an AOT-compiled graph that never loads again ("'function' object has
    # no attribute 'finalize_loading'", then a full compile): the cache only adds its save.
    "VLLM_DISABLE_COMPILE_CACHE": "1",
    # The worker in the engine core's process (vLLM's UniProcExecutor, what a one-GPU server runs): one
    # process, its imports and its IPC fewer. vllm-cpu asks for a worker process only to bind OpenMP threads.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}
"""A vllm-cpu server's environment unless the caller's says otherwise (``cpu_server_env``). Measured on the
bundled small MoE, alone on 2 cores (``reap-swap serve``): 81 s to healthy with vLLM's settings, 63 s
without the compile cache, 44 s with the worker in-process too; 4 x 64 greedy tokens 4.46 s, 2.83 s, 1.81 s,
the same text."""

_RESERVED: dict[int, socket.socket] = {}
"""Registry of ports handed out by ``free_port`` and not yet taken by their server."""


def cpu_server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The ``CPU_SERVER_ENV`` settings ``environ`` does not set. Threads bound to cores
    (``VLLM_CPU_OMP_THREADS_BIND`` other than nobind) keep vLLM's worker process, which sets the binding."""
    out = {k: v for k, v in CPU_SERVER_ENV.items() if k not in environ}
    if environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind") != "nobind":
        out.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return out


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody else will be given until ``release_port`` (ServerProcess releases it once up)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    port = int(s.getsockname()[1])
    _RESERVED[port] = s
    return port


def release_port(port: int) -> None:
    s = _RESERVED.pop(port, None)
    if s is not None:
        s.close()


class ServerStartError(RuntimeError):
    pass


def _group_members(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out


def listens_on(pids: Iterable[psutil.Process], port: int) -> bool:
    for p in pids:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.Error, PermissionError):
            continue
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return False


def _raise_on_sigterm() -> signal.Handlers | None:
    """Make SIGTERM raise (as Ctrl-C does) so cleanup runs; returns the handler to restore, if replaced."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None  # someone (pytest, an app) handles SIGTERM already: leave it to them
    try:
        def terminated(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)

        return signal.signal(signal.SIGTERM, terminated)  # type: ignore[return-value]
    except ValueError:  # not the main thread: signals cannot be handled here
        return None


class ServerProcess:
    """A child server: started, health-checked (and identity-checked), then stopped with its process group."""

    def __init__(
        self,
        argv: Sequence[str],
        port: int,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        health_path: str = "/health",
        name: str = "server",
        ready_status: Sequence[int] = (200,),
    ):
        self.argv = list(argv)
        self.port = port
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.health_path = health_path
        self.name = name
        self.ready_status = tuple(ready_status)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        previous = _raise_on_sigterm()
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
            self._wait_healthy(timeout)
        except BaseException:  # a failed, timed-out or interrupted start-up leaves nothing running
            self.stop(timeout=5.0)
            raise
        finally:
            release_port(self.port)
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        return self

    def _wait_healthy(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.log_tail()}")
            try:
                healthy = httpx.get(self.url + self.health_path, timeout=2.0).status_code in self.ready_status
            except httpx.HTTPError:
                healthy = False
            if healthy:
                if listens_on(_group_members(self.proc.pid), self.port):
                    return
                raise ServerStartError(f"{self.name}: port {self.port} answers, but not from this server's processes")
            time.sleep(0.5)
        raise ServerStartError(f"{self.name} not healthy after {timeout:.0f}s; log tail:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 20.0) -> None:
        """SIGINT, then SIGTERM, then SIGKILL to the whole group; grandchildren included, leader exited or not."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Members that outlived the leader (or a leader that exited early) share its group: end them too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
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
        "def found(m):\n"
        "    try:\n"
        "        return importlib.util.find_spec(m) is not None\n"
        "    except ModuleNotFoundError:  # a parent package this vLLM lacks (0.26 has no launchers)\n"
        "        return False\n"
        "mod = next(m for m in mods if found(m))\n"
        "sys.argv = [mod, *sys.argv[1:]]\n"
        "if __name__ == '__main__':\n"
        "    runpy.run_module(mod, run_name='__main__', alter_sys=True)\n"
    )
    return [sys.executable, "-c", code, "--model", str(model), *args]
