"""``reap-swap learned-sets``: the GPU benchmark's learned-routing expert sets, built and scored on routing traces.

Steps (each recorded, with its command, inputs' hashes and time, in the JSON's ``provenance``):

1. a model directory in ``--workdir``: ``--model``'s config.json plus the tokenizer files of
   ``--tokenizer`` when the model directory has none (a card without weights);
2. ``reap-swap plan`` on the observation, at ``S = round(fraction x E)`` slots in every layer
   (``--allocation even``, a ``--budget-gib`` that buys exactly ``S x layers`` expert slots);
3. ``reap-swap train`` on the observation + that plan, once per feature set (default estimator
   search each); the classifier is then chosen across feature sets with ``train.choose`` (same
   folds, same rule as ``--features auto``). Feature sets with the model's own routing need
   its weights and are left out when the model directory has none;
4. the sets (``benchmarks/learned/sets.py``) and their scores on every ``--trace``.

Prompts: trace request ids are corpus sample ids; each request's prompt is the sample's
``prompt`` (what ``record-traces`` sent as the user turn), matched by (id, source, tags) in
``--corpus`` (default: the files the trace names), and the classifier sees what the proxy
would extract from a chat completion carrying it (``proxy.prompts.prompt_from_body``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from reap_swap.benchmarks.learned import sets as ls
from reap_swap.cli import RawDescriptionHelpFormatter

GIB = 1 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CHAT_ROUTE = "/v1/chat/completions"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dir_hashes(path: Path) -> dict[str, dict[str, Any]]:
    return {p.name: {"sha256": sha256_file(p), "bytes": p.stat().st_size} for p in sorted(path.iterdir()) if p.is_file()}


def prepare_model(model: Path, tokenizer: Path | None, work: Path) -> tuple[Path, list[str]]:
    """The model directory plan and train read: ``model`` itself, or its config + ``tokenizer``'s files in the workdir."""
    if tokenizer is None and (model / "tokenizer.json").is_file():
        return model, []
    src = tokenizer or model
    if not (src / "tokenizer.json").is_file():
        raise ls.SetsError(f"{model} has no tokenizer.json: pass --tokenizer DIR (a model trained with the same tokenizer)")
    out = work / "model"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model / "config.json", out / "config.json")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out, [f"{out}: config.json of {model}, tokenizer files of {src} (no weights)"]


def budget_gib(layout: Any, slots: int) -> float:
    """A --budget-gib that buys exactly ``slots`` experts in every MoE layer (half an expert of margin)."""
    resident = layout.non_expert_bytes + slots * layout.num_moe_layers * layout.bytes_per_expert + layout.bytes_per_expert // 2
    return resident / GIB


def feature_sets(requested: str, model_dir: Path) -> tuple[list[str], list[str]]:
    from reap_swap.classifier.features import FEATURE_SETS
    from reap_swap.classifier.train import AUTO_SETS

    if requested != "auto":
        sets = [s.strip() for s in requested.split(",") if s.strip()]
        bad = [s for s in sets if s not in FEATURE_SETS]
        if bad or not sets:
            raise ls.SetsError(f"--features: unknown sets {bad}; choose from {FEATURE_SETS} or auto")
        return sets, [f"feature sets fixed by --features {requested}"]
    sets, notes = list(AUTO_SETS), []
    if not any(model_dir.glob("*.safetensors")):
        sets = ["tokens", "tokens+embedding"]
        notes.append(f"{model_dir} has no weights: the routing feature sets (the model run on every vocabulary token) cannot be "
                     "built, so the search covers tokens and tokens+embedding")
    try:
        from reap_swap.classifier.embedder import default_model_dir

        default_model_dir()
    except Exception as exc:  # noqa: BLE001 - no embedder: token features only
        sets = [s for s in sets if "embedding" not in s]
        notes.append(f"no sentence embedder ({exc}): embedding feature sets left out")
    return sets, notes


