#!/usr/bin/env python3
"""Build the realistic example corpus from this machine's permissively licensed files.

Why: the template corpus (``example/corpus``) teaches a classifier its templates.
These conversations paste real code, configs, docs and failures cut from the
same local, licence-checked sources the model-training corpus uses
(``models/train/corpus_sources.py``), plus the generated math worksheets'
problems, in varied styles and two phrasing banks. Deterministic for a given
machine, ``--seed`` and ``--per-domain`` (sorted candidates, seeded RNGs keyed by
conversation id, hash splits).

Splits: ``test.jsonl`` holds 20 % of each domain (hash of the id). The
cross-source split is in the tags: every origin (package, Rust std module, math
topic) is held out or not by a hash coin; conversations drawn from held-out
origins, which are also worded with phrasing bank B, carry ``cross:test``, the
rest ``cross:train`` (``reap-swap plan/train/evaluate --split tag:cross:test``).

    python example/realistic/build.py [--out DIR] [--seed 11] [--per-domain 200]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from conversations import STYLE_WEIGHTS, STYLES, conversation  # noqa: E402
from snippets import Candidate, Snippet, origin_of, snippet  # noqa: E402

from corpus_math import GENERATORS  # noqa: E402  (models/train, on the path via snippets)
from corpus_sources import all_candidates  # noqa: E402

DOMAINS = ("code-python", "code-c", "code-js", "code-rust", "prose", "ops", "math")
FROM_TRAINING = {"code-python": "code-python", "code-c": "code-c", "code-js": "code-js", "code-rust": "code-rust",
                 "prose": "prose", "shell-config": "ops"}
KINDS = {"prose": {"docstrings", "mdbook-html", "text", "metadata"}, "ops": {"text", "mdbook-shell", "md-shell", "metadata-shell"}}
HELD_SHARE = 0.3
TEST_SHARE = 0.2
MAX_PER_ORIGIN = 300
TOOLS = {"claude-code": ("claude-sonnet-4-5", "claude-opus-4-1"), "cursor-composer": ("gpt-5", "composer-1"),
         "codex": ("gpt-5-codex",), "opencode": ("qwen3-coder", "kimi-k2"), "windsurf": ("swe-1.5",), "trae": ("doubao-seed-code",)}
BASE_MS, SPAN_MS = 1_735_689_600_000, 300 * 86_400_000  # 2025-01-01, ~10 months


def coin(seed: int, key: str) -> float:
    return int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:12], 16) / float(1 << 48)


def candidate_pools(seed: int) -> tuple[dict[str, dict[str, list[Candidate]]], dict[str, str]]:
    """domain -> origin -> candidates (capped per origin, seeded), and each origin's licence."""
    cands, _ = all_candidates()
    pools: dict[str, dict[str, list[Candidate]]] = defaultdict(lambda: defaultdict(list))
    licences: dict[str, str] = {}
    for c in cands:
        dom = FROM_TRAINING.get(c.domain)
        if dom is None or (dom in KINDS and c.kind not in KINDS[dom]) or (dom.startswith("code") and c.kind not in ("text", "rust-src-html")):
            continue
        origin = origin_of(c)
        pools[dom][origin].append(c)
        licences[origin] = c.licence
    for dom in pools:
        for origin, items in pools[dom].items():
            if len(items) > MAX_PER_ORIGIN:
                pools[dom][origin] = random.Random(f"{seed}:{origin}").sample(items, MAX_PER_ORIGIN)
    return pools, licences


def held_out(seed: int, origins: list[str]) -> set[str]:
    """Origins held out by the cross-source split: a hash coin each, at least one held and one kept."""
    ranked = sorted(origins, key=lambda o: coin(seed, o))
    held = {o for o in origins if coin(seed, o) < HELD_SHARE}
    if not held:
        held = {ranked[0]}
    if held == set(origins) and len(origins) > 1:
        held.discard(ranked[-1])
    return held


