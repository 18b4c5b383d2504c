"""``reap-swap demo``: the whole pipeline on the embedded default, end to end.

model -> observe the realistic example corpus -> plan at a stated budget
(training split only) -> report -> train + evaluate the classifier against
every baseline -> ``serve`` and ``proxy`` on free loopback ports -> OpenAI
SDK requests from every domain of the held-out split -> a per-request table
(chosen slices, bytes moved, swap time, live miss ratio, and the miss ratio
the same tokens would have had with the classifier's own set for that
request, the core alone, core + static slices, the static top-k set and the
even split) and figures -> everything shut down, also on Ctrl-C or failure.
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

from .cli import HelpFormatter
from .example.corpora import realistic_corpus_files, subsample
from .paths import bundled_model_dir
from .procs import ServerProcess, free_port, reap_swap_argv


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


def demo_requests(corpus: list[Path], n_per_domain: int) -> list[tuple[str, str]]:
    """The first user turn of the held-out conversations, ``n_per_domain`` of each domain, domains interleaved."""
    from .planning.corpus import conversation_messages

    test = next(p for p in corpus if p.stem == "test")
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

    from .classifier.evaluate import run_evaluation
    from .classifier.evaluation import format_table
    from .classifier.train import train
    from .models.families import layout_for
    from .plan import load_plan
    from .planning import coverage as cov
    from .planning.budget import make_budget
    from .planning.observations import load_observations
    from .planning.observe import observe
    from .planning.planner import PlanParams, build_plan
    from .planning.report import write_report
    from .planning.splits import split_indices

    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or default_model(work)
    layout = layout_for(model)
    step(f"model {model}: {layout.num_moe_layers} MoE layers x {layout.num_experts} experts, top-{layout.top_k}, "
         f"{layout.total_bytes / 2**20:.1f} MiB ({layout.dtype})")
    corpus = [Path(p) for p in args.corpus] if args.corpus else realistic_corpus_files()
    if args.per_domain_samples:
        corpus = subsample(corpus, args.per_domain_samples, work / "corpus")
    step(f"observing {', '.join(str(p) for p in corpus)} (REAP saliency, frequencies, co-activation) ...")
    obs_dir = work / "observations"
    observe(model, corpus, obs_dir, max_samples=args.max_samples, max_tokens=args.max_tokens, batch_size=8 if args.max_tokens <= 512 else 4)
    obs = load_observations(obs_dir)
    step(f"planning at {args.budget_ratio:.0%} of the model's bytes resident, from the training split ...")
    plan_path = work / "plan.json"
    # One-expert slices: the proxy's policy ranks slices, so with singletons its choice is the classifier's
    # expert-granular one (co-activation slices stay available with reap-swap plan --slice-size).
    params = PlanParams(core_fraction=args.core_fraction, split="test", slice_size=1)
    plan_dict = build_plan(obs, layout, make_budget(layout, ratio=args.budget_ratio), params, str(model), Path(model) / "tokenizer.json")
    plan_path.write_text(json.dumps(plan_dict, indent=1) + "\n")
    plan = load_plan(plan_path)
    report = write_report(plan_path, obs_dir, work / "report")  # prints the summary, the CV tables of the plan's choices included
    step("training the prompt -> per-expert mass classifier ...")
    clf_dir = work / "classifier"
    train(obs_dir, plan_path, clf_dir, "test", None, None)
    evaluation = run_evaluation(obs_dir, plan_path, clf_dir, "test", latency_prompts=20)
    print(format_table(evaluation), flush=True)
    train_idx, _ = split_indices(obs, "test")
    train_share = obs.mass_share()[train_idx]
    sets = {"core": cov.core_only(plan, obs.layer_ids), "static": cov.static_best(plan, obs.layer_ids, train_share),
            "topk": cov.static_topk(plan, obs.layer_ids, train_share), "even": cov.even_split(plan, obs.layer_ids, train_share)}
    resident = {name: {layer: strat(0, li) for li, layer in enumerate(obs.layer_ids)} for name, strat in sets.items()}
    from .classifier.model import SliceClassifier

    own = SliceClassifier.load(clf_dir, plan)  # its own choice per request, before the proxy's union and hysteresis
    bport, pport = free_port(), free_port()
    backend = ServerProcess(reap_swap_argv("serve", "--model", str(model), "--plan", str(plan_path), "--port", str(bport),
                                           "--max-model-len", "2048", "--no-enable-prefix-caching"),
                            bport, work / "logs" / "serve.log", name="reap-swap serve")  # serve sets CPU_SERVER_ENV on CPU
    proxy = ServerProcess(reap_swap_argv("proxy", "--backend", f"http://127.0.0.1:{bport}", "--plan", str(plan_path),
                                         "--classifier", str(clf_dir), "--port", str(pport)),
                          pport, work / "logs" / "proxy.log", name="reap-swap proxy")
    rows = []
    step(f"starting reap-swap serve on 127.0.0.1:{bport} (vLLM start-up takes about a minute here) ...")
    with backend:
        step(f"starting reap-swap proxy on 127.0.0.1:{pport} ...")
        with proxy:
            client = OpenAI(base_url=proxy.url + "/v1", api_key="demo", max_retries=0)
            for i, (domain, prompt) in enumerate(demo_requests(corpus, args.per_domain)):
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
                misses = rec.get("router_misses", {})  # the proxy collects (and clears) them on the backend
                if "summary" not in misses:
                    raise RuntimeError(f"request {rid}: no router misses in the proxy's forensics ({misses.get('error', 'not collected')})")
                rows.append({
                    "request_id": rid, "domain": domain, "latency_s": latency,
                    "slices": sum(len(v) for v in rec.get("chosen_slices", {}).values()),
                    "swap": rec["swap"]["status"], "bytes_copied": rec["swap"]["bytes_copied"],
                    "swap_ms": rec["swap"]["backend_ms"], "tokens": misses["summary"]["tokens"],
                    "miss_ratio": misses["summary"]["inactive_ratio"],
                    "core_only_miss_ratio": miss_ratio_for(misses, resident["core"]),
                    "static_miss_ratio": miss_ratio_for(misses, resident["static"]),
                    "topk_miss_ratio": miss_ratio_for(misses, resident["topk"]),
                    "even_miss_ratio": miss_ratio_for(misses, resident["even"]),
                    "classifier_miss_ratio": miss_ratio_for(misses, own.select(prompt).active),
                    "first_slices": {k: v for k, v in list(rec.get("chosen_slices", {}).items())[:2]},
                })
            stats = httpx.get(proxy.url + "/stats").json()
        step("stopping the proxy and the server ...")
    figures = _figures(rows, evaluation, work)
    for name in report["figures"]:
        shutil.copy(work / "report" / name, work / name)
    return {"model": str(model), "plan": str(plan_path), "corpus": [str(p) for p in corpus], "requests": rows, "evaluation": evaluation,
            "proxy_stats": stats, "figures": figures + report["figures"], "coverage": report["coverage"],
            "plan_choices": {k: plan_dict["scorerArtifacts"][k] for k in ("allocation", "core", "training")}}


def _figures(rows: list[dict[str, Any]], evaluation: dict[str, Any], work: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4))
    arms = [("static_miss_ratio", "core + static slices", "#bbbbbb"), ("topk_miss_ratio", "static top-k (plan counts)", "#7fb0e0"),
            ("even_miss_ratio", "even split", "#e0b07f"), ("miss_ratio", "reap-swap (classifier, live)", "#1f5fa6")]
    for j, (key, label, color) in enumerate(arms):
        ax.bar(x + (j - 1.5) * 0.2, [r[key] for r in rows], 0.2, label=label, color=color)
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
    colors = {"predicted": "#1f5fa6", "oracle": "#2a9d5c", evaluation["best_baseline"]: "#e07f7f"}
    ax.bar(range(len(names)), [st[n]["mean"] for n in names], color=[colors.get(n, "#bbbbbb") for n in names])
    for i, n in enumerate(names):
        ax.text(i, st[n]["mean"] + 0.01, f"{st[n]['mean']:.3f}", ha="center", fontsize=7)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of gate mass on resident experts")
    ax.set_title(f"Held-out coverage (gap closed vs {evaluation['best_baseline']}: {evaluation['gap_closed']:.0%})")
    fig.tight_layout()
    fig.savefig(work / "coverage_by_strategy.png", dpi=120)
    plt.close(fig)
    return ["miss_ratio_per_request.png", "coverage_by_strategy.png"]


COLUMNS = (("miss_ratio", "miss"), ("classifier_miss_ratio", "predicted"), ("core_only_miss_ratio", "core-only"),
           ("static_miss_ratio", "static"), ("topk_miss_ratio", "top-k"), ("even_miss_ratio", "even"))


def print_table(result: dict[str, Any]) -> None:
    head = "".join(f"{name:>10}" for _, name in COLUMNS)
    print(f"\n{'request':<26}{'domain':<12}{'slices':>7}{'swap':>11}{'KB moved':>10}{'swap ms':>9}{'tokens':>8}{head}")
    print("(miss: live, through the proxy; predicted: the classifier's own set for the request; the rest: static sets, same tokens)")
    for r in result["requests"]:
        cells = "".join(f"{r[key]:>10.3f}" for key, _ in COLUMNS)
        print(f"{r['request_id']:<26}{r['domain']:<12}{r['slices']:>7}{r['swap']:>11}{r['bytes_copied'] / 1024:>10.1f}"
              f"{r['swap_ms']:>9.1f}{r['tokens']:>8}{cells}")
    rs = result["requests"]
    if rs:
        tot = lambda k: sum(r[k] * r["tokens"] for r in rs) / sum(r["tokens"] for r in rs)  # noqa: E731
        print(f"{'token-weighted mean':<38}{'':>45}" + "".join(f"{tot(key):>10.3f}" for key, _ in COLUMNS))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap demo", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("out/demo"), help="where the demo writes its model, observations, plan, classifier, logs and figures")
    p.add_argument("--model", type=Path, help="MoE model dir (default: the bundled trained small MoE, else a tiny random one)")
    p.add_argument("--budget-ratio", type=float, default=0.6, help="resident share of the model's bytes")
    p.add_argument("--core-fraction", type=float, help="share of each layer's slots for core experts (default: cross-validated)")
    p.add_argument("--corpus", nargs="+", help="ai-data-extraction JSONL with a test.jsonl split (default: the realistic example corpus)")
    p.add_argument("--per-domain", type=int, default=2, help="demo requests per domain")
    p.add_argument("--per-domain-samples", type=int, help="observe only the first N conversations of each domain per file")
    p.add_argument("--gen-tokens", type=int, default=48, help="tokens generated per demo request")
    p.add_argument("--max-samples", type=int, help="cap on observed corpus samples")
    p.add_argument("--max-tokens", type=int, default=2048, help="token cap per observed sample (2048 covers the example conversations)")
    p.add_argument("--quick", action="store_true", help="reduced mode (CI): 20 conversations per domain, 512-token samples, 1 request per domain, 16 tokens each")
    a = p.parse_args(argv)
    if a.quick:
        a.per_domain_samples, a.max_tokens, a.per_domain, a.gen_tokens = a.per_domain_samples or 20, 512, 1, 16
    for path in a.corpus or []:
        if not Path(path).is_file():
            p.error(f"corpus file not found: {path}")
    if a.corpus and not any(Path(x).stem == "test" for x in a.corpus):
        p.error("--corpus needs a test.jsonl file (the held-out split the demo requests and evaluation use)")
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