def run_step(name: str, argv: list[str], outputs: list[Path], inputs: dict[str, str], work: Path, force: bool) -> dict[str, Any]:
    """Run ``reap-swap ARGV`` in-process, or reuse its outputs when the same command ran on the same inputs."""
    from reap_swap.cli import main as cli

    stamp = work / f"{name}.step.json"
    key = {"argv": argv, "inputs": inputs}
    if not force and stamp.is_file() and all(p.exists() for p in outputs):
        old = json.loads(stamp.read_text())
        if old.get("key") == key:
            return {"name": name, "command": "reap-swap " + " ".join(argv), "seconds": old["seconds"], "reused": True}
    print(f"[learned-sets] reap-swap {' '.join(argv)}", flush=True)
    t = time.perf_counter()
    rc = cli(argv)
    seconds = time.perf_counter() - t
    if rc != 0:
        raise ls.SetsError(f"reap-swap {argv[0]} exited {rc}")
    stamp.write_text(json.dumps({"key": key, "seconds": seconds}, indent=1) + "\n")
    return {"name": name, "command": "reap-swap " + " ".join(argv), "seconds": seconds, "reused": False}


def choose_classifier(dirs: dict[str, Path]) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
    """Feature set of the winner across per-set trainings (``train.choose``: the embedding only when it pays)."""
    from reap_swap.classifier.train import choose

    table = []
    for name, d in dirs.items():
        table += json.loads((d / "classifier.json").read_text())["model_selection"]["table"]
    best = choose(table)
    meta = json.loads((dirs[best["features"]] / "classifier.json").read_text())["model_selection"]
    if meta["chosen"] != best["params"]:
        raise ls.SetsError(f"classifier {best['features']} chose {meta['chosen']}, the cross-set choice is {best['params']}")
    return best["features"], best, sorted(table, key=lambda r: -r["cv_coverage"])


def trace_prompts(trace: Any, corpus: list[Path]) -> list[tuple[str, str]]:
    """(prompt the proxy would see, corpus label) of every trace request."""
    from reap_swap.planning.corpus import read_corpus
    from reap_swap.proxy.prompts import prompt_from_body

    index: dict[tuple[str, str, tuple[str, ...]], list[tuple[Any, str]]] = {}
    for path in corpus:
        for s in read_corpus([path], lambda m: "\n".join(x["content"] for x in m))[0]:
            index.setdefault((s.sample_id, s.source, tuple(s.tags)), []).append((s, path.parent.name or path.stem))
    out = []
    for req in trace.requests():
        hits = index.get((req.request_id, req.info.get("source", ""), tuple(req.info.get("tags", ()))), [])
        if len(hits) != 1:
            raise ls.SetsError(f"trace request {req.request_id!r}: {len(hits)} matching samples in {[str(p) for p in corpus]}")
        sample, label = hits[0]
        text = prompt_from_body(CHAT_ROUTE, {"messages": [{"role": "user", "content": sample.prompt}]})
        out.append((text or "", label))
    return out


def prompt_token_check(model_dir: Path, trace: Any, texts: list[str]) -> str:
    """How many requests' prompt token counts (chat template, as record-traces built them) equal their prefill rows."""
    try:
        from transformers import AutoTokenizer

        from reap_swap.planning.trace_record import _prompt_ids
    except ImportError as exc:
        return f"not checked ({exc})"
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    cap = int(trace.meta.get("decoding", {}).get("max_prompt_tokens", 1 << 30))
    same = sum(len(_prompt_ids(tok, t, cap)) == int((r.phase == 0).sum()) for t, r in zip(texts, trace.requests()))
    return f"{same}/{trace.num_requests}"