class Source:
    """Draws snippets for a conversation, from held-out or kept origins only."""

    def __init__(self, pools: dict[str, dict[str, list[Candidate]]], held: dict[str, set[str]], rng: random.Random, from_held: bool):
        self.pools, self.held, self.rng, self.from_held = pools, held, rng, from_held

    def __call__(self, domain: str) -> Snippet:
        if domain == "math":
            return self.math()
        origins = sorted(o for o in self.pools[domain] if (o in self.held[domain]) == self.from_held)
        families: dict[str, list[str]] = defaultdict(list)
        for o in origins:  # family first (pypi, npm, rust-book, ...): no family floods a domain by its number of packages
            families[o.split(":", 1)[0]].append(o)
        for _ in range(60):
            origin = self.rng.choice(families[self.rng.choice(sorted(families))])
            sn = snippet(self.rng.choice(self.pools[domain][origin]), domain, self.rng)
            if sn is not None:
                return sn
        raise RuntimeError(f"no usable snippet in {domain} ({'held-out' if self.from_held else 'kept'} origins)")

    def math(self) -> Snippet:
        topics = [(t, g) for t, g in GENERATORS if (f"math:{t}" in self.held["math"]) == self.from_held]
        topic, gen = self.rng.choice(topics)
        statement, solution = gen(self.rng)
        return Snippet("math", f"math:{topic}", "generated (models/train/corpus_math.py)", topic, statement, topic, solution, 1)


def build(seed: int, per_domain: int) -> tuple[list[dict], dict]:
    pools, licences = candidate_pools(seed)
    held = {d: held_out(seed, sorted(pools[d])) for d in DOMAINS if d != "math"}
    held["math"] = held_out(seed, [f"math:{t}" for t, _ in GENERATORS])
    rows = []
    for domain in DOMAINS:
        for i in range(per_domain):
            cid = f"{domain}-{i:04d}"
            rng = random.Random(f"{seed}:{cid}")
            from_held = rng.random() < HELD_SHARE
            bank = "B" if from_held else "A"
            style = rng.choices(STYLES, weights=STYLE_WEIGHTS[domain])[0]
            msgs, used, extra = conversation(domain, style, bank, rng, Source(pools, held, rng, from_held))
            tool = rng.choice(sorted(TOOLS))
            for m in msgs:
                if m["role"] == "assistant" and rng.random() < 0.8:
                    m["model"] = rng.choice(TOOLS[tool])
            tags = [domain, f"style:{style}", f"origin:{used[0].origin}", f"phrasing:{bank}", "cross:test" if from_held else "cross:train"] + extra
            rows.append({"messages": msgs, "source": tool, "created_at": BASE_MS + rng.randrange(SPAN_MS), "tags": tags, "id": cid,
                         "provenance": [{"origin": s.origin, "licence": licences.get(s.origin, s.licence), "path": s.path} for s in used]})
    manifest = {
        "seed": seed, "per_domain": per_domain, "held_share": HELD_SHARE, "test_share": TEST_SHARE,
        "held_out_origins": {d: sorted(v) for d, v in held.items()},
        "origins": {d: len(pools[d]) for d in DOMAINS if d != "math"},
        "licences": dict(sorted(Counter(p["licence"] for r in rows for p in r["provenance"]).items())),
        "styles": dict(sorted(Counter(r["tags"][1] for r in rows).items())),
        "cross": dict(sorted(Counter(r["tags"][4] for r in rows).items())),
    }
    return rows, manifest


def split(rows: list[dict], seed: int) -> tuple[list[dict], list[dict]]:
    """20 % of each domain, by a hash of the id, to test."""
    test_ids: set[str] = set()
    by_domain: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        by_domain[r["tags"][0]].append(r["id"])
    for ids in by_domain.values():
        ranked = sorted(ids, key=lambda i: coin(seed, "split:" + i))
        test_ids |= set(ranked[: round(TEST_SHARE * len(ids))])
    return [r for r in rows if r["id"] not in test_ids], [r for r in rows if r["id"] in test_ids]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--per-domain", type=int, default=200)
    a = p.parse_args()
    rows, manifest = build(a.seed, a.per_domain)
    train, test = split(rows, a.seed)
    a.out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train.jsonl", train), ("test.jsonl", test)):
        with open(a.out / name, "w", encoding="utf-8") as fh:
            for r in sorted(part, key=lambda r: r["id"]):
                fh.write(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n")
    manifest["files"] = {"train.jsonl": len(train), "test.jsonl": len(test)}
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    size = sum((a.out / n).stat().st_size for n in ("train.jsonl", "test.jsonl"))
    print(f"wrote {len(train)} train + {len(test)} test conversations ({size / 1e6:.2f} MB) to {a.out}; "
          f"cross split {manifest['cross']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
