"""The on-disk observation format and its aggregate view.

An observation directory holds::

    manifest.json     model id + config sha256, corpus sha256, token counts,
                      chunk list, parameters, and its own content hash
    samples.jsonl     one line per sample: id, source, tags, tokens, prompt, file, chunk
    chunk-NNNN.npz    per chunk: sample_mass [n, L, E] float32 (summed gate weight),
                      sample_freq [n, L, E] int32 (routed tokens), sample_saliency
                      [n, L, E] float32 (summed gate x ||expert output||), and
                      coact [L, E, E] int64 (tokens routed to both experts)

Adding samples writes a new chunk; nothing already observed is recomputed.
Aggregates are summed per sample in sorted-id order (float64), so the same
set of samples gives the same numbers however it was chunked.

Crash safety: chunks and the manifest are written to a temporary file,
fsynced and renamed into place, and the manifest is the only commit point:
a chunk, or a ``samples.jsonl`` row, that the manifest does not list does not
exist (a run killed at any instant leaves the last committed state readable).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable

import numpy as np

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SAMPLES = "samples.jsonl"


class ObservationError(ValueError):
    pass


@dataclass
class Observations:
    """Everything the planner and the classifier need, aggregated."""

    manifest: dict[str, Any]
    layer_ids: list[int]
    num_experts: int
    top_k: int
    sample_ids: list[str]
    sources: list[str]
    tags: list[tuple[str, ...]]
    prompts: list[str]
    files: list[str]
    sample_tokens: np.ndarray  # [N]
    sample_mass: np.ndarray  # [N, L, E] float32
    sample_freq: np.ndarray  # [N, L, E] int32
    sample_saliency: np.ndarray  # [N, L, E] float32
    coact: np.ndarray  # [L, E, E] int64

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def mass(self) -> np.ndarray:
        """[L, E] summed gate weight over all samples."""
        return self.sample_mass.astype(np.float64).sum(axis=0)

    @property
    def freq(self) -> np.ndarray:
        return self.sample_freq.astype(np.int64).sum(axis=0)

    @property
    def saliency(self) -> np.ndarray:
        """[L, E] REAP saliency: mean over routed tokens of gate x ||expert output||."""
        total = self.sample_saliency.astype(np.float64).sum(axis=0)
        return np.divide(total, self.freq, out=np.zeros_like(total), where=self.freq > 0)

    @property
    def sha256(self) -> str:
        return str(self.manifest["content_sha256"])

    def mass_share(self) -> np.ndarray:
        """[N, L, E]: each sample's gate mass per layer, normalized to sum 1."""
        m = self.sample_mass.astype(np.float64)
        tot = m.sum(axis=2, keepdims=True)
        return np.divide(m, tot, out=np.zeros_like(m), where=tot > 0)

    def subset(self, index: np.ndarray | list[int]) -> "Observations":
        idx = np.asarray(index, dtype=np.int64)
        return Observations(
            manifest=self.manifest,
            layer_ids=self.layer_ids,
            num_experts=self.num_experts,
            top_k=self.top_k,
            sample_ids=[self.sample_ids[i] for i in idx],
            sources=[self.sources[i] for i in idx],
            tags=[self.tags[i] for i in idx],
            prompts=[self.prompts[i] for i in idx],
            files=[self.files[i] for i in idx],
            sample_tokens=self.sample_tokens[idx],
            sample_mass=self.sample_mass[idx],
            sample_freq=self.sample_freq[idx],
            sample_saliency=self.sample_saliency[idx],
            coact=self.coact,  # token-level co-activation is kept for the whole set
        )