def diagnose(trace: Any, plan: Any, wishes: list[Any], prior: dict[int, Any], slots: int) -> dict[str, Any]:
    """Reference points for reading the arms' scores (not installed by any arm)."""
    from reap_swap.planning.traces import DECODE, PREFILL
    from reap_swap.proxy.policy import ResidencyPolicy

    layers, n, e = [int(x) for x in trace.meta["moe_layers"]], trace.num_requests, trace.num_experts
    no_hyst = ls.replay_policy(ResidencyPolicy(plan, 0.0), [[w] for w in wishes], prior)
    own_prefill = [ls.top_sets(ls.routed_mass(*ls.request_rows(trace, r, PREFILL), e), layers, slots) for r in range(n)]
    decode_all = sum((ls.routed_mass(*ls.request_rows(trace, r, DECODE), e) for r in range(n)), np.zeros((len(layers), e)))
    return {"classifier_hysteresis_0": ls.score(trace, ls.per_request(no_hyst.sets), slots),
            "own_prefill_top_s": ls.score(trace, ls.per_request(own_prefill), slots),
            "hindsight_static_decode_top_s": ls.score(trace, ls.fixed(ls.top_sets(decode_all, layers, slots)), slots)}


async def _classify(clf: Any, texts: list[str]) -> list[tuple[Any, dict[str, Any]]]:
    return [await clf.select(t) for t in texts]


