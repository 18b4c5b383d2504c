"""The realistic example corpus: readable, licensed, split as documented, rebuilt byte for byte."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from reap_swap.example.corpora import realistic_corpus_files, subsample
from reap_swap.planning.corpus import read_corpus

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "example" / "realistic" / "build.py"
DOMAINS = {"code-python", "code-c", "code-js", "code-rust", "prose", "ops", "math"}


def _rows() -> list[tuple[str, dict]]:
    return [(p.stem, json.loads(line)) for p in realistic_corpus_files() for line in p.read_text().splitlines() if line.strip()]


def test_every_conversation_reads_and_is_tagged() -> None:
    samples, stats = read_corpus(realistic_corpus_files(), lambda msgs: "\n".join(m["content"] for m in msgs))
    assert len(samples) == 1400 and not stats.skipped
    rows = _rows()
    for _, r in rows:
        domain, style, origin, phrasing, cross = r["tags"][:5]
        assert domain in DOMAINS and style.startswith("style:") and origin.startswith("origin:")
        assert (phrasing, cross) in {("phrasing:A", "cross:train"), ("phrasing:B", "cross:test")}
        assert r["messages"][0]["role"] == "user" and r["provenance"]
    per_domain = Counter((f, r["tags"][0]) for f, r in rows)
    assert all(per_domain[("test", d)] == 40 and per_domain[("train", d)] == 160 for d in DOMAINS)
    assert len(Counter(r["tags"][1] for _, r in rows)) == 6


def test_sources_are_permissive_and_cross_split_holds_out_whole_origins() -> None:
    sys.path.insert(0, str(REPO / "models" / "train"))
    from corpus_licences import free_text_family, spdx_ok

    manifest = json.loads((REPO / "example" / "realistic" / "manifest.json").read_text())
    held = manifest["held_out_origins"]
    anywhere = {o for origins in held.values() for o in origins}
    for _, r in _rows():
        for p in r["provenance"]:
            assert p["licence"].startswith("generated") or spdx_ok(p["licence"]) or free_text_family(p["licence"]) or p["licence"] == "BSD"
            if "cross:test" in r["tags"]:
                assert p["origin"] in anywhere
        first_held = r["provenance"][0]["origin"] in held[r["tags"][0]]
        assert first_held == ("cross:test" in r["tags"])


@pytest.mark.skipif(not (Path.home() / ".rustup").is_dir() or shutil.which("npm") is None,
                    reason="the corpus is cut from this machine's Rust docs and npm packages")
def test_build_is_deterministic(tmp_path: Path) -> None:
    outs = []
    for run in ("a", "b"):
        r = subprocess.run([sys.executable, str(BUILD), "--per-domain", "3", "--out", str(tmp_path / run)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        outs.append([(tmp_path / run / n).read_bytes() for n in ("train.jsonl", "test.jsonl", "manifest.json")])
    assert outs[0] == outs[1]
    assert sum(1 for _ in (tmp_path / "a" / "train.jsonl").read_text().splitlines()) + \
        sum(1 for _ in (tmp_path / "a" / "test.jsonl").read_text().splitlines()) == 21


def test_subsample_keeps_the_first_conversations_of_each_domain(tmp_path: Path) -> None:
    files = subsample(realistic_corpus_files(), 2, tmp_path)
    assert [f.name for f in files] == ["train.jsonl", "test.jsonl"]
    for f in files:
        tags = [json.loads(x)["tags"][0] for x in f.read_text().splitlines()]
        assert Counter(tags) == {d: 2 for d in DOMAINS}
