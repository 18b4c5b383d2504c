"""Issue 11 point 8: the process manager on real processes (no vLLM): interrupted and failed
start-ups leave nothing running, ports are reserved race-free, and a stranger on the port is never
taken for our server."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SLOW_SERVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
if sys.argv[2] == "exit":
    sys.exit(3)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_file(path: Path, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"{path} never written")


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGTERM"])
def test_interrupted_start_up_leaves_no_process(tmp_path: Path, signal_name: str) -> None:
    """A driver process starts a never-healthy server and is interrupted during start-up."""
    pidfile = tmp_path / "grandchild.pid"
    (tmp_path / "srv.py").write_text(SLOW_SERVER)
    # The driver stands for a process run from a terminal: Ctrl-C raises there. (A job started in
    # the background of a non-interactive shell inherits SIGINT ignored, and Python keeps it so.)
    driver = (
        "import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from pathlib import Path\nfrom reap_swap.procs import ServerProcess, free_port\n"
        f"p = free_port()\nServerProcess([sys.executable, {str(tmp_path / 'srv.py')!r}, {str(pidfile)!r}, 'wait'], p, "
        f"Path({str(tmp_path / 'log')!r})).start(timeout=600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=Path(__file__).resolve().parents[1])
    grandchild = _wait_file(pidfile)
    proc.send_signal(getattr(__import__("signal"), signal_name))
    proc.wait(30)
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild), "the server's child outlived an interrupted start-up"


def test_early_exit_kills_the_whole_group(tmp_path: Path) -> None:
    from reap_swap.procs import ServerProcess, ServerStartError, free_port

    pidfile = tmp_path / "grandchild.pid"
    (tmp_path / "srv.py").write_text(SLOW_SERVER)
    port = free_port()
    with pytest.raises(ServerStartError, match="exited with 3"):
        ServerProcess([sys.executable, str(tmp_path / "srv.py"), str(pidfile), "exit"], port, tmp_path / "log").start(timeout=60)
    grandchild = _wait_file(pidfile)
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(grandchild)


def test_reserved_port_is_given_to_nobody_else_and_a_stranger_is_not_our_server(tmp_path: Path) -> None:
    from reap_swap.procs import ServerProcess, ServerStartError, free_port, release_port

    port = free_port()
    seen = set()
    for _ in range(3000):  # the kernel's ephemeral allocator skips the reserved port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            seen.add(s.getsockname()[1])
    assert port not in seen
    with socket.socket() as plain:  # nor can anyone bind it without SO_REUSEADDR
        with pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
    release_port(port)
    # A stranger (this test process) answers /health on the port: the child is never taken for it.
    stranger = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        idle = [sys.executable, "-c", "import time; time.sleep(600)"]
        with pytest.raises(ServerStartError, match="not from this server"):
            ServerProcess(idle, port, tmp_path / "log", health_path="/").start(timeout=30)
    finally:
        stranger.kill()
        stranger.wait()


def test_older_vllm_without_launchers_gets_the_openai_server(tmp_path: Path) -> None:
    from reap_swap.procs import stock_vllm_argv

    # a vLLM like 0.26: no vllm.entrypoints.launchers package, only vllm.entrypoints.openai.api_server
    pkg = tmp_path / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "entrypoints", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text("import sys\nif __name__ == '__main__':\n    print('openai api_server', sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(stock_vllm_argv("m", "--port", "0"), env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "openai api_server ['--model', 'm', '--port', '0']" in out.stdout


def test_a_cpu_servers_settings_yield_to_the_callers_and_bound_threads_keep_the_worker_process() -> None:
    from reap_swap.procs import CPU_SERVER_ENV, cpu_server_env

    assert cpu_server_env({}) == CPU_SERVER_ENV
    assert cpu_server_env({"VLLM_CPU_KVCACHE_SPACE": "8"}) == {k: v for k, v in CPU_SERVER_ENV.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    bound = cpu_server_env({"VLLM_CPU_OMP_THREADS_BIND": "0-15"})
    assert "VLLM_CPU_OMP_THREADS_BIND" not in bound and "VLLM_ENABLE_V1_MULTIPROCESSING" not in bound  # vLLM's worker binds them
    assert cpu_server_env({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}).get("VLLM_ENABLE_V1_MULTIPROCESSING") is None