def git_head() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON with objects indented and lists of scalars on one line (sets stay readable and small)."""
    pad = " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        return "{\n" + ",\n".join(f"{pad}{json.dumps(str(k))}: {dumps(v, indent + 1)}" for k, v in obj.items()) + "\n" + " " * indent + "}"
    if isinstance(obj, list) and any(isinstance(x, (dict, list)) for x in obj):
        return "[\n" + ",\n".join(pad + dumps(x, indent + 1) for x in obj) + "\n" + " " * indent + "]"
    return json.dumps(obj)


def build(a: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    from reap_swap.classifier.model import SliceClassifier
    from reap_swap.models.families import layout_for
    from reap_swap.plan import load_plan
    from reap_swap.planning import traces as tr
    from reap_swap.planning.observations import load_observations
    from reap_swap.planning.splits import split_indices
    from reap_swap.proxy.classify import Classifier
    from reap_swap.proxy.policy import ResidencyPolicy

    t_start = time.perf_counter()
    work: Path = a.workdir
    work.mkdir(parents=True, exist_ok=True)
    obs = load_observations(a.obs)
    traces = {p.stem: tr.load(p) for p in a.trace}
    model_dir, notes = prepare_model(a.model, a.tokenizer, work)
    layout = layout_for(model_dir)
    slots = ls.slots_for(a.slots_fraction, layout.num_experts)
    layers = list(layout.moe_layers)
    for name, t in traces.items():
        if [int(x) for x in t.meta["moe_layers"]] != layers or t.num_experts != layout.num_experts:
            raise ls.SetsError(f"trace {name}: MoE layers / experts differ from {a.model}")
    if obs.layer_ids != layers or obs.num_experts != layout.num_experts:
        raise ls.SetsError(f"{a.obs}: observed on another MoE layout than {a.model}")
    model_hashes = dir_hashes(model_dir)
    inputs = {"observation": obs.sha256, **{f"model/{k}": v["sha256"] for k, v in model_hashes.items()}}
    steps = []
    plan_path = work / "plan.json"
    gib = budget_gib(layout, slots)
    steps.append(run_step("plan", ["plan", "--observations", str(a.obs), "--model", str(model_dir), "--budget-gib", repr(gib),
                                   "--allocation", "even", "--split", a.split, "--out", str(plan_path)], [plan_path], inputs, work, a.force))
    plan = load_plan(plan_path)
    ls.check_capacity(plan, slots)
    sets_to_try, feature_notes = feature_sets(a.features, model_dir)
    notes += feature_notes
    clf_dirs = {f: work / f"clf-{f.replace('+', '-')}" for f in sets_to_try}
    for f, d in clf_dirs.items():
        steps.append(run_step(f"train-{f}", ["train", "--observations", str(a.obs), "--plan", str(plan_path), "--model", str(model_dir),
                                             "--split", a.split, "--features", f, "--out", str(d)], [d / "classifier.json"],
                              {**inputs, "plan": sha256_file(plan_path)}, work, a.force))
    chosen, best, table = choose_classifier(clf_dirs)
    model = SliceClassifier.load(clf_dirs[chosen], plan)
    clf_meta = json.loads((clf_dirs[chosen] / "classifier.json").read_text())

    train_idx, _ = split_indices(obs, a.split, require_heldout=False)
    policy = ResidencyPolicy(plan, a.hysteresis, "union")
    plain, with_clf = Classifier(plan, None), Classifier(plan, model, budget_s=3600.0, max_queued=1 << 30)
    clf_prior = ls.prior_of(plan, model.expert_prior)
    sets = {"static_topk": ls.static_topk(obs.sample_mass[train_idx], obs.layer_ids, slots),
            "plan": ls.static_policy_set(policy, plain.prior_wish(), ls.prior_of(plan, None)),
            "classifier_prior": ls.static_policy_set(policy, with_clf.prior_wish(), clf_prior)}
    # groups in flight together: --batch's under the key bs8 whatever its size, then each --extra-batches size B under bsB
    sizes = {"bs8": a.batch, **{f"bs{b}": b for b in a.extra_batches}}
    per_req: dict[str, dict[str, dict[str, Any]]] = {k: {} for arm in ("classifier", "oracle") for k in (arm, *(f"{arm}_{key}" for key in sizes))}
    group_lists: dict[str, dict[str, dict[str, list[int]]]] = {f"groups_{key}": {} for key in sizes}
    scores: dict[str, dict[str, Any]] = {}
    requests, policy_log, timings, diagnostics = {}, {}, {}, {}
    for name, trace in traces.items():
        t0 = time.perf_counter()
        prompts = trace_prompts(trace, a.corpus or [Path(p) for p in trace.meta.get("corpus", [])])
        texts = [p for p, _ in prompts]
        answers = asyncio.run(_classify(with_clf, texts))
        if not all(info.get("classified") for _, info in answers):
            raise ls.SetsError(f"{name}: some prompts were not classified: {[i for _, i in answers if not i.get('classified')][:2]}")
        t1 = time.perf_counter()
        wishes = [w for w, _ in answers]
        n = trace.num_requests
        bs1 = ls.replay_policy(policy, [[w] for w in wishes], clf_prior)
        oracle = [ls.oracle_sets(trace, [r], slots) for r in range(n)]
        keys = [f"{r}:{req.request_id}" for r, req in enumerate(trace.requests())]  # ids repeat across corpora
        requests[name] = [{"key": k, "index": r, "id": req.request_id, "source": req.info.get("source"), "tags": req.info.get("tags"), "corpus": lab,
                           "prefill_rows": int((req.phase == tr.PREFILL).sum()), "decode_rows": int((req.phase == tr.DECODE).sum())}
                          for r, (k, req, (_, lab)) in enumerate(zip(keys, trace.requests(), prompts))]
        per_req["classifier"][name] = {k: ls.payload(s) for k, s in zip(keys, bs1.sets)}
        per_req["oracle"][name] = {k: ls.payload(s) for k, s in zip(keys, oracle)}
        policy_log[name] = {"classifier": {"swaps": bs1.swaps, "kept": {keys[i]: r for i, r in enumerate(bs1.reasons) if r != "swap"}}}
        clf_arms, oracle_arms = {"classifier": ls.per_request(bs1.sets)}, {"oracle": ls.per_request(oracle)}
        for key, size in sizes.items():  # the proxy's policy over each consecutive group of `size` requests in flight
            groups = ls.groups_of(n, size)
            bsn = ls.replay_policy(policy, [[wishes[i] for i in g] for g in groups], clf_prior)
            oracle_n = [ls.oracle_sets(trace, g, slots) for g in groups]
            group_lists[f"groups_{key}"][name] = {str(g): grp for g, grp in enumerate(groups)}
            per_req[f"classifier_{key}"][name] = {str(g): ls.payload(s) for g, s in enumerate(bsn.sets)}
            per_req[f"oracle_{key}"][name] = {str(g): ls.payload(s) for g, s in enumerate(oracle_n)}
            policy_log[name][f"classifier_{key}"] = {"swaps": bsn.swaps, "kept": {str(i): r for i, r in enumerate(bsn.reasons) if r != "swap"}}
            clf_arms[f"classifier_{key}"] = ls.grouped(bsn.sets, size)
            oracle_arms[f"oracle_{key}"] = ls.grouped(oracle_n, size)
        arms = {**{k: ls.fixed(v) for k, v in sets.items()}, **clf_arms, **oracle_arms}
        labels = sorted({lab for _, lab in prompts})
        scores[name] = {}
        for arm, sets_for in arms.items():
            s = ls.score(trace, sets_for, slots)
            s["by_corpus"] = {lab: ls.score(trace, sets_for, slots, [r for r, (_, l) in enumerate(prompts) if l == lab]) for lab in labels}
            scores[name][arm] = s
        diagnostics[name] = diagnose(trace, policy.plan, wishes, clf_prior, slots)
        timings[name] = {"classify_s": t1 - t0, "classify_ms_per_prompt": (t1 - t0) * 1e3 / max(n, 1), "sets_and_scores_s": time.perf_counter() - t1,
                         "prompt_tokens_match_prefill_rows": prompt_token_check(model_dir, trace, texts)}
    plain.close()
    with_clf.close()
    ms = clf_meta["model_selection"]
    lp0 = plan.layers[plan.layer_ids()[0]]
    return {
        "slots_per_layer": slots, "slots_fraction": a.slots_fraction, "layers": layers, "num_experts": layout.num_experts,
        "sets": {k: ls.payload(v) for k, v in sets.items()},
        "per_request": per_req,
        "requests": requests,
        **group_lists,
        "scores": scores,
        "diagnostics": {"what": "not arms: the classifier replayed without hysteresis; each request's own prefill routing top-S "
                                "(a predictor that knew each prompt's own routing exactly); the top-S of the trace's own decode mass (hindsight static)",
                        "scores": diagnostics},
        "policy": {"hysteresis": a.hysteresis, "mode": "union", "batch": a.batch, "extra_batches": a.extra_batches,
                   "start": "plan core (serve --start-resident core)",
                   "replay": policy_log},
        "plan": {"path": str(plan_path), "sha256": plan.sha256, "file_sha256": sha256_file(plan_path), "bytes": plan_path.stat().st_size,
                 "core_per_layer": len(lp0.core), "specialist_per_layer": lp0.specialist_experts, "slices_per_layer": len(lp0.slices),
                 "slice_sizes_layer0": [len(s.experts) for s in lp0.slices],
                 "core_fraction": plan.raw["scorerArtifacts"]["core"], "allocation": plan.raw["scorerArtifacts"]["allocation"]["rule"],
                 "static_set_rule": "the proxy with this plan and no classifier: prior wish (every slice scored 1.0) through ResidencyPolicy.decide "
                                    "from the core: core + slices in catalogue order (heaviest activationMass first) while they fit, the last "
                                    "trimmed to the lowest ids"},
        "classifier": {"chosen_features": chosen, "chosen_params": best["params"], "cv_coverage": best["cv_coverage"],
                       "cv_groups": ms["cv_groups"], "folds": ms["folds"], "train_samples": clf_meta["train_samples"],
                       "static_topk_train_coverage": ms["static_topk_train_coverage"], "feedback_chosen_by_train": clf_meta["feedback"]["params"],
                       "feedback_note": "the proxy never calls feedback(): predictions are used uncorrected, as served",
                       "table": [{k: r[k] for k in ("features", "params", "cv_coverage", "seconds")} for r in table],
                       "path": str(clf_dirs[chosen]), "files": dir_hashes(clf_dirs[chosen])},
        "provenance": {
            "command": "reap-swap learned-sets " + " ".join(argv), "git_head": git_head(), "steps": steps, "notes": notes,
            "split": a.split, "train_samples": int(len(train_idx)),
            "inputs": {"observation": {"path": str(a.obs), "content_sha256": obs.sha256, "samples": obs.num_samples},
                       "traces": {n: {"path": str(p), "sha256": sha256_file(p)} for n, p in zip(traces, a.trace)},
                       "model_dir": {"path": str(model_dir), "files": model_hashes}},
            "timings": {"traces": timings, "total_s": time.perf_counter() - t_start},
            "keys": "sets: {layer_<MoE layer index>: experts}; per_request[arm][trace file stem]: by '<index in trace>:<request id>' "
                    "(an id can repeat across corpora), *_bs8 by consecutive group index g = requests 8g..8g+7 (groups_bs8), "
                    "*_bs<B> (--extra-batches) likewise by groups of B (groups_bs<B>)",
        },
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="reap-swap learned-sets", description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("--obs", type=Path, required=True, help="observation directory (reap-swap observe)")
    p.add_argument("--trace", type=Path, nargs="+", required=True, help="routing trace(s) to score on (reap-swap record-traces)")
    p.add_argument("--model", type=Path, required=True, help="model directory (config.json; tokenizer and weights if present)")
    p.add_argument("--tokenizer", type=Path, help="directory with the model's tokenizer.json when --model has none")
    p.add_argument("--corpus", type=Path, nargs="+", help="corpus files holding the traces' prompts (default: those the trace names)")
    p.add_argument("--slots-fraction", type=float, default=0.3, help="share of each layer's experts in every set (its slots)")
    p.add_argument("--split", default="test", help="samples held out of static_topk, plan and train (as plan/train --split)")
    p.add_argument("--features", default="auto", help="auto, or comma-separated classifier feature sets to search")
    p.add_argument("--hysteresis", type=float, default=0.05, help="the proxy's --hysteresis")
    p.add_argument("--batch", type=int, default=8, help="requests in flight together for the *_bs8 arms")
    p.add_argument("--extra-batches", default="", help="more group sizes, comma-separated (e.g. 32): classifier_bs<B> and oracle_bs<B> "
                   "sets per consecutive group of B, for bench-gpu --extra-batches B with the classifier arms")
    p.add_argument("--workdir", type=Path, required=True, help="plan, classifiers and step stamps (reused when inputs match)")
    p.add_argument("--force", action="store_true", help="re-run plan and train even when the workdir has them")
    p.add_argument("--out", type=Path, required=True, help="the sets JSON to write (bench-gpu --sets)")
    a = p.parse_args(argv)
    if a.batch < 1 or not 0 <= a.hysteresis < 1:
        p.error("--batch must be >= 1 and --hysteresis in [0, 1)")
    try:
        a.extra_batches = sorted({int(x) for x in a.extra_batches.split(",") if x.strip()})
    except ValueError:
        p.error(f"--extra-batches takes group sizes like 32 or 16,32, got {a.extra_batches!r}")
    if any(b < 2 or b in (a.batch, 8) for b in a.extra_batches):  # classifier_bs8 names --batch's groups whatever their size
        p.error(f"--extra-batches must be >= 2 and differ from --batch {a.batch} and from 8, got {a.extra_batches}")
    try:
        result = build(a, argv)
    except (ls.SetsError, ValueError, OSError) as exc:
        print(f"reap-swap learned-sets: error: {exc}", file=sys.stderr)
        return 2
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(dumps(result) + "\n")
    print(ls.format_table({t: {arm: s for arm, s in arms.items()} for t, arms in result["scores"].items()}))
    c = result["classifier"]
    print(f"classifier: {c['chosen_features']} {c['chosen_params']} CV coverage {c['cv_coverage']:.4f} "
          f"(static top-k train coverage {c['static_topk_train_coverage']:.4f}); wrote {a.out}")
    return 0
