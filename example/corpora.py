"""The shipped example corpora and a deterministic per-domain subsample of them.

``realistic/``: conversations cut from this machine's permissively licensed
files (code, configs, docs, failures, math), the demo's default corpus.
``corpus/``: the older template-generated conversations (six domains), kept
for the unit tests, which rely on its small, fast shape.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent


def realistic_corpus_files() -> list[Path]:
    """``train.jsonl`` and ``test.jsonl`` of the realistic corpus."""
    files = [HERE / "realistic" / "train.jsonl", HERE / "realistic" / "test.jsonl"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"realistic example corpus missing: {', '.join(missing)}")
    return files


def subsample(files: list[Path], per_domain: int, out_dir: Path) -> list[Path]:
    """The first ``per_domain`` conversations of each domain (first tag) of each file, same file names."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in files:
        kept: dict[str, int] = defaultdict(int)
        lines = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            domain = (json.loads(line).get("tags") or ["untagged"])[0]
            if kept[domain] < per_domain:
                kept[domain] += 1
                lines.append(line)
        target = out_dir / path.name
        target.write_text("\n".join(lines) + "\n", encoding="utf-8")
        written.append(target)
    return written
