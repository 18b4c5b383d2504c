"""``reap-swap bench-classify``: classification latency idle and while vLLM generates for N streams.

In production the proxy classifies beside a busy vLLM server. This starts
``reap-swap serve`` on the model and plan, keeps ``--streams`` streaming chat
completions running back to back (from a separate client process), and times
the classifier the way the proxy runs it (one thread, a small OpenMP team) on held-out prompts: idle first,
then under load. It reports p50/p90/p99/max of the whole ``select`` (features
+ predict + selection) and how often ``select_within(--budget-ms)`` had to
answer with the prior. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from reap_swap.cli import HelpFormatter
from reap_swap.plan import PlanError, load_plan

from .model import ClassifierError, SliceClassifier


def held_out_prompts(corpus: Path, limit: int) -> list[str]:
    """What the proxy would classify: the prompt text of each conversation (last user turn + context)."""
    from reap_swap.planning.corpus import conversation_messages, prompt_text

    out = []
    for line in corpus.read_text(encoding="utf-8").splitlines():
        msgs = conversation_messages(json.loads(line)) if line.strip() else "empty"
        if not isinstance(msgs, str):
            upto = max(i for i, m in enumerate(msgs) if m["role"] == "user")
            out.append(prompt_text(msgs[: upto + 1]))
        if len(out) >= limit:
            break
    return out


def stats(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"n": int(len(a)), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "max": float(a.max())}


def measure(clf: SliceClassifier, prompts: list[str], budget_ms: float, gap_s: float) -> dict[str, Any]:
    """Time ``select`` per prompt, then ``select_within`` (fallback rate), prompts spaced by ``gap_s``."""
    full, feats = [], []
    for text in prompts:
        t = time.perf_counter()
        sel = clf.select(text)
        full.append((time.perf_counter() - t) * 1e3)
        feats.append(sel.embed_ms)
        time.sleep(gap_s)
    fell_back = 0
    for text in prompts:
        fell_back += bool(clf.select_within(text, budget_ms).fallback)
        time.sleep(gap_s)
    return {"select_ms": stats(full), "features_ms": stats(feats), "budget_ms": budget_ms, "fallback_rate": fell_back / len(prompts)}


def stream_forever(url: str, model: str, prompts: list[str], i: int, streams: int, gen: int, stop: Any, tokens: Any, errors: Any, started: Any) -> None:
    """One client stream (in the load process): chat completions back to back until ``stop`` is set."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0)
    k, first = i, True
    while not stop.is_set():
        try:
            stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[k % len(prompts)][-1500:]}],
                                                    max_tokens=gen, temperature=0.8, stream=True)
            for _chunk in stream:
                if first:
                    first = False
                    with started.get_lock():
                        started.value += 1
                with tokens.get_lock():
                    tokens.value += 1
                if stop.is_set():
                    break
        except Exception:  # noqa: BLE001 - counted; the load keeps going
            with errors.get_lock():
                errors.value += 1
            time.sleep(0.2)
        k += streams


