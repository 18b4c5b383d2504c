"""Build the mixed-domain MoE training corpus from this machine's own files.

Why: a trained MoE only routes by token type and domain if its corpus has
distinct domains; nothing can be downloaded here, so the corpus is assembled
from permissively licensed files already installed (Python, C headers, npm's
JS, Rust std, docs, configs) plus generated math. Deterministic: sorted walks,
seeded shuffles, hash dedup, per-document and per-domain caps.

    python build_corpus.py build    --out /tmp/moe-corpus/out
    python build_corpus.py tokenize --out /tmp/moe-corpus/out
    python build_corpus.py all      --out /tmp/moe-corpus/out
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus_chat import as_chat, conversations, generated_conversations, shape_of, test_split_paths, wrapped  # noqa: E402
from corpus_math import math_document  # noqa: E402
from corpus_sources import DOMAINS, Candidate, all_candidates  # noqa: E402
from corpus_text import acceptable, chunks, extract  # noqa: E402

# Bytes of text per domain (~3.2 bytes/token with the 8k BPE), ~35M tokens in all. code-js,
# code-rust and shell-config take everything this machine has; no domain passes ~22%.
DEFAULT_DOMAIN_BYTES = {
    "code-python": 24_000_000, "code-c": 24_000_000, "code-js": 24_000_000, "code-rust": 24_000_000,
    "prose": 24_000_000, "shell-config": 24_000_000, "math": 18_000_000, "code-other": 8_000_000,
}


@dataclass
class BuildConfig:
    """Knobs of one build; all recorded in the manifest."""

    seed: int = 1234
    domain_bytes: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_DOMAIN_BYTES))
    package_share: float = 0.3  # first pass: no package above this share of its domain's cap
    # Files of one package in one directory with one extension are often near-copies
    # (kernel tuning JSONs, pyenv's build definitions): shell-config takes at most this many.
    max_files_per_group: int = 40
    # Docstrings are English but plentiful; keep books/READMEs the larger part of prose.
    kind_share: dict[str, float] = field(default_factory=lambda: {"docstrings": 0.5})
    max_doc_chars: int = 16_000
    max_chunks_per_file: int = 16
    min_doc_chars: int = 200
    heldout_frac: float = 0.01
    min_heldout_files: int = 12
    shard_bytes: int = 32_000_000
    # Conversation-shaped text (corpus_chat.py): this share of each domain's documents is wrapped
    # as a chat, and the example corpus' train split is added as the ``chat`` domain.
    chat_share: float = 0.3
    chat_corpus: str = str(Path(__file__).resolve().parents[2] / "example" / "realistic" / "train.jsonl")
    # More chat turns in every shape (paste, short, multi-turn, long, pasted log, editor): the realistic
    # generator run again with another seed as the ``chat-gen`` domain, minus any conversation quoting a
    # file the test split (the benchmark workload) quotes. 0 turns it off; --scale scales it.
    generated_chats_per_domain: int = 700
    generated_chats_seed: int = 101
    test_corpus: str = str(Path(__file__).resolve().parents[2] / "example" / "realistic" / "test.jsonl")


@dataclass
class Doc:
    text: str
    domain: str
    key: str  # source file (or generated id): chunks of one file share a split
    package: str
    licence: str


def _norm_hash(text: str) -> str:
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()


def select_domain(
    domain: str, cands: list[Candidate], cfg: BuildConfig, seen: set[str], stats: dict
) -> list[Doc]:
    """Seeded-shuffle the domain's candidates and take documents up to its byte cap.

    Pass 1 caps each package at ``package_share`` of the domain so no single package
    (torch headers, one big book) dominates; pass 2 fills what is left, uncapped.
    """
    cap = cfg.domain_bytes[domain]
    order = sorted(cands, key=lambda c: (c.path, c.kind))
    random.Random(f"{cfg.seed}:{domain}").shuffle(order)
    docs: list[Doc] = []
    used: set[int] = set()
    per_pkg: dict[str, int] = defaultdict(int)
    per_group: dict[tuple[str, str, str], int] = defaultdict(int)
    per_kind: dict[str, int] = defaultdict(int)
    total = 0
    for pass_no in (1, 2):
        pkg_cap = int(cap * cfg.package_share) if pass_no == 1 else cap
        for i, c in enumerate(order):
            if total >= cap:
                break
            group = (c.package, str(Path(c.path).parent), c.kind)
            grouped = domain == "shell-config" and c.kind == "text"
            kind_full = per_kind[c.kind] >= cap * cfg.kind_share.get(c.kind, 1.0)
            if i in used or kind_full or per_pkg[c.package] >= pkg_cap or (
                grouped and per_group[group] >= cfg.max_files_per_group
            ):
                continue
            used.add(i)
            per_group[group] += 1
            text = extract(c)
            if text is None or not acceptable(text, domain, cfg.min_doc_chars):
                stats["rejected"] += 1
                continue
            for piece in chunks(text, cfg.max_doc_chars, cfg.max_chunks_per_file):
                h = _norm_hash(piece)
                if len(piece.strip()) < cfg.min_doc_chars or h in seen:
                    stats["duplicates" if h in seen else "rejected"] += 1
                    continue
                seen.add(h)
                n = len(piece.encode())
                key = c.path + ("#" + c.kind if c.kind != "text" else "")
                docs.append(Doc(piece, domain, key, c.package, c.licence))
                per_pkg[c.package] += n
                per_kind[c.kind] += n
                total += n
    stats["candidates"] = len(cands)
    return docs


def math_docs(cfg: BuildConfig, seen: set[str]) -> list[Doc]:
    """Generated worksheets up to the math cap."""
    r = random.Random(f"{cfg.seed}:math")
    docs, total, i = [], 0, 0
    while total < cfg.domain_bytes["math"]:
        text = math_document(r) + "\n"
        i += 1
        h = _norm_hash(text)
        if h in seen:
            continue
        seen.add(h)
        docs.append(Doc(text, "math", f"generated:math:{i}", "generated", "generated (this script)"))
        total += len(text.encode())
    return docs


def split_heldout(docs: list[Doc], cfg: BuildConfig) -> tuple[list[Doc], list[Doc]]:
    """~1% of source files (all their chunks) per domain go to held-out, chosen by key hash."""
    keys = sorted({d.key for d in docs}, key=lambda k: hashlib.sha256(f"{cfg.seed}:{k}".encode()).hexdigest())
    n_held = max(cfg.min_heldout_files, round(cfg.heldout_frac * len(keys)))
    held_keys = set(keys[:n_held])
    return [d for d in docs if d.key not in held_keys], [d for d in docs if d.key in held_keys]


def write_jsonl(path: Path, docs: list[Doc]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for d in docs:
            fh.write(json.dumps({"text": d.text, "domain": d.domain}, ensure_ascii=False) + "\n")


def build(out: Path, cfg: BuildConfig) -> dict:
    """Select, dedup, split and write shards plus manifest.json; returns the manifest."""
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("train-*.jsonl"):
        old.unlink()
    cands, report = all_candidates()
    by_domain: dict[str, list[Candidate]] = defaultdict(list)
    for c in cands:
        by_domain[c.domain].append(c)
    seen: set[str] = set()
    train: list[Doc] = []
    held: list[Doc] = []
    manifest_domains: dict[str, dict] = {}
    for domain in DOMAINS:
        stats = {"rejected": 0, "duplicates": 0, "candidates": 0}
        if domain == "math":
            docs = math_docs(cfg, seen)
        elif by_domain[domain]:
            docs = select_domain(domain, by_domain[domain], cfg, seen, stats)
        else:
            print(f"[build] {domain}: no sources on this machine, skipped", flush=True)
            continue
        shapes: dict[str, int] = defaultdict(int)
        wrapped_docs = []
        for d in docs:
            if wrapped(d.key, cfg.chat_share, cfg.seed):
                shapes[shape_of(d.key, d.domain)] += 1
                d = Doc(as_chat(d.text, d.domain, d.key), d.domain, d.key, d.package, d.licence)
            wrapped_docs.append(d)
        docs = wrapped_docs
        stats["chat_shapes"] = dict(sorted(shapes.items()))
        tr, he = split_heldout(docs, cfg)
        train += tr
        held += he
        manifest_domains[domain] = _domain_entry(docs, tr, he, stats)
        e = manifest_domains[domain]
        print(f"[build] {domain}: {e['files_used']} files, {e['docs']} docs, {e['bytes']/1e6:.1f} MB "
              f"(held-out {e['heldout_docs']} docs) in {time.time() - t0:.0f}s", flush=True)
    chat_path = Path(cfg.chat_corpus)
    if cfg.chat_corpus and chat_path.is_file():
        chats = [Doc(text, "chat", f"example:{cid}", "reap-swap-example", "per-excerpt, see example/realistic provenance") for cid, text in conversations(chat_path)]
        tr, he = split_heldout(chats, cfg)
        train += tr
        held += he
        manifest_domains["chat"] = _domain_entry(chats, tr, he, {"rejected": 0, "duplicates": 0, "candidates": len(chats)})
        print(f"[build] chat: {len(chats)} conversations from {chat_path}", flush=True)
    if cfg.generated_chats_per_domain > 0:
        avoid = test_split_paths(Path(cfg.test_corpus))
        gen_docs, styles = [], defaultdict(int)
        for cid, text, style, origin, licence in generated_conversations(cfg.generated_chats_seed, cfg.generated_chats_per_domain, avoid):
            h = _norm_hash(text)
            if h in seen:
                continue
            seen.add(h)
            styles[style] += 1
            gen_docs.append(Doc(text, "chat-gen", cid, origin or "generated", licence or "generated (corpus_math.py)"))
        tr, he = split_heldout(gen_docs, cfg)
        train += tr
        held += he
        manifest_domains["chat-gen"] = _domain_entry(gen_docs, tr, he, {"rejected": 0, "duplicates": 0, "candidates": len(gen_docs),
                                                                        "styles": dict(sorted(styles.items())), "avoided_test_paths": len(avoid)})
        print(f"[build] chat-gen: {len(gen_docs)} generated conversations (seed {cfg.generated_chats_seed}), styles {dict(styles)} "
              f"in {time.time() - t0:.0f}s", flush=True)
    random.Random(f"{cfg.seed}:shuffle").shuffle(train)
    shard, size, shards = [], 0, []
    for d in train:
        shard.append(d)
        size += len(d.text.encode())
        if size >= cfg.shard_bytes:
            shards.append(shard)
            shard, size = [], 0
    if shard:
        shards.append(shard)
    for i, s in enumerate(shards):
        write_jsonl(out / f"train-{i:05d}.jsonl", s)
    write_jsonl(out / "heldout.jsonl", held)
    manifest = {
        "config": asdict(cfg),
        "domains": manifest_domains,
        "train_shards": [f"train-{i:05d}.jsonl" for i in range(len(shards))],
        "heldout": "heldout.jsonl",
        "packages_used": {k: asdict(v) for k, v in sorted(report.used.items())},
        "packages_skipped": {k: asdict(v) for k, v in sorted(report.skipped.items())},
        "notes": report.notes,
        "build_seconds": round(time.time() - t0, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def _domain_entry(docs: list[Doc], tr: list[Doc], he: list[Doc], stats: dict) -> dict:
    """Per-domain manifest entry: counts, bytes, licences and the files used, by package."""
    files: dict[str, list[str]] = defaultdict(list)
    pkg_bytes: dict[str, int] = defaultdict(int)
    for d in docs:
        if not files[d.package] or files[d.package][-1] != d.key:
            files[d.package].append(d.key)
        pkg_bytes[d.package] += len(d.text.encode())
    licences = {d.package: d.licence for d in docs}
    return {
        "files_used": len({d.key for d in docs}),
        "docs": len(docs),
        "train_docs": len(tr),
        "heldout_docs": len(he),
        "bytes": sum(len(d.text.encode()) for d in docs),
        "train_bytes": sum(len(d.text.encode()) for d in tr),
        "heldout_bytes": sum(len(d.text.encode()) for d in he),
        "licence_summary": _licence_summary(licences, pkg_bytes),
        "packages": {p: {"licence": licences[p], "bytes": pkg_bytes[p], "files": sorted(set(files[p]))}
                     for p in sorted(files)},
        **stats,
    }


def _licence_summary(licences: dict[str, str], pkg_bytes: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for pkg, lic in licences.items():
        out[lic] += pkg_bytes[pkg]
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["build", "tokenize", "all"])
    ap.add_argument("--out", type=Path, default=Path("/tmp/moe-corpus/out"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every domain's byte cap")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--export", type=Path, default=None, help="copy packed data + tokenizer here")
    args = ap.parse_args(argv)
    cfg = BuildConfig(seed=args.seed)
    cfg.domain_bytes = {k: int(v * args.scale) for k, v in cfg.domain_bytes.items()}
    cfg.generated_chats_per_domain = int(round(cfg.generated_chats_per_domain * min(1.0, args.scale * 2)))
    if args.step in ("build", "all"):
        build(args.out, cfg)
    if args.step in ("tokenize", "all"):
        from corpus_tokenize import tokenize_corpus

        tokenize_corpus(args.out, vocab_size=args.vocab, export=args.export)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
