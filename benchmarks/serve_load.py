"""A closed-loop HTTP load generator for OpenAI-compatible servers, and its pure aggregation.

``run_load`` keeps ``concurrency`` streaming ``/v1/completions`` requests in flight until ``n``
have been sent; each records its TTFT (first content chunk), every later content chunk's
arrival (inter-token latency), its end, its completion tokens (the server's ``usage`` in the
final chunk with ``stream_options.include_usage``, else the number of content chunks), its
text and any error. ``aggregate`` turns those records into the run's numbers; it is pure.
A prompt is text or token ids (exact prompt lengths); a request may carry its own
``X-Request-Id`` (vLLM adopts it: the trace replay and the miss accounting key on it).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

Prompt = str | list[int]

WORDS = ("the of and to in is was for on are with as by at from this that which have it not be or an "
         "server expert model token cache memory layer route swap host device batch request stream").split()


@dataclass
class RequestRecord:
    start: float
    first: float | None = None            # first content chunk (absolute, monotonic seconds)
    chunks: list[float] = field(default_factory=list)  # every content chunk's arrival, first included
    end: float | None = None
    tokens: int = 0
    tokens_from_usage: bool = False
    text: str = ""
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    def itls(self) -> list[float]:
        """Gaps between content chunks; a chunk holding k > 1 tokens (usage says more tokens than
        chunks) spreads its gap over those tokens."""
        gaps = [b - a for a, b in zip(self.chunks, self.chunks[1:])]
        if not gaps:
            return []
        extra = self.tokens - len(self.chunks)
        if self.tokens_from_usage and extra > 0:
            per = len(gaps) + extra
            total = self.chunks[-1] - self.chunks[0]
            return [total / per] * per
        return gaps

    def decode_tps(self) -> float | None:
        if self.first is None or self.end is None or self.tokens < 2 or self.end <= self.first:
            return None
        return (self.tokens - 1) / (self.end - self.first)


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return xs[0]
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def aggregate(records: list[RequestRecord], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [g for r in ok for g in r.itls()]
    dec = [d for r in ok if (d := r.decode_tps()) is not None]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "completion_tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall if wall > 0 else None,
        "decode_tok_s_per_request_p50": percentile(dec, 50),
        "decode_tok_s_per_request_mean": sum(dec) / len(dec) if dec else None,
        "ttft_ms_p50": _ms(percentile(ttfts, 50)),
        "ttft_ms_p99": _ms(percentile(ttfts, 99)),
        "itl_ms_p50": _ms(percentile(itls, 50)),
        "itl_ms_p99": _ms(percentile(itls, 99)),
        "tokens_from_usage": all(r.tokens_from_usage for r in ok) if ok else False,
    }


def make_prompts(n: int, prompt_words: int, seed: int = 0, corpus: list[str] | None = None) -> list[str]:
    """n prompts of about prompt_words words: corpus samples cut to length, else random words."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if corpus:
            words = corpus[i % len(corpus)].split()
            out.append(" ".join((words * (prompt_words // max(1, len(words)) + 1))[:prompt_words]))
        else:
            out.append(" ".join(rng.choice(WORDS) for _ in range(prompt_words)))
    return out


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: Prompt, max_tokens: int,
                      temperature: float, seed: int | None, timeout: float, request_id: str | None = None) -> RequestRecord:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if seed is not None:
        body["seed"] = seed
    headers = {"X-Request-Id": request_id} if request_id else None
    rec = RequestRecord(start=time.monotonic())
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body, timeout=timeout, headers=headers) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    rec.error = str(msg["error"])[:300]
                    break
                for choice in msg.get("choices") or []:
                    text = choice.get("text") or ""
                    if text:
                        now = time.monotonic()
                        if rec.first is None:
                            rec.first = now
                        rec.chunks.append(now)
                        rec.text += text
                usage = msg.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    rec.tokens = int(usage["completion_tokens"])
                    rec.tokens_from_usage = True
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    rec.end = time.monotonic()
    if not rec.tokens_from_usage:
        rec.tokens = len(rec.chunks)
    return rec


async def run_load(url: str, model: str, prompts: list[Prompt], concurrency: int, max_tokens: int,
                   temperature: float = 0.0, seed: int | None = None, timeout: float = 600.0,
                   request_ids: list[str] | None = None) -> tuple[list[RequestRecord], float]:
    """Closed loop: ``concurrency`` workers take the next prompt as soon as their last request ends
    (prompt i is sent as ``request_ids[i]`` when given)."""
    if request_ids is not None and len(request_ids) != len(prompts):
        raise ValueError(f"{len(request_ids)} request ids for {len(prompts)} prompts")
    queue = list(enumerate(prompts))
    results: list[RequestRecord | None] = [None] * len(prompts)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        async def worker() -> None:
            while queue:
                i, prompt = queue.pop(0)
                results[i] = await one_request(client, url, model, prompt, max_tokens, temperature,
                                               None if seed is None else seed + i, timeout,
                                               None if request_ids is None else request_ids[i])
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        wall = time.monotonic() - t0
    return [r for r in results if r is not None], wall


def load(url: str, model: str, prompts: list[Prompt], concurrency: int, max_tokens: int, temperature: float = 0.0,
         seed: int | None = None, timeout: float = 600.0, request_ids: list[str] | None = None) -> dict[str, Any]:
    records, wall = asyncio.run(run_load(url, model, prompts, concurrency, max_tokens, temperature, seed, timeout, request_ids))
    stats = aggregate(records, wall)
    stats["concurrency"] = concurrency
    stats["temperature"] = temperature
    stats["texts"] = [r.text for r in records]
    stats["error_messages"] = [r.error for r in records if r.error][:5]
    return stats


def record_dict(r: RequestRecord) -> dict[str, Any]:
    return asdict(r)