def load_process(url: str, model: str, prompts: list[str], streams: int, gen: int, stop: Any, tokens: Any, errors: Any, started: Any) -> None:
    threads = [threading.Thread(target=stream_forever, args=(url, model, prompts, i, streams, gen, stop, tokens, errors, started), daemon=True)
               for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


class Load:
    """``streams`` streaming clients in a separate process (so their GIL is not the timed process's)."""

    def __init__(self, url: str, model: str, prompts: list[str], streams: int, gen_tokens: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.stop, self.tokens, self.errors, self.started = ctx.Event(), ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0)
        self.streams = streams
        self.proc = ctx.Process(target=load_process, args=(url, model, prompts, streams, gen_tokens, self.stop, self.tokens, self.errors, self.started),
                                daemon=True)

    def __enter__(self) -> "Load":
        self.proc.start()
        deadline = time.monotonic() + 300
        while self.started.value < self.streams and time.monotonic() < deadline and self.proc.is_alive():
            time.sleep(0.2)
        self.t0, self.tok0 = time.perf_counter(), self.tokens.value
        return self

    def __exit__(self, *exc: object) -> None:
        self.rate = (self.tokens.value - self.tok0) / max(time.perf_counter() - self.t0, 1e-9)
        self.error_count = int(self.errors.value)
        self.stop.set()
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from reap_swap.procs import ServerProcess, free_port, reap_swap_argv

    torch.set_num_threads(a.threads or max(1, min(4, (os.cpu_count() or 2) // 2)))  # what the proxy does
    plan = load_plan(a.plan)
    clf = SliceClassifier.load(a.classifier, plan)
    prompts = held_out_prompts(a.corpus, a.requests)
    clf.select(prompts[0])  # warm-up
    result: dict[str, Any] = {"classifier": str(a.classifier), "features": clf.features.spec.name, "prompts": len(prompts),
                              "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(), "streams": a.streams}
    result["idle"] = measure(clf, prompts, a.budget_ms, a.gap_ms / 1e3)
    result["idle"]["loadavg_1m"] = os.getloadavg()[0]
    port = free_port()
    server = ServerProcess(reap_swap_argv("serve", "--model", str(a.model), "--plan", str(a.plan), "--port", str(port),
                                          "--max-model-len", "2048", "--no-enable-prefix-caching"),
                           port, a.workdir / "serve.log", name="reap-swap serve")  # serve sets the CPU settings
    with server:
        with Load(server.url, str(a.model), prompts, a.streams, a.gen_tokens) as load:
            result["loaded"] = measure(clf, prompts, a.budget_ms, a.gap_ms / 1e3)
        result["load"] = {"decode_tok_per_s": load.rate, "errors": load.error_count, "gen_tokens_per_request": a.gen_tokens,
                          "loadavg_1m_after": os.getloadavg()[0]}
    return result


def format_table(r: dict[str, Any]) -> str:
    lines = [f"embed+predict+select latency, {r['features']} features, {r['prompts']} held-out prompts, "
             f"{r['torch_threads']} torch thread(s) on {r['cpus']} CPUs",
             f"{'':<34}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}{'prior used':>12}"]
    for key, label in (("idle", "idle"), ("loaded", f"vLLM generating, {r['streams']} streams")):
        m = r[key]
        s = m["select_ms"]
        lines.append(f"{label:<34}{s['p50']:>8.2f}{s['p90']:>8.2f}{s['p99']:>8.2f}{s['max']:>8.2f}"
                     f"{m['fallback_rate']:>11.0%} (budget {m['budget_ms']:g} ms)")
    lines.append(f"load: {r['load']['decode_tok_per_s']:.0f} streamed tokens/s, {r['load']['errors']} errors; 1-minute load average "
                 f"{r['idle']['loadavg_1m']:.1f} idle, {r['load']['loadavg_1m_after']:.1f} loaded (other processes on the box count too)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap bench-classify", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="model directory to serve for the load")
    p.add_argument("--plan", type=Path, required=True, help="plan JSON (reap-swap plan)")
    p.add_argument("--classifier", type=Path, required=True, help="classifier folder (reap-swap train)")
    p.add_argument("--corpus", type=Path, required=True, help="held-out ai-data-extraction JSONL (e.g. example/realistic/test.jsonl)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streaming generations during the load phase")
    p.add_argument("--requests", type=int, default=200, help="prompts timed per phase")
    p.add_argument("--gen-tokens", type=int, default=64, help="tokens per load request")
    p.add_argument("--gap-ms", type=float, default=20.0, help="pause between timed prompts")
    p.add_argument("--budget-ms", type=float, default=40.0, help="select_within budget")
    p.add_argument("--threads", type=int, help="torch threads for the embedder (default: the proxy's choice)")
    p.add_argument("--workdir", type=Path, default=Path("out/bench-classify"), help="server logs")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/classify_under_load.json"), help="result JSON")
    a = p.parse_args(argv)
    for path in (a.model, a.plan, a.classifier, a.corpus):
        if not path.exists():
            p.error(f"not found: {path}")
    try:
        result = run(a)
    except (PlanError, ClassifierError) as exc:
        print(f"reap-swap bench-classify: error: {exc}", file=sys.stderr)
        return 2
    print(format_table(result))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0
