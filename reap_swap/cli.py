"""The ``reap-swap`` command: one subcommand per pipeline stage.

Each subcommand lives in its own module as ``main(argv) -> int`` and is
imported only when run, so ``reap-swap --help`` and the light commands start
fast and work without vLLM installed.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("reap_swap.demo:main", "the whole pipeline end to end on the embedded default"),
    "tiny-model": ("reap_swap.models.tiny_cli:main", "build a deterministic tiny Qwen3-MoE test model"),
    "serve": ("reap_swap.server_ext.launcher:main", "serve a model with vLLM + expert-granular residency"),
    "bench-swap": ("reap_swap.benchmarks.swap_bench:main", "benchmark swaps and decode speed on a served model"),
    "observe": ("reap_swap.planning.observe:main", "REAP observation of a model over a calibration corpus"),
    "plan": ("reap_swap.planning.planner:main", "write a plan (core + co-activation slices) under a VRAM budget"),
    "plan-report": ("reap_swap.planning.report:main", "figures and a summary of a plan"),
    "train": ("reap_swap.classifier.train:main_train", "train the prompt -> per-expert mass classifier"),
    "evaluate": ("reap_swap.classifier.evaluate:main_evaluate", "held-out coverage: prediction vs static, top-k, even split, LFU, oracle"),
    "bench-classify": ("reap_swap.classifier.bench:main", "classifier latency idle and while vLLM generates for N streams"),
    "proxy": ("reap_swap.proxy.cli:main", "OpenAI-compatible routing proxy in front of reap-swap serve"),
    "bench-proxy": ("reap_swap.proxy.bench:main", "proxy overhead and concurrency policies, side by side"),
    "bench-proxy-scaling": ("reap_swap.benchmarks.proxy_scaling:main", "the proxy's policy decision time at 1/64/256 in-flight wishes and the per-request miss read, before/after (table + JSON)"),
    "bench-ledger-soak": ("reap_swap.benchmarks.ledger_soak:main", "N proxied requests, each reset by the proxy, on the tiny model: the miss ledger must keep none of them"),
    "bench-gpu": ("reap_swap.benchmarks.gpu_bench:main", "stock vLLM vs reap-swap on the GPU, one process per arm (table + JSON)"),
    "bench-serve": ("reap_swap.benchmarks.serve_bench:main", "served load over HTTP: stock vllm serve vs reap-swap serve at concurrency 1/8/32, one server per arm (table + JSON)"),
    "record-traces": ("reap_swap.planning.trace_record:main", "record a model's routing token by token into a routing trace (.npz)"),
    "simulate": ("reap_swap.planning.simulate:main", "replay a routing trace through expert cache policies (static, prior, LRU, LFRU, counters, Belady)"),
    "locality": ("reap_swap.planning.locality:main", "per-layer routing locality of traces: experts for 50/80/90 % mass, token-to-token reuse, vs published Qwen3"),
    "pregate-accuracy": ("reap_swap.benchmarks.pregate_accuracy:main", "how well layer L+d's router on layer L's hidden state predicts L+d's top-k experts (pre-gating), beside temporal reuse and static baselines"),
    "learned-sets": ("reap_swap.benchmarks.learned.sets_cli:main", "expert sets of the GPU benchmark's learned-routing arms (static top-k, plan, classifier, oracle), scored on traces"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """The help of every reap-swap command: each option's default after its help, unless the help
    already says it ("default ...", ``%(default)s``) or there is none to show (a flag, a required
    option, nothing set); docstring markup (code between double backquotes) shown plain."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.help is argparse.SUPPRESS or "%(default)" in text or re.search(r"\bdefault\b", text, re.I):
            return action.help
        if action.required or action.nargs == 0 or action.default in (None, "", argparse.SUPPRESS):
            return action.help
        return super()._get_help_string(action)

    def _format_text(self, text: str) -> str:
        return super()._format_text(re.sub(r"``([^`]+)``", r"\1", text))


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``HelpFormatter`` keeping the description's own line breaks (lists, tables)."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: reap-swap COMMAND [ARGS]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<14} {text}")
        print("\nRun reap-swap COMMAND --help for a command's options.")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"reap-swap: error: unknown command {name!r} (see reap-swap --help)", file=sys.stderr)
        return 2
    module, func = COMMANDS[name][0].split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
