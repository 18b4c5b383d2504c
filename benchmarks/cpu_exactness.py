"""Exactness of the CPU expert path (issue 16): stock vLLM vs reap-swap with REAP_CPU_EXPERTS=1.

Each arm runs in its own process (``python -m reap_swap.benchmarks.cpu_exactness arm SPEC OUT``)
and records, per prompt, the greedy token ids of ``--gen`` decode steps at batch 1 and the logits
of every step (a forward hook on the model's logits processor, which runs outside the CUDA graph).
The CPU arm keeps 30 % of each layer's experts resident and sets the cost model so that the CPU
computes *every* miss (the worst case for exactness: most pairs from the CPU's arithmetic).

Reported per model: greedy-token agreement with stock over the 256 tokens (share of equal
positions, and the first position that differs) and max |delta logit| over the steps before the
first difference (after it the two runs condition on different tokens and logits are not
comparable).

Usage (GPU): python -m reap_swap.benchmarks.cpu_exactness run --out exactness.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from reap_swap.paths import bundled_model_dir, learned128_cpu_dir

from .gpu_report import first_diff

MODELS = {"small_moe": bundled_model_dir, "learned128_cpu": learned128_cpu_dir}


def _arm(spec: dict[str, Any], out: Path) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if spec["cpu"]:
        from reap_swap.server_ext import config as rc
        from reap_swap.server_ext.cpu_experts import cpu_path as cp

        os.environ[rc.ENV_SLOTS] = str(spec["slots"])
        os.environ[rc.ENV_START] = json.dumps({f"layer_{i}": list(range(spec["slots"])) for i in range(spec["layers"])})
        os.environ[cp.ENV_CPU_EXPERTS] = "1"
        os.environ[cp.ENV_CPU_GBPS] = "1e6"  # the CPU wins every split: all misses on the CPU
        os.environ[cp.ENV_LINK_GBPS] = "1"
        os.environ[cp.ENV_FIXED_US] = "0"
        os.environ[cp.ENV_PAIR_US] = "0"
    import torch
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(model=spec["model"], dtype="bfloat16", max_model_len=spec["prompt_len"] + spec["gen"] + 16, seed=0,
                              enable_prefix_caching=False, gpu_memory_utilization=0.3, max_num_seqs=4,
                              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8]})
    if spec["cpu"]:
        kw["worker_extension_cls"] = "reap_swap.server_ext.worker_ext.ReapWorkerExtension"
    llm = LLM(**kw)
    if spec["cpu"]:
        llm.collective_rpc("reap_install")

    def install(model: Any) -> int:
        model.reap_logits = []
        model.reap_logits_hook = model.logits_processor.register_forward_hook(lambda m, i, o: model.reap_logits.append(o.float().cpu()))
        return 0

    def take(model: Any) -> Any:
        rows, model.reap_logits = model.reap_logits, []
        return rows

    llm.apply_model(install)
    if spec["cpu"]:
        llm.collective_rpc("reap_cpu_path_stats", args=(True,))
    sp = SamplingParams(temperature=0, max_tokens=spec["gen"], ignore_eos=True)
    prompts = []
    for prompt in spec["prompts"]:
        llm.apply_model(take)
        o = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
        rows = llm.apply_model(take)[0]
        logits = torch.cat([r[-1:] for r in rows])  # the sampled row of each step (the prompt's last position first)
        prompts.append({"tokens": list(o.outputs[0].token_ids), "logits": logits})
    torch.save({"prompts": prompts, "cpu_path": llm.collective_rpc("reap_cpu_path_stats")[0] if spec["cpu"] else None}, out)


def compare(stock: dict[str, Any], cpu: dict[str, Any]) -> dict[str, Any]:
    per = []
    for a, b in zip(stock["prompts"], cpu["prompts"]):
        ta, tb = a["tokens"], b["tokens"]
        first = first_diff(ta, tb)
        upto = len(ta) if first is None else first + 1  # step `first` still saw the same prefix
        delta = (a["logits"][:upto] - b["logits"][:upto]).abs().max().item()
        per.append({"agreement": sum(x == y for x, y in zip(ta, tb)) / len(ta), "first_diff": first,
                    "max_abs_logit_delta": delta, "steps_compared": upto,
                    "logit_scale": a["logits"][:upto].abs().max().item()})
    n = sum(len(a["tokens"]) for a in stock["prompts"])
    return {
        "prompts": len(per),
        "tokens_per_prompt": len(stock["prompts"][0]["tokens"]),
        "greedy_agreement_256": sum(p["agreement"] * len(a["tokens"]) for p, a in zip(per, stock["prompts"])) / n,
        "identical_prompts": sum(p["first_diff"] is None for p in per),
        "max_abs_logit_delta": max(p["max_abs_logit_delta"] for p in per),
        "per_prompt": per,
        "cpu_path": cpu.get("cpu_path"),
    }


def run(args: argparse.Namespace) -> int:
    import numpy as np

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"what": __doc__.split("\n\n")[1].replace("\n", " "), "gen": args.gen, "models": {}}
    for name in args.models:
        model = MODELS[name]()
        cfg = json.loads((model / "config.json").read_text())
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(3, cfg["vocab_size"], args.prompt_len)] for _ in range(args.prompts)]
        slots = max(1, round(0.3 * cfg["num_experts"]))
        arms = {}
        for arm in ("stock", "cpu"):
            spec = {"model": str(model), "cpu": arm == "cpu", "slots": slots, "layers": cfg["num_hidden_layers"],
                    "prompt_len": args.prompt_len, "gen": args.gen, "prompts": prompts}
            sp, out = workdir / f"{name}_{arm}.spec.json", workdir / f"{name}_{arm}.pt"
            sp.write_text(json.dumps(spec))
            out.unlink(missing_ok=True)
            with (workdir / "arms.log").open("ab") as log:
                rc = subprocess.run([sys.executable, "-m", "reap_swap.benchmarks.cpu_exactness", "arm", str(sp), str(out)],
                                    stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout_s).returncode
            if rc != 0 or not out.is_file():
                result["models"][name] = {"error": f"{arm} arm ended with {rc} (log: {workdir / 'arms.log'})"}
                break
            import torch

            arms[arm] = torch.load(out, weights_only=False)
        else:
            result["models"][name] = {"slots": slots, "experts": cfg["num_experts"], "top_k": cfg["num_experts_per_tok"],
                                      **compare(arms["stock"], arms["cpu"])}
        print(json.dumps({name: {k: v for k, v in result["models"][name].items() if k != "per_prompt"}}, indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if all("error" not in m for m in result["models"].values()) else 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["arm"]:
        _arm(json.loads(Path(argv[1]).read_text()), Path(argv[2]))
        sys.stdout.flush()
        os._exit(0)
    p = argparse.ArgumentParser(prog="cpu_exactness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=["run"])
    p.add_argument("--out", required=True)
    p.add_argument("--workdir", default="/tmp/cpu-exactness")
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen", type=int, default=256)
    p.add_argument("--timeout-s", type=float, default=240)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