def content_hash(manifest: dict[str, Any], chunk_hashes: list[str]) -> str:
    keep = {k: manifest[k] for k in ("format_version", "model", "params") if k in manifest}
    blob = json.dumps({"manifest": keep, "chunks": sorted(chunk_hashes)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(obs_dir: Path) -> dict[str, Any] | None:
    path = obs_dir / MANIFEST
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ObservationError(f"{path}: corrupt manifest ({exc})") from None
    if data.get("format_version") != FORMAT_VERSION:
        raise ObservationError(f"{path}: unsupported format_version {data.get('format_version')!r}")
    return data


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write through ``write`` into a temp file, fsync it, rename it over ``path``, fsync the folder."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


def write_manifest(obs_dir: Path, manifest: dict[str, Any]) -> None:
    """The commit point: content hash, then an atomic replace of ``manifest.json``."""
    manifest["content_sha256"] = content_hash(manifest, [c["sha256"] for c in manifest["chunks"]])
    blob = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    atomic_write(obs_dir / MANIFEST, lambda fh: fh.write(blob))


def append_rows(obs_dir: Path, rows: list[dict[str, Any]]) -> None:
    with open(obs_dir / SAMPLES, "a") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def committed_rows(obs_dir: Path, manifest: dict[str, Any] | None) -> tuple[list[dict[str, Any]], int]:
    """``samples.jsonl`` rows of chunks the manifest lists, in file order, and how many lines were not.

    Rows of uncommitted chunks and torn lines (a crash mid-append) are ignored;
    a committed chunk whose rows are not all there is corruption.
    """
    chunks = {c["file"]: int(c["samples"]) for c in (manifest or {}).get("chunks", [])}
    path = obs_dir / SAMPLES
    if not path.exists():
        if chunks:
            raise ObservationError(f"{path}: missing, but the manifest lists {len(chunks)} chunk(s)")
        return [], 0
    rows: list[dict[str, Any]] = []
    ignored = 0
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    ignored += 1
                    continue
                if isinstance(row, dict) and row.get("chunk") in chunks:
                    rows.append(row)
                else:
                    ignored += 1
    except OSError as exc:
        raise ObservationError(f"{path}: unreadable ({exc})") from None
    counts: dict[str, int] = {}
    for row in rows:
        counts[row["chunk"]] = counts.get(row["chunk"], 0) + 1
    short = {name: (counts.get(name, 0), n) for name, n in chunks.items() if counts.get(name, 0) != n}
    if short:
        raise ObservationError(f"{path}: rows per chunk (found, expected) do not match the manifest: {short}")
    return rows, ignored


def discard_uncommitted(obs_dir: Path, manifest: dict[str, Any] | None) -> int:
    """Drop what a crashed run left behind (rows of uncommitted chunks, temp files); returns rows dropped."""
    for tmp in obs_dir.glob(".*.tmp"):
        tmp.unlink()
    rows, ignored = committed_rows(obs_dir, manifest)
    if ignored:
        blob = "".join(json.dumps(r) + "\n" for r in rows).encode()
        atomic_write(obs_dir / SAMPLES, lambda fh: fh.write(blob))
    return ignored


def load_observations(obs_dir: str | Path) -> Observations:
    obs_dir = Path(obs_dir)
    manifest = read_manifest(obs_dir)
    if manifest is None:
        raise ObservationError(f"{obs_dir}: no {MANIFEST} (run reap-swap observe first)")
    rows, _ = committed_rows(obs_dir, manifest)
    by_chunk: dict[str, dict[str, np.ndarray]] = {}
    for chunk in manifest["chunks"]:
        path = obs_dir / chunk["file"]
        if not path.is_file() or file_sha256(path) != chunk["sha256"]:
            raise ObservationError(f"{path}: missing or modified since it was written (sha256 mismatch)")
        with np.load(path) as npz:
            by_chunk[chunk["file"]] = {k: npz[k] for k in npz.files}
    order = sorted(range(len(rows)), key=lambda i: rows[i]["id"])
    pos_in_chunk: dict[str, int] = {}
    picks: list[tuple[str, int]] = []
    for row in rows:
        n = pos_in_chunk.get(row["chunk"], 0)
        picks.append((row["chunk"], n))
        pos_in_chunk[row["chunk"]] = n + 1

    def gather(key: str) -> np.ndarray:
        return np.stack([by_chunk[picks[i][0]][key][picks[i][1]] for i in order])

    layers = [int(x) for x in manifest["model"]["moe_layers"]]
    num_experts = int(manifest["model"]["num_experts"])
    coact = np.zeros((len(layers), num_experts, num_experts), dtype=np.int64)
    for arrays in by_chunk.values():
        coact += arrays["coact"]
    return Observations(
        manifest=manifest,
        layer_ids=layers,
        num_experts=num_experts,
        top_k=int(manifest["model"]["top_k"]),
        sample_ids=[rows[i]["id"] for i in order],
        sources=[rows[i]["source"] for i in order],
        tags=[tuple(rows[i]["tags"]) for i in order],
        prompts=[rows[i].get("prompt", "") for i in order],
        files=[rows[i].get("file", "") for i in order],
        sample_tokens=np.array([rows[i]["tokens"] for i in order], dtype=np.int64),
        sample_mass=gather("sample_mass"),
        sample_freq=gather("sample_freq"),
        sample_saliency=gather("sample_saliency"),
        coact=coact,
    )
