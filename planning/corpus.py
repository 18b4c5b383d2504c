"""Calibration corpus input: ai-data-extraction JSONL, ``{"text"}`` JSONL and plain text.

Conversations are rendered with the model's chat template (code context and
suggested diffs included, as the model would see them pasted into a chat).
Every sample keeps its id, source and tags. Malformed lines are skipped and
counted by reason; an input with no usable sample is an error saying why.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

ROLES = ("system", "user", "assistant", "tool")


class CorpusError(ValueError):
    pass


@dataclass(frozen=True)
class Sample:
    sample_id: str
    text: str
    source: str
    tags: tuple[str, ...]
    prompt: str
    """The text a proxy sees before the model answers: the last user turn with bounded context."""
    file: str = ""
    """Stem of the corpus file it came from (``train``/``test`` splits are told apart by it)."""


@dataclass
class CorpusStats:
    files: list[str] = field(default_factory=list)
    lines: int = 0
    samples: int = 0
    skipped: Counter[str] = field(default_factory=Counter)

    def to_json(self) -> dict[str, Any]:
        return {"files": self.files, "lines": self.lines, "samples": self.samples, "skipped": dict(self.skipped)}


def content_text(content: Any) -> str:
    """A message's text: a string, or the text parts of an OpenAI content-part list joined by newlines.

    The proxy extracts prompts with this same function, so a conversation
    observed here and the same conversation sent live give the same text.
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            p["text"] for p in content
            if isinstance(p, dict) and p.get("type") in ("text", "input_text") and isinstance(p.get("text"), str)
        )
    return ""


class _BadField(ValueError):
    """A message field with the wrong shape: the sample is skipped and counted under ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _message_text(msg: dict[str, Any]) -> str:
    content = msg.get("content")
    if content is not None and not isinstance(content, (str, list)):
        raise _BadField("bad_content")
    parts = [content_text(content)]
    contexts, diffs = msg.get("code_context") or [], msg.get("suggested_diffs") or []
    if not isinstance(contexts, list):
        raise _BadField("bad_code_context")
    if not isinstance(diffs, list):
        raise _BadField("bad_suggested_diffs")
    for ctx in contexts:
        if isinstance(ctx, dict) and isinstance(ctx.get("code"), str) and ctx["code"]:
            parts.append(f"File: {ctx.get('file', 'snippet')}\n```\n{ctx['code']}\n```")
    for diff in diffs:
        if isinstance(diff, dict) and isinstance(diff.get("diff"), str) and diff["diff"]:
            parts.append(f"Diff for {diff.get('file', 'file')}:\n```diff\n{diff['diff']}\n```")
        elif isinstance(diff, str) and diff.strip():
            parts.append(f"```diff\n{diff}\n```")
    return "\n\n".join(p for p in parts if p.strip())


def conversation_messages(row: dict[str, Any]) -> list[dict[str, str]] | str:
    """Chat messages of one ai-data-extraction row, or the reason it is unusable."""
    msgs = row.get("messages")
    if not isinstance(msgs, list) or not msgs:
        return "no_messages"
    out = []
    for m in msgs:
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return "bad_message"
        try:
            text = _message_text(m)
        except _BadField as exc:
            return exc.reason
        if text.strip():
            out.append({"role": str(m["role"]), "content": text})
    if not any(m["role"] == "user" for m in out):
        return "no_user_turn"
    return out


def prompt_text(messages: list[dict[str, str]], max_chars: int = 2000) -> str:
    """What a router sees before generation: the last user turn, plus earlier turns as far as room allows."""
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    text = messages[last_user]["content"][-max_chars:]
    for m in reversed(messages[:last_user]):
        if len(text) >= max_chars:
            break
        text = (m["content"][-(max_chars - len(text)) :] + "\n\n" + text).strip()
    return text


def _tags(row: dict[str, Any]) -> tuple[str, ...]:
    tags = row.get("tags")
    if isinstance(tags, list) and all(isinstance(t, str) for t in tags) and tags:
        return tuple(tags)
    return ("untagged",)


def read_corpus(
    paths: Iterable[str | Path],
    render: Callable[[list[dict[str, str]]], str],
    max_samples: int | None = None,
) -> tuple[list[Sample], CorpusStats]:
    """Samples from every file, in file then line order; ``render`` applies the chat template."""
    stats = CorpusStats()
    samples: list[Sample] = []
    seen: set[str] = set()
    for path in [Path(p) for p in paths]:
        if not path.is_file():
            raise CorpusError(f"corpus file not found: {path}")
        stats.files.append(str(path))
        if path.suffix in (".txt", ".md"):
            rows: Iterable[tuple[int, Any]] = enumerate([{"text": path.read_text(encoding="utf-8", errors="replace")}])
        else:
            rows = _jsonl_rows(path, stats)
        for _, row in rows:
            stats.lines += 1
            sample = _sample(row, path, render, stats)
            if sample is None:
                continue
            if sample.sample_id in seen:
                stats.skipped["duplicate_id"] += 1
                continue
            seen.add(sample.sample_id)
            samples.append(sample)
            if max_samples and len(samples) >= max_samples:
                stats.samples = len(samples)
                return samples, stats
    stats.samples = len(samples)
    if not samples:
        why = ", ".join(f"{k}: {v}" for k, v in stats.skipped.items()) or "the files are empty"
        raise CorpusError(f"no usable sample in {len(stats.files)} file(s), {stats.lines} record(s) ({why})")
    return samples, stats


def _jsonl_rows(path: Path, stats: CorpusStats) -> Iterable[tuple[int, Any]]:
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except (json.JSONDecodeError, RecursionError):
                stats.lines += 1
                stats.skipped["invalid_json"] += 1


def _sample(row: Any, path: Path, render: Callable[[list[dict[str, str]]], str], stats: CorpusStats) -> Sample | None:
    if not isinstance(row, dict):
        stats.skipped["not_an_object"] += 1
        return None
    if "messages" in row:
        msgs = conversation_messages(row)
        if isinstance(msgs, str):
            stats.skipped[msgs] += 1
            return None
        try:
            text = render(msgs)
        except Exception:  # noqa: BLE001 - a chat template that rejects this conversation skips it, counted
            stats.skipped["chat_template_error"] += 1
            return None
        if not isinstance(text, str):
            stats.skipped["chat_template_error"] += 1
            return None
        prompt = prompt_text(msgs)
    elif isinstance(row.get("text"), str):
        text = prompt = row["text"]
    else:
        stats.skipped["no_messages_or_text"] += 1
        return None
    if not text.strip():
        stats.skipped["empty"] += 1
        return None
    sid = row.get("id")
    if not isinstance(sid, str) or not sid:
        # Content identity, not position: inserting a line must not make every later sample "new".
        sid = f"{path.stem}:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:20]
    source = row.get("source") if isinstance(row.get("source"), str) else path.stem
    return Sample(sample_id=sid, text=text, source=source, tags=_tags(row), prompt=prompt, file=path.stem)


def corpus_sha256(samples: list[Sample]) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(s.sample_id.encode() + b"\0" + hashlib.sha256(s.text.encode()).digest())
    return h.hexdigest()
