"""Subprocess for test_online_cache_e2e: an offline vLLM engine, stock or with the online cache.

``python tests/online_cache_probe.py SPEC.json OUT.json``. SPEC: model, kind ("stock", or
"reap" / "reap_ram" with the residency env), ``runs``: lists of {"id", "prompt" (token ids)} run concurrently (one list = one
batch), ``gen``, ``max_batched`` (chunked prefill's token budget), optional ``swap_before``
(per run index: an active set the control plane installs before that batch).
OUT: per batch the generated ids; for reap the cache view (resident sets, promotions),
router-miss reports per request, verify and the state after every batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from probe_support import run_batch  # this script's directory is on sys.path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    from vllm import LLM

    kw: dict[str, Any] = dict(model=spec["model"], dtype="float32", max_model_len=512, enable_prefix_caching=False, seed=0,
                              max_num_seqs=8, enable_chunked_prefill=True, max_num_batched_tokens=spec["max_batched"])
    reap = spec["kind"].startswith("reap")  # "reap" or "reap_ram" (RAM complement)
    if reap:
        kw["worker_extension_cls"] = "reap_swap.server_ext.swap_repair.RepairingWorkerExtension"
    llm = LLM(**kw)
    out: dict[str, Any] = {"runs": []}
    if reap:
        out["install"] = llm.collective_rpc("reap_install")[0]
    for i, batch in enumerate(spec["runs"]):
        run: dict[str, Any] = {}
        target = (spec.get("swap_before") or {}).get(str(i))
        if reap and target:
            run["swap"] = llm.collective_rpc("reap_swap", args=(target,))[0]
        run["tokens"] = run_batch(llm, batch, spec["gen"])
        if reap:
            run["view"] = llm.collective_rpc("reap_cache_view")[0]
            run["verify"] = llm.collective_rpc("reap_verify")[0]
            run["reports"] = {r["id"]: llm.collective_rpc("reap_router_misses", args=(r["id"],))[0] for r in batch}
        out["runs"].append(run)
    if reap:
        out["state"] = llm.collective_rpc("reap_state")[0]
    Path(sys.argv[2]).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
