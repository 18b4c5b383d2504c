"""Train the BPE tokenizer on the corpus and pack it into uint16 token arrays.

Why one self-contained file: the GPU box gets the data in one transfer and has
no vLLM or project install, so ``moe_data.npz.xz`` holds the packed train and
held-out tokens, per-domain held-out arrays, the tokenizer files and a small
JSON header. Documents are separated by ``<|endoftext|>``.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Iterator

import numpy as np

from reap_swap.models.tokenizer import PAD_TOKEN, save_tokenizer, train_bpe

DATA_FILE = "moe_data.npz.xz"
EOT = PAD_TOKEN  # "<|endoftext|>"


def read_docs(paths: list[Path]) -> Iterator[dict]:
    for p in paths:
        with open(p, encoding="utf-8") as fh:
            for line in fh:
                yield json.loads(line)


def encode_docs(tok, docs: list[dict], eot_id: int, batch: int = 512) -> tuple[np.ndarray, dict[str, int]]:
    """Token ids of all docs, each followed by <|endoftext|>, plus tokens per domain."""
    parts: list[np.ndarray] = []
    per_domain: dict[str, int] = defaultdict(int)
    for i in range(0, len(docs), batch):
        chunk = docs[i : i + batch]
        encoded = tok.encode_batch([d["text"] for d in chunk], add_special_tokens=False)
        for d, enc in zip(chunk, encoded, strict=True):
            ids = np.asarray(enc.ids + [eot_id], dtype=np.uint16)
            parts.append(ids)
            per_domain[d["domain"]] += len(ids)
    arr = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)
    return arr, dict(per_domain)


def tokenize_corpus(out: Path, vocab_size: int = 8192, export: Path | None = None) -> dict:
    """Train BPE, encode train/held-out, write ``moe_data.npz.xz`` and ``data_meta.json``."""
    t0 = time.time()
    manifest = json.loads((out / "manifest.json").read_text())
    train_docs = list(read_docs([out / s for s in manifest["train_shards"]]))
    held_docs = list(read_docs([out / manifest["heldout"]]))
    print(f"[tokenize] {len(train_docs)} train docs, {len(held_docs)} held-out docs", flush=True)
    tok = train_bpe((d["text"] for d in train_docs), vocab_size)
    if tok.get_vocab_size() > 65535:
        raise ValueError("vocab does not fit uint16")
    tok_dir = out / "tokenizer"
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    save_tokenizer(tok, tok_dir, model_max_length=4096)
    eot_id = tok.token_to_id(EOT)
    print(f"[tokenize] BPE vocab {tok.get_vocab_size()} trained in {time.time() - t0:.0f}s", flush=True)

    train, train_dom = encode_docs(tok, train_docs, eot_id)
    held, held_dom = encode_docs(tok, held_docs, eot_id)
    arrays: dict[str, np.ndarray] = {"train": train, "heldout": held}
    for dom in sorted(held_dom):
        arrays[f"heldout__{dom}"], _ = encode_docs(tok, [d for d in held_docs if d["domain"] == dom], eot_id)
    train_bytes = defaultdict(int)
    for d in train_docs:
        train_bytes[d["domain"]] += len(d["text"].encode())
    meta = {
        "vocab_size": tok.get_vocab_size(),
        "eot_id": eot_id,
        "special_tokens": {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")},
        "train_tokens": int(train.size),
        "heldout_tokens": int(held.size),
        "train_tokens_per_domain": dict(sorted(train_dom.items())),
        "heldout_tokens_per_domain": dict(sorted(held_dom.items())),
        "train_bytes_per_token": {k: round(train_bytes[k] / max(1, v), 3) for k, v in sorted(train_dom.items())},
        "domains": sorted(held_dom),
        "tokenizer_files": sorted(p.name for p in tok_dir.iterdir()),
    }
    arrays["meta_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    for p in sorted(tok_dir.iterdir()):
        arrays[f"file__{p.name}"] = np.frombuffer(p.read_bytes(), dtype=np.uint8)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    raw = buf.getvalue()
    t1 = time.time()
    packed = lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)
    (out / DATA_FILE).write_bytes(packed)
    meta.update(
        npz_bytes=len(raw),
        xz_bytes=len(packed),
        xz_seconds=round(time.time() - t1, 1),
        sha256=hashlib.sha256(packed).hexdigest(),
        tokenize_seconds=round(time.time() - t0, 1),
    )
    (out / "data_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"[tokenize] train {train.size:,} tokens, held-out {held.size:,}; npz {len(raw)/1e6:.1f} MB -> "
          f"{DATA_FILE} {len(packed)/1e6:.1f} MB in {time.time() - t0:.0f}s", flush=True)
    if export is not None:
        export.mkdir(parents=True, exist_ok=True)
        for name in (DATA_FILE, "data_meta.json", "manifest.json"):
            shutil.copy2(out / name, export / name)
        print(f"[tokenize] exported to {export}", flush=True)
    return meta

