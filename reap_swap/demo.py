"""``reap-swap demo``: the whole pipeline on the embedded default, end to end.

model -> observe the example corpus -> plan at a stated budget -> report ->
train + evaluate the classifier -> ``serve`` and ``proxy`` on free loopback
ports -> OpenAI SDK requests from several domains -> a per-request table
(chosen slices, bytes moved, swap time, miss ratio against the static core)
and figures -> everything shut down, also on Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .paths import bundled_model_dir, example_corpus_files
from .procs import ServerProcess, free_port, reap_swap_argv

CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def step(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def default_model(work: Path) -> Path:
    """The committed trained small MoE when present, else a freshly built tiny random one."""
    trained = bundled_model_dir()
    if (trained / "model.safetensors").is_file():
        return trained
    from .models.tiny import TinySpec, build_tiny_model

    out = work / "tiny-model"
    if not (out / "model.safetensors").is_file():
        build_tiny_model(out, TinySpec())
    return out


def demo_requests(n_per_domain: int) -> list[tuple[str, str]]:
    from .planning.corpus import conversation_messages

    test = next(p for p in example_corpus_files() if p.stem == "test")
    by: dict[str, list[str]] = {}
    for line in test.read_text().splitlines():
        row = json.loads(line)
        msgs = conversation_messages(row)
        if isinstance(msgs, str):
            continue
        first_user = next(m["content"] for m in msgs if m["role"] == "user")
        by.setdefault(row["tags"][0], []).append(first_user)
    return [(d, by[d][i]) for i in range(n_per_domain) for d in sorted(by) if i < len(by[d])]


def miss_ratio_for(misses: dict[str, Any], resident: dict[int, list[int]]) -> float:
    """Miss ratio the same routed tokens would have had with another resident set."""
    obs = ina = 0.0
    for key, row in misses["by_layer"].items():
        mass = row["expert_mass"]
        have = set(resident[int(key.removeprefix("layer_"))])
        obs += sum(mass)
        ina += sum(m for e, m in enumerate(mass) if e not in have)
    return ina / obs if obs else 0.0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    from openai import OpenAI

    from .classifier.train import run_evaluation, train
    from .models.families import layout_for
    from .plan import load_plan
    from .planning.budget import make_budget
    from .planning.observations import load_observations
    from .planning.observe import observe
    from .planning.planner import PlanParams, build_plan
    from .planning.report import write_report
    from .planning import coverage as cov

    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or default_model(work)
    layout = layout_for(model)
    step(f"model {model}: {layout.num_moe_layers} MoE layers x {layout.num_experts} experts, top-{layout.top_k}, "
         f"{layout.total_bytes / 2**20:.1f} MiB ({layout.dtype})")
    step("observing the example corpus (REAP saliency, frequencies, co-activation) ...")
    obs_dir = work / "observations"
    observe(model, example_corpus_files(), obs_dir, max_samples=args.max_samples, max_tokens=args.max_tokens, batch_size=8)
    obs = load_observations(obs_dir)
    step(f"planning at {args.budget_ratio:.0%} of the model's bytes resident ...")
    plan_path = work / "plan.json"
    plan_dict = build_plan(obs, layout, make_budget(layout, ratio=args.budget_ratio), PlanParams(core_fraction=args.core_fraction), str(model))
    plan_path.write_text(json.dumps(plan_dict, indent=1) + "\n")
    plan = load_plan(plan_path)
    report = write_report(plan_path, obs_dir, work / "report")
    step("training the prompt -> slices classifier ...")
    clf_dir = work / "classifier"
    train(obs_dir, plan_path, clf_dir, "test", None, None)
    evaluation = run_evaluation(obs_dir, plan_path, clf_dir, "test", latency_prompts=20)
    from .classifier.evaluation import format_table

    print(format_table(evaluation), flush=True)
    core = {layer: list(lp.core) for layer, lp in plan.layers.items()}
    static_strategy = cov.static_best(plan, obs.layer_ids, obs.mass_share())
    static = {layer: static_strategy(0, li) for li, layer in enumerate(obs.layer_ids)}
    bport, pport = free_port(), free_port()
    backend = ServerProcess(reap_swap_argv("serve", "--model", str(model), "--plan", str(plan_path), "--port", str(bport),
                                           "--max-model-len", "2048", "--no-enable-prefix-caching"),
                            bport, work / "logs" / "serve.log", env=CPU_ENV, name="reap-swap serve")
    proxy = ServerProcess(reap_swap_argv("proxy", "--backend", f"http://127.0.0.1:{bport}", "--plan", str(plan_path),
                                         "--classifier", str(clf_dir), "--port", str(pport)),
                          pport, work / "logs" / "proxy.log", name="reap-swap proxy")
    rows = []
    step(f"starting reap-swap serve on 127.0.0.1:{bport} (vLLM start-up takes about a minute here) ...")
    with backend:
        step(f"starting reap-swap proxy on 127.0.0.1:{pport} ...")
        with proxy:
            client = OpenAI(base_url=proxy.url + "/v1", api_key="demo", max_retries=0)
            for i, (domain, prompt) in enumerate(demo_requests(args.per_domain)):
                rid = f"demo-{i:02d}-{domain}"
                t = time.perf_counter()
                client.chat.completions.create(model=str(model), messages=[{"role": "user", "content": prompt}],
                                               max_tokens=args.gen_tokens, temperature=0, extra_headers={"X-Request-Id": rid})
                latency = time.perf_counter() - t
                rec: dict[str, Any] = {}
                for _ in range(100):
                    rec = httpx.get(f"{proxy.url}/forensics/{rid}").json()
                    if "router_misses" in rec:
                        break
                    time.sleep(0.05)
                misses = httpx.get(f"{backend.url}/router_misses/{rid}").json()
                rows.append({
                    "request_id": rid, "domain": domain, "latency_s": latency,
                    "slices": sum(len(v) for v in rec.get("chosen_slices", {}).values()),
                    "swap": rec["swap"]["status"], "bytes_copied": rec["swap"]["bytes_copied"],
                    "swap_ms": rec["swap"]["backend_ms"], "tokens": misses["summary"]["tokens"],
                    "miss_ratio": misses["summary"]["inactive_ratio"],
                    "core_only_miss_ratio": miss_ratio_for(misses, core),
                    "static_miss_ratio": miss_ratio_for(misses, static),
                    "first_slices": {k: v for k, v in list(rec.get("chosen_slices", {}).items())[:2]},
                })
            stats = httpx.get(proxy.url + "/stats").json()
        step("stopping the proxy and the server ...")
    figures = _figures(rows, evaluation, work)
    for name in report["figures"]:
        shutil.copy(work / "report" / name, work / name)
    return {"model": str(model), "plan": str(plan_path), "requests": rows, "evaluation": evaluation, "proxy_stats": stats,
            "figures": figures + report["figures"], "coverage": report["coverage"]}


def _figures(rows: list[dict[str, Any]], evaluation: dict[str, Any], work: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows) + 2), 4))
    ax.bar(x - 0.27, [r["core_only_miss_ratio"] for r in rows], 0.27, label="core only (static)", color="#bbbbbb")
    ax.bar(x, [r["static_miss_ratio"] for r in rows], 0.27, label="core + static slices", color="#7fb0e0")
    ax.bar(x + 0.27, [r["miss_ratio"] for r in rows], 0.27, label="reap-swap (classifier, live)", color="#1f5fa6")
    ax.set_xticks(x, [r["domain"] for r in rows], rotation=45, ha="right")
    ax.set_ylabel("router miss ratio (gate mass on host experts)")
    ax.set_title("Miss ratio per request")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(work / "miss_ratio_per_request.png", dpi=120)
    plt.close(fig)
    st = evaluation["strategies"]
    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(st)
    ax.bar(names, [st[n]["mean"] for n in names], color=["#bbbbbb", "#7fb0e0", "#e0b07f", "#1f5fa6", "#2a9d5c"])
    for i, n in enumerate(names):
        ax.text(i, st[n]["mean"] + 0.01, f"{st[n]['mean']:.3f}", ha="center", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of gate mass on resident experts")
    ax.set_title(f"Held-out coverage by strategy (gap closed {evaluation['gap_closed']:.0%})")
    fig.tight_layout()
    fig.savefig(work / "coverage_by_strategy.png", dpi=120)
    plt.close(fig)
    return ["miss_ratio_per_request.png", "coverage_by_strategy.png"]


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{'request':<22}{'domain':<10}{'slices':>7}{'swap':>11}{'KB moved':>10}{'swap ms':>9}{'tokens':>8}"
          f"{'miss':>8}{'core-only':>11}{'static':>8}")
    for r in result["requests"]:
        print(f"{r['request_id']:<22}{r['domain']:<10}{r['slices']:>7}{r['swap']:>11}{r['bytes_copied'] / 1024:>10.1f}"
              f"{r['swap_ms']:>9.1f}{r['tokens']:>8}{r['miss_ratio']:>8.3f}{r['core_only_miss_ratio']:>11.3f}{r['static_miss_ratio']:>8.3f}")
    rs = result["requests"]
    if rs:
        tot = lambda k: sum(r[k] * r["tokens"] for r in rs) / sum(r["tokens"] for r in rs)  # noqa: E731
        print(f"{'token-weighted mean':<32}{'':>48}{tot('miss_ratio'):>8.3f}{tot('core_only_miss_ratio'):>11.3f}{tot('static_miss_ratio'):>8.3f}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("out/demo"))
    p.add_argument("--model", type=Path, help="MoE model dir (default: the bundled trained small MoE, else a tiny random one)")
    p.add_argument("--budget-ratio", type=float, default=0.6, help="resident share of the model's bytes")
    p.add_argument("--core-fraction", type=float, default=0.5)
    p.add_argument("--per-domain", type=int, default=2, help="demo requests per domain")
    p.add_argument("--gen-tokens", type=int, default=48)
    p.add_argument("--max-samples", type=int, help="cap on observed corpus samples")
    p.add_argument("--max-tokens", type=int, default=512, help="token cap per observed sample")
    p.add_argument("--quick", action="store_true", help="reduced mode (CI): fewer samples and requests")
    a = p.parse_args(argv)
    if a.quick:
        a.max_samples, a.max_tokens, a.per_domain, a.gen_tokens = a.max_samples or 600, 128, 1, 16
    t0 = time.perf_counter()

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)  # stop the servers on kill too, not only on Ctrl-C
    try:
        result = run(a)
    except KeyboardInterrupt:
        print("\n[demo] interrupted; servers stopped", file=sys.stderr)
        return 130
    print_table(result)
    (a.workdir / "demo.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    step(f"done in {time.perf_counter() - t0:.0f}s; figures: " + ", ".join(str(a.workdir / f) for f in result["figures"]))
    return 0
