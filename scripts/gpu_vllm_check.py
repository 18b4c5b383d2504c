"""GPU check of the vLLM extension (vLLM 0.26+, CUDA): the same model served stock and with
expert-granular residency (CUDA VMM backing), CUDA graphs on. Checks token identity across
swaps, real bytes moved, misses from the real routing, and times decode for each arm.

    python scripts/gpu_vllm_check.py --model DIR --out result.json [--eager]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox jumps over the lazy dog. Write a short story about it.",
    "sudo systemctl restart nginx && journalctl -u nginx --since today | tail",
    "Solve for x: 3x + 7 = 22. First subtract 7 from both sides, then",
]


def generate(llm, max_tokens: int):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(PROMPTS, sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t


def decode_tps(llm, tokens: int = 256) -> float:
    from vllm import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], one, use_tqdm=False)
    t = time.perf_counter()
    llm.generate(PROMPTS[:1], one, use_tqdm=False)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(PROMPTS[:1], full, use_tqdm=False)
    tn = time.perf_counter() - t
    return (tokens - 1) / (tn - t1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--slots", type=int, default=8)
    a = ap.parse_args()
    import torch
    from vllm import LLM

    cfg = json.load(open(os.path.join(a.model, "config.json")))
    E, L = cfg["num_experts"], cfg["num_hidden_layers"]
    common = dict(model=a.model, max_model_len=1024, enforce_eager=a.eager, gpu_memory_utilization=0.3, seed=0, enable_prefix_caching=False)
    result: dict = {"model": a.model, "eager": a.eager, "torch": torch.__version__}
    llm = LLM(**common)
    result["stock_tokens"], _ = generate(llm, 64)
    result["stock_decode_tps"] = decode_tps(llm)
    del llm
    gc.collect()
    torch.cuda.empty_cache()

    core = list(range(a.slots // 2))
    os.environ["REAP_RESIDENT_EXPERTS_PER_LAYER"] = str(a.slots)
    os.environ["REAP_START_RESIDENT"] = json.dumps({f"layer_{i}": core for i in range(L)})
    llm = LLM(**common, worker_extension_cls="reap_swap.server_ext.worker_ext.ReapWorkerExtension")
    info = llm.collective_rpc("reap_install")[0]
    result["install"] = {k: v for k, v in info.items() if k != "resident"}
    toks, _ = generate(llm, 64)
    result["identical_core_only"] = toks == result["stock_tokens"]
    result["misses_core_only"] = llm.collective_rpc("reap_router_misses", args=("__all__",))[0]["summary"]
    result["decode_tps_core_only"] = decode_tps(llm)
    swap = llm.collective_rpc("reap_swap", args=({f"layer_{i}": list(range(E - a.slots, E)) for i in range(L)},))[0]
    result["swap"] = {k: v for k, v in swap.items() if k != "resident"}
    result["verify_after_swap"] = llm.collective_rpc("reap_verify")[0]
    llm.collective_rpc("reap_reset_router_stats")
    toks, _ = generate(llm, 64)
    result["identical_after_swap"] = toks == result["stock_tokens"]
    result["misses_after_swap"] = llm.collective_rpc("reap_router_misses", args=("__all__",))[0]["summary"]
    del llm
    gc.collect()
    torch.cuda.empty_cache()

    os.environ["REAP_RESIDENT_EXPERTS_PER_LAYER"] = str(E)
    os.environ["REAP_START_RESIDENT"] = json.dumps({f"layer_{i}": list(range(E)) for i in range(L)})
    llm = LLM(**common, worker_extension_cls="reap_swap.server_ext.worker_ext.ReapWorkerExtension")
    llm.collective_rpc("reap_install")
    toks, _ = generate(llm, 64)
    result["identical_all_resident"] = toks == result["stock_tokens"]
    result["misses_all_resident"] = llm.collective_rpc("reap_router_misses", args=("__all__",))[0]["summary"]
    result["decode_tps_all_resident"] = decode_tps(llm)
    result.pop("stock_tokens")
    print(json.dumps(result, indent=1), flush=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
