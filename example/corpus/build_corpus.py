#!/usr/bin/env python3
"""Deterministic generator for the REAP-swap example calibration corpus.

Writes ``train.jsonl``, ``test.jsonl`` and ``README.md`` in ai-data-extraction JSONL
format (one conversation per line) across six domains: code, ops, math, writing,
general and research. All content comes from templates with randomized slots and
from programmatic code/math generation in this file; standard library only.

    python example/corpus/build_corpus.py [--out DIR] [--seed 7] [--per-domain 100]
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import random
import re
import statistics
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

Turn = dict[str, Any]
Template = Callable[[random.Random], list[Turn]]

DOMAINS = ("code", "ops", "math", "writing", "general", "research")
LANGS = ("python", "typescript", "rust", "go", "c", "sql")
LANG_NAME = {"python": "Python", "typescript": "TypeScript", "rust": "Rust", "go": "Go", "c": "C", "sql": "SQL"}
FENCE = {"python": "python", "typescript": "ts", "rust": "rust", "go": "go", "c": "c", "sql": "sql"}
SOURCES: dict[str, tuple[str, ...]] = {
    "claude-code": ("claude-sonnet-4-5", "claude-opus-4-1", "claude-haiku-4-5"),
    "cursor-composer": ("claude-sonnet-4-5", "gpt-5", "composer-1"),
    "codex": ("gpt-5-codex", "gpt-5"),
    "opencode": ("claude-sonnet-4-5", "qwen3-coder", "kimi-k2"),
    "windsurf": ("swe-1.5", "claude-sonnet-4-5", "gpt-5"),
    "trae": ("doubao-seed-code", "claude-sonnet-4", "gpt-5"),
}
BASE_MS = 1_704_067_200_000  # 2024-01-01T00:00:00Z
SPAN_MS = 640 * 86_400_000
OPENERS = ("", "", "", "", "", "Hi! ", "Hey, ", "Quick question: ", "Okay, so ", "Hello. ",
           "I could use a hand. ", "Hoping you can help. ", "So, ")
CLOSERS = ("", "", "", "", "", " Thanks!", " Thanks in advance.", " Appreciate it.",
           " Keep it reasonably short.", " Please be specific.", " No rush.", " Cheers.")
FOLLOW_LEADS = ("Thanks, that helps. ", "Great. Next one: ", "Got it. Another thing: ", "Makes sense. ",
                "OK. Related question: ", "Perfect, thank you. Also, ", "Nice. ", "That worked. ")
FOLLOWUP_CODE_LEADS = ("Thanks. ", "Nice, that works. ", "Great. ", "OK, next: ", "Follow-up: ", "Cool. ")


# ----------------------------------------------------------------------------- helpers
def U(text: str, ctx: list[dict[str, Any]] | None = None) -> Turn:
    """A user turn, optionally with Cursor-style code context."""
    turn: Turn = {"role": "user", "content": text}
    if ctx:
        turn["code_context"] = ctx
    return turn


def A(text: str, diffs: list[dict[str, str]] | None = None) -> Turn:
    """An assistant turn, optionally with suggested diffs."""
    turn: Turn = {"role": "assistant", "content": text}
    if diffs:
        turn["suggested_diffs"] = diffs
    return turn


def decap(s: str) -> str:
    """Lower-case the first letter unless it starts with the pronoun I or a code span."""
    if not s or s.startswith(("I ", "I'", "`")) or s[:2].isupper():
        return s
    return s[0].lower() + s[1:]


def strip_opener(text: str) -> str:
    for op in sorted(OPENERS, key=len, reverse=True):
        if op and text.lower().startswith(op.lower()):
            return text[len(op):]
    return text


def lead_in(lead: str, text: str) -> str:
    """Prefix a follow-up lead, fixing the capitalisation of what follows."""
    text = strip_opener(text)
    if lead.endswith(", "):
        return lead + decap(text)
    return lead + text[:1].upper() + text[1:]


def ask(rng: random.Random, text: str) -> str:
    """Wrap a user request with a varied opener/closer; occasionally all lower-case."""
    op = rng.choice(OPENERS)
    body = decap(text) if op.endswith((", ", "so ")) else text
    out = op + body + ("" if text.rstrip().endswith(":") else rng.choice(CLOSERS))
    if "`" not in out and "\n" not in out and rng.random() < 0.12:
        out = out.lower()
    return out


def pick(rng: random.Random, *options: str) -> str:
    """Choose one of several phrasings."""
    return rng.choice(options)


def fill(template: str, slots: dict[str, str]) -> str:
    """Replace @name@ placeholders (safe inside code that uses braces)."""
    for key, val in slots.items():
        template = template.replace(f"@{key}@", val)
    return template


def ident(lang: str, words: tuple[str, ...]) -> str:
    """Identifier in the naming convention of the language."""
    if lang in ("typescript", "go"):
        return words[0] + "".join(w.capitalize() for w in words[1:])
    return "_".join(words)


def fence(lang: str, code: str) -> str:
    return f"```{FENCE.get(lang, lang)}\n{code.rstrip()}\n```"


def num(x: float, nd: int = 2) -> str:
    """Format a number with thousands separators, trimming useless decimals."""
    if abs(x - round(x)) < 1e-9:
        return f"{int(round(x)):,}"
    return f"{x:,.{nd}f}"


def frac(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


_DRAWN: dict[str, list[Any]] = {}


def draw(rng: random.Random, key: str, items: list[Any]) -> Any:
    """Pick from a bank without replacement until it is exhausted, then reshuffle (fewer exact repeats)."""
    pool = _DRAWN.get(key)
    if not pool:
        pool = list(items)
        rng.shuffle(pool)
        _DRAWN[key] = pool
    return pool.pop()


def schedule(rng: random.Random, items: list[Any], n: int) -> list[Any]:
    """Balanced schedule: every item appears equally often (shuffled blocks)."""
    out: list[Any] = []
    while len(out) < n:
        block = list(items)
        rng.shuffle(block)
        out.extend(block)
    return out[:n]


# ----------------------------------------------------------------------------- code domain
CODE: dict[str, dict[str, tuple[str, str, str]]] = {
    "argmax": {
        "python": (r'''def @fn@(@xs@: list[float]) -> int:
    """Return the index of the largest value in @xs@."""
    if not @xs@:
        raise ValueError("@xs@ must not be empty")
    best_i, best_v = 0, @xs@[0]
    for i, v in enumerate(@xs@):
        if v > best_v:
            best_i, best_v = i, v
    return best_i
''', "best_i, best_v = 0, @xs@[0]", "best_i, best_v = 0, 0"),
        "typescript": (r'''export function @fn@(@xs@: number[]): number {
  if (@xs@.length === 0) throw new RangeError("@xs@ must not be empty");
  let bestI = 0;
  let bestV = @xs@[0];
  for (let i = 1; i < @xs@.length; i++) {
    if (@xs@[i] > bestV) {
      bestI = i;
      bestV = @xs@[i];
    }
  }
  return bestI;
}
''', "let bestV = @xs@[0];", "let bestV = 0;"),
        "rust": (r'''pub fn @fn@(@xs@: &[i64]) -> Option<usize> {
    let first = *@xs@.first()?;
    let mut best_i = 0;
    let mut best_v = first;
    for (i, &v) in @xs@.iter().enumerate().skip(1) {
        if v > best_v {
            best_i = i;
            best_v = v;
        }
    }
    Some(best_i)
}
''', "let mut best_v = first;", "let mut best_v = 0;"),
        "go": (r'''import "errors"

func @fn@(@xs@ []int) (int, error) {
	if len(@xs@) == 0 {
		return 0, errors.New("@xs@ must not be empty")
	}
	bestI, bestV := 0, @xs@[0]
	for i, v := range @xs@ {
		if v > bestV {
			bestI, bestV = i, v
		}
	}
	return bestI, nil
}
''', "bestI, bestV := 0, @xs@[0]", "bestI, bestV := 0, 0"),
        "c": (r'''#include <stddef.h>

/* Returns the index of the largest element, or -1 if len is 0. */
long @fn@(const int *@xs@, size_t len) {
    if (len == 0) return -1;
    size_t best_i = 0;
    int best_v = @xs@[0];
    for (size_t i = 1; i < len; i++) {
        if (@xs@[i] > best_v) {
            best_i = i;
            best_v = @xs@[i];
        }
    }
    return (long)best_i;
}
''', "int best_v = @xs@[0];", "int best_v = 0;"),
    },
    "chunk": {
        "python": (r'''def @fn@(@xs@: list, size: int) -> list[list]:
    """Split @xs@ into consecutive batches of at most `size` items."""
    if size <= 0:
        raise ValueError("size must be positive")
    return [@xs@[i:i + size] for i in range(0, len(@xs@), size)]
''', "range(0, len(@xs@), size)", "range(0, len(@xs@) - size, size)"),
        "typescript": (r'''export function @fn@<T>(@xs@: T[], size: number): T[][] {
  if (size <= 0) throw new RangeError("size must be positive");
  const out: T[][] = [];
  for (let i = 0; i < @xs@.length; i += size) {
    out.push(@xs@.slice(i, i + size));
  }
  return out;
}
''', "i < @xs@.length; i += size", "i + size <= @xs@.length; i += size"),
        "rust": (r'''pub fn @fn@<T: Clone>(@xs@: &[T], size: usize) -> Vec<Vec<T>> {
    assert!(size > 0, "size must be positive");
    let mut out = Vec::new();
    let mut start = 0;
    while start < @xs@.len() {
        let end = (start + size).min(@xs@.len());
        out.push(@xs@[start..end].to_vec());
        start = end;
    }
    out
}
''', "while start < @xs@.len()", "while start + size <= @xs@.len()"),
        "go": (r'''func @fn@(@xs@ []string, size int) [][]string {
	if size <= 0 {
		panic("size must be positive")
	}
	var out [][]string
	for start := 0; start < len(@xs@); start += size {
		end := min(start+size, len(@xs@))
		out = append(out, @xs@[start:end])
	}
	return out
}
''', "start < len(@xs@);", "start+size <= len(@xs@);"),
        "c": (r'''#include <stddef.h>

/* Sums consecutive groups of n elements into out; returns the number of groups. */
size_t @fn@(const int *@xs@, size_t len, size_t n, long *out) {
    if (n == 0) return 0;
    size_t groups = 0;
    for (size_t start = 0; start < len; start += n) {
        long sum = 0;
        size_t end = start + n < len ? start + n : len;
        for (size_t i = start; i < end; i++) sum += @xs@[i];
        out[groups++] = sum;
    }
    return groups;
}
''', "start < len; start += n", "start + n <= len; start += n"),
    },
    "movavg": {
        "python": (r'''def @fn@(@xs@: list[int], window: int) -> list[float]:
    """Moving average of @xs@ over `window` consecutive items."""
    if window <= 0 or window > len(@xs@):
        return []
    total = sum(@xs@[:window])
    out = [total / window]
    for i in range(window, len(@xs@)):
        total += @xs@[i] - @xs@[i - window]
        out.append(total / window)
    return out
''', "total / window", "total // window"),
        "typescript": (r'''export function @fn@(@xs@: number[], window: number): number[] {
  if (window <= 0 || window > @xs@.length) return [];
  let total = 0;
  for (let i = 0; i < window; i++) total += @xs@[i];
  const out = [total / window];
  for (let i = window; i < @xs@.length; i++) {
    total += @xs@[i] - @xs@[i - window];
    out.push(total / window);
  }
  return out;
}
''', "@xs@[i - window];", "@xs@[i - window + 1];"),
        "rust": (r'''pub fn @fn@(@xs@: &[i64], window: usize) -> Vec<f64> {
    if window == 0 || window > @xs@.len() {
        return Vec::new();
    }
    @xs@.windows(window)
        .map(|w| w.iter().sum::<i64>() as f64 / window as f64)
        .collect()
}
''', "w.iter().sum::<i64>() as f64 / window as f64", "(w.iter().sum::<i64>() / window as i64) as f64"),
        "go": (r'''func @fn@(@xs@ []int, window int) []float64 {
	if window <= 0 || window > len(@xs@) {
		return nil
	}
	out := make([]float64, 0, len(@xs@)-window+1)
	sum := 0
	for i, v := range @xs@ {
		sum += v
		if i >= window {
			sum -= @xs@[i-window]
		}
		if i >= window-1 {
			out = append(out, float64(sum)/float64(window))
		}
	}
	return out
}
''', "float64(sum)/float64(window)", "float64(sum/window)"),
        "c": (r'''#include <stddef.h>

/* Writes len - window + 1 averages into out; returns how many were written. */
size_t @fn@(const int *@xs@, size_t len, size_t window, double *out) {
    if (window == 0 || window > len) return 0;
    long sum = 0;
    size_t k = 0;
    for (size_t i = 0; i < len; i++) {
        sum += @xs@[i];
        if (i >= window) sum -= @xs@[i - window];
        if (i + 1 >= window) out[k++] = (double)sum / window;
    }
    return k;
}
''', "(double)sum / window", "sum / window"),
    },
    "wordcount": {
        "python": (r'''def @fn@(text: str) -> dict[str, int]:
    """Count case-insensitive word frequencies, ignoring edge punctuation."""
    counts: dict[str, int] = {}
    for word in text.lower().split():
        word = word.strip(".,;:!?\"'()")
        if word:
            counts[word] = counts.get(word, 0) + 1
    return counts
''', "text.lower().split()", 'text.lower().split(" ")'),
        "typescript": (r'''export function @fn@(text: string): Map<string, number> {
  const counts = new Map<string, number>();
  for (const raw of text.toLowerCase().split(/\s+/)) {
    const word = raw.replace(/^[^\p{L}\p{N}]+|[^\p{L}\p{N}]+$/gu, "");
    if (word) counts.set(word, (counts.get(word) ?? 0) + 1);
  }
  return counts;
}
''', r"split(/\s+/)", 'split(" ")'),
        "rust": (r'''use std::collections::HashMap;

pub fn @fn@(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for raw in text.split_whitespace() {
        let word = raw.trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase();
        if !word.is_empty() {
            *counts.entry(word).or_insert(0) += 1;
        }
    }
    counts
}
''', "text.split_whitespace()", "text.split(' ')"),
        "go": (r'''import "strings"

func @fn@(text string) map[string]int {
	counts := make(map[string]int)
	for _, raw := range strings.Fields(strings.ToLower(text)) {
		word := strings.Trim(raw, ".,;:!?\"'()")
		if word != "" {
			counts[word]++
		}
	}
	return counts
}
''', "strings.Fields(strings.ToLower(text))", 'strings.Split(strings.ToLower(text), " ")'),
        "c": (r'''#include <ctype.h>
#include <stddef.h>

/* Counts whitespace-separated words in s. */
size_t @fn@(const char *s) {
    size_t words = 0;
    int in_word = 0;
    for (; *s; s++) {
        if (isspace((unsigned char)*s)) {
            in_word = 0;
        } else if (!in_word) {
            in_word = 1;
            words++;
        }
    }
    return words;
}
''', "isspace((unsigned char)*s)", "*s == ' '"),
    },
}

TESTS: dict[str, dict[str, str]] = {
    "argmax": {
        "python": r'''import pytest
from @mod@ import @fn@

@pytest.mark.parametrize("values, expected", [
    ([3, 9, 4], 1),
    ([-5, -2, -9], 1),
    ([7], 0),
    ([2, 8, 8], 1),
])
def test_@fn@(values, expected):
    assert @fn@(values) == expected

def test_@fn@_rejects_empty():
    with pytest.raises(ValueError):
        @fn@([])
''',
        "typescript": r'''import { describe, expect, it } from "vitest";
import { @fn@ } from "./@mod@";

describe("@fn@", () => {
  it.each([
    [[3, 9, 4], 1],
    [[-5, -2, -9], 1],
    [[2, 8, 8], 1],
  ])("@fn@(%j) is %i", (input, expected) => {
    expect(@fn@(input)).toBe(expected);
  });
  it("throws on an empty array", () => {
    expect(() => @fn@([])).toThrow(RangeError);
  });
});
''',
        "rust": r'''#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_largest() {
        assert_eq!(@fn@(&[3, 9, 4]), Some(1));
    }

    #[test]
    fn all_negative() {
        assert_eq!(@fn@(&[-5, -2, -9]), Some(1));
    }

    #[test]
    fn empty_is_none() {
        assert_eq!(@fn@(&[]), None);
    }
}
''',
        "go": r'''func Test@Fn@(t *testing.T) {
	cases := []struct {
		name string
		in   []int
		want int
	}{
		{"mixed", []int{3, 9, 4}, 1},
		{"all negative", []int{-5, -2, -9}, 1},
		{"tie keeps first", []int{2, 8, 8}, 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := @fn@(tc.in)
			if err != nil || got != tc.want {
				t.Fatalf("got %d, %v; want %d", got, err, tc.want)
			}
		})
	}
}
''',
        "c": r'''#include <assert.h>
#include "@mod@.h"

int main(void) {
    int mixed[] = {3, 9, 4};
    int negative[] = {-5, -2, -9};
    assert(@fn@(mixed, 3) == 1);
    assert(@fn@(negative, 3) == 1);
    assert(@fn@(mixed, 0) == -1);
    return 0;
}
''',
    },
    "wordcount": {
        "python": r'''from @mod@ import @fn@

def test_counts_are_case_insensitive():
    assert @fn@("The cat saw the dog.") == {"the": 2, "cat": 1, "saw": 1, "dog": 1}

def test_splits_on_any_whitespace():
    assert @fn@("alpha\nbeta\tgamma") == {"alpha": 1, "beta": 1, "gamma": 1}

def test_empty_string():
    assert @fn@("") == {}
''',
        "typescript": r'''import { expect, test } from "vitest";
import { @fn@ } from "./@mod@";

test("counts are case-insensitive", () => {
  expect(Object.fromEntries(@fn@("The cat saw the dog."))).toEqual({ the: 2, cat: 1, saw: 1, dog: 1 });
});

test("splits on newlines and tabs", () => {
  expect([...@fn@("alpha\nbeta\tgamma").keys()]).toEqual(["alpha", "beta", "gamma"]);
});
''',
        "rust": r'''#[test]
fn splits_on_any_whitespace() {
    let counts = @fn@("alpha\nbeta\tgamma alpha");
    assert_eq!(counts.get("alpha"), Some(&2));
    assert_eq!(counts.len(), 3);
}

#[test]
fn strips_punctuation_and_case() {
    assert_eq!(@fn@("Stop. STOP!").get("stop"), Some(&2));
}
''',
        "go": r'''func Test@Fn@(t *testing.T) {
	got := @fn@("The cat\tsaw the\ndog.")
	want := map[string]int{"the": 2, "cat": 1, "saw": 1, "dog": 1}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
}
''',
        "c": r'''#include <assert.h>
#include "@mod@.h"

int main(void) {
    assert(@fn@("") == 0);
    assert(@fn@("one") == 1);
    assert(@fn@("  two\twords\n") == 2);
    assert(@fn@("a\n\nb  c") == 3);
    return 0;
}
''',
    },
}

TASKS: dict[str, dict[str, Any]] = {
    "argmax": {
        "names": [("index", "of", "max"), ("argmax",), ("find", "peak", "index"), ("max", "position"), ("largest", "index")],
        "xs": ["values", "readings", "scores", "samples", "prices", "latencies"],
        "things": ["temperature readings", "daily profit figures", "sensor offsets", "score deltas", "elevation changes"],
        "spec": "returns the index of the largest value in a list of @things@",
        "explain": "`@fn@` scans the input once and returns the position of its largest element. It keeps two pieces "
                   "of state: the index of the best element so far and that element's value. The best value is seeded "
                   "with the first element rather than a constant like 0, which keeps it correct when every value is "
                   "negative. Because the comparison is a strict `>`, ties resolve to the earliest index.",
        "notes": {"python": "Empty input raises `ValueError` instead of returning -1, which would silently index the last element.",
                  "typescript": "An empty array throws a `RangeError`; returning -1 would be too easy to misuse as an index.",
                  "rust": "`first()?` exits early with `None` for an empty slice, so the `Option<usize>` return type forces callers to handle that case.",
                  "go": "Following Go convention, the empty case is reported through the second `error` return value.",
                  "c": "C has no exceptions, so an empty array is reported as -1; that is why the return type is a signed `long` and not `size_t`."},
        "symptom": "It passes my tests, but for a batch where all the @things@ are negative it always returns 0.",
        "why": "The tracker for the best value starts at 0 instead of at the first element. When every value is negative, "
               "nothing is ever greater than 0, so the index never moves off 0. Seed it with the first element; the empty "
               "case is already handled before that line, so indexing it is safe.",
        "edge": ("I call it with an empty list", "The function checks for empty input before touching the first element."),
        "review": ["The all-negative case is the classic bug in this kind of loop, so pin it down with a test.",
                   "If this ever takes floating-point values, remember that comparisons with NaN are always false, so a leading NaN would be reported as the maximum. Decide whether to skip or reject NaNs."],
        "cx": ("O(n)", "O(1)", "it makes one pass and keeps constant extra state"),
    },
    "chunk": {
        "names": [("chunk",), ("batch", "items"), ("split", "batches"), ("chunked",), ("make", "batches")],
        "names_c": [("chunk", "sums"), ("batch", "totals"), ("group", "sums")],
        "xs": ["items", "rows", "records", "ids", "jobs", "paths"],
        "things": ["database rows", "upload jobs", "user IDs", "file paths", "queue messages"],
        "things_c": ["sensor samples", "byte counts", "order amounts"],
        "xs_c": ["samples", "sizes", "amounts"],
        "spec": "splits a list of @things@ into batches of `size` items, keeping a shorter final batch",
        "spec_c": "sums consecutive groups of `n` @things@ into an output array and returns the number of groups",
        "explain": "`@fn@` cuts the input into consecutive batches of at most `size` elements. It advances a start index "
                   "by the batch size and clamps the end index to the length, so the final batch can be shorter instead "
                   "of being dropped or reading past the end. A non-positive size is rejected up front because it would "
                   "otherwise loop forever.",
        "explain_c": "`@fn@` walks the array in consecutive groups of `n` elements, adds up each group and writes the sum "
                     "into `out`. The end of each group is clamped to `len`, so a shorter final group is still summed. The "
                     "return value says how many entries of `out` were written; the caller must provide room for "
                     "`(len + n - 1) / n` sums. `n == 0` returns 0 instead of looping forever.",
        "notes": {"python": "Slicing copies each batch, so mutating a batch later won't change the original list.",
                  "typescript": "It is generic over `T`, so the batch type is inferred from whatever array you pass in.",
                  "rust": "The `T: Clone` bound is needed because each batch is copied into its own `Vec`; if views are enough, `@xs@.chunks(size)` avoids the copies.",
                  "go": "Sub-slices share the original backing array, so nothing is copied, but appending to one batch can overwrite the start of the next.",
                  "c": "The caller owns `out` and the function never allocates, which keeps it usable in embedded code."},
        "symptom": "When the input doesn't divide evenly, the last few @things@ disappear. With 10 items and a size of 4 I only get two batches back.",
        "why": "The loop only starts a batch when a *full* batch still fits (`start + size <= len`). The leftover tail is "
               "shorter than the batch size, never satisfies that condition, and is silently dropped. Loop while the "
               "start index is below the length and clamp the end index instead.",
        "edge": ("the batch size is 0, or larger than the whole list", "A size of zero is rejected before the loop, and a size larger than the input simply yields one short batch."),
        "review": ["Validating the size up front is right; without it a zero size would spin forever.",
                   "If callers only iterate once, a lazy generator or iterator would avoid holding every batch in memory."],
        "cx": ("O(n)", "O(n)", "every element is copied into exactly one batch"),
        "cx_go": ("O(n)", "O(n/size)", "only slice headers are created; the elements themselves are shared"),
        "cx_c": ("O(n)", "O(1)", "sums go straight into the caller's buffer"),
    },
    "movavg": {
        "names": [("moving", "average"), ("rolling", "mean"), ("sliding", "avg"), ("smooth",), ("window", "means")],
        "xs": ["readings", "samples", "prices", "temps", "counts"],
        "things": ["daily sales figures", "temperature readings", "request counts", "closing prices", "heart-rate samples"],
        "spec": "computes the moving average of @things@ over a sliding window of `window` elements",
        "explain": "`@fn@` produces one average per full window, so `n` inputs and a window of `k` give `n - k + 1` "
                   "values. Instead of re-summing every window it keeps a running total: each step adds the element "
                   "entering the window and subtracts the one leaving it. A window that is empty or longer than the data "
                   "returns an empty result instead of failing.",
        "explain_rust": "`@fn@` uses the standard library's `windows(k)` iterator, which yields every overlapping slice of "
                        "length `k`. Each slice is summed and divided by `k` as a float, producing `n - k + 1` averages. "
                        "It is short and readable, but it re-sums every window, so it does O(n*k) work.",
        "notes": {"python": "Division uses `/`, so results are floats even when the inputs are integers.",
                  "typescript": "JavaScript numbers are doubles, so there is no integer-division trap, though huge totals can lose precision.",
                  "rust": "The `as f64` casts are required because Rust never converts between integer and float types implicitly.",
                  "go": "Go has no implicit numeric conversions, so both operands are converted with `float64(...)` before dividing.",
                  "c": "The `(double)` cast on `sum` forces floating-point division; without it the result would be truncated."},
        "symptom": "The averages come out as whole numbers. For [1, 2, 3, 4] with a window of 2 I expect 1.5, 2.5, 3.5 but get 1, 2, 3.",
        "symptom_typescript": "The first average is right, but after that the values drift and are wrong for every later window.",
        "why": "Both operands of the division are integers, so the division is done in integer arithmetic and truncated "
               "before the result ever becomes a float. Convert to floating point before dividing, not after.",
        "why_typescript": "When the window slides, you must subtract the element that just left it, which sits at `i - window`. "
                          "The code subtracts `i - window + 1`, an element that is still inside the window, so the running "
                          "total is off after the first step and the error compounds.",
        "edge": ("the window is bigger than the number of data points", "That case returns an empty result, because there is no complete window to average."),
        "review": ["Document that the output is shorter than the input (`n - window + 1` values); callers often zip it with timestamps and get off-by-one errors.",
                   "For long series of large floats the running total accumulates rounding error; recomputing it every few thousand steps keeps it honest."],
        "cx": ("O(n)", "O(n - k)", "the running total adds and subtracts each element once"),
        "cx_rust": ("O(n*k)", "O(n - k)", "each window is summed from scratch"),
    },
    "wordcount": {
        "names": [("word", "counts"), ("count", "words"), ("word", "freq"), ("tally", "words")],
        "xs": ["text"],
        "things": ["support tickets", "chat messages", "product reviews", "log lines", "survey answers"],
        "spec": "counts how often each word appears in a piece of text (case-insensitive, ignoring punctuation)",
        "spec_c": "counts the whitespace-separated words in a C string",
        "explain": "`@fn@` builds a frequency table. It lower-cases the text, splits it on runs of whitespace, strips "
                   "punctuation from both ends of each token and skips tokens that end up empty, such as a lone dash. "
                   "Each remaining word increments its entry in a map.",
        "explain_c": "`@fn@` counts words with a tiny state machine: `in_word` remembers whether the previous character "
                     "belonged to a word. A word is counted at each transition from whitespace to non-whitespace, so runs "
                     "of spaces, tabs or newlines never create extra words. The cast to `unsigned char` before `isspace` "
                     "avoids undefined behaviour for bytes above 127.",
        "notes": {"python": "`dict.get(word, 0) + 1` avoids a `KeyError`; `collections.Counter` would be a shorter alternative.",
                  "typescript": "The `u` flag with `\\p{L}` and `\\p{N}` makes the trimming Unicode-aware, so accented words survive.",
                  "rust": "`entry(word).or_insert(0)` does the lookup and the insert with a single hash operation.",
                  "go": "Incrementing a missing key works because the zero value of `int` is 0.",
                  "c": "It neither allocates nor modifies the string, so it is safe to call on string literals."},
        "symptom": "Words separated by a newline or a tab get counted as one word, so \"end\\nstart\" shows up as a single entry.",
        "why": "Splitting on a literal space only separates words at space characters. Newlines, tabs and carriage "
               "returns stay inside the tokens. Split on any run of whitespace instead.",
        "edge": ("the text is empty or only punctuation", "Empty tokens are skipped, so you get an empty result rather than a bogus entry for the empty string."),
        "review": ["Lower-casing is fine for English; for Turkish or German text, case folding is more robust.",
                   "Hyphenated words are treated as one token and apostrophes are kept. Make sure that matches what the report expects."],
        "cx": ("O(c)", "O(u)", "it touches each of the c characters once and stores one entry per distinct word (u of them)"),
        "cx_c": ("O(c)", "O(1)", "it only keeps a counter and a flag"),
    },
}
MODULES = ["stats", "batching", "metrics", "textutil", "ingest", "report", "helpers", "pipeline"]
PY_PKGS = ["app", "src", "pipeline", "tools", "service"]


def tget(task: str, key: str, lang: str) -> Any:
    """Task attribute with an optional per-language override (key_lang)."""
    t = TASKS[task]
    return t.get(f"{key}_{lang}", t[key])


def code_slots(rng: random.Random, task: str, lang: str) -> dict[str, str]:
    names = TASKS[task].get("names_c") if lang == "c" else None
    fn = ident(lang, rng.choice(names or TASKS[task]["names"]))
    mod = rng.choice(MODULES)
    path = {"python": f"{rng.choice(PY_PKGS)}/{mod}.py", "typescript": f"src/lib/{mod}.ts", "rust": f"src/{mod}.rs",
            "go": f"internal/{mod}/{mod}.go", "c": f"src/{mod}.c"}[lang]
    return {"fn": fn, "Fn": fn[0].upper() + fn[1:], "xs": rng.choice(tget(task, "xs", lang)), "mod": mod,
            "things": rng.choice(tget(task, "things", lang)), "path": path, "L": LANG_NAME[lang]}


def snippet(task: str, lang: str, s: dict[str, str], buggy: bool = False) -> str:
    code, good, bad = CODE[task][lang]
    if buggy:
        code = code.replace(good, bad)
    return fill(code, s)


def show_code(rng: random.Random, lang: str, s: dict[str, str], code: str, prompt: str, follow: bool = False) -> Turn:
    """User turn that shares code inline or as editor selection context (follow-ups just say 'it')."""
    if follow:
        return U(lead_in(rng.choice(FOLLOWUP_CODE_LEADS), prompt.replace("@here@", "it")))
    if rng.random() < 0.5:
        start = rng.randint(1, 120)
        end = start + code.count("\n") - 1
        ctx = [{"file": s["path"], "code": code, "range": {"selectionStartLineNumber": start, "selectionEndLineNumber": end}}]
        where = pick(rng, f"the selected code in `{s['path']}`", f"`{s['fn']}` (selected)", f"this function from `{s['path']}`")
        return U(ask(rng, prompt.replace("@here@", where)), ctx)
    return U(ask(rng, prompt.replace("@here@", "this")) + "\n\n" + fence(lang, code))


def c_write(rng: random.Random, task: str, lang: str, s: dict[str, str]) -> list[Turn]:
    spec = fill(tget(task, "spec", lang), s)
    q = pick(rng, f"Write a {s['L']} function `{s['fn']}` that {spec}.",
             f"I need a {s['L']} helper that {spec}. Call it `{s['fn']}`.",
             f"How would you write something in {s['L']} that {spec}? It's going into `{s['path']}`.",
             f"Can you give me an idiomatic {s['L']} implementation of a function that {spec}?")
    q += pick(rng, "", " Handle empty input sensibly.", " No external dependencies please.",
              " It runs in a hot loop, so avoid needless allocations.", " Include a short comment.")
    a = (pick(rng, "Here's a straightforward version:", f"Here is `{s['fn']}`:", "This should do it:", "Sure:")
         + "\n\n" + fence(lang, snippet(task, lang, s)) + "\n\n" + TASKS[task]["notes"][lang] + " "
         + pick(rng, "It runs in {0} time with {1} extra space.", "Complexity is {0} time, {1} extra memory.")
         .format(*tget(task, "cx", lang)[:2]))
    return [U(ask(rng, q)), A(a)]


def c_explain(rng: random.Random, task: str, lang: str, s: dict[str, str]) -> list[Turn]:
    q = pick(rng, "What does @here@ do? I inherited it from a teammate who left.",
             "Can you walk me through @here@ step by step?",
             "I'm new to " + s["L"] + ". Could you explain @here@ in plain terms?",
             "Explain @here@ to me, especially the loop logic.")
    a = fill(tget(task, "explain", lang), s) + "\n\n" + TASKS[task]["notes"][lang]
    return [show_code(rng, lang, s, snippet(task, lang, s), q), A(a)]


def c_bug(rng: random.Random, task: str, lang: str, s: dict[str, str]) -> list[Turn]:
    bad, good = snippet(task, lang, s, buggy=True), snippet(task, lang, s)
    q = fill(tget(task, "symptom", lang), s) + " " + pick(rng, "What's wrong with @here@?", "Can you find the bug in @here@?",
                                                          "Any idea why? Here's @here@.", "Please fix @here@.")
    diff = "".join(difflib.unified_diff(bad.splitlines(True), good.splitlines(True), f"a/{s['path']}", f"b/{s['path']}", n=1))
    fixed = [ln for ln in good.splitlines() if ln not in bad.splitlines()]
    a = (fill(tget(task, "why", lang), s) + "\n\n" + pick(rng, "The fix is one line:", "Change that line to:", "Corrected line:")
         + "\n\n" + fence(lang, "\n".join(fixed)) + "\n\n"
         + pick(rng, "After the change, add a test for exactly this input so it can't regress.",
                "It's worth adding a regression test with the input that exposed this.",
                "Everything else in the function looks fine."))
    return [show_code(rng, lang, s, bad, q), A(a, [{"file": s["path"], "diff": diff}])]


def c_tests(rng: random.Random, task: str, lang: str, s: dict[str, str], follow: bool = False) -> list[Turn]:
    if task not in TESTS:
        task = rng.choice(sorted(TESTS))
        s = code_slots(rng, task, lang)
    fw = {"python": "pytest", "typescript": "vitest", "rust": "the built-in test harness", "go": "the testing package",
          "c": "plain assert"}[lang]
    q = pick(rng, "Write unit tests for @here@.", f"Can you add {fw} tests for @here@? Cover the edge cases.",
             "I have no tests for @here@. What should I test, and can you write them?")
    a = (pick(rng, f"Here are tests using {fw}:", "These cover the normal path and the edges:", "A compact suite:")
         + "\n\n" + fence(lang, fill(TESTS[task][lang], s)) + "\n\n"
         + {"argmax": "The all-negative case is the important one: it catches a best-value tracker that starts at 0.",
            "wordcount": "The tab and newline cases catch implementations that split on a literal space."}[task])
    return [show_code(rng, lang, s, snippet(task, lang, s), q, follow), A(a)]


def c_review(rng: random.Random, task: str, lang: str, s: dict[str, str]) -> list[Turn]:
    q = pick(rng, "Review @here@ before I open a PR.", "Any feedback on @here@? Be picky.",
             "Is @here@ idiomatic " + s["L"] + "? What would you change?")
    pts = TASKS[task]["review"] + rng.sample(LANG_TIPS[lang], 2)
    rng.shuffle(pts)
    a = (pick(rng, "Overall this is solid. A few notes:", "Looks correct to me. Suggestions:", "Mostly good. Some points:")
         + "\n\n" + "\n".join(f"{i}. {p}" for i, p in enumerate(pts, 1)))
    return [show_code(rng, lang, s, snippet(task, lang, s), q), A(a)]


def c_complexity(rng: random.Random, task: str, lang: str, s: dict[str, str], follow: bool = False) -> list[Turn]:
    n = rng.choice([10_000, 250_000, 2_000_000, 50_000_000])
    t, sp, why = tget(task, "cx", lang)
    k = rng.choice([7, 30, 90, 365])
    q = pick(rng, f"What's the time and space complexity of @here@? Will it cope with {n:,} inputs?",
             f"Is @here@ going to be a bottleneck at about {n:,} elements?")
    ops = n * k if "k" in t else n
    speed = "well under a second" if ops < 5e8 else f"roughly {ops / 1e9:.1f} billion basic steps, which is noticeable"
    a = (f"Time is {t} and extra space is {sp}, because {why}. "
         + (f"With a window of {k}, {n:,} inputs means about {ops:,} additions, {speed}. " if "k" in t
            else f"For {n:,} inputs that's about {ops:,} basic steps, {speed}. ")
         + pick(rng, "Measure before optimizing, but I wouldn't expect this to dominate a profile.",
                "If it does show up in a profile, the allocation pattern is the first thing to look at.",
                "Memory, not CPU, is more likely to be your limit at that size."))
    return [show_code(rng, lang, s, snippet(task, lang, s), q, follow), A(a)]


def c_port(rng: random.Random, task: str, lang: str, s: dict[str, str]) -> list[Turn]:
    if lang == "c" and task in ("chunk", "wordcount"):  # the C variants have different semantics
        task = rng.choice(["argmax", "movavg"])
        s = code_slots(rng, task, lang)
    same = task in ("argmax", "movavg")
    src = rng.choice([x for x in LANGS[:5] if x != lang and (same or x != "c")])
    s_src = code_slots(rng, task, src)
    q = pick(rng, f"Port @here@ to {s['L']}.", f"We're rewriting this service in {s['L']}. How would @here@ look there?",
             f"Translate @here@ into idiomatic {s['L']}, please.")
    a = (pick(rng, f"Here's an idiomatic {s['L']} version:", f"In {s['L']} I'd write it like this:")
         + "\n\n" + fence(lang, snippet(task, lang, s)) + "\n\n" + TASKS[task]["notes"][lang])
    return [show_code(rng, src, s_src, snippet(task, src, s_src), q), A(a)]


def c_edge(rng: random.Random, task: str, lang: str, s: dict[str, str], follow: bool = False) -> list[Turn]:
    case, ans = TASKS[task]["edge"]
    q = pick(rng, f"What does @here@ do if {case}?", f"Does @here@ behave correctly when {case}?")
    a = ans + " " + TASKS[task]["notes"][lang] + "\n\n" + fill(tget(task, "explain", lang), s).split(". ")[0] + "."
    return [show_code(rng, lang, s, snippet(task, lang, s), q, follow), A(a)]


LANG_TIPS: dict[str, list[str]] = {
    "python": ["Type hints are good; running `mypy --strict` in CI keeps them honest.",
               "A short doctest in the docstring doubles as documentation and a test.",
               "Raising a specific exception, as you do, beats returning `None` and pushing checks onto every caller."],
    "typescript": ["Mark the parameter `readonly` to document that the input is never mutated.",
                   "Turning on `noUncheckedIndexedAccess` types indexed reads as `T | undefined`, which catches off-by-one reads at compile time.",
                   "Prefer a named export over a default export so editors auto-import it reliably."],
    "rust": ["Taking a slice rather than `&Vec<T>` lets callers pass arrays and sub-slices.",
             "Run `cargo clippy -- -D warnings` in CI; it flags manual loops that have an iterator equivalent.",
             "A doc comment with an `# Examples` section becomes a doctest that `cargo test` runs."],
    "go": ["Run `go vet` and `staticcheck` in CI; both are cheap and catch real bugs.",
           "A generic version constrained by `cmp.Ordered` (Go 1.21+) would also work for floats and strings.",
           "Table-driven tests with `t.Run` make it painless to add cases later."],
    "c": ["Compile with `-Wall -Wextra -Wconversion`; mixing `size_t` and `int` is where C bugs hide.",
          "Keep pointer parameters `const` whenever the function doesn't write through them.",
          "Run the tests under `-fsanitize=address,undefined` to catch out-of-bounds reads early."],
}

LANG_QA: dict[str, list[tuple[str, str]]] = {
    "python": [
        ("Getting this when I run the importer:\n```\nTraceback (most recent call last):\n  File \"@path@\", line @ln@, in load_rows\n"
         "    total += row[\"@field@\"]\nKeyError: '@field@'\n```\nThe CSV definitely has that column. What's going on?",
         "A `KeyError` means `row` has no key spelled exactly `'@field@'`. With CSV files the usual culprits are a byte-order "
         "mark at the start of the file (so the first header is really `'\\ufeff@field@'`), stray spaces in the header, or a "
         "different capitalisation. Print `list(row)` for the first row to see the real names.\n\nIf it's the BOM, open the "
         "file with `encoding=\"utf-8-sig\"`. For whitespace, normalise the headers once:\n\n```python\nreader = csv.DictReader(f)\n"
         "reader.fieldnames = [h.strip().lower() for h in reader.fieldnames]\n```\n\nAlso note that `DictReader` yields strings, "
         "so you'll want `int(row[\"@field@\"])` before adding it to a total."),
        ("My script fails with `RuntimeError: dictionary changed size during iteration` on line @ln@ of `@path@`. The loop "
         "goes over `@v@.items()` and deletes entries whose value is None. Why is that illegal?",
         "Deleting from a dict while iterating over a live view of it invalidates the iterator, and CPython detects that and "
         "raises instead of silently skipping keys. Iterate over a snapshot, or build a new dict:\n\n```python\n"
         "for key in list(@v@):\n    if @v@[key] is None:\n        del @v@[key]\n\n# or, usually clearer:\n"
         "@v@ = {k: v for k, v in @v@.items() if v is not None}\n```\n\nThe comprehension creates a new object, so if other "
         "code holds a reference to the old dict, use the first form, which mutates in place."),
        ("Should I use a dataclass, a TypedDict or a pydantic model for `@Type@` records that come in as JSON from an API?",
         "It depends on where the data is trusted. A `TypedDict` only describes the shape for the type checker: at runtime it's "
         "still a plain dict and nothing is validated. A `@dataclass` gives you a real class with attribute access, defaults "
         "and `frozen=True` if you want immutability, but it doesn't coerce or validate fields either. A pydantic model "
         "validates and converts at the boundary, which is what you want for untrusted API input.\n\nA common split: validate "
         "with pydantic where the JSON enters, then pass dataclasses or the models themselves through the rest of the code. "
         "If the payload is internal and already trusted, a TypedDict is the lightest option."),
    ],
    "typescript": [
        ("tsc complains `error TS2532: Object is possibly 'undefined'.` on `groups.get(key).push(@v@)` in `@path@`. "
         "I set the key two lines above, so it can't be undefined. How do I fix this properly?",
         "The compiler doesn't track that `set` and `get` refer to the same key, so `Map.get` is always typed as "
         "`T | undefined`. Rather than silencing it with `!`, restructure so the value is in a local:\n\n```ts\n"
         "let bucket = groups.get(key);\nif (!bucket) {\n  bucket = [];\n  groups.set(key, bucket);\n}\nbucket.push(@v@);\n```\n\n"
         "This also saves a second hash lookup. The non-null assertion `groups.get(key)!` works, but it turns a compile-time "
         "check into a potential runtime crash if the code above ever changes."),
        ("Why do I get `Property '@field@' does not exist on type '@Type@'` when I check `if (\"@field@\" in obj)` first? "
         "`@Type@` is a union of two interfaces.",
         "Narrowing with `in` only works when the property is declared on at least one member of the union. If neither "
         "interface mentions `@field@`, TypeScript has nothing to narrow to. Give the variants a discriminant instead:\n\n```ts\n"
         "type @Type@ =\n  | { kind: \"ok\"; @field@: string }\n  | { kind: \"error\"; message: string };\n\n"
         "if (obj.kind === \"ok\") {\n  console.log(obj.@field@); // narrowed\n}\n```\n\nDiscriminated unions also make `switch` "
         "statements exhaustive when you add a `never` check in the default branch."),
        ("I'm fetching @n@ URLs with `for (const u of urls) { results.push(await fetch(u)); }` and it's slow. Is `Promise.all` "
         "the answer? I don't want to hammer the server either.",
         "The loop awaits each request before starting the next, so total time is the sum of all latencies. `Promise.all` "
         "starts them all at once, which is fast but sends @n@ requests simultaneously. A small concurrency limit is the middle "
         "ground:\n\n```ts\nasync function mapLimit<T, R>(items: T[], limit: number, fn: (t: T) => Promise<R>): Promise<R[]> {\n"
         "  const out: R[] = new Array(items.length);\n  let next = 0;\n  const workers = Array.from({ length: limit }, async () => {\n"
         "    while (next < items.length) {\n      const i = next++;\n      out[i] = await fn(items[i]);\n    }\n  });\n"
         "  await Promise.all(workers);\n  return out;\n}\n```\n\nWith a limit of 5 to 10 you usually get most of the speed-up "
         "without tripping rate limits."),
    ],
    "rust": [
        ("Compiler says:\n```\nerror[E0502]: cannot borrow `@v@` as mutable because it is also borrowed as immutable\n"
         "  --> @path@:@ln@:13\n```\nI'm looping over `@v@.iter()` and pushing derived items onto `@v@` inside the loop.",
         "The iterator holds a shared borrow of `@v@` for the whole loop, and `push` needs an exclusive one. Rust rejects this "
         "because `push` can reallocate the vector and leave the iterator pointing at freed memory. Collect the new items "
         "first, then extend:\n\n```rust\nlet extra: Vec<_> = @v@.iter().filter_map(derive).collect();\n@v@.extend(extra);\n```\n\n"
         "If the new items must themselves be processed, iterate by index with `while i < @v@.len()`, which re-checks the length "
         "each time and only borrows briefly."),
        ("Getting `error[E0382]: borrow of moved value: `@v@`` after I pass `@v@` into `@fn@(@v@)` and then print it. "
         "In other languages that's fine. What's the Rust way?",
         "Passing a `String` or `Vec` by value moves ownership into the function, so the caller can't use it afterwards. "
         "You have three options. If the function only reads the data, change its signature to take a reference "
         "(`&str` or `&[T]`) and call `@fn@(&@v@)`; this is the usual fix. If it needs to modify it, take `&mut`. If it "
         "genuinely needs its own copy, call `@fn@(@v@.clone())`, accepting the allocation.\n\nPrefer borrowing: signatures "
         "that take `&str` instead of `String` also accept string literals and slices, so they're more flexible for callers."),
        ("When should a Rust library return `Result<T, Box<dyn Error>>` versus defining its own error enum? I'm writing "
         "a crate that parses `@Type@` files.",
         "For a library, define your own error type. Callers can then `match` on variants such as `Io`, `Syntax { line }` "
         "or `UnsupportedVersion` and react differently, which is impossible with an opaque `Box<dyn Error>`. The `thiserror` "
         "crate removes most of the boilerplate:\n\n```rust\n#[derive(Debug, thiserror::Error)]\npub enum ParseError {\n"
         "    #[error(\"I/O error: {0}\")]\n    Io(#[from] std::io::Error),\n    #[error(\"syntax error on line {line}\")]\n"
         "    Syntax { line: usize },\n}\n```\n\nIn binaries and tests, `anyhow::Result` or `Box<dyn Error>` is fine, because "
         "there you usually just report the error rather than handle individual cases."),
    ],
    "go": [
        ("Service crashes at startup with `panic: assignment to entry in nil map` from `@path@:@ln@`. The map is a field "
         "on my `@Type@` struct. What did I miss?",
         "A map field's zero value is `nil`. Reading from a nil map is fine, but writing to one panics. Struct literals "
         "like `@Type@{}` don't allocate the map for you. Initialise it in a constructor:\n\n```go\nfunc New@Type@() *@Type@ {\n"
         "\treturn &@Type@{@field@: make(map[string]int)}\n}\n```\n\nor lazily before the first write with "
         "`if s.@field@ == nil { s.@field@ = make(map[string]int) }`. If several goroutines write to it, also guard it with "
         "a `sync.Mutex`, because concurrent map writes are a fatal error too."),
        ("My worker program ends with `fatal error: all goroutines are asleep - deadlock!`. I send @n@ jobs on an "
         "unbuffered channel from main and the workers read them. Where's the deadlock?",
         "That message means every goroutine is blocked and none can make progress. The usual cause in this pattern is that "
         "main sends on the channel before the workers are started, or keeps waiting for results after every worker has "
         "exited. Start the workers first, close the jobs channel when you're done sending, and wait with a `WaitGroup`:\n\n"
         "```go\nvar wg sync.WaitGroup\nfor w := 0; w < 4; w++ {\n\twg.Add(1)\n\tgo func() {\n\t\tdefer wg.Done()\n"
         "\t\tfor j := range jobs {\n\t\t\thandle(j)\n\t\t}\n\t}()\n}\nfor i := 0; i < @n@; i++ {\n\tjobs <- i\n}\nclose(jobs)\nwg.Wait()\n```\n\n"
         "Without `close(jobs)`, the `range` loops never end and `wg.Wait()` blocks forever."),
        ("What's the right way to put a timeout on an outgoing HTTP request in Go? Right now `@fn@` just calls `http.Get` "
         "and sometimes hangs for minutes.",
         "`http.Get` uses the default client, which has no timeout at all. Use a context so the deadline propagates and "
         "callers can cancel:\n\n```go\nctx, cancel := context.WithTimeout(ctx, 5*time.Second)\ndefer cancel()\n"
         "req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)\nif err != nil {\n\treturn err\n}\n"
         "resp, err := client.Do(req)\nif err != nil {\n\treturn fmt.Errorf(\"fetch %s: %w\", url, err)\n}\ndefer resp.Body.Close()\n```\n\n"
         "Also create one shared `http.Client` with `Timeout` set as a safety net, and always close the body, otherwise "
         "connections aren't reused."),
    ],
    "c": [
        ("This segfaults and valgrind says `Invalid write of size 1` inside strcpy:\n```c\nchar *@v@;\nstrcpy(@v@, input);\n```\n"
         "It worked on my laptop. Why does it crash on the server?",
         "`@v@` is an uninitialised pointer, so `strcpy` writes to whatever address happens to be in it. On your laptop "
         "that garbage happened to point at writable memory; on the server it didn't. Both behaviours are undefined. "
         "Allocate space first, including the terminating NUL:\n\n```c\nsize_t len = strlen(input);\nchar *@v@ = malloc(len + 1);\n"
         "if (@v@ == NULL) return -1;\nmemcpy(@v@, input, len + 1);\n```\n\nOn POSIX systems `strdup(input)` does the same in "
         "one call. Remember to `free` it, and build with `-fsanitize=address` so this class of bug fails loudly on every machine."),
        ("Linking fails with `undefined reference to `@fn@'` even though I `#include <math.h>`. Command: "
         "`gcc -o report report.c`. What's missing?",
         "The header only declares `@fn@`; the implementation lives in the maths library, libm, which gcc doesn't link by "
         "default on Linux. Add `-lm` at the end of the command:\n\n```\ngcc -Wall -o report report.c -lm\n```\n\nOrder matters: "
         "libraries must come after the object files that use them, because the linker resolves symbols left to right. "
         "In a Makefile, put it in `LDLIBS += -lm` rather than `CFLAGS`."),
        ("What's the difference between `char *@v@ = \"hello\";` and `char @v@[] = \"hello\";`? The first one crashes when "
         "I do `@v@[0] = 'H';`.",
         "`char *@v@ = \"hello\"` makes a pointer to a string literal, which usually lives in read-only memory; writing "
         "through it is undefined behaviour and typically segfaults. `char @v@[] = \"hello\"` creates a writable array of six "
         "bytes (five letters plus the NUL) initialised with a copy of the literal, so modifying it is fine.\n\nThe habit "
         "that prevents this: declare pointers to literals as `const char *`, so the compiler rejects the write at compile "
         "time instead of letting it crash at run time."),
    ],
}


LANG_CONCEPTS: dict[str, list[tuple[str, str]]] = {
    "python": [
        ("What's the point of `async`/`await` in Python if it's still single-threaded? Would it speed up my script that calls "
         "an API @n@ times?",
         "Async code is single-threaded but doesn't sit idle while waiting on the network. With `await`, the event loop switches "
         "to another task whenever one is blocked on I/O, so @n@ HTTP calls can be in flight at once. For I/O-bound work like "
         "API calls that is a big speed-up; for CPU-bound work it does nothing, and you'd use `multiprocessing` instead.\n\n"
         "```python\nasync def fetch_all(urls):\n    async with httpx.AsyncClient(timeout=10) as client:\n"
         "        sem = asyncio.Semaphore(10)\n        async def one(u):\n            async with sem:\n"
         "                return (await client.get(u)).json()\n        return await asyncio.gather(*(one(u) for u in urls))\n```\n\n"
         "The semaphore caps concurrency at 10 so you don't overwhelm the API."),
        ("Can someone explain Python decorators? I see `@@functools.wraps` everywhere and don't get what it does.",
         "A decorator is a function that takes a function and returns a replacement, and `@deco` above a `def` is shorthand "
         "for `f = deco(f)`. The replacement usually wraps the original:\n\n```python\nimport functools, time\n\n"
         "def timed(fn):\n    @functools.wraps(fn)\n    def wrapper(*args, **kwargs):\n        start = time.perf_counter()\n"
         "        try:\n            return fn(*args, **kwargs)\n        finally:\n"
         "            print(f\"{fn.__name__} took {time.perf_counter() - start:.3f}s\")\n    return wrapper\n```\n\n"
         "`functools.wraps` copies the original's name, docstring and signature onto `wrapper`. Without it, every decorated "
         "function would show up as `wrapper` in tracebacks, logs and `help()`."),
    ],
    "typescript": [
        ("When should I use generics in TypeScript instead of `any`? I have a `@fn@` helper that returns whatever it's given.",
         "Use a generic whenever the output type depends on the input type. With `any`, the compiler forgets the type and "
         "everything downstream is unchecked:\n\n```ts\nfunction @fn@<T>(value: T): T {\n  return value;\n}\n\n"
         "const n = @fn@(42);        // n: number\nconst s = @fn@(\"hi\");      // s: string\n```\n\nIf you need to accept "
         "anything but don't care what it is, prefer `unknown` over `any`: it forces a type check before use. Constraints "
         "like `<T extends { id: string }>` let a generic function rely on specific properties."),
        ("What's the difference between `interface` and `type` in TypeScript? Our codebase mixes both for `@Type@`.",
         "For describing object shapes they are nearly interchangeable. The practical differences: interfaces can be reopened "
         "and merged (declaration merging), which library authors use to let consumers extend types, and they tend to give "
         "clearer error messages for object types. Type aliases can describe things interfaces can't: unions "
         "(`type Status = \"ok\" | \"error\"`), tuples, mapped and conditional types.\n\nA common team rule: `interface` for object "
         "shapes like `@Type@`, `type` for unions and computed types. Consistency matters more than which one you pick."),
    ],
    "rust": [
        ("I don't understand lifetimes. Why does `fn longest(a: &str, b: &str) -> &str` fail to compile with "
         "`missing lifetime specifier`?",
         "The returned reference must point into one of the inputs, but the compiler can't tell which, so it can't check that "
         "the result won't outlive the data it borrows. A lifetime parameter states the relationship:\n\n```rust\n"
         "fn longest<'a>(a: &'a str, b: &'a str) -> &'a str {\n    if a.len() >= b.len() { a } else { b }\n}\n```\n\n"
         "Read `'a` as 'the result lives no longer than both inputs'. Lifetimes don't change how long anything lives; they "
         "describe constraints so the borrow checker can reject dangling references. Most functions with a single reference "
         "input need no annotation because elision rules fill it in."),
        ("How should I share a `HashMap` between threads in Rust? `@v@` needs to be updated by several worker threads.",
         "Wrap it in `Arc<Mutex<...>>`: `Arc` gives shared ownership across threads and `Mutex` ensures only one thread mutates "
         "it at a time.\n\n```rust\nuse std::{collections::HashMap, sync::{Arc, Mutex}, thread};\n\n"
         "let @v@ = Arc::new(Mutex::new(HashMap::new()));\nlet handles: Vec<_> = (0..4).map(|i| {\n"
         "    let @v@ = Arc::clone(&@v@);\n    thread::spawn(move || {\n        @v@.lock().unwrap().insert(i, i * i);\n    })\n"
         "}).collect();\nfor h in handles { h.join().unwrap(); }\n```\n\nKeep the lock held briefly. If reads vastly "
         "outnumber writes, `RwLock` helps; for heavy contention, a concurrent map crate such as `dashmap` shards the locking."),
    ],
    "go": [
        ("How do I parse JSON into a struct in Go when some fields may be missing? `@Type@` has an optional `@field@`.",
         "Use struct tags to map JSON keys and a pointer (or `omitempty` on output) for optional fields, so you can tell "
         "'missing' from the zero value:\n\n```go\ntype @Type@ struct {\n\tID    string  `json:\"id\"`\n"
         "\t@Field@ *int `json:\"@field@,omitempty\"`\n}\n\nvar v @Type@\nif err := json.Unmarshal(data, &v); err != nil {\n"
         "\treturn fmt.Errorf(\"decode @Type@: %w\", err)\n}\nif v.@Field@ == nil {\n\t// field was absent\n}\n```\n\nFields "
         "must be exported (capitalised) for `encoding/json` to fill them. To reject unknown keys, use a `json.Decoder` with "
         "`DisallowUnknownFields()`."),
        ("When should a Go method have a pointer receiver vs a value receiver? My `@Type@` type mixes both.",
         "Use a pointer receiver when the method modifies the receiver, when the struct is large enough that copying it is "
         "wasteful, or when it contains something that must not be copied, such as a `sync.Mutex`. Value receivers suit small, "
         "immutable types like a `Point` or `time.Time`.\n\nThe usual advice is consistency: if any method of `@Type@` needs a "
         "pointer receiver, make them all pointer receivers. Mixing them affects which method sets satisfy an interface: a "
         "`@Type@` value doesn't implement an interface whose methods have pointer receivers, only `*@Type@` does."),
    ],
    "c": [
        ("How do I safely read a line of unknown length from stdin in C? `fgets` with a fixed buffer truncates long lines.",
         "On POSIX systems `getline` grows the buffer for you:\n\n```c\nchar *line = NULL;\nsize_t cap = 0;\nssize_t len;\n"
         "while ((len = getline(&line, &cap, stdin)) != -1) {\n    if (len > 0 && line[len - 1] == '\\n') line[--len] = '\\0';\n"
         "    process(line, (size_t)len);\n}\nfree(line);\n```\n\n`getline` reallocates `line` as needed and returns the "
         "length, so embedded NUL bytes don't confuse you. Free the buffer once at the end, not per iteration. On platforms "
         "without `getline`, loop over `fgets` and `realloc` until the chunk ends with a newline."),
        ("Why do people say never to return a pointer to a local variable in C? My `@fn@` returns `&buf[0]` and it seems to work.",
         "A local array lives in the function's stack frame, which is reclaimed when the function returns. The pointer still "
         "holds the old address, and the bytes may still be there by luck, until the next function call overwrites them. It "
         "'works' until it doesn't, often only in optimised builds.\n\nThe fixes: let the caller pass a buffer and its size "
         "(`int @fn@(char *out, size_t n)`), allocate with `malloc` and document that the caller must `free`, or use a "
         "`static` buffer if the function never needs to be reentrant. Compilers warn about this with `-Wreturn-local-addr`."),
    ],
}


def c_concept(rng: random.Random, task: str, lang: str, s: dict[str, str]) -> list[Turn]:
    bank = LANG_CONCEPTS[lang] + [LANG_QA[lang][2]]
    q, a = draw(rng, f"concept:{lang}", bank)
    field = rng.choice([("retry", "count"), ("discount",), ("parent", "id"), ("max", "age")])
    slots = dict(s, field=ident(lang, field), Field="".join(w.capitalize() for w in field),
                 Type=rng.choice(["Invoice", "Shipment", "Session", "Config", "Event"]), n=str(rng.choice([50, 200, 1000])),
                 v=ident(lang, rng.choice([("cache",), ("counts",), ("registry",)])))
    return [U(ask(rng, fill(q, slots).replace("@@", "@"))), A(fill(a, slots))]


def c_qa(rng: random.Random, task: str, lang: str, s: dict[str, str]) -> list[Turn]:
    q, a = draw(rng, f"qa:{lang}", LANG_QA[lang][:2])
    field = rng.choice([("user", "id"), ("order", "total"), ("created", "at"), ("status",), ("retry", "count")])
    slots = dict(s, field=ident(lang, field), Type=rng.choice(["Invoice", "Shipment", "Session", "Config", "Event"]),
                 v=ident(lang, rng.choice([("buf",), ("name",), ("entries",), ("pending",), ("out", "path")])),
                 ln=str(rng.randint(12, 240)), n=str(rng.choice([20, 50, 200, 1000])),
                 fn=rng.choice(["sqrt", "pow", "floor", "log10"]) if lang == "c" else s["fn"])
    return [U(ask(rng, fill(q, slots))), A(fill(a, slots))]


SCHEMAS = [
    dict(p="customers", g="country", c="orders", fk="customer_id", amt="total_cents", st="status", sv="refunded", noun="order"),
    dict(p="accounts", g="plan", c="invoices", fk="account_id", amt="amount_cents", st="state", sv="void", noun="invoice"),
    dict(p="stores", g="region", c="sales", fk="store_id", amt="revenue", st="channel", sv="online", noun="sale"),
    dict(p="members", g="city", c="loans", fk="member_id", amt="late_fee_cents", st="status", sv="overdue", noun="loan"),
    dict(p="drivers", g="depot", c="deliveries", fk="driver_id", amt="distance_m", st="outcome", sv="failed", noun="delivery"),
]


def sql_schema(sc: dict[str, str]) -> str:
    return (f"{sc['p']}(id, name, {sc['g']}, created_at)\n"
            f"{sc['c']}(id, {sc['fk']}, {sc['amt']}, {sc['st']}, created_at)")


def s_topn(rng: random.Random, sc: dict[str, str]) -> list[Turn]:
    n, d = rng.choice([3, 5, 10]), rng.choice([30, 90, 365])
    q = f"Tables:\n```\n{sql_schema(sc)}\n```\nFor each {sc['g']}, I want the top {n} {sc['p']} by summed {sc['amt']} over the last {d} days. Postgres."
    a = (f"Aggregate first, then rank inside each {sc['g']} with a window function:\n\n```sql\nWITH totals AS (\n"
         f"    SELECT p.id, p.name, p.{sc['g']}, SUM(c.{sc['amt']}) AS total\n    FROM {sc['p']} p\n"
         f"    JOIN {sc['c']} c ON c.{sc['fk']} = p.id\n    WHERE c.created_at >= now() - interval '{d} days'\n"
         f"    GROUP BY p.id, p.name, p.{sc['g']}\n), ranked AS (\n    SELECT *, ROW_NUMBER() OVER (PARTITION BY {sc['g']} ORDER BY total DESC) AS rn\n"
         f"    FROM totals\n)\nSELECT {sc['g']}, name, total\nFROM ranked\nWHERE rn <= {n}\nORDER BY {sc['g']}, total DESC;\n```\n\n"
         f"`ROW_NUMBER` breaks ties arbitrarily; use `RANK()` if tied {sc['p']} should all be included, which can return more than {n} rows per group.")
    return [U(ask(rng, q)), A(a)]


def s_monthly(rng: random.Random, sc: dict[str, str]) -> list[Turn]:
    year, k = rng.choice([2022, 2023, 2024]), rng.choice([10, 50, 100])
    q = (f"Need a monthly report from `{sc['c']}`: number of rows and sum of {sc['amt']} per month since {year}, excluding "
         f"{sc['st']} = '{sc['sv']}', and only months with more than {k} rows.")
    a = (f"```sql\nSELECT date_trunc('month', created_at) AS month,\n       COUNT(*) AS n,\n       SUM({sc['amt']}) AS total\n"
         f"FROM {sc['c']}\nWHERE created_at >= DATE '{year}-01-01'\n  AND {sc['st']} <> '{sc['sv']}'\nGROUP BY 1\n"
         f"HAVING COUNT(*) > {k}\nORDER BY 1;\n```\n\nThe row filter goes in `WHERE` (applied before grouping) and the month "
         f"filter in `HAVING` (applied after). One caveat: `<>` also drops rows where {sc['st']} is NULL; if those should "
         f"count, write `{sc['st']} IS DISTINCT FROM '{sc['sv']}'`.")
    return [U(ask(rng, q)), A(a)]


def s_groupby(rng: random.Random, sc: dict[str, str]) -> list[Turn]:
    q = (f"Postgres rejects this with `column \"p.name\" must appear in the GROUP BY clause or be used in an aggregate function`:\n"
         f"```sql\nSELECT p.{sc['g']}, p.name, COUNT(*)\nFROM {sc['p']} p JOIN {sc['c']} c ON c.{sc['fk']} = p.id\nGROUP BY p.{sc['g']};\n```\nWhy?")
    a = (f"Each output row represents one {sc['g']}, but a {sc['g']} has many {sc['p']}, so the database can't know which "
         f"`name` to show. Decide what you actually want:\n\n- keep each name separate: `GROUP BY p.{sc['g']}, p.id, p.name`\n"
         f"- one row per {sc['g']} with a list of names: `string_agg(DISTINCT p.name, ', ')`\n- one representative name: `min(p.name)`\n\n"
         f"MySQL without `ONLY_FULL_GROUP_BY` would silently pick an arbitrary name, which is why the same query may have "
         f"'worked' elsewhere.")
    return [U(ask(rng, q)), A(a)]


def s_slow(rng: random.Random, sc: dict[str, str]) -> list[Turn]:
    rows, secs, pid = rng.choice([12, 40, 85, 300]), rng.choice([4, 9, 22]), rng.randint(100, 99999)
    q = (f"This takes {secs} s on {rows}M rows:\n```sql\nSELECT * FROM {sc['c']} WHERE {sc['fk']} = {pid} "
         f"AND created_at >= now() - interval '7 days' ORDER BY created_at DESC;\n```\nEXPLAIN shows `Seq Scan on {sc['c']}`. How do I speed it up?")
    a = (f"A sequential scan means no index matches the filter, so Postgres reads all {rows} million rows. A composite "
         f"index with the equality column first and the range/sort column second serves both the filter and the ORDER BY:\n\n"
         f"```sql\nCREATE INDEX CONCURRENTLY idx_{sc['c']}_{sc['fk']}_created\n    ON {sc['c']} ({sc['fk']}, created_at DESC);\n```\n\n"
         f"`CONCURRENTLY` avoids locking writes while it builds. Afterwards run `EXPLAIN (ANALYZE, BUFFERS)` again; you should see "
         f"an Index Scan and no separate sort step. Also select only the columns you need instead of `*`.")
    return [U(ask(rng, q)), A(a)]


def s_leftjoin(rng: random.Random, sc: dict[str, str]) -> list[Turn]:
    q = (f"I want every row of {sc['p']}, including ones with no {sc['c']}, but this drops them:\n```sql\n"
         f"SELECT p.name, COUNT(c.id)\nFROM {sc['p']} p LEFT JOIN {sc['c']} c ON c.{sc['fk']} = p.id\n"
         f"WHERE c.{sc['st']} = '{sc['sv']}'\nGROUP BY p.name;\n```")
    a = (f"The `WHERE` clause runs after the join. For {sc['p']} without a match, every `c.` column is NULL, and "
         f"`NULL = '{sc['sv']}'` is not true, so those rows are filtered out, which turns the LEFT JOIN into an inner join. "
         f"Move the condition into the join:\n\n```sql\nSELECT p.name, COUNT(c.id)\nFROM {sc['p']} p\n"
         f"LEFT JOIN {sc['c']} c ON c.{sc['fk']} = p.id AND c.{sc['st']} = '{sc['sv']}'\nGROUP BY p.id, p.name;\n```\n\n"
         f"`COUNT(c.id)` counts only matched rows, so unmatched {sc['p']} show 0. Grouping by `p.id` also keeps two {sc['p']} with the same name apart.")
    return [U(ask(rng, q)), A(a)]


def s_dedupe(rng: random.Random, sc: dict[str, str]) -> list[Turn]:
    q = (f"A retry bug inserted duplicate rows into `{sc['c']}`: same {sc['fk']}, {sc['amt']} and created_at, different id. "
         f"How do I delete the duplicates but keep the oldest id, and stop it happening again?")
    a = (f"Number the rows within each duplicate group and delete everything after the first:\n\n```sql\nDELETE FROM {sc['c']}\n"
         f"WHERE id IN (\n    SELECT id FROM (\n        SELECT id, ROW_NUMBER() OVER (\n"
         f"            PARTITION BY {sc['fk']}, {sc['amt']}, created_at ORDER BY id) AS rn\n        FROM {sc['c']}\n    ) t\n"
         f"    WHERE rn > 1\n);\n```\n\nRun it as a `SELECT` first and check the count, ideally inside a transaction. Then "
         f"add a unique constraint so the database rejects future duplicates:\n\n```sql\nALTER TABLE {sc['c']}\n"
         f"    ADD CONSTRAINT {sc['c']}_dedupe UNIQUE ({sc['fk']}, {sc['amt']}, created_at);\n```\n\nBetter still, give "
         f"the client an idempotency key column and make that unique.")
    return [U(ask(rng, q)), A(a)]


CODE_TEMPLATES = [c_write, c_explain, c_bug, c_tests, c_review, c_complexity, c_port, c_edge, c_qa, c_concept]
SQL_TEMPLATES = [s_topn, s_monthly, s_groupby, s_slow, s_leftjoin, s_dedupe]


def code_followup(rng: random.Random, task: str, lang: str, s: dict[str, str]) -> list[Turn]:
    """A second user turn about the same function: tests, complexity, edge case or another language."""
    kinds = ["complexity", "edge", "other"] + (["tests"] if task in TESTS else [])
    kind = rng.choice(kinds)
    if kind == "other":
        other = rng.choice([x for x in LANGS[:5] if x != lang and (x != "c" or task in ("argmax", "movavg"))])
        s2 = dict(code_slots(rng, task, other), xs=s["xs"])
        q = pick(rng, f"Could you show the same thing in {LANG_NAME[other]}?", f"What would this look like in {LANG_NAME[other]}?")
        return [U(lead_in(rng.choice(FOLLOWUP_CODE_LEADS), q)),
                A(f"Sure, in {LANG_NAME[other]}:\n\n" + fence(other, snippet(task, other, s2)) + "\n\n" + TASKS[task]["notes"][other])]
    fn = {"complexity": c_complexity, "edge": c_edge, "tests": c_tests}[kind]
    return fn(rng, task, lang, s, follow=True)


def gen_code(rng: random.Random, n: int) -> list[tuple[list[Turn], list[str], str]]:
    """Code conversations, languages spread evenly; ids code-<lang>-NNNN."""
    langs = [LANGS[i % len(LANGS)] for i in range(n)]
    per_lang = {lg: schedule(rng, CODE_TEMPLATES if lg != "sql" else SQL_TEMPLATES, langs.count(lg)) for lg in LANGS}
    counters = {lg: 0 for lg in LANGS}
    out = []
    for lg in langs:
        tmpl = per_lang[lg][counters[lg]]
        counters[lg] += 1
        if lg == "sql":
            turns = tmpl(rng, rng.choice(SCHEMAS))
        else:
            task = rng.choice(sorted(CODE))
            s = code_slots(rng, task, lg)
            turns = tmpl(rng, task, lg, s)
            if rng.random() < 0.4 and tmpl in (c_write, c_explain, c_bug, c_review):
                turns += code_followup(rng, task, lg, s)
        out.append((turns, [f"lang:{lg}"], f"code-{lg}-{counters[lg]:04d}"))
    return out



# ----------------------------------------------------------------------------- ops domain
SVCS = ["billing-api", "ingest-worker", "search-svc", "auth-gateway", "report-runner", "media-resizer", "notifier"]
HOSTS = ["web-01", "db-02", "app-prod-3", "edge-fra-1", "build-runner-2", "worker-7"]
SITES = ["shop.example.com", "api.example.org", "status.example.net", "app.example.io", "portal.example.dev"]
NAMESPACES = ["prod", "staging", "payments", "data", "default"]


def o_top_ips(rng: random.Random) -> list[Turn]:
    n, path = rng.choice([5, 10, 20]), rng.choice(["/login", "/api/search", "/wp-admin", "/checkout", "/graphql"])
    q = pick(rng, f"The nginx access log at /var/log/nginx/access.log is huge. How do I get the top {n} client IPs hitting {path}?",
             f"Someone is hammering {path} on our server. Give me a one-liner that lists the {n} busiest client IPs from the access log.")
    a = (f"With the default combined log format the client IP is the first field:\n\n```bash\ngrep -F '\"GET {path}' /var/log/nginx/access.log \\\n"
         f"  | awk '{{print $1}}' | sort | uniq -c | sort -rn | head -n {n}\n```\n\n`uniq -c` only counts adjacent duplicates, "
         f"which is why the first `sort` is needed; the second sorts by count, highest first. To include rotated logs, use "
         f"`zcat -f /var/log/nginx/access.log*` as the input. If you're behind a load balancer, the first field is the "
         f"balancer's address and you need the `X-Forwarded-For` value instead, so log `$http_x_forwarded_for` first.")
    return [U(ask(rng, q)), A(a)]


def o_disk(rng: random.Random) -> list[Turn]:
    host, pct = rng.choice(HOSTS), rng.randint(91, 100)
    q = pick(rng, f"Root filesystem on {host} is at {pct}% and I can't tell what's eating it.",
             f"`df -h` on {host} shows / at {pct}%. Where do I start?")
    a = ("Work from the top down and stay on one filesystem:\n\n```bash\ndf -h /\nsudo du -xh --max-depth=1 / 2>/dev/null | sort -h | tail -n 15\n"
         "sudo du -xh --max-depth=1 /var 2>/dev/null | sort -h | tail\n```\n\nThe usual suspects are `/var/log` (check "
         "`journalctl --disk-usage`, then `sudo journalctl --vacuum-size=500M`), Docker (`docker system df`, then "
         "`docker system prune`), and core dumps.\n\nIf `du` adds up to much less than `df` reports, a process is holding "
         "a deleted file open. Find it with `sudo lsof +L1`; restarting that process (often a service whose log was "
         "rotated without `copytruncate`) frees the space immediately.")
    return [U(ask(rng, q)), A(a)]


def o_systemd(rng: random.Random) -> list[Turn]:
    svc, user, port = rng.choice(SVCS), rng.choice(["deploy", "svc", "app"]), rng.choice([8000, 8080, 9000, 5000])
    q = (f"Write me a systemd unit for {svc}. The binary is /opt/{svc}/bin/{svc}, it should run as user {user}, read "
         f"its environment from /etc/{svc}.env, listen on port {port}, and restart if it crashes.")
    a = (f"Save this as `/etc/systemd/system/{svc}.service`:\n\n```ini\n[Unit]\nDescription={svc}\nAfter=network-online.target\n"
         f"Wants=network-online.target\n\n[Service]\nType=simple\nUser={user}\nGroup={user}\nEnvironmentFile=/etc/{svc}.env\n"
         f"Environment=PORT={port}\nExecStart=/opt/{svc}/bin/{svc}\nRestart=on-failure\nRestartSec=5\nNoNewPrivileges=true\n"
         f"ProtectSystem=strict\nReadWritePaths=/var/lib/{svc}\n\n[Install]\nWantedBy=multi-user.target\n```\n\nThen:\n\n"
         f"```bash\nsudo systemctl daemon-reload\nsudo systemctl enable --now {svc}\njournalctl -u {svc} -f\n```\n\n"
         f"`ProtectSystem=strict` makes the filesystem read-only for the service except the listed paths; drop it if the "
         f"service writes elsewhere.")
    return [U(ask(rng, q)), A(a)]


DOCKERFILES = {
    "Python (FastAPI, requirements.txt)": ("FROM python:3.12-slim AS base\nENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1\n"
        "WORKDIR /app\nCOPY requirements.txt .\nRUN pip install --no-cache-dir -r requirements.txt\nCOPY . .\n"
        "RUN useradd --create-home appuser\nUSER appuser\nEXPOSE @port@\n"
        "CMD [\"uvicorn\", \"main:app\", \"--host\", \"0.0.0.0\", \"--port\", \"@port@\"]"),
    "Node (Express, package-lock.json)": ("FROM node:20-alpine AS deps\nWORKDIR /app\nCOPY package.json package-lock.json ./\n"
        "RUN npm ci --omit=dev\n\nFROM node:20-alpine\nWORKDIR /app\nENV NODE_ENV=production\n"
        "COPY --from=deps /app/node_modules ./node_modules\nCOPY . .\nUSER node\nEXPOSE @port@\nCMD [\"node\", \"server.js\"]"),
    "Go (single binary)": ("FROM golang:1.22 AS build\nWORKDIR /src\nCOPY go.mod go.sum ./\nRUN go mod download\nCOPY . .\n"
        "RUN CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o /out/@svc@ ./cmd/@svc@\n\n"
        "FROM gcr.io/distroless/static-debian12\nCOPY --from=build /out/@svc@ /@svc@\nUSER nonroot:nonroot\n"
        "EXPOSE @port@\nENTRYPOINT [\"/@svc@\"]"),
}


def o_dockerfile(rng: random.Random) -> list[Turn]:
    kind = draw(rng, "DOCKERFILES", sorted(DOCKERFILES))
    svc, port = rng.choice(SVCS), rng.choice([3000, 8000, 8080])
    q = pick(rng, f"Can you write a production Dockerfile for our {kind} service {svc}? It listens on {port}.",
             f"Our image for {svc} is 1.2 GB. It's a {kind} app on port {port}. How should the Dockerfile look?")
    a = (pick(rng, "Here's a lean version:", "Something like this:") + "\n\n```dockerfile\n"
         + fill(DOCKERFILES[kind], {"svc": svc, "port": str(port)}) + "\n```\n\nDependency manifests are copied before the "
         "source so the dependency layer stays cached when only code changes. It runs as a non-root user, and a "
         "`.dockerignore` with `.git`, `node_modules`, `__pycache__` and local env files keeps the build context small. "
         "Check the result with `docker image ls` and `docker history`.")
    return [U(ask(rng, q)), A(a)]


def o_compose(rng: random.Random) -> list[Turn]:
    svc, port, pg = rng.choice(SVCS), rng.choice([3000, 8000, 8080]), rng.choice([15, 16])
    q = (f"I need a docker-compose.yml for local dev: {svc} (built from the current directory, port {port}), "
         f"Postgres {pg} and Redis. The app must wait until Postgres is actually ready.")
    a = (f"```yaml\nservices:\n  {svc}:\n    build: .\n    ports:\n      - \"{port}:{port}\"\n    environment:\n"
         f"      DATABASE_URL: postgres://app:app@db:5432/app\n      REDIS_URL: redis://cache:6379/0\n    depends_on:\n"
         f"      db:\n        condition: service_healthy\n      cache:\n        condition: service_started\n  db:\n"
         f"    image: postgres:{pg}\n    environment:\n      POSTGRES_USER: app\n      POSTGRES_PASSWORD: app\n"
         f"      POSTGRES_DB: app\n    volumes:\n      - pgdata:/var/lib/postgresql/data\n    healthcheck:\n"
         f"      test: [\"CMD-SHELL\", \"pg_isready -U app\"]\n      interval: 5s\n      retries: 10\n  cache:\n"
         f"    image: redis:7\nvolumes:\n  pgdata:\n```\n\n`condition: service_healthy` makes compose wait for the "
         f"healthcheck, not just for the container to start. Inside the network, services reach each other by name "
         f"(`db`, `cache`), not `localhost`.")
    return [U(ask(rng, q)), A(a)]


def o_k8s_deploy(rng: random.Random) -> list[Turn]:
    svc, ns, rep = rng.choice(SVCS), rng.choice(NAMESPACES), rng.choice([2, 3, 4])
    port, ver, mem = rng.choice([8080, 8000, 9000]), f"1.{rng.randint(2, 19)}.{rng.randint(0, 9)}", rng.choice([256, 512, 1024])
    q = (f"Write a Kubernetes Deployment and Service for {svc} in namespace {ns}: image registry.example.com/{svc}:{ver}, "
         f"{rep} replicas, container port {port}, health endpoint /healthz, about {mem}Mi of memory.")
    a = (f"```yaml\napiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {svc}\n  namespace: {ns}\nspec:\n  replicas: {rep}\n"
         f"  selector:\n    matchLabels: {{app: {svc}}}\n  template:\n    metadata:\n      labels: {{app: {svc}}}\n    spec:\n"
         f"      containers:\n        - name: {svc}\n          image: registry.example.com/{svc}:{ver}\n          ports:\n"
         f"            - containerPort: {port}\n          readinessProbe:\n            httpGet: {{path: /healthz, port: {port}}}\n"
         f"            periodSeconds: 5\n          resources:\n            requests: {{cpu: 100m, memory: {mem}Mi}}\n"
         f"            limits: {{memory: {mem}Mi}}\n---\napiVersion: v1\nkind: Service\nmetadata:\n  name: {svc}\n  namespace: {ns}\n"
         f"spec:\n  selector: {{app: {svc}}}\n  ports:\n    - port: 80\n      targetPort: {port}\n```\n\nApply with "
         f"`kubectl apply -f {svc}.yaml` and watch `kubectl -n {ns} rollout status deploy/{svc}`. I left out a CPU limit "
         f"on purpose, since CPU throttling often hurts latency more than it helps.")
    return [U(ask(rng, q)), A(a)]


def o_crashloop(rng: random.Random) -> list[Turn]:
    svc, ns = rng.choice(SVCS), rng.choice(NAMESPACES)
    code = rng.choice([137, 1])
    q = pick(rng, f"After the last deploy, {svc} pods in {ns} are in CrashLoopBackOff. describe says Last State: Terminated, Exit Code {code}. How do I debug this?",
             f"{svc} keeps restarting in namespace {ns} (CrashLoopBackOff, exit code {code}). What should I check?")
    cause = ("Exit code 137 means the container was killed with SIGKILL, and in Kubernetes that is almost always the "
             "OOM killer: `describe` will show `Reason: OOMKilled`. Either the memory limit is too low for the new "
             "version or it leaks. Compare usage with `kubectl top pod` and raise `resources.limits.memory`, or profile it."
             if code == 137 else
             "Exit code 1 is the application exiting with an error, usually at startup: a missing environment variable, "
             "a config file that isn't mounted, or a database it can't reach. The previous container's logs will say which.")
    a = (f"Start with the evidence from the crashed container, not the new one:\n\n```bash\nkubectl -n {ns} describe pod -l app={svc} | sed -n '/Last State/,/Ready/p'\n"
         f"kubectl -n {ns} logs deploy/{svc} --previous --tail=100\nkubectl -n {ns} get events --sort-by=.lastTimestamp | tail -n 20\n```\n\n"
         f"{cause}\n\nIf you need it fixed now, `kubectl -n {ns} rollout undo deploy/{svc}` returns to the previous ReplicaSet while you investigate.")
    return [U(ask(rng, q)), A(a)]


def o_nginx(rng: random.Random) -> list[Turn]:
    site, port = rng.choice(SITES), rng.choice([3000, 8000, 8080, 5000])
    q = (f"Set up nginx as a reverse proxy for {site} to an app on 127.0.0.1:{port}. HTTPS with a Let's Encrypt "
         f"certificate, redirect HTTP, and websockets need to work.")
    a = (f"```nginx\nserver {{\n    listen 80;\n    server_name {site};\n    return 301 https://$host$request_uri;\n}}\n\n"
         f"server {{\n    listen 443 ssl;\n    http2 on;\n    server_name {site};\n\n    ssl_certificate     /etc/letsencrypt/live/{site}/fullchain.pem;\n"
         f"    ssl_certificate_key /etc/letsencrypt/live/{site}/privkey.pem;\n\n    location / {{\n        proxy_pass http://127.0.0.1:{port};\n"
         f"        proxy_http_version 1.1;\n        proxy_set_header Upgrade $http_upgrade;\n        proxy_set_header Connection \"upgrade\";\n"
         f"        proxy_set_header Host $host;\n        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;\n"
         f"        proxy_set_header X-Forwarded-Proto $scheme;\n        proxy_read_timeout 300s;\n    }}\n}}\n```\n\n"
         f"Get the certificate with `sudo certbot certonly --nginx -d {site}`, then `sudo nginx -t && sudo systemctl reload nginx`. "
         f"The `Upgrade`/`Connection` headers and HTTP/1.1 are what make websockets work; the long read timeout keeps idle sockets open.")
    return [U(ask(rng, q)), A(a)]


def o_502(rng: random.Random) -> list[Turn]:
    site, port, svc = rng.choice(SITES), rng.choice([3000, 8000, 8080]), rng.choice(SVCS)
    q = f"{site} suddenly returns 502 Bad Gateway. nginx is up, the upstream is {svc} on port {port}. Where do I look?"
    a = (f"A 502 means nginx reached out to the upstream and got nothing usable back. The error log tells you which kind "
         f"of failure:\n\n```bash\nsudo tail -n 50 /var/log/nginx/error.log\nsudo ss -tlnp | grep ':{port}'\n"
         f"systemctl status {svc}\ncurl -sv http://127.0.0.1:{port}/ -o /dev/null\n```\n\n- `connect() failed (111: Connection refused)`: "
         f"nothing listens on {port}; the service crashed or binds another port.\n- `upstream prematurely closed connection`: the app "
         f"died mid-request; check its logs.\n- `(13: Permission denied)` on RHEL-family systems: SELinux blocks nginx from "
         f"making network connections; `setsebool -P httpd_can_network_connect 1` fixes it.\n\nIf `curl` works locally but nginx "
         f"fails, compare the `proxy_pass` address with what `ss` shows, e.g. `localhost` resolving to `::1` while the app listens on IPv4 only.")
    return [U(ask(rng, q)), A(a)]


def o_git_undo(rng: random.Random) -> list[Turn]:
    n, branch = rng.randint(1, 4), rng.choice(["feature/invoices", "fix/login-timeout", "chore/deps", "exp/cache"])
    q = pick(rng, f"I made {n} commit(s) on main that should have gone to a new branch {branch}. Not pushed yet. How do I move them?",
             f"Oops: committed {n} time(s) to main locally instead of {branch}. Nothing is pushed. Fix?")
    a = (f"Since nothing is pushed, this is safe and local:\n\n```bash\ngit branch {branch}        # new branch at the current commit\n"
         f"git reset --hard HEAD~{n}        # move main back {n} commit(s)\ngit switch {branch}\n```\n\nThe commits aren't lost: "
         f"`{branch}` still points at them. Before the `reset --hard`, make sure `git status` is clean, because it discards "
         f"uncommitted changes. If main had been pushed already, don't rewrite it; instead use `git revert` for those commits "
         f"on main and cherry-pick them onto the branch.")
    return [U(ask(rng, q)), A(a)]


def o_git_reflog(rng: random.Random) -> list[Turn]:
    q = pick(rng, "I ran `git reset --hard` to the wrong commit and my last few commits are gone from `git log`. Can I get them back?",
             "Deleted a local branch with `git branch -D` that had unpushed work on it. Is it recoverable?")
    sha = "".join(rng.choice("0123456789abcdef") for _ in range(7))
    a = (f"Almost certainly. Git keeps every position HEAD has been at in the reflog for about 90 days:\n\n```bash\n"
         f"git reflog --date=relative | head -n 20\n```\n\nFind the line just before the mistake, for example "
         f"`{sha} HEAD@{{3}}: commit: ...`, and put a branch on it:\n\n```bash\ngit branch rescue {sha}\ngit log --oneline rescue | head\n```\n\n"
         f"Once you've confirmed it's the right work, merge or reset onto it. Creating a branch first is the safe move: "
         f"nothing is overwritten, and you can delete `rescue` later. Uncommitted changes that were discarded are a "
         f"different story; those never reached the object database unless they were staged.")
    return [U(ask(rng, q)), A(a)]


def o_git_conflict(rng: random.Random) -> list[Turn]:
    f1 = rng.choice(["src/config.ts", "app/models.py", "go.mod", "Cargo.lock", "package-lock.json", "README.md"])
    q = f"During `git rebase origin/main` I got `CONFLICT (content): Merge conflict in {f1}`. What's the cleanest way through this?"
    lock = f1.endswith(("lock", ".lock", "lock.json", "go.mod"))
    a = ("Resolve one commit at a time:\n\n```bash\ngit status                  # lists the conflicted files\n"
         f"git diff {f1}                 # shows <<<<<<< / ======= / >>>>>>> sections\n# edit the file, keep the right lines\n"
         f"git add {f1}\ngit rebase --continue\n```\n\nDuring a rebase the sides are swapped compared with a merge: `ours` is "
         "the upstream you're rebasing onto and `theirs` is your commit. "
         + (f"For a generated file like `{f1}`, don't hand-merge: take one side with `git checkout --theirs {f1}` and "
            "regenerate it with the package manager before `git add`. " if lock else
            "Run the tests before continuing, since a conflict-free file can still be semantically wrong. ")
         + "If it gets messy, `git rebase --abort` puts everything back as it was.")
    return [U(ask(rng, q)), A(a)]


CRON = [("every weekday at 6:30 in the morning", "30 6 * * 1-5"), ("every 15 minutes", "*/15 * * * *"),
        ("at 02:00 on the first day of every month", "0 2 1 * *"), ("every Sunday at 23:45", "45 23 * * 0"),
        ("at five past every hour from 9am to 5pm", "5 9-17 * * *"), ("twice a day, at midnight and noon", "0 0,12 * * *")]


def o_cron(rng: random.Random) -> list[Turn]:
    when, expr = rng.choice(CRON)
    script = rng.choice(["/opt/scripts/rotate_exports.sh", "/usr/local/bin/sync-reports", "/home/deploy/bin/cleanup.py"])
    q = pick(rng, f"How do I run {script} {when} with cron? It works when I run it by hand but I've heard cron is picky.",
             f"What's the crontab line for running {script} {when}?")
    a = (f"The schedule `{expr}` means {when}. In `crontab -e`:\n\n```cron\nSHELL=/bin/bash\nPATH=/usr/local/bin:/usr/bin:/bin\n"
         f"{expr} flock -n /tmp/{Path(script).stem}.lock {script} >> /var/log/{Path(script).stem}.log 2>&1\n```\n\nCron runs "
         f"with a minimal environment: a short `PATH`, no shell profile, and the user's home as working directory, which is "
         f"why scripts that work interactively fail there. Use absolute paths inside the script, redirect output to a log so "
         f"errors aren't lost, and `flock -n` prevents a slow run from overlapping the next one. Times are in the server's "
         f"time zone; check with `timedatectl`.")
    return [U(ask(rng, q)), A(a)]


def o_port(rng: random.Random) -> list[Turn]:
    svc, port, host = rng.choice(SVCS), rng.choice([8080, 9000, 5432, 6379, 3000]), rng.choice(HOSTS)
    q = f"{svc} on {host} answers `curl localhost:{port}` fine, but from another machine the connection times out. What am I missing?"
    a = (f"Check three layers, from the inside out:\n\n```bash\nsudo ss -tlnp | grep ':{port}'\n```\n\nIf the local address is "
         f"`127.0.0.1:{port}`, the service only listens on loopback; configure it to bind `0.0.0.0` (or the private IP). "
         f"Next, the host firewall:\n\n```bash\nsudo ufw status            # Debian/Ubuntu\nsudo firewall-cmd --list-all  # RHEL family\n"
         f"sudo ufw allow from 10.0.0.0/8 to any port {port} proto tcp\n```\n\nFinally, cloud security groups or network ACLs. "
         f"A timeout (rather than 'connection refused') usually means packets are dropped by a firewall; refused means they "
         f"arrive but nothing listens. `nc -vz {host} {port}` from the client side tells you which.")
    return [U(ask(rng, q)), A(a)]


def o_journal(rng: random.Random) -> list[Turn]:
    svc, h = rng.choice(SVCS), rng.choice([2, 6, 12, 24])
    q = pick(rng, f"How do I pull only the errors from {svc} for the last {h} hours with journalctl, and count them per hour?",
             f"Need to triage {svc} logs: errors in the past {h}h, grouped by hour. journald on Ubuntu.")
    a = (f"`-p err` filters by syslog priority (err and worse) and `--since` accepts relative times:\n\n```bash\n"
         f"journalctl -u {svc} -p err --since \"{h} hours ago\" --no-pager\n```\n\nTo count per hour, print short ISO "
         f"timestamps and cut them to the hour:\n\n```bash\njournalctl -u {svc} -p err --since \"{h} hours ago\" -o short-iso --no-pager \\\n"
         f"  | cut -c1-13 | sort | uniq -c\n```\n\nIf the app logs everything at info level with 'ERROR' in the text, "
         f"priority filtering won't catch it; use `--grep 'ERROR|Traceback'` instead. `-o json` plus `jq` is the robust route for anything fancier.")
    return [U(ask(rng, q)), A(a)]


def o_ssh(rng: random.Random) -> list[Turn]:
    user, host = rng.choice(["deploy", "ubuntu", "admin", "ci"]), rng.choice(HOSTS)
    q = f"`ssh {user}@{host}` fails with `Permission denied (publickey)`. My key is in ~/.ssh/authorized_keys on the server. Ideas?"
    a = (f"Get the client's view first: `ssh -v {user}@{host}` shows which keys it offers and whether the server rejects them. "
         f"On the server, the usual cause is permissions: sshd ignores `authorized_keys` if the directory or file is writable "
         f"by others.\n\n```bash\nsudo chown -R {user}:{user} /home/{user}/.ssh\nchmod 700 /home/{user}/.ssh\n"
         f"chmod 600 /home/{user}/.ssh/authorized_keys\nsudo journalctl -u ssh --since '10 min ago'\n```\n\nThe server log will "
         f"say 'Authentication refused: bad ownership or modes' if that's it. Other causes: the key is on one wrapped line, "
         f"the client offers a different key (pin it with `-i ~/.ssh/id_ed25519`), or `AllowUsers` in sshd_config excludes {user}.")
    return [U(ask(rng, q)), A(a)]


def o_backup(rng: random.Random) -> list[Turn]:
    src, dest, k = rng.choice(["/srv/uploads", "/var/lib/app", "/home/shared/docs"]), rng.choice(["/mnt/backup", "/backups"]), rng.choice([7, 14, 30])
    q = f"Write a bash script that backs up {src} to {dest} as a dated tarball every night and deletes archives older than {k} days."
    a = (f"```bash\n#!/usr/bin/env bash\nset -euo pipefail\n\nSRC=\"{src}\"\nDEST=\"{dest}\"\nKEEP_DAYS={k}\n"
         f"stamp=$(date +%F)\narchive=\"$DEST/$(basename \"$SRC\")-$stamp.tar.gz\"\n\nmkdir -p \"$DEST\"\n"
         f"tar -czf \"$archive.tmp\" -C \"$(dirname \"$SRC\")\" \"$(basename \"$SRC\")\"\nmv \"$archive.tmp\" \"$archive\"\n"
         f"find \"$DEST\" -name '*.tar.gz' -mtime +\"$KEEP_DAYS\" -delete\necho \"backup ok: $archive\"\n```\n\n"
         f"`set -euo pipefail` stops on the first error, so a failed `tar` never triggers the cleanup. Writing to a `.tmp` "
         f"name and renaming means a half-written archive never looks like a good one. Schedule it with cron or a systemd timer, "
         f"and test a restore now and then; a backup you've never restored is a hope, not a backup.")
    return [U(ask(rng, q)), A(a)]


def o_tls(rng: random.Random) -> list[Turn]:
    site, d = rng.choice(SITES), rng.choice([7, 14, 21])
    q = pick(rng, f"How can I check from the command line when the TLS certificate for {site} expires?",
             f"Want a check that warns me if the cert on {site} expires within {d} days. Shell is fine.")
    a = (f"`openssl` can fetch and decode the certificate:\n\n```bash\necho | openssl s_client -connect {site}:443 -servername {site} 2>/dev/null \\\n"
         f"  | openssl x509 -noout -enddate -issuer\n```\n\n`-servername` matters on hosts serving several sites; without SNI "
         f"you may get the default certificate. For a check that fails if it expires within {d} days:\n\n```bash\n"
         f"echo | openssl s_client -connect {site}:443 -servername {site} 2>/dev/null \\\n  | openssl x509 -noout -checkend $(({d}*86400)) \\\n"
         f"  || echo \"certificate for {site} expires within {d} days\"\n```\n\nIf it's a Let's Encrypt cert, `sudo certbot renew --dry-run` "
         f"verifies that automatic renewal will actually work.")
    return [U(ask(rng, q)), A(a)]


def o_load(rng: random.Random) -> list[Turn]:
    host, cpus = rng.choice(HOSTS), rng.choice([2, 4, 8, 16])
    load = round(cpus * rng.uniform(1.5, 6.0), 2)
    q = f"Load average on {host} is {load} and it has {cpus} cores. Users say it's sluggish. How do I find the cause?"
    a = (f"A load of {load} on {cpus} cores is about {load / cpus:.1f} runnable-or-waiting tasks per core, so work is queueing. "
         f"On Linux, load also counts tasks stuck in uninterruptible I/O, so first find out whether it's CPU or disk:\n\n"
         f"```bash\nvmstat 1 5          # high 'wa' = waiting on I/O, high 'us'/'sy' = CPU\nps -eo pid,stat,pcpu,pmem,comm --sort=-pcpu | head\n"
         f"iostat -x 1 3       # %util near 100 and high await = saturated disk\n```\n\nProcesses in state `D` in the `ps` output "
         f"are blocked on I/O. If it's CPU, the top of that list is your culprit; if it's I/O, `iotop` shows which process "
         f"is reading or writing. Check `dmesg -T | tail` too, in case the OOM killer or disk errors are involved.")
    return [U(ask(rng, q)), A(a)]


def o_dns(rng: random.Random) -> list[Turn]:
    site = rng.choice(SITES)
    zone = site.split(".", 1)[1]
    old, new = f"203.0.113.{rng.randint(2, 250)}", f"198.51.100.{rng.randint(2, 250)}"
    q = f"We moved {site} from {old} to {new} an hour ago. Some machines still resolve the old IP. How do I check and flush this?"
    a = (f"Compare what the authoritative server says with what resolvers have cached:\n\n```bash\ndig +short NS {zone}\n"
         f"dig +short {site} @$(dig +short NS {zone} | head -n1)   # authoritative answer\ndig {site}                       # note the TTL column\n```\n\n"
         f"If the authoritative answer is {new}, the rest is caching: resolvers keep the old record until its TTL runs "
         f"out. On a systemd-resolved machine, `resolvectl flush-caches` clears the local cache; browsers have their own. "
         f"Next time, lower the TTL to 300 seconds a day before the move so the switch propagates quickly.")
    return [U(ask(rng, q)), A(a)]


OPS_TEMPLATES: list[Template] = [o_top_ips, o_disk, o_systemd, o_dockerfile, o_compose, o_k8s_deploy, o_crashloop, o_nginx,
                                 o_502, o_git_undo, o_git_reflog, o_git_conflict, o_cron, o_port, o_journal, o_ssh,
                                 o_backup, o_tls, o_load, o_dns]


# ----------------------------------------------------------------------------- math domain
NAMES = ["Maya", "Omar", "Lena", "Tomás", "Priya", "Jonas", "Aiko", "Grace", "Dmitri", "Fatima", "Leo", "Nia"]


def par(v: int | Fraction) -> str:
    """Parenthesize negative numbers: -2 -> '(-2)'."""
    return f"({frac(Fraction(v))})" if v < 0 else frac(Fraction(v))


def poly_str(coeffs: list[int] | list[Fraction]) -> str:
    """coeffs[i] is the coefficient of x^i; returns e.g. '3x^3 - 2x + 5'."""
    terms = []
    for i in range(len(coeffs) - 1, -1, -1):
        c = coeffs[i]
        if c == 0:
            continue
        mag = abs(c)
        ms = str(mag) if Fraction(mag).denominator == 1 else f"({mag})"
        body = ("" if mag == 1 and i > 0 else ms) + ("x" if i >= 1 else "") + (f"^{i}" if i > 1 else "")
        terms.append(("-" if c < 0 else "+", body))
    if not terms:
        return "0"
    head = ("-" if terms[0][0] == "-" else "") + terms[0][1]
    return head + "".join(f" {s} {b}" for s, b in terms[1:])


def steps(lines: list[str]) -> str:
    return "\n".join(f"{i}. {ln}" for i, ln in enumerate(lines, 1))


def m_discount(rng: random.Random) -> list[Turn]:
    item, price = rng.choice(["jacket", "bike helmet", "blender", "pair of boots", "desk lamp"]), rng.choice([48, 79.99, 120, 249, 64.5])
    d, t = rng.choice([15, 20, 25, 30, 40]), rng.choice([5, 6.5, 8, 8.25, 10])
    after = price * (100 - d) / 100
    final = after * (100 + t) / 100
    q = f"A {item} costs ${num(price)}. It's on sale for {d}% off, and then {num(t)}% sales tax is added. What do I pay at the register?"
    a = steps([f"Discount: {d}% of ${num(price)} = ${price * d / 100:,.2f}.",
               f"Sale price: ${num(price)} - ${price * d / 100:,.2f} = ${after:,.2f}.",
               f"Tax: {num(t)}% of ${after:,.2f} = ${after * t / 100:,.2f}.",
               f"Total: ${after:,.2f} + ${after * t / 100:,.2f} = ${final:,.2f}."])
    a += (f"\n\nYou pay about **${final:,.2f}**. Note the order doesn't matter: multiplying by {1 - d / 100:g} and by "
          f"{1 + t / 100:g} gives the same result either way, but the discount and tax percentages can't simply be added.")
    return [U(ask(rng, q)), A(a)]


def m_pipes(rng: random.Random) -> list[Turn]:
    a_h, b_h = rng.choice([(3, 6), (4, 12), (2, 3), (5, 20), (6, 10)])
    drain = rng.choice([None, 12, 15, 30])
    rate = Fraction(1, a_h) + Fraction(1, b_h) - (Fraction(1, drain) if drain else 0)
    t = 1 / rate
    h, mins = int(t), (t - int(t)) * 60
    q = (f"Pipe A fills a tank in {a_h} hours and pipe B fills it in {b_h} hours."
         + (f" A drain at the bottom empties a full tank in {drain} hours and is accidentally left open." if drain else "")
         + " If everything runs together starting from empty, how long until the tank is full?")
    lines = [f"Pipe A fills 1/{a_h} of the tank per hour, pipe B fills 1/{b_h}."]
    if drain:
        lines.append(f"The drain removes 1/{drain} per hour.")
    lines += [f"Net rate: {' + '.join(f'1/{x}' for x in (a_h, b_h))}{f' - 1/{drain}' if drain else ''} = {frac(rate)} tank per hour.",
              f"Time = 1 / ({frac(rate)}) = {frac(t)} hours" + (f" = {h} h {float(mins):.0f} min." if t.denominator != 1 else ".")]
    about = f" (about {float(t):.2f} h)" if t.denominator != 1 else ""
    return [U(ask(rng, q)), A("Work with rates (tanks per hour), which add up:\n\n" + steps(lines)
                              + f"\n\nSo it takes **{frac(t)} hours**{about}.")]


def m_trains(rng: random.Random) -> list[Turn]:
    d, v1, v2, lag = rng.choice([300, 420, 510, 600]), rng.choice([80, 90, 100, 120]), rng.choice([60, 75, 110]), rng.choice([0, 30, 60])
    c1, c2 = rng.sample(["Lyon", "Leeds", "Dresden", "Porto", "Graz", "Utrecht", "Turin"], 2)
    head = Fraction(v1 * lag, 60)
    t2 = (d - head) / (v1 + v2)
    total1 = t2 + Fraction(lag, 60)
    q = (f"A train leaves {c1} toward {c2} at {v1} km/h. "
         + (f"{lag} minutes later, " if lag else "At the same time, ")
         + f"another leaves {c2} toward {c1} at {v2} km/h. The cities are {d} km apart. When and where do they meet?")
    lines = ([f"In the first {lag} minutes the first train covers {v1} x {lag}/60 = {num(float(head))} km, leaving {num(float(d - head))} km."] if lag else [])
    lines += [f"Once both move, the gap closes at {v1} + {v2} = {v1 + v2} km/h.",
              f"Time until they meet: {num(float(d - head))} / {v1 + v2} = {float(t2):.3f} h (about {float(t2) * 60:.0f} minutes) after the second train leaves.",
              f"The first train has then travelled {v1} x {float(total1):.3f} = {float(v1 * total1):.1f} km from {c1}."]
    return [U(ask(rng, q)), A(steps(lines) + f"\n\nThey meet about **{float(v1 * total1):.1f} km from {c1}** "
                              f"({float(d - v1 * total1):.1f} km from {c2}). Check: the two distances add up to {d} km.")]


def m_linear(rng: random.Random) -> list[Turn]:
    a, c = rng.sample([-5, -3, -2, 2, 3, 4, 6, 7], 2)
    b, d = rng.choice([i for i in range(-20, 21) if i]), rng.choice([i for i in range(-20, 21) if i])
    x = Fraction(d - b, a - c)
    lhs, rhs = poly_str([b, a]), poly_str([d, c])
    q = pick(rng, f"Solve for x: {lhs} = {rhs}.", f"How do I solve {lhs} = {rhs}? Show the steps.")
    move = f"Subtract {c}x from both sides" if c > 0 else f"Add {-c}x to both sides"
    const = f"Subtract {b} from both sides" if b > 0 else f"Add {-b} to both sides"
    a_txt = steps([f"{move}: {poly_str([b, a - c])} = {d}.", f"{const}: {poly_str([0, a - c])} = {d - b}.",
                   f"Divide by {a - c}: x = {frac(x)}.",
                   f"Check: {a}·{par(x)} + {par(b)} = {frac(a * x + b)} and {c}·{par(x)} + {par(d)} = {frac(c * x + d)}, so both sides agree."])
    return [U(ask(rng, q)), A(a_txt + f"\n\nSo **x = {frac(x)}**" + (f" (about {float(x):.3f})." if x.denominator != 1 else "."))]


def fac(r: int) -> str:
    return "x" if r == 0 else f"(x - {r})" if r > 0 else f"(x + {-r})"


def m_quadratic(rng: random.Random) -> list[Turn]:
    k, r1, r2 = rng.choice([1, 1, 2, 3]), rng.randint(-7, 7), rng.randint(-7, 7)
    b, c = -k * (r1 + r2), k * r1 * r2
    disc = b * b - 4 * k * c
    eq = poly_str([c, b, k]) + " = 0"
    q = pick(rng, f"Find the roots of {eq}.", f"Solve {eq} using the quadratic formula, please.")
    roots = sorted({r1, r2})
    a = steps([f"Identify a = {k}, b = {b}, c = {c}.", f"Discriminant: b^2 - 4ac = {b * b} - {par(4 * k * c)} = {disc}.",
               f"x = (-b ± sqrt({disc})) / (2*{k}) = ({-b} ± {math.isqrt(disc)}) / {2 * k}.",
               "Roots: " + " and ".join(f"x = {r}" for r in roots) + "."])
    extra = ("The discriminant is 0, so there is a single repeated root." if disc == 0 else
             f"Check by factoring: {k if k != 1 else ''}{fac(r1)}{fac(r2)} expands back to the original.")
    return [U(ask(rng, q)), A(a + "\n\n" + extra)]


def m_system(rng: random.Random) -> list[Turn]:
    x, y = rng.randint(-6, 9), rng.randint(-6, 9)
    a1, b1, a2, b2 = rng.choice([(2, 3, 1, -1), (3, 2, 5, -4), (1, 4, 2, 1), (4, -1, 3, 2), (5, 2, 2, 3)])
    c1, c2 = a1 * x + b1 * y, a2 * x + b2 * y
    eqs = f"{a1}x + {b1}y = {c1} and {a2}x + {b2}y = {c2}".replace("+ -", "- ")
    eqs = re.sub(r"(?<![\d.])1(?=[xy])", "", eqs)
    q = f"Solve the system {eqs}."
    m1, m2 = a2, a1
    lines = [f"Multiply the first equation by {m1} and the second by {m2} so the x terms match: "
             f"{a1 * m1}x + {b1 * m1}y = {c1 * m1} and {a2 * m2}x + {b2 * m2}y = {c2 * m2}.",
             f"Subtract: ({b1 * m1} - {par(b2 * m2)})y = {c1 * m1} - {par(c2 * m2)}, so {b1 * m1 - b2 * m2}y = {c1 * m1 - c2 * m2} and y = {y}.",
             f"Substitute into the first equation: {a1}x + {b1}({y}) = {c1}, so {a1}x = {c1 - b1 * y} and x = {x}.",
             f"Check in the second: {a2}({x}) + {b2}({y}) = {c2}."]
    body = re.sub(r"(?<![\d.])1(?=[xy])", "", steps(lines).replace("+ -", "- "))
    return [U(ask(rng, q)), A("Elimination works well here.\n\n" + body + f"\n\n**x = {x}, y = {y}.**")]


def m_derivative(rng: random.Random) -> list[Turn]:
    co = [rng.randint(-9, 9), rng.randint(-6, 6), rng.randint(-5, 5), rng.choice([1, 2, -1, 3])]
    x0 = rng.randint(-3, 3)
    d = [i * co[i] for i in range(1, 4)]
    fx = sum(c * x0 ** i for i, c in enumerate(co))
    slope = sum(c * x0 ** i for i, c in enumerate(d))
    q = pick(rng, f"What is the derivative of f(x) = {poly_str(co)}, and what's the equation of the tangent line at x = {x0}?",
             f"Differentiate f(x) = {poly_str(co)} and find the tangent at x = {x0}.")
    icpt = fx - slope * x0
    a = steps([f"Power rule term by term: f'(x) = {poly_str(d)}.", f"Slope at x = {x0}: f'({x0}) = {slope}.",
               f"Point on the curve: f({x0}) = {fx}.", f"Tangent: y - {fx} = {slope}(x - {x0}), i.e. y = {poly_str([icpt, slope])}."])
    return [U(ask(rng, q)), A(a.replace("- -", "+ ").replace("(x - -", "(x + "))]


def m_integral(rng: random.Random) -> list[Turn]:
    co = [rng.randint(-5, 6), rng.randint(-4, 4), rng.choice([1, 2, 3, -1])]
    lo, hi = sorted(rng.sample(range(-2, 5), 2))
    anti = [Fraction(0)] + [Fraction(c, i + 1) for i, c in enumerate(co)]
    F = lambda v: sum(c * v ** i for i, c in enumerate(anti))  # noqa: E731
    val = F(hi) - F(lo)
    anti_s = poly_str(anti)
    q = f"Evaluate the definite integral of {poly_str(co)} from x = {lo} to x = {hi}."
    a = steps([f"Antiderivative: F(x) = {anti_s}.", f"F({hi}) = {frac(F(hi))}.", f"F({lo}) = {frac(F(lo))}.",
               f"Integral = F({hi}) - F({lo}) = {frac(val)}" + (f" ≈ {float(val):.4f}." if val.denominator != 1 else ".")])
    note = ("The result is negative, so on this interval more of the area lies below the x-axis than above it." if val < 0 else
            "Differentiating F(x) gives back the integrand, which is a quick way to check the antiderivative.")
    return [U(ask(rng, q)), A("By the fundamental theorem of calculus:\n\n" + a.replace("+ (-", "- (") + "\n\n" + note)]


def m_balls(rng: random.Random) -> list[Turn]:
    r, b = rng.randint(3, 9), rng.randint(2, 8)
    col1, col2, box = rng.choice([("red", "blue", "bag"), ("green", "yellow", "jar"), ("white", "black", "box")])
    n = r + b
    p_both = Fraction(r, n) * Fraction(r - 1, n - 1)
    p_mix = 2 * Fraction(r, n) * Fraction(b, n - 1)
    q = (f"A {box} has {r} {col1} and {b} {col2} marbles. I draw two without putting the first back. What's the probability "
         f"both are {col1}? And that I get one of each?")
    a = steps([f"P(first {col1}) = {r}/{n}; then {r - 1} {col1} remain out of {n - 1}.",
               f"P(both {col1}) = {r}/{n} x {r - 1}/{n - 1} = {frac(p_both)} ≈ {float(p_both):.3f}.",
               f"One of each can happen as {col1}-then-{col2} or {col2}-then-{col1}: 2 x ({r}/{n} x {b}/{n - 1}) = {frac(p_mix)} ≈ {float(p_mix):.3f}."])
    ratio = f"{math.comb(r, 2)}/{math.comb(n, 2)}"
    return [U(ask(rng, q)), A(a + f"\n\nSame answer with combinations: C({r},2)/C({n},2) = {ratio}"
                              + ("" if ratio == frac(p_both) else f" = {frac(p_both)}") + ".")]


def m_dice(rng: random.Random) -> list[Turn]:
    n, face = rng.randint(2, 8), rng.choice([6, 1])
    p = 1 - Fraction(5, 6) ** n
    need = next(k for k in range(1, 50) if 1 - (5 / 6) ** k > 0.5)
    q = f"If I roll a fair die {n} times, what's the chance of getting at least one {face}? How many rolls until it's better than even odds?"
    a = steps([f"Use the complement: P(no {face} in one roll) = 5/6.", f"P(no {face} in {n} rolls) = (5/6)^{n} = {frac(Fraction(5, 6) ** n)} ≈ {float(Fraction(5, 6) ** n):.4f}.",
               f"P(at least one) = 1 - {float(Fraction(5, 6) ** n):.4f} ≈ {float(p):.4f}, about {float(p) * 100:.1f}%.",
               f"Better than 50% first happens at n = {need}, since (5/6)^{need} ≈ {(5 / 6) ** need:.4f} < 0.5 but (5/6)^{need - 1} ≈ {(5 / 6) ** (need - 1):.4f}."])
    return [U(ask(rng, q)), A(a + "\n\nAdding 1/6 per roll would overcount, because it counts outcomes with several "
                              f"{face}s more than once; the complement avoids that.")]


def m_binomial(rng: random.Random) -> list[Turn]:
    n, k, pct = rng.randint(6, 15), 0, rng.choice([10, 20, 30, 40, 60])
    k = rng.randint(1, min(n - 1, 6))
    what = rng.choice(["free throws", "seeds germinating", "emails getting a reply", "parts passing inspection"])
    p = Fraction(pct, 100)
    prob = math.comb(n, k) * p ** k * (1 - p) ** (n - k)
    q = f"Each of {n} independent trials succeeds with probability {pct}% (think {what}). What's the probability of exactly {k} successes?"
    a = steps([f"Binomial formula: P(X = {k}) = C({n},{k}) p^{k} (1-p)^{n - k}.", f"C({n},{k}) = {math.comb(n, k)}.",
               f"p^{k} = {pct / 100:g}^{k} = {float(p ** k):.6g}; (1-p)^{n - k} = {1 - pct / 100:g}^{n - k} = {float((1 - p) ** (n - k)):.6g}.",
               f"Multiply: {math.comb(n, k)} x {float(p ** k):.6g} x {float((1 - p) ** (n - k)):.6g} ≈ {float(prob):.4f}."])
    return [U(ask(rng, q)), A(a + f"\n\nSo about **{float(prob) * 100:.2f}%**. For comparison, the expected number of successes is "
                              f"n·p = {n * pct / 100:g}.")]


def m_gcd(rng: random.Random) -> list[Turn]:
    g = rng.choice([6, 12, 14, 15, 18, 21, 24])
    a, b = g * rng.randint(5, 40), g * rng.randint(5, 40)
    a, b = max(a, b), min(a, b)
    if a % b == 0:
        a += g
    lines, x, y = [], a, b
    while y:
        lines.append(f"{x} = {x // y} x {y} + {x % y}")
        x, y = y, x % y
    q = pick(rng, f"Find gcd({a}, {b}) with the Euclidean algorithm, and the lcm too.", f"What are the GCD and LCM of {a} and {b}? Show the steps.")
    return [U(ask(rng, q)), A("Repeatedly replace the larger number by the remainder:\n\n" + steps(lines)
                              + f"\n\nThe last non-zero remainder is **gcd = {x}**. Then lcm = {a} x {b} / {x} = **{a * b // x}**.")]


def m_modexp(rng: random.Random) -> list[Turn]:
    base, e, m = rng.randint(2, 19), rng.randint(20, 120), rng.choice([7, 11, 13, 17, 23, 97, 101])
    q = f"Compute {base}^{e} mod {m} by hand. Is there a trick so I don't need the huge number?"
    bits, sq, lines, acc = bin(e)[2:], base % m, [], 1
    for i, bit in enumerate(reversed(bits)):
        if bit == "1":
            acc = acc * sq % m
        lines.append(f"{base}^{2 ** i} ≡ {sq} (mod {m})" + (" ← used" if bit == "1" else ""))
        sq = sq * sq % m
    assert acc == pow(base, e, m)
    used = " + ".join(str(2 ** i) for i, bit in enumerate(reversed(bits)) if bit == "1")
    return [U(ask(rng, q)), A(f"Yes: square-and-multiply. Write the exponent in binary: {e} = {bits}₂ = {used}. Square repeatedly, "
                              f"reducing mod {m} each time:\n\n" + steps(lines) + f"\n\nMultiply the marked powers together mod {m}: "
                              f"**{base}^{e} ≡ {acc} (mod {m})**. Every intermediate number stays below {m}², so it's easy by hand.")]


def factorize(n: int) -> dict[int, int]:
    out: dict[int, int] = {}
    p = 2
    while p * p <= n:
        while n % p == 0:
            out[p] = out.get(p, 0) + 1
            n //= p
        p += 1
    if n > 1:
        out[n] = out.get(n, 0) + 1
    return out


def m_factor(rng: random.Random) -> list[Turn]:
    n = math.prod(rng.choice([2, 2, 3, 3, 5, 7, 11, 13]) for _ in range(rng.randint(3, 6)))
    f = factorize(n)
    fs = " x ".join(f"{p}^{k}" if k > 1 else str(p) for p, k in sorted(f.items()))
    nd = math.prod(k + 1 for k in f.values())
    sd = math.prod((p ** (k + 1) - 1) // (p - 1) for p, k in f.items())
    q = f"What is the prime factorization of {n}, and how many positive divisors does it have?"
    return [U(ask(rng, q)), A(f"Divide out the smallest primes first:\n\n{n} = {fs}\n\nFor n = p1^a1 · p2^a2 · ..., the number of "
                              f"divisors is (a1+1)(a2+1)...: " + " x ".join(str(k + 1) for k in f.values()) + f" = **{nd} divisors**. "
                              f"Their sum, from the product of geometric series (p^(a+1) - 1)/(p - 1), is {sd:,}.")]


def m_compound(rng: random.Random) -> list[Turn]:
    p, r, y = rng.choice([1000, 2500, 5000, 12000]), rng.choice([3, 4.5, 5, 6, 7.2]), rng.choice([5, 8, 10, 15])
    annual = p * (1 + r / 100) ** y
    monthly = p * (1 + r / 1200) ** (12 * y)
    q = f"If I invest ${p:,} at {r}% a year for {y} years, how much will I have with annual compounding versus monthly compounding?"
    a = steps([f"Annual: A = P(1 + r)^t = {p:,} x {1 + r / 100:g}^{y} = ${annual:,.2f}.",
               f"Monthly: A = P(1 + r/12)^(12t) = {p:,} x (1 + {r / 100:g}/12)^{12 * y} = ${monthly:,.2f}.",
               f"Difference: ${monthly - annual:,.2f}."])
    dbl = math.log(2) / math.log(1 + r / 100)
    return [U(ask(rng, q)), A(a + f"\n\nMonthly compounding earns slightly more because interest starts earning interest sooner. "
                              f"At {r}% money doubles in about {dbl:.1f} years (the rule of 72 gives {72 / r:.1f}).")]


def m_series(rng: random.Random) -> list[Turn]:
    if rng.random() < 0.5:
        a0, d, n = rng.randint(1, 20), rng.randint(2, 9), rng.randint(12, 60)
        last, s = a0 + (n - 1) * d, n * (2 * a0 + (n - 1) * d) // 2
        q = f"What's the sum of the first {n} terms of the arithmetic sequence {a0}, {a0 + d}, {a0 + 2 * d}, ...?"
        a = steps([f"Common difference d = {d}.", f"Last term: a_{n} = {a0} + ({n} - 1) x {d} = {last}.",
                   f"Sum = n(first + last)/2 = {n} x ({a0} + {last}) / 2 = {s}."])
    else:
        a0, r, n = rng.randint(1, 5), rng.choice([2, 3]), rng.randint(6, 12)
        s = a0 * (r ** n - 1) // (r - 1)
        q = f"Sum the geometric series {a0} + {a0 * r} + {a0 * r * r} + ... with {n} terms."
        a = steps([f"Ratio r = {r}, first term a = {a0}.", f"Formula: S = a(r^n - 1)/(r - 1) = {a0}({r}^{n} - 1)/({r} - 1).",
                   f"{r}^{n} = {r ** n}, so S = {a0} x {r ** n - 1} / {r - 1} = {s}."])
    return [U(ask(rng, q)), A(a + f"\n\nThe answer is **{s:,}**.")]


def money(x: float, nd: int = 2) -> str:
    return ("-" if x < 0 else "") + f"${abs(x):,.{nd}f}"


def m_expected(rng: random.Random) -> list[Turn]:
    win6, win5, cost = rng.choice([10, 12, 15]), rng.choice([3, 4, 5]), rng.choice([2, 3, 4])
    ev = Fraction(win6 + win5, 6) - cost
    q = (f"A dice game at the school fair: you pay ${cost} to roll one die. A 6 pays ${win6}, a 5 pays ${win5}, anything else pays nothing. "
         f"What's the expected profit per game? Should I play?")
    a = steps([f"Expected payout = (1/6)({win6}) + (1/6)({win5}) + (4/6)(0) = {frac(Fraction(win6 + win5, 6))} ≈ ${(win6 + win5) / 6:.2f}.",
               f"Expected profit = payout - cost = {(win6 + win5) / 6:.2f} - {cost} = {money(float(ev))} per game."])
    verdict = ("positive, so over many games you'd come out ahead on average" if ev > 0 else
               "negative, so the house wins in the long run" if ev < 0 else "exactly zero, a fair game")
    return [U(ask(rng, q)), A(a + f"\n\nThe expectation is {verdict}. Over 100 games that's about {money(float(ev) * 100, 0)} in total, "
                              "though any single short session can go either way.")]


def m_stats(rng: random.Random) -> list[Turn]:
    data = [rng.randint(3, 40) for _ in range(rng.randint(7, 11))]
    what = rng.choice(["minutes of commute", "daily orders", "quiz scores", "rainfall in mm"])
    mean, med, sd = statistics.mean(data), statistics.median(data), statistics.stdev(data)
    q = f"Here are some {what}: {', '.join(map(str, data))}. Find the mean, median and sample standard deviation."
    sq = sum((x - mean) ** 2 for x in data)
    a = steps([f"Mean = sum / n = {sum(data)} / {len(data)} = {mean:.2f}.",
               f"Sorted: {', '.join(map(str, sorted(data)))}; median = {num(med)}.",
               f"Sum of squared deviations from the mean = {sq:.2f}.",
               f"Sample variance = {sq:.2f} / ({len(data)} - 1) = {sq / (len(data) - 1):.2f}; standard deviation = {sd:.2f}."])
    skew = "pulled up by a few large values" if mean > med else "pulled down by a few small values" if mean < med else "equal to the median"
    return [U(ask(rng, q)), A(a + f"\n\nThe mean is {skew}. The sample version divides by n - 1 because the mean itself was estimated from the data.")]


def m_optimize(rng: random.Random) -> list[Turn]:
    L = rng.choice([40, 60, 80, 100, 120, 150])
    q = (f"I have {L} m of fencing to make a rectangular pen against a long wall, so only three sides need fence. "
         f"What dimensions give the largest area?")
    x = Fraction(L, 4)
    a = steps([f"Let x be each side perpendicular to the wall; the side parallel to it is {L} - 2x.",
               f"Area A(x) = x({L} - 2x) = {L}x - 2x^2.", f"A'(x) = {L} - 4x = 0 gives x = {frac(x)} m.",
               f"A''(x) = -4 < 0, so it's a maximum. Parallel side = {L} - 2({frac(x)}) = {frac(L - 2 * x)} m.",
               f"Maximum area = {frac(x)} x {frac(L - 2 * x)} = {frac(x * (L - 2 * x))} m²."])
    return [U(ask(rng, q)), A(a + "\n\nThe side along the wall is twice as long as each of the other two; that shape is optimal for any fence length.")]


def m_bayes(rng: random.Random) -> list[Turn]:
    prev, sens, spec = rng.choice([0.5, 1, 2, 5]), rng.choice([90, 95, 99]), rng.choice([90, 95, 98])
    pop = 100_000
    sick = pop * prev / 100
    tp, fp = sick * sens / 100, (pop - sick) * (100 - spec) / 100
    q = (f"A condition affects {prev}% of people. A test catches {sens}% of real cases and has a {100 - spec}% false-positive rate. "
         f"If someone tests positive, what's the chance they actually have it?")
    a = steps([f"Imagine {pop:,} people: {num(sick)} have the condition and {num(pop - sick)} don't.",
               f"True positives: {sens}% of {num(sick)} = {num(tp)}.", f"False positives: {100 - spec}% of {num(pop - sick)} = {num(fp)}.",
               f"P(condition | positive) = {num(tp)} / ({num(tp)} + {num(fp)}) = {tp / (tp + fp):.3f}."])
    return [U(ask(rng, q)), A(a + f"\n\nOnly about **{tp / (tp + fp) * 100:.1f}%**. When a condition is rare, false positives from the "
                              "large healthy group can outnumber true positives; this is Bayes' theorem with natural frequencies.")]


def m_percent_change(rng: random.Random) -> list[Turn]:
    start, up, down = rng.choice([40, 80, 150, 220]), rng.choice([10, 20, 25, 50]), rng.choice([10, 20, 25, 40])
    mid = start * (1 + up / 100)
    end = mid * (1 - down / 100)
    change = (end - start) / start * 100
    q = f"A stock at ${start} rises {up}% one month and falls {down}% the next. Is it back where it started? What's the overall change?"
    a = steps([f"After the rise: {start} x {1 + up / 100:g} = ${mid:,.2f}.", f"After the fall: {mid:,.2f} x {1 - down / 100:g} = ${end:,.2f}.",
               f"Overall change: ({end:,.2f} - {start}) / {start} = {change:+.2f}%."])
    return [U(ask(rng, q)), A(a + "\n\nPercent changes multiply rather than add, because the second percentage applies to a different base.")]


def m_percent_of(rng: random.Random) -> list[Turn]:
    p, n = rng.choice([5, 12, 15, 17.5, 22, 35, 64]), rng.choice([80, 240, 365, 1250, 48.6, 2999])
    if rng.random() < 0.5:
        q = pick(rng, f"what is {num(p)}% of {num(n)}?", f"{num(p)} percent of {num(n)}", f"Quick one: {num(p)}% of {num(n)}?")
        a = (f"{num(p)}% of {num(n)} = {num(p)}/100 x {num(n)} = **{num(p * n / 100, 3)}**.\n\nShortcut: 10% of {num(n)} is "
             f"{num(n / 10, 3)}, so you can build most percentages from 10%, 5% and 1% pieces in your head.")
    else:
        part = round(n * p / 100, 2)
        q = pick(rng, f"{num(part)} is what percent of {num(n)}?", f"What percentage of {num(n)} is {num(part)}?")
        a = (f"Divide the part by the whole and multiply by 100: {num(part)} / {num(n)} x 100 = **{part / n * 100:.2f}%**.\n\n"
             f"Check: {part / n * 100:.2f}% of {num(n)} is {num(n * part / n, 2)}.")
    return [U(q), A(a)]


def m_speed(rng: random.Random) -> list[Turn]:
    who, unit = rng.choice([("a car", "miles"), ("a cyclist", "km"), ("a train", "km"), ("a runner", "km")])
    d, mins = rng.choice([12, 45, 60, 150, 210, 21.1]), rng.choice([40, 75, 90, 150, 210])
    v = d / (mins / 60)
    extra = rng.choice([30, 100, 250])
    q = pick(rng, f"If {who} travels {num(d)} {unit} in {mins} minutes, what's its average speed?",
             f"{who.capitalize()} covers {num(d)} {unit} in {mins} minutes. Average speed? And how long would {extra} {unit} take at that pace?")
    a = (f"Average speed = distance / time. {mins} minutes is {mins}/60 = {mins / 60:.3g} hours, so speed = {num(d)} / {mins / 60:.3g} "
         f"≈ **{v:.2f} {unit} per hour**.\n\nAt that pace, {extra} {unit} takes {extra} / {v:.2f} ≈ {extra / v:.2f} hours, about "
         f"{int(extra / v)} h {round((extra / v - int(extra / v)) * 60)} min. Average speed ignores stops and speed changes along the way.")
    return [U(ask(rng, q)), A(a)]


def m_calculus2(rng: random.Random) -> list[Turn]:
    k = rng.choice([2, 3, 4, 5])
    q, a = rng.choice([
        (f"integrate sin({k}x) cos({k}x) dx", f"Use the substitution u = sin({k}x), so du = {k} cos({k}x) dx:\n\n"
         f"∫ sin({k}x) cos({k}x) dx = (1/{k}) ∫ u du = u²/{2 * k} + C = **sin²({k}x)/{2 * k} + C**.\n\nAlternatively, "
         f"sin({k}x)cos({k}x) = ½ sin({2 * k}x), which integrates to -cos({2 * k}x)/{4 * k} + C. The two answers differ only by a constant."),
        (f"What's the derivative of sin({k}x^2)?", f"Chain rule: the outer function is sin(u) with u = {k}x², so d/dx sin(u) = cos(u) · du/dx.\n\n"
         f"du/dx = {2 * k}x, so **d/dx sin({k}x²) = {2 * k}x cos({k}x²)**.\n\nCheck at x = 0: the slope is 0, which matches the graph being flat there."),
        (f"Find the limit of sin({k}x)/x as x approaches 0.", f"Rewrite it as {k} · sin({k}x)/({k}x). As x → 0, {k}x → 0 too, and the "
         f"standard limit sin(t)/t → 1 as t → 0.\n\nSo the limit is **{k}**. L'Hôpital's rule agrees: the derivative ratio is "
         f"{k}cos({k}x)/1, which is {k} at x = 0."),
        (f"Integrate x e^({k}x) dx.", f"Integration by parts with u = x and dv = e^({k}x) dx, so du = dx and v = e^({k}x)/{k}:\n\n"
         f"∫ x e^({k}x) dx = x e^({k}x)/{k} - ∫ e^({k}x)/{k} dx = x e^({k}x)/{k} - e^({k}x)/{k * k} + C\n\n= **e^({k}x)(x/{k} - 1/{k * k}) + C**.\n\n"
         "Differentiate the result to check: the product rule gives back x e^(kx)."),
        (f"Differentiate f(x) = e^({k}x) ln(x).", f"Product rule: (uv)' = u'v + uv' with u = e^({k}x) and v = ln x.\n\n"
         f"u' = {k}e^({k}x) and v' = 1/x, so **f'(x) = e^({k}x) ({k} ln x + 1/x)**.\n\nThe domain is x > 0 because of the logarithm."),
    ])
    return [U(ask(rng, q)), A(a)]


PROOFS = {
    "the square root of 2 is irrational": "Suppose √2 = p/q with p and q whole numbers with no common factor. Squaring gives "
        "2q² = p², so p² is even, which means p is even; write p = 2m. Then 2q² = 4m², so q² = 2m² and q is even too. Now p and q "
        "share the factor 2, contradicting the assumption that the fraction was in lowest terms. So no such fraction exists, "
        "and √2 is irrational.",
    "1 + 2 + ... + n = n(n+1)/2 for every positive integer n": "Use induction. Base case: for n = 1 the left side is 1 and "
        "the right side is 1·2/2 = 1. Inductive step: assume 1 + ... + k = k(k+1)/2. Adding k + 1 to both sides gives "
        "k(k+1)/2 + (k+1) = (k+1)(k+2)/2, which is the formula for n = k + 1. By induction it holds for all n.",
    "there are infinitely many primes": "Suppose there were only finitely many primes p1, p2, ..., pk. Let N = p1·p2·...·pk + 1. "
        "Dividing N by any of the pi leaves remainder 1, so none of them divides N. But every integer greater than 1 has a "
        "prime factor, so N has a prime factor missing from the list. That contradicts the list being complete, so there are "
        "infinitely many primes.",
    "n³ - n is divisible by 6 for every integer n": "Factor it: n³ - n = (n - 1)·n·(n + 1), the product of three consecutive "
        "integers. Among any two consecutive integers one is even, so the product is divisible by 2. Among any three "
        "consecutive integers one is a multiple of 3, so it is divisible by 3. Since 2 and 3 are coprime, it is divisible by 6.",
}


def m_proof(rng: random.Random) -> list[Turn]:
    claim = draw(rng, "PROOFS", sorted(PROOFS))
    n = rng.randint(4, 12)
    q = pick(rng, f"prove that {claim}", f"Can you show me a proof that {claim}? I get lost in the textbook version.",
             f"How do you prove {claim}?")
    check = {"the square root of 2 is irrational": f"Numerically, √2 ≈ {math.sqrt(2):.10f}, and no fraction hits it exactly.",
             "1 + 2 + ... + n = n(n+1)/2 for every positive integer n": f"Sanity check with n = {n}: the sum is {sum(range(n + 1))} and {n}·{n + 1}/2 = {n * (n + 1) // 2}.",
             "there are infinitely many primes": "Note N itself need not be prime: 2·3·5·7·11·13 + 1 = 30031 = 59 · 509.",
             "n³ - n is divisible by 6 for every integer n": f"Example: n = {n} gives {n ** 3 - n} = 6 x {(n ** 3 - n) // 6}."}[claim]
    return [U(ask(rng, q)), A(PROOFS[claim] + "\n\n" + check)]


def m_geometry(rng: random.Random) -> list[Turn]:
    kind = rng.choice(["circle", "triangle", "cylinder"])
    if kind == "circle":
        r = rng.choice([3, 4.5, 7, 12, 2.5])
        q = pick(rng, f"area and circumference of a circle with radius {num(r)} cm?", f"A round table has a diameter of {num(2 * r)} cm. What's its area?")
        a = (f"The radius is {num(r)} cm.\n\n- Area = πr² = π x {num(r)}² = {num(r * r)}π ≈ **{math.pi * r * r:.2f} cm²**\n"
             f"- Circumference = 2πr = {num(2 * r)}π ≈ {2 * math.pi * r:.2f} cm\n\nIf you're given the diameter, halve it first; "
             "using the diameter in πr² is the most common slip.")
    elif kind == "triangle":
        a_, b_ = rng.choice([(3, 4), (5, 12), (8, 15), (7, 24), (20, 21)])
        s = rng.choice([1, 2, 3])
        x, y = a_ * s, b_ * s
        q = f"A right triangle has legs {x} and {y}. How long is the hypotenuse, and what's the area?"
        a = (f"Pythagoras: c² = {x}² + {y}² = {x * x} + {y * y} = {x * x + y * y}, so c = √{x * x + y * y} = **{math.isqrt(x * x + y * y)}**.\n\n"
             f"Area = ½ x base x height = ½ x {x} x {y} = **{num(x * y / 2)}** square units. The legs are perpendicular, "
             "so either one can serve as the base.")
    else:
        r, h = rng.choice([3, 5, 8, 10]), rng.choice([10, 12, 20, 25])
        v = math.pi * r * r * h
        q = f"How much water fits in a cylindrical tank with radius {r} cm and height {h} cm? Answer in litres."
        a = (f"Volume = πr²h = π x {r}² x {h} = {r * r * h}π ≈ {v:,.1f} cm³.\n\nSince 1 litre = 1,000 cm³, that's about "
             f"**{v / 1000:.2f} litres**.")
    return [U(ask(rng, q)), A(a)]


def m_fractions(rng: random.Random) -> list[Turn]:
    f1, f2 = Fraction(rng.randint(1, 9), rng.choice([2, 3, 4, 5, 6, 8])), Fraction(rng.randint(1, 9), rng.choice([3, 4, 6, 7, 9, 10]))
    op = rng.choice(["+", "-", "x", "÷"])
    res = {"+": f1 + f2, "-": f1 - f2, "x": f1 * f2, "÷": f1 / f2}[op]
    q = pick(rng, f"what is {frac(f1)} {op} {frac(f2)}?", f"How do I work out {frac(f1)} {op} {frac(f2)} without a calculator?")
    lcd = f1.denominator * f2.denominator // math.gcd(f1.denominator, f2.denominator)
    how = {"+": f"Use the common denominator {lcd}: {frac(f1)} = {f1.numerator * (lcd // f1.denominator)}/{lcd} and "
                f"{frac(f2)} = {f2.numerator * (lcd // f2.denominator)}/{lcd}; add the numerators.",
           "-": f"Use the common denominator {lcd}: {frac(f1)} = {f1.numerator * (lcd // f1.denominator)}/{lcd} and "
                f"{frac(f2)} = {f2.numerator * (lcd // f2.denominator)}/{lcd}; subtract the numerators.",
           "x": "Multiply the numerators together and the denominators together, then simplify.",
           "÷": f"Dividing by {frac(f2)} is the same as multiplying by its reciprocal {f2.denominator}/{f2.numerator}."}[op]
    return [U(ask(rng, q)), A(f"{how}\n\nResult: **{frac(res)}**" + (f" ≈ {float(res):.4f}." if res.denominator != 1 else ".")
                              + " Always reduce by the greatest common divisor at the end.")]


def m_two_dice(rng: random.Random) -> list[Turn]:
    target = rng.randint(2, 12)
    ways = [(a, b) for a in range(1, 7) for b in range(1, 7) if a + b == target]
    p = Fraction(len(ways), 36)
    q = pick(rng, f"what's the probability of rolling a total of {target} with two dice?", f"Two dice: chance the sum is {target}?")
    a = (f"There are 6 x 6 = 36 equally likely outcomes. Those summing to {target}: {', '.join(f'({x},{y})' for x, y in ways)}, which is "
         f"{len(ways)} outcome{'s' if len(ways) > 1 else ''}.\n\nP(sum = {target}) = {len(ways)}/36 = **{frac(p)}** ≈ {float(p):.3f}. "
         "Seven is the most likely total (6/36), and 2 and 12 the least likely (1/36 each).")
    return [U(ask(rng, q)), A(a)]


MATH_TEMPLATES: list[Template] = [m_discount, m_pipes, m_trains, m_linear, m_quadratic, m_system, m_derivative, m_integral,
                                  m_balls, m_dice, m_binomial, m_gcd, m_modexp, m_factor, m_compound, m_series, m_expected,
                                  m_stats, m_optimize, m_bayes, m_percent_change, m_percent_of, m_speed, m_calculus2, m_proof,
                                  m_geometry, m_fractions, m_two_dice]


# ----------------------------------------------------------------------------- writing domain
FIRST = ["Sarah", "Daniel", "Amara", "Kenji", "Rosa", "Felix", "Ingrid", "Marcus", "Leila", "Owen", "Chloe", "Ravi"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Alvarez", "Brennan", "Novak", "Haddad", "Whitfield", "Castillo"]
COMPANIES = ["Northwind Logistics", "Bluebird Dental", "Harbor & Pine", "Tandem Studio", "Meridian Health", "Copperleaf Books"]


def person(rng: random.Random) -> tuple[str, str]:
    first = rng.choice(FIRST)
    return first, f"{first} {rng.choice(LAST)}"


def w_reschedule(rng: random.Random) -> list[Turn]:
    (f1, full), (me, _) = person(rng), person(rng)
    mtg = rng.choice(["quarterly review", "project kickoff", "one-on-one", "vendor call", "design critique"])
    d1, d2 = rng.sample(["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"], 2)
    why = rng.choice(["a family commitment", "a client deadline that moved up", "a medical appointment", "travel delays"])
    q = f"Draft a short email to {full} asking to move our {mtg} from {d1} to {d2} because of {why}. Polite but not groveling. My name is {me}."
    body = pick(rng, f"I hope your week is going well. Would it be possible to move our {mtg} from {d1} to {d2}? "
                     f"I've run into {why}, and I'd rather reschedule than give the meeting half my attention.",
                f"I'm writing to ask whether we could shift our {mtg} from {d1} to {d2}. Unfortunately {why} has come up, "
                f"and I want to make sure we have a proper conversation.")
    close = pick(rng, f"Any time on {d2} works for me, so please pick whatever suits your calendar. Sorry for the shuffle, and thank you for being flexible.",
                 f"I'm free most of {d2}; if that day doesn't work, I'm happy to find another slot early next week. Thanks for understanding.")
    a = f"Subject: Moving our {mtg} to {d2}\n\nHi {f1},\n\n{body}\n\n{close}\n\nBest regards,\n{me}"
    return [U(ask(rng, q)), A(a)]


def w_timeoff(rng: random.Random) -> list[Turn]:
    (boss, _), (me, _) = person(rng), person(rng)
    days, month = rng.choice([3, 5, 8, 10]), rng.choice(["June", "August", "October", "December", "March"])
    reason = rng.choice(["my sister's wedding", "a long-planned trip", "moving house", "some rest after the launch"])
    q = f"Help me write a message to my manager {boss} asking for {days} days off in {month} for {reason}. I want it to sound organised."
    a = (f"Hi {boss},\n\nI'd like to request {days} days of leave in {month} for {reason}. I'm flexible on the exact dates "
         f"by a day or two if that helps the team's schedule.\n\n"
         + pick(rng, "Before I go, I'll finish my open tasks or hand them over with clear notes, and I'll make sure someone "
                     "is briefed on anything that might come up while I'm away.",
                "I've checked the roadmap and don't see any deadlines that week that depend on me. I'll write up a handover "
                "so nothing stalls, and I can be reached for anything truly urgent.")
         + f"\n\nPlease let me know if this works, or if you'd like to talk it through.\n\nThanks,\n{me}")
    return [U(ask(rng, q)), A(a)]


def w_interview(rng: random.Random) -> list[Turn]:
    (f1, full), (me, _) = person(rng), person(rng)
    role, co = rng.choice(["product designer", "data analyst", "operations manager", "marketing coordinator"]), rng.choice(COMPANIES)
    topic = rng.choice(["your plans for the new onboarding flow", "how the team measures success", "the expansion into Canada"])
    q = f"I interviewed with {full} at {co} for a {role} role today. Write a thank-you email that mentions our chat about {topic}."
    a = (f"Subject: Thank you for today's conversation\n\nDear {f1},\n\nThank you for taking the time to meet with me today about "
         f"the {role} position. I especially enjoyed our conversation about {topic}; it gave me a much clearer picture of "
         f"what the role involves and why it matters to {co}.\n\n"
         + pick(rng, "Our discussion made me even more excited about the opportunity. I think my experience turning messy "
                     "requirements into clear plans would let me contribute quickly.",
                "I left the interview more enthusiastic than I arrived. The challenges you described are exactly the kind "
                "of work I do best, and I'd love the chance to take them on with your team.")
         + f"\n\nPlease let me know if there is anything else I can provide. I look forward to hearing from you.\n\nKind regards,\n{me}")
    return [U(ask(rng, q)), A(a)]


EDIT_BASE = [
    "Our team moved the weekly planning meeting to Thursday because several people travel on Mondays. The new slot gives "
    "everyone time to review the numbers first. Notes will now go out the same afternoon.",
    "The library will close its east wing in May because the roof needs repairs. Many study rooms will move to the second "
    "floor. Staff expect the work to take about six weeks.",
    "We switched suppliers because the old one kept missing delivery dates. The new contract costs slightly more. Orders "
    "now arrive within three days, and customers have noticed.",
    "The garden club plans to plant native flowers along the river path because they need less water. Many volunteers have "
    "already signed up. Seedlings will now be grown in the school greenhouse.",
    "Our support team answers most tickets within a day because we added weekend shifts. Many customers mentioned the change "
    "in surveys. The next goal is to publish better help articles.",
]


def clunkify(rng: random.Random, text: str) -> tuple[str, list[str]]:
    """Make a clean paragraph wordy; return the wordy text and a list of the edits needed to undo it."""
    changes, out = [], text
    if rng.random() < 0.8:
        out = out.replace(" because ", " due to the fact that ", 1)
        changes.append('"due to the fact that" becomes "because"')
    if " now " in out and rng.random() < 0.7:
        out = out.replace(" now ", " at this point in time ", 1)
        changes.append('"at this point in time" becomes "now"')
    if "Many " in out:
        out = out.replace("Many ", "A very large number of ", 1)
        changes.append('"a very large number of" is just "many"')
    sents = out.split(". ")
    i = rng.randrange(len(sents))
    filler = rng.choice(["Basically, ", "It is important to note that ", "As a matter of fact, ", "In my opinion I think that "])
    sents[i] = filler + sents[i][0].lower() + sents[i][1:]
    changes.append(f'dropped the filler opener "{filler.strip(", ")}"')
    return ". ".join(sents), changes


def w_edit(rng: random.Random) -> list[Turn]:
    clean = draw(rng, "EDIT_BASE", EDIT_BASE)
    wordy, changes = clunkify(rng, clean)
    q = pick(rng, "Can you tighten this paragraph? It feels wordy.", "Edit this for clarity and concision:",
             "Please clean up this paragraph for our newsletter.", "This reads clunky. Fix it without changing the meaning?")
    a = (pick(rng, "Here's a tighter version:", "Revised:", "Try this:") + f"\n\n{clean}\n\n"
         + pick(rng, "What changed: ", "Main edits: ") + "; ".join(changes) + ". "
         + pick(rng, "The facts are unchanged, and each sentence now carries one point.",
                "The meaning is the same, but the reader reaches the point faster."))
    return [U(ask(rng, q) + "\n\n" + wordy), A(a)]


def w_story(rng: random.Random) -> list[Turn]:
    who = rng.choice(["a retired lighthouse keeper", "a night-shift baker", "a twelve-year-old chess prodigy", "a courier in a flooded city",
                      "a museum guard", "an elderly beekeeper"])
    thing = rng.choice(["a brass key", "an unsigned letter", "a jar of mismatched buttons", "a photograph with one face scratched out", "a stopped pocket watch"])
    mood = rng.choice(["quiet and melancholy", "warm with a hint of mystery", "tense", "gently funny"])
    name = rng.choice(FIRST)
    weather = rng.choice(["rain had been falling for three days", "first frost had silvered the windows",
                          "heat had settled over the town like a lid", "fog had rolled in off the water"])
    q = f"Write the opening of a short story (2-3 paragraphs) about {who} who finds {thing}. Tone: {mood}."
    p1 = f"By the time {name} noticed it, the {weather}."
    a = (f"{p1} It was {thing}, resting where nothing should have been, as if someone had set it down a moment ago and "
         f"meant to come back.\n\n"
         + pick(rng, f"{name} had spent a lifetime as {who}, and a lifetime teaches you to leave strange things alone. "
                     f"Still, {name} picked it up. It was lighter than expected, and warmer, as though a hand had only just let go of it.",
                f"Being {who} meant {name} was used to long hours and small surprises, but not to this. "
                f"The object seemed to belong to a story already underway, one that had started without asking permission.")
         + "\n\n" + pick(rng, f"Outside, a door closed somewhere down the street. {name} picked up the {thing.split(' ', 1)[1]} and, "
                              "for the first time in years, did not go straight home.",
                         f"There was no name on it and no explanation, only the feeling of being chosen. {name} decided, "
                         "against every sensible instinct, to find out who had left it."))
    return [U(ask(rng, q)), A(a)]


PRODUCTS = [  # item, features as (spec-sheet form, sentence form), audience
    ("insulated water bottle", [("24-hour cold retention", "keeps drinks cold for a full day"), ("leak-proof lid", "has a lid that won't leak in your bag"),
                                ("fits car cup holders", "fits neatly in a car cup holder")], "commuters and hikers"),
    ("standing desk converter", [("five-second height adjustment", "moves from sitting to standing in seconds"), ("holds two monitors", "holds two monitors with room to spare"),
                                 ("no assembly", "arrives ready to use")], "people working from home"),
    ("wool throw blanket", [("recycled wool", "is woven from recycled wool"), ("machine washable", "survives the washing machine"),
                            ("oversized", "is big enough to share")], "anyone who reads on the sofa"),
    ("smart plant sensor", [("soil moisture and light readings", "tracks soil moisture and light"), ("phone reminders", "nudges your phone when it's time to water"),
                            ("one-year battery", "runs for a year on a single battery")], "forgetful gardeners"),
    ("cast iron skillet", [("pre-seasoned", "comes pre-seasoned and ready to cook"), ("induction and campfire safe", "works on induction hobs and campfires alike"),
                           ("lifetime durability", "will outlast most of your kitchen")], "home cooks"),
]


def w_product(rng: random.Random) -> list[Turn]:
    item, feats, who = draw(rng, "PRODUCTS", PRODUCTS)
    brand, words_n = rng.choice(["Fjord", "Larkspur", "Ember & Oak", "Tidewell", "Northfield"]), rng.choice([80, 100, 120])
    q = f"Write a product description (about {words_n} words) for the {brand} {item}. Features: {'; '.join(f for f, _ in feats)}. Audience: {who}."
    s = [f for _, f in feats]
    a = (pick(rng, f"Meet the {brand} {item}, designed with {who} in mind.",
              f"Some things earn a permanent place in your routine. The {brand} {item} is one of them.")
         + f" It {s[0]}, so you can stop thinking about it and get on with your day. "
         + f"Thoughtful details make the difference: it {s[1]}, and it {s[2]}.\n\n"
         + pick(rng, "It's the kind of everyday upgrade you notice every time you reach for it, and miss the moment it's gone.",
                "Built to last and designed without fuss, it makes a practical gift, or a well-deserved treat for yourself."))
    return [U(ask(rng, q)), A(a)]


def w_summary(rng: random.Random) -> list[Turn]:
    town, item = rng.choice(["Millbrook", "Ashford", "Port Ellen", "Cedar Falls"]), rng.choice(["protected bike lanes", "extended library hours", "a new skate park", "free evening bus service"])
    cost, vote, months = rng.choice([180_000, 420_000, 1_200_000]), rng.choice([(5, 2), (4, 3), (6, 1)]), rng.choice([3, 6, 9])
    passage = (f"At Tuesday's meeting, the {town} town council voted {vote[0]} to {vote[1]} to approve funding for {item}. "
               f"The project will cost roughly ${cost:,}, most of which will come from a state grant awarded last spring. "
               f"Supporters argued that the change would make the town centre safer and more welcoming, while opponents "
               f"questioned whether the money might be better spent on road maintenance. Several residents spoke during the "
               f"public comment period, many of them parents. Work is expected to begin within {months} months, and the council "
               f"has promised a public review one year after completion.")
    q = pick(rng, "Summarize this in two or three sentences:", "Give me a short summary of this article:", "TL;DR this for a newsletter blurb:")
    a = (f"{town}'s council approved {item} by a {vote[0]}-{vote[1]} vote. The roughly ${cost:,} project is mostly funded by a state "
         f"grant; supporters cited safety and a livelier town centre, while critics preferred spending on roads. "
         f"Work should start within {months} months, with a public review a year after it's finished.")
    return [U(ask(rng, q) + "\n\n" + passage), A(a)]


def w_polite(rng: random.Random) -> list[Turn]:
    thing = rng.choice(["the invoice", "my refund", "the replacement part", "the contract draft"])
    days = rng.choice([10, 14, 21])
    rough = f"This is ridiculous. I've been waiting {days} days for {thing} and nobody answers my emails. Fix it today or I'm done with you."
    q = pick(rng, "Make this message more polite but still firm:", "Rewrite this so it's professional. I'm annoyed but don't want to burn bridges:")
    a = (pick(rng, "Here's a firmer-but-civil version:", "Try this:") + f"\n\nHello,\n\nI'm following up on {thing}, which I've now been "
         f"waiting on for {days} days. I've sent several emails without a reply, and I'm concerned that it has fallen through "
         f"the cracks.\n\nCould you please confirm today when I can expect it? If there's a problem on your end, I'd appreciate "
         f"knowing so we can find a solution together. Resolving this quickly matters to me, as I'd like to keep working with you.\n\n"
         f"Thank you,\n[Your name]\n\nThis version keeps the deadline and the consequence implicit rather than as a threat, which usually gets a faster response.")
    return [U(ask(rng, q) + "\n\n" + rough), A(a)]


def w_casual(rng: random.Random) -> list[Turn]:
    event, day = rng.choice(["the office kitchen renovation", "the parking garage repainting", "the network upgrade"]), rng.choice(["Monday", "next Wednesday", "the 14th"])
    formal = (f"Please be advised that, commencing {day}, {event} will necessitate temporary changes to standard facilities "
              f"access. Employees are kindly requested to plan accordingly and direct any enquiries to Facilities Management.")
    q = pick(rng, "Turn this into a friendly message for our team chat:", "Make this sound human, for a casual team channel:")
    a = (f"Heads up, everyone! Starting {day}, {event} is kicking off, so things will be a bit different around the office for a while. "
         f"Plan ahead a little and you'll barely notice. Questions? Ping the Facilities team, they're happy to help.\n\n"
         "I swapped the formal phrasing for plain words, led with what's happening and when, and kept the one action people need to take.")
    return [U(ask(rng, q) + "\n\n" + formal), A(a)]


def w_cover(rng: random.Random) -> list[Turn]:
    role, years = rng.choice(["project coordinator", "UX researcher", "customer success lead", "grant writer"]), rng.randint(2, 9)
    field, win = rng.choice(["nonprofit fundraising", "retail operations", "healthcare administration", "education"]), rng.choice(
        ["cut onboarding time by a third", "grew repeat customers by 20%", "secured three multi-year grants", "rebuilt a struggling volunteer program"])
    q = f"Write the opening paragraph of a cover letter for a {role} job. I have {years} years in {field} and I {win}."
    a = (f"Dear Hiring Manager,\n\nIn {years} years working in {field}, I've learned that good results come from clear plans, "
         f"honest communication and steady follow-through. In my current role I {win}, and I did it by listening closely "
         f"to the people involved before changing anything. I'm applying for the {role} position because it would let me "
         f"bring that same approach to a team whose mission I genuinely admire.\n\n"
         + pick(rng, "Open with the result, then the how; hiring managers skim, and the number is what sticks.",
                "You can follow this with one paragraph of specific evidence and a short closing."))
    return [U(ask(rng, q)), A(a)]


def w_toast(rng: random.Random) -> list[Turn]:
    occ = rng.choice(["retirement", "wedding", "farewell", "30th birthday"])
    name, years, trait = rng.choice(FIRST), rng.randint(3, 35), rng.choice(["endless patience", "terrible puns", "kindness to newcomers", "legendary spreadsheets"])
    q = f"I need a short toast (under 150 words) for {name}'s {occ}. I've known them {years} years; they're known for their {trait}."
    a = (f"If I could have everyone's attention for a moment. I've known {name} for {years} years, and in that time I've learned "
         f"two things: you can always count on {name}, and you can never escape their {trait}.\n\n"
         + pick(rng, f"Through busy seasons and quiet ones, {name} has made the people around them better, usually without anyone noticing "
                     "how it happened. That's a rare gift, and we've all been lucky to share in it.",
                f"{name} is the person who remembers your birthday, shows up when you're moving house, and somehow "
                "makes every room a little warmer. We don't say it often enough, so I'll say it now: thank you.")
         + f"\n\nSo please raise your glasses. To {name}, and to everything that comes next. Cheers!")
    return [U(ask(rng, q)), A(a)]


def w_apology(rng: random.Random) -> list[Turn]:
    co, days = rng.choice(COMPANIES), rng.choice([3, 5, 7, 10])
    cause = rng.choice(["a fault at our warehouse", "a problem with our payment provider", "unexpected demand", "severe weather at our carrier"])
    perk = rng.choice(["free shipping on your next order", "a 15% discount code", "an extended return window"])
    q = f"Write a customer apology email from {co}: orders are delayed about {days} days due to {cause}. We're offering {perk}."
    a = (f"Subject: Your order is delayed, and we're sorry\n\nDear customer,\n\nWe owe you an apology. Because of {cause}, "
         f"orders placed recently will arrive about {days} days later than promised. We know you were counting on us, and "
         f"we're sorry for the inconvenience.\n\nOur team is working to get every order out as quickly as possible, and you'll "
         f"receive a tracking update as soon as yours ships. As a thank-you for your patience, we'd like to offer you {perk}; "
         f"it's already been added to your account.\n\nIf you'd rather cancel, just reply to this email and we'll refund you "
         f"in full, no questions asked.\n\nWith our apologies,\nThe {co} team")
    return [U(ask(rng, q)), A(a)]


def w_blog(rng: random.Random) -> list[Turn]:
    hobby = rng.choice(["sourdough baking", "urban sketching", "trail running", "birdwatching", "learning the cello as an adult", "container gardening"])
    q = pick(rng, f"Write an engaging intro paragraph for a blog post about getting started with {hobby}.",
             f"I'm starting a blog about {hobby}. Can you write the first post's opening?")
    a = (pick(rng, f"Nobody warns you that {hobby} will quietly take over your weekends.",
              f"I came to {hobby} the way most people do: by accident, and slightly skeptical.")
         + " It starts with curiosity and a little impatience, and before long you find yourself reading about it at midnight "
           "and planning your week around it. "
         + pick(rng, "If you're standing at the beginning, wondering whether it's worth the effort, this post is for you.",
                "This blog is my attempt to share what I've learned, including the mistakes, so your first steps are easier than mine.")
         + " We'll cover what you actually need to start, what you can safely ignore, and the small habits that make it stick.")
    return [U(ask(rng, q)), A(a)]


def w_simplify(rng: random.Random) -> list[Turn]:
    topic, text, simple = rng.choice([
        ("volcanoes", "Volcanic eruptions occur when magma, generated by the partial melting of the mantle, ascends through the crust "
         "due to its lower density and accumulates in subsurface chambers until pressure exceeds the strength of the overlying rock.",
         "Deep under the ground, it's so hot that some rock melts into a thick liquid called magma. Magma is lighter than the rock "
         "around it, so it slowly rises and collects in underground pockets. When too much pushes up, the rock on top can't hold "
         "it anymore, and it bursts out. That's an eruption!"),
        ("vaccines", "Vaccines expose the immune system to a harmless antigen, eliciting the production of antibodies and memory "
         "cells that enable a rapid and effective response upon subsequent exposure to the pathogen.",
         "A vaccine is like a practice round for your body. It shows your immune system a harmless 'wanted poster' of a germ. "
         "Your body learns what the germ looks like and builds defenders. Later, if the real germ shows up, your body "
         "recognizes it right away and fights it off quickly."),
        ("inflation", "Inflation denotes a sustained increase in the general price level, which erodes the purchasing power of "
         "money, such that a given nominal sum buys fewer goods and services over time.",
         "Inflation means prices slowly go up over time. If a snack costs one dollar today and more next year, the same dollar "
         "buys less than before. So money is a bit like ice: if you keep it for a long time, it shrinks a little."),
    ])
    age = rng.choice([8, 10, 12])
    q = f"Rewrite this for a {age}-year-old, keeping it accurate:\n\n{text}"
    return [U(ask(rng, q)), A(pick(rng, "Here's a kid-friendly version:", f"For a {age}-year-old:") + f"\n\n{simple}\n\n"
                              "I used short sentences, everyday words and one comparison to anchor the idea, and dropped the jargon.")]


def w_place(rng: random.Random) -> list[Turn]:
    place, season = rng.choice(["a harbor town", "a mountain village", "a city market", "an old train station", "a lakeside cabin"]), rng.choice(["early autumn", "midwinter", "late spring", "a summer evening"])
    q = f"Write a descriptive paragraph about {place} in {season}. Focus on sounds and smells, not just sights."
    smell = {"early autumn": "wood smoke and damp leaves", "midwinter": "cold stone and roasting chestnuts",
             "late spring": "cut grass and rain on warm pavement", "a summer evening": "sun-warmed dust and something frying nearby"}[season]
    a = (f"In {season}, {place} seems to breathe more slowly. The air carries {smell}, and beneath the ordinary noise there's "
         "a softer layer: a gull complaining somewhere, a shutter knocking in the wind, two neighbours laughing over a joke only "
         "they understand. Footsteps echo a little longer than they should. "
         + pick(rng, "Even the light sounds different, if that's possible, muffled and patient, as if the whole place is listening.",
                "Somewhere a radio plays a song nobody quite remembers, and for a moment everyone walks in time with it."))
    return [U(ask(rng, q)), A(a)]


def w_thanks(rng: random.Random) -> list[Turn]:
    who, did = rng.choice([("my neighbor", "watering my plants for two weeks"), ("my daughter's teacher", "her patience this year"),
                           ("a former mentor", "recommending me for my new job"), ("our volunteers", "running the food drive")])
    q = f"Help me write a short thank-you note to {who} for {did}."
    a = (pick(rng, "Thank you so much for ", "I wanted to say a heartfelt thank you for ") + did + ". "
         + pick(rng, "It made a real difference, and it didn't go unnoticed.", "You made something stressful feel easy, and I'm grateful.")
         + " " + pick(rng, "I hope I can return the favour soon.", "Please know how much it meant to me.")
         + "\n\nWarmly,\n[Your name]\n\nIf you know a specific detail, like the plant that survived against all odds, add it; a concrete "
           "detail is what makes a thank-you feel personal.")
    return [U(ask(rng, q)), A(a)]


def w_bio(rng: random.Random) -> list[Turn]:
    _, full = person(rng)
    job, years, niche = rng.choice(["landscape architect", "pediatric nurse", "software consultant", "documentary editor"]), rng.randint(4, 20), rng.choice(
        ["small public spaces", "family-centered care", "legacy system migrations", "stories about work and labor"])
    hobby = rng.choice(["rebuilding old bicycles", "long-distance swimming", "baking bread", "coaching youth soccer"])
    q = f"Write a third-person professional bio (about 80 words) for {full}: {job}, {years} years' experience, focused on {niche}, enjoys {hobby}."
    a = (f"{full} is a {job} with {years} years of experience and a particular focus on {niche}. Known for a calm, practical "
         f"approach, {full.split()[0]} works closely with colleagues and clients to turn complicated problems into clear next "
         f"steps. {full.split()[0]}'s work is grounded in the belief that careful listening leads to better outcomes. "
         f"Outside of work, {full.split()[0]} can usually be found {hobby}.")
    return [U(ask(rng, q)), A(a)]


WRITING_TEMPLATES: list[Template] = [w_reschedule, w_timeoff, w_interview, w_edit, w_story, w_product, w_summary, w_polite,
                                     w_casual, w_cover, w_toast, w_apology, w_blog, w_simplify, w_place, w_thanks, w_bio]


META_PREFIXES = ("What changed", "Main edits", "I used", "I swapped", "This version", "If you know", "Open with", "You can follow")


def shorten(text: str) -> str:
    """Drop meta commentary, then keep the first sentence of each long paragraph (greetings and sign-offs survive)."""
    paras = text.split("\n\n")
    if paras[0].endswith(":"):
        paras = paras[1:]
    while paras and paras[-1].startswith(META_PREFIXES):
        paras = paras[:-1]
    out = []
    for para in paras:
        if len(para.split()) > 25 and ". " in para:
            para = para.split(". ")[0] + "."
        out.append(para)
    return "\n\n".join(out)


def writing_followup(rng: random.Random, turns: list[Turn]) -> list[Turn]:
    short = shorten(turns[-1]["content"])
    if len(short.split()) < 45 or short == turns[-1]["content"]:
        return []
    q = pick(rng, "Can you make it shorter?", "Good, but cut it down by half.", "Shorter version please, same tone.", "Too long. Trim it?")
    return [U(q), A(pick(rng, "Here's a trimmed version:", "Shorter:", "Cut down:") + "\n\n" + short)]


# ----------------------------------------------------------------------------- general domain
GEN_INTROS = ("", "", "Sure. ", "Good question. ", "Happy to help. ", "Short answer first: ")
COUNTRIES = [  # country, capital, language(s), currency, note
    ("Japan", "Tokyo", "Japanese", "yen", "The country is made up of four main islands and thousands of smaller ones."),
    ("Canada", "Ottawa", "English and French", "Canadian dollar", "Canada has the longest coastline of any country."),
    ("Australia", "Canberra", "English", "Australian dollar", "Canberra was purpose-built as a compromise between Sydney and Melbourne."),
    ("Brazil", "Brasília", "Portuguese", "real", "Brasília was built as a planned capital and inaugurated in 1960."),
    ("Kenya", "Nairobi", "Swahili and English", "Kenyan shilling", "The equator runs through the country."),
    ("Norway", "Oslo", "Norwegian", "Norwegian krone", "Its western coast is famous for deep fjords."),
    ("Turkey", "Ankara", "Turkish", "Turkish lira", "Istanbul is the largest city, but Ankara has been the capital since 1923."),
    ("Morocco", "Rabat", "Arabic and Tamazight", "dirham", "Casablanca is the biggest city; Rabat is the seat of government."),
    ("New Zealand", "Wellington", "English and Māori", "New Zealand dollar", "Wellington sits at the southern tip of the North Island."),
    ("Vietnam", "Hanoi", "Vietnamese", "đồng", "Ho Chi Minh City in the south is the largest city."),
    ("Peru", "Lima", "Spanish, Quechua and Aymara", "sol", "Machu Picchu, in the Andes, is its best-known site."),
    ("Switzerland", "Bern", "German, French, Italian and Romansh", "Swiss franc", "Zurich and Geneva are larger than Bern."),
    ("Portugal", "Lisbon", "Portuguese", "euro", "Lisbon is one of the oldest cities in western Europe."),
    ("South Korea", "Seoul", "Korean", "won", "About half the population lives in the Seoul metropolitan area."),
]


def g_capital(rng: random.Random) -> list[Turn]:
    c, cap, lang, cur, note = draw(rng, "capital", COUNTRIES)
    q = pick(rng, f"What's the capital of {c}?", f"Is the capital of {c} its biggest city? What is it, anyway?",
             f"Settle a debate: what is the capital city of {c}?")
    a = (f"The capital of {c} is {cap}. {note} "
         + pick(rng, f"The main language is {lang}, and the currency is the {cur}.", f"People there speak {lang} and pay in the {cur}.")
         + " " + pick(rng, "It's a common trivia trap, because many people assume the best-known city must be the capital.",
                      "Capitals are often chosen for political reasons, such as a compromise between rival cities, rather than size."))
    return [U(ask(rng, q)), A(a)]


def g_travel(rng: random.Random) -> list[Turn]:
    c, cap, lang, cur, _ = draw(rng, "travel", COUNTRIES)
    days = rng.choice([5, 7, 10, 14])
    q = f"I'm visiting {c} for {days} days, flying into {cap}. What should I know about money, language and getting around?"
    a = (f"The currency is the {cur}. Cards are widely accepted in cities, but carry a little cash for markets, small cafés "
         f"and rural areas, and tell your bank you're travelling so your card isn't blocked. Withdrawing from bank ATMs "
         f"usually beats exchange counters at the airport.\n\nThe main language is {lang}. Learning 'hello', 'please', "
         f"'thank you' and 'excuse me' goes a long way, and an offline translation app covers the rest.\n\nFor {days} days, "
         + pick(rng, f"base yourself in {cap} for the first few nights to get over the flight, then pick one or two regions "
                     "rather than trying to see everything.",
                f"spend two or three days in {cap} and use public transport or trains for day trips; moving hotels every "
                "night eats more time than you'd think.")
         + " Check entry requirements for your passport well before you book.")
    return [U(ask(rng, q)), A(a)]


SCIENCE = {
    "why the sky is blue": "Sunlight contains all colours. As it passes through the atmosphere, it bumps into gas molecules "
        "that are much smaller than the light's wavelength, and those scatter short wavelengths (blue and violet) far more "
        "strongly than long ones (red). That scattered blue light reaches your eyes from every direction, so the whole sky looks "
        "blue. It isn't violet mostly because our eyes are more sensitive to blue and some violet is absorbed high up. At "
        "sunset, light travels through much more air, most of the blue is scattered away, and the reds and oranges remain.",
    "what causes the seasons": "Seasons come from the tilt of Earth's axis, about 23.4 degrees, not from our distance to the "
        "Sun. As Earth orbits, one hemisphere leans toward the Sun for part of the year. That hemisphere gets sunlight at a "
        "steeper angle, which concentrates the energy on a smaller area, and it also gets longer days. Half a year later it "
        "leans away, so the light is spread thinner and days are shorter. That's why it is summer in Australia when it is "
        "winter in Europe, and why Earth is actually closest to the Sun in early January.",
    "how tides work": "Tides are mostly caused by the Moon's gravity. It pulls slightly harder on the side of Earth facing it "
        "than on Earth's centre, and harder on the centre than on the far side. That difference stretches the oceans into two "
        "bulges, one toward the Moon and one opposite. As Earth rotates through both bulges, most coasts get two high tides "
        "and two low tides roughly every 24 hours and 50 minutes. The Sun adds a smaller effect: when Sun and Moon line up you "
        "get larger spring tides, and when they're at right angles, smaller neap tides.",
    "why bread rises": "Yeast is a living fungus. When it has water, warmth and sugar from the flour, it ferments and releases "
        "carbon dioxide gas. Kneading develops gluten, a stretchy network of proteins, which traps the gas in tiny bubbles, so "
        "the dough inflates like a balloon. In the oven the bubbles expand further, the yeast dies off, and the heat sets the "
        "gluten and starch into the airy structure of a loaf. Salt slows yeast down, which is why it's added in small amounts.",
    "why ice floats": "Most substances are denser as solids than as liquids, but water is an exception. When water freezes, its "
        "molecules lock into a hexagonal crystal held together by hydrogen bonds, and that arrangement leaves more empty space "
        "than the jumbled liquid does. Ice is about 9% less dense than liquid water, so it floats. This matters for life: lakes "
        "freeze from the top down, and the ice layer insulates the water beneath, letting fish survive the winter.",
    "how far away lightning is": "Light arrives almost instantly, but sound travels about 343 metres per second in air. Count "
        "the seconds between the flash and the thunder and divide by 3 to get the distance in kilometres, or by 5 for miles. "
        "So a 9-second gap means the strike was roughly 3 km away. If the gap is under about 30 seconds, you're close enough "
        "to be at risk and should get indoors.",
}


def g_science(rng: random.Random) -> list[Turn]:
    topic = draw(rng, "SCIENCE", sorted(SCIENCE))
    q = pick(rng, f"Can you explain {topic}? My kid asked and I realised I don't know.", f"Simple explanation of {topic}, please.",
             f"I've always wondered about {topic}. What's the actual science?")
    a = pick(rng, "Good question. ", "Here's the short version. ", "") + SCIENCE[topic]
    return [U(ask(rng, q)), A(a)]


HISTORY = {
    "the printing press": "Johannes Gutenberg developed his movable-type printing press in Mainz around 1440 to 1450. The key "
        "ideas were metal type cast in reusable moulds, an oil-based ink that stuck to metal, and a screw press adapted from "
        "wine and paper making. Books, pamphlets and later newspapers became far cheaper, literacy spread, and ideas could "
        "travel faster than any authority could control them. Historians link it to the Reformation, the Scientific "
        "Revolution and the standardisation of languages. Movable type existed earlier in East Asia, but the combination of "
        "an alphabet with few letters and the press made it especially efficient in Europe.",
    "the Silk Road": "The Silk Road wasn't one road but a web of trade routes linking China with Central Asia, the Middle East "
        "and the Mediterranean, active for well over a thousand years from around the second century BCE. Few merchants "
        "travelled the whole length; goods passed from trader to trader. Silk went west, while horses, glassware, silver and "
        "spices moved in many directions. Just as important were the ideas that travelled with them: Buddhism spread into "
        "China along these routes, along with technologies such as papermaking moving west. Unfortunately, so did disease.",
    "Roman aqueducts": "Roman aqueducts carried water from springs and rivers into cities using nothing but gravity. Engineers "
        "surveyed routes with a very gentle, steady downhill slope, sometimes only a few centimetres per hundred metres. Most "
        "of an aqueduct actually ran underground in channels; the famous arched bridges were needed only to cross valleys. "
        "Rome itself was eventually served by eleven aqueducts feeding public fountains, baths and private homes of the "
        "wealthy. Several remain impressive today, such as the Pont du Gard in southern France.",
    "the Industrial Revolution": "The Industrial Revolution began in Britain in the second half of the eighteenth century and "
        "spread to Europe and North America in the nineteenth. Machines powered first by water and then by steam engines "
        "transformed textile production, ironmaking and mining, and railways later shrank travel times dramatically. Work "
        "moved from homes and small workshops into factories, and people moved from the countryside into fast-growing cities. "
        "Living standards eventually rose, but early factory conditions, child labour and pollution were grim, which drove "
        "new labour laws and trade unions.",
    "the Magna Carta": "Magna Carta was a charter agreed by King John of England in 1215 under pressure from rebellious barons. "
        "Much of it dealt with specific feudal grievances, and it was annulled within months, but revised versions were "
        "reissued in later years. Its lasting importance is the principle that the king was subject to the law, including "
        "the idea that free men could not be imprisoned or punished except through lawful judgment. Later generations, "
        "including the drafters of constitutions centuries afterwards, treated it as a symbol of liberty.",
}


def g_history(rng: random.Random) -> list[Turn]:
    topic = draw(rng, "HISTORY", sorted(HISTORY))
    q = pick(rng, f"Give me a quick overview of {topic} and why it mattered.", f"Why is {topic} such a big deal in history?",
             f"What should I know about {topic}? Studying for a quiz.")
    return [U(ask(rng, q)), A(rng.choice(GEN_INTROS) + HISTORY[topic])]


COOKING = {
    "fluffy long-grain rice": "Rinse 1 cup of rice in a sieve until the water runs mostly clear, which removes surface starch. "
        "Put it in a pot with 1.5 cups of water and a pinch of salt, bring it to a boil, then cover and turn the heat to the "
        "lowest setting for 15 minutes. Take it off the heat and leave it covered for another 10 minutes before fluffing with "
        "a fork. The resting time is what finishes the cooking evenly, so don't skip it and don't lift the lid early.",
    "soft-boiled eggs": "Bring a pot of water to a gentle boil, lower cold eggs in with a spoon and set a timer: 6 minutes "
        "gives a runny yolk and just-set white, 7 minutes a jammy yolk. Move the eggs straight into ice water for a couple "
        "of minutes to stop the cooking and make them easier to peel. Starting from boiling water rather than cold makes "
        "the timing consistent no matter what pot or stove you use.",
    "roasted vegetables that actually get crispy": "Heat the oven to about 220°C (425°F). Cut the vegetables into even "
        "pieces, toss them with enough oil to coat and a good pinch of salt, and spread them in a single layer with space "
        "between pieces. Crowding is the usual problem: packed vegetables steam instead of browning, so use two trays if you "
        "need to. Roast for 25 to 40 minutes depending on the vegetable, turning once halfway.",
    "pasta": "Use a big pot with plenty of water, roughly 4 litres per 500 g, and salt it well once it boils. Add the pasta, "
        "stir in the first minute so it doesn't stick, and start tasting a couple of minutes before the packet time. Save "
        "a cup of the cooking water before draining; its starch helps the sauce cling. Finish the pasta in the sauce for "
        "a minute with a splash of that water rather than pouring sauce over plain noodles.",
}


def g_cooking(rng: random.Random) -> list[Turn]:
    dish = draw(rng, "COOKING", sorted(COOKING))
    q = pick(rng, f"How do I make {dish}? Mine never turns out right.", f"What's the trick to {dish}?",
             f"Beginner cook here. Walk me through {dish}.")
    return [U(ask(rng, q)), A(rng.choice(GEN_INTROS) + COOKING[dish])]


SUBS = [  # ingredient, unit, per-unit recipe, note
    ("buttermilk", "cup", [("milk", 1, "cup"), ("lemon juice or white vinegar", 1, "tablespoon")], "Stir and let it stand 5 to 10 minutes until slightly thickened."),
    ("self-raising flour", "cup", [("plain flour", 1, "cup"), ("baking powder", 1.5, "teaspoon"), ("salt", 0.25, "teaspoon")], "Whisk well so the baking powder is evenly distributed."),
    ("brown sugar", "cup", [("white sugar", 1, "cup"), ("molasses", 1, "tablespoon")], "Mix with a fork until the colour is even."),
    ("eggs (in baking)", "egg", [("ground flaxseed", 1, "tablespoon"), ("water", 3, "tablespoon")], "Let it gel for 5 minutes. Works best in muffins and cookies, not in recipes that rely on eggs for lift."),
]


def qty(x: float) -> str:
    """Kitchen quantity: 1.5 -> '1 1/2', 0.25 -> '1/4'."""
    f = Fraction(x).limit_denominator(8)
    whole, rest = divmod(f.numerator, f.denominator)
    return " ".join(p for p in (str(whole) if whole else "", f"{rest}/{f.denominator}" if rest else "") if p) or "0"


def g_substitute(rng: random.Random) -> list[Turn]:
    ing, unit, parts, note = draw(rng, "SUBS", SUBS)
    amt = rng.choice([1, 2, 3]) if unit == "egg" else rng.choice([0.5, 1, 1.5, 2])
    need = f"{amt} egg{'s' if amt > 1 else ''}" if unit == "egg" else f"{qty(amt)} {unit}{'s' if amt > 1 else ''} of {ing}"
    q = pick(rng, f"My recipe needs {need} and I don't have any. What can I use?", f"What can I substitute for {need}?")
    lines = [f"- {qty(q_ * amt)} {u}{'s' if q_ * amt > 1 else ''} {name}" for name, q_, u in parts]
    a = (f"For {need}, combine:\n\n" + "\n".join(lines) + f"\n\n{note} "
         + pick(rng, "The result won't be identical, but in most recipes nobody will notice.", "It's a standard swap that bakers use all the time."))
    return [U(ask(rng, q)), A(a)]


def g_sleep(rng: random.Random) -> list[Turn]:
    (bed, bh), (wake, wh) = rng.choice([("11pm", 23), ("midnight", 24), ("1am", 25)]), rng.choice([("6:30", 30.5), ("7", 31), ("7:30", 31.5)])
    q = f"I go to bed around {bed}, wake at {wake}, and still feel tired. I usually scroll my phone in bed. Any practical sleep tips?"
    hours = wh - bh
    a = (f"Going to bed at {bed} and waking at {wake} gives you at most {num(hours, 1)} hours in bed, and less actual sleep once you "
         f"count the scrolling; most adults need 7 to 9. " + pick(rng, "A few habits make the biggest difference.", "Beyond the hours, habits matter.")
         + " Keep the same wake-up time every day, weekends included; "
         "a consistent wake time anchors your body clock more than bedtime does. Get daylight in the first hour after waking, "
         "even ten minutes outside.\n\nIn the evening, move the phone out of reach for the last 30 to 60 minutes. The problem "
         "is less the blue light than the endless, engaging content that keeps your brain alert. Keep the bedroom cool, dark and "
         "quiet, and cut caffeine after early afternoon, since it lingers for hours.\n\n"
         + pick(rng, "If you're still exhausted after a few weeks of this, or someone says you snore heavily or stop breathing at "
                     "night, talk to a doctor; conditions like sleep apnea are common and treatable.",
                "Give changes two or three weeks before judging them. Persistent daytime sleepiness despite enough sleep is worth "
                "mentioning to a doctor."))
    return [U(ask(rng, q)), A(a)]


def g_running(rng: random.Random) -> list[Turn]:
    weeks, goal = rng.choice([6, 8, 10]), rng.choice(["run 5 km without stopping", "jog for 30 minutes", "finish a charity 5K"])
    q = f"I'm out of shape and want to {goal} in {weeks} weeks. How should I start without getting hurt?"
    a = (f"Start with run-walk intervals, three days a week with a rest day between. In week 1, alternate 1 minute of easy "
         f"jogging with 2 minutes of walking, eight times. Each week, shift the ratio a little toward running; by week "
         f"{weeks // 2} you might jog 5 minutes and walk 1, and by week {weeks} most people can {goal}.\n\nThe pace should feel "
         "easy enough to talk in short sentences. Going too fast is the most common beginner mistake and the main cause of "
         "sore shins and knees. If something hurts sharply or keeps hurting the next day, repeat the previous week instead of "
         "pushing on.\n\nComfortable shoes matter more than expensive ones. Warm up with five minutes of brisk walking, and if "
         "you have any heart or joint conditions, check with a doctor before starting.")
    return [U(ask(rng, q)), A(a)]


STAINS = {
    "coffee": "Blot (don't rub) as much as you can, then rinse from the back of the fabric with cold water to push the stain "
        "out the way it came in. Work a little liquid laundry detergent or dish soap into the spot, leave it for 5 minutes, "
        "and rinse again. Wash as usual, and check the stain is gone before drying, because heat sets it.",
    "red wine": "Blot immediately, then pour cold water through the stain or cover it with a layer of salt to draw the liquid "
        "out. Afterwards, a mix of dish soap and hydrogen peroxide (test on a hidden spot first; it can lighten colours) "
        "lifts most of what's left. Wash in cold water and air-dry until you're sure it's gone.",
    "grease": "Sprinkle cornstarch or baking soda on the spot and leave it for 15 minutes to absorb the oil, then brush it off. "
        "Rub a drop of dish soap into the stain, since it's designed to break up grease, and wash in the warmest water the "
        "fabric allows.",
    "ink": "Put a paper towel under the fabric and dab the stain with rubbing alcohol on a cotton ball, moving to a clean part "
        "of the cotton as the ink transfers. Don't scrub, which spreads it. Rinse, apply a little detergent, then wash.",
}


def g_stain(rng: random.Random) -> list[Turn]:
    stain, fabric = draw(rng, "STAINS", sorted(STAINS)), rng.choice(["cotton shirt", "pair of jeans", "white blouse", "sofa cushion cover"])
    q = pick(rng, f"I spilled {stain} on my {fabric}. How do I get it out?", f"Best way to remove a {stain} stain from a {fabric}?")
    return [U(ask(rng, q)), A(rng.choice(GEN_INTROS) + STAINS[stain] + " " + pick(rng, "Always check the care label first.", "The sooner you treat it, the better the odds."))]


PLANTS = {
    "succulent": ("the leaves are turning soft and mushy", "That's the classic sign of overwatering. Succulents store water in their "
                  "leaves and rot if the soil stays damp. Water only when the soil is completely dry, then soak it and let it "
                  "drain fully. Use a pot with a drainage hole and a gritty cactus mix, and give it the brightest window you have."),
    "pothos": ("the leaves are turning yellow", "Yellow leaves on a pothos usually mean too much water or poor drainage, "
               "especially if several leaves yellow at once. Let the top few centimetres of soil dry before watering, and make "
               "sure water isn't pooling in the saucer. One old leaf yellowing now and then is normal."),
    "basil": ("it keeps getting leggy and flowering", "Basil wants at least six hours of sun and regular pinching. Harvest from the "
              "top, cutting just above a pair of leaves, which makes it branch and bush out. Pinch off flower buds as soon as they "
              "appear; once it flowers, the leaves get bitter and growth slows."),
    "fiddle-leaf fig": ("it's dropping leaves", "Fiddle-leaf figs hate change. Leaf drop often follows a move, a cold draught or "
                        "a sudden shift in watering. Keep it in bright, indirect light away from radiators and doors, water when "
                        "the top 5 cm of soil is dry, and then leave it alone; it usually recovers in a few weeks."),
}


def g_plants(rng: random.Random) -> list[Turn]:
    plant = draw(rng, "PLANTS", sorted(PLANTS))
    sym, ans = PLANTS[plant]
    q = pick(rng, f"My {plant} is struggling: {sym}. What am I doing wrong?", f"Help, {sym} on my {plant}. Can I save it?")
    return [U(ask(rng, q)), A(rng.choice(GEN_INTROS) + ans)]


CITIES = {"Lisbon": ["the Alfama district and the castle", "Belém and its tower", "a ride on tram 28", "a day trip to Sintra"],
          "Kyoto": ["Fushimi Inari's gates, early in the morning", "the Arashiyama bamboo grove", "Kinkaku-ji, the Golden Pavilion", "the Gion district at dusk"],
          "Rome": ["the Colosseum and the Forum", "the Vatican Museums", "an evening in Trastevere", "the Pantheon and Piazza Navona"],
          "Edinburgh": ["the Royal Mile and the castle", "a hike up Arthur's Seat", "the National Museum of Scotland", "the shops and cafés of Stockbridge"],
          "Mexico City": ["the historic centre and the Zócalo", "Chapultepec Park and the anthropology museum", "Coyoacán", "a day trip to Teotihuacan"]}


def g_itinerary(rng: random.Random) -> list[Turn]:
    city = draw(rng, "CITIES", sorted(CITIES))
    days = rng.choice([2, 3, 4])
    sights = CITIES[city]
    q = f"Plan a relaxed {days}-day trip to {city}. I like walking, food and a bit of history, not rushing."
    plan = []
    for d in range(days):
        chunk = sights[d::days]
        plan.append(f"**Day {d + 1}:** " + " and ".join(chunk) + ". " + pick(rng, "Leave the afternoon open for wandering.",
                                                                             "Book a long lunch somewhere local.",
                                                                             "End with dinner in the neighbourhood you're staying in."))
    a = (f"Here's a gentle {days}-day plan for {city}:\n\n" + "\n".join(plan) + "\n\nBook tickets for the big sights ahead, "
         "go early to beat the crowds, and walk between nearby stops rather than taking taxis; that's where you'll find the "
         "best food and the small surprises.")
    return [U(ask(rng, q)), A(a)]


def g_jetlag(rng: random.Random) -> list[Turn]:
    frm, to, zones = rng.choice([("New York", "Paris", 6), ("Toronto", "Berlin", 6), ("Chicago", "Rome", 7), ("London", "Los Angeles", 8),
                                 ("Madrid", "Vancouver", 9), ("London", "Denver", 7), ("Boston", "Lisbon", 5), ("Dubai", "London", 4)])
    east = frm in ("New York", "Toronto", "Chicago", "Boston")
    q = f"Flying {frm} to {to} next week. How do I deal with jet lag?"
    a = (f"That's roughly {zones} time zones {'east' if east else 'west'}. As a rule of thumb the body adjusts by about an hour a "
         f"day, so it could take the better part of a week to feel fully normal"
         + (", and flying east is usually harder because you have to fall asleep earlier than your body wants." if east else
            ", though westward trips tend to be easier because staying up later is simpler than falling asleep earlier.")
         + "\n\nSwitch to local time as soon as you board: eat and sleep on the destination's schedule. On arrival, get outside in "
           "daylight, especially in the morning after flying east or the late afternoon after flying west. Keep naps under 30 "
           "minutes, drink water, and go easy on alcohol on the flight. If you use melatonin, ask a pharmacist about timing and dose.")
    return [U(ask(rng, q)), A(a)]


def g_budget(rng: random.Random) -> list[Turn]:
    pay = rng.choice([2400, 3100, 3800, 4500, 5200])
    q = f"I take home about ${pay:,} a month and never know where it goes. How should I set up a simple budget?"
    a = (f"A simple starting point is the 50/30/20 rule, applied to take-home pay:\n\n- Needs (rent, bills, groceries, transport): "
         f"50% = ${pay * 0.5:,.0f}\n- Wants (eating out, hobbies, subscriptions): 30% = ${pay * 0.3:,.0f}\n- Savings and extra "
         f"debt payments: 20% = ${pay * 0.2:,.0f}\n\nFirst, track one month of spending from your bank statements, since most "
         "people underestimate small recurring costs. Then automate: move the savings amount on payday so you never see it. "
         "Build an emergency fund of three months of needs before investing, and pay off high-interest card debt first. The "
         "percentages are a guide; in an expensive city, needs may take more, which is fine as long as you know it.")
    return [U(ask(rng, q)), A(a)]


def g_energy(rng: random.Random) -> list[Turn]:
    home = rng.choice(["a drafty old flat", "a small house", "a rented apartment"])
    q = f"Our energy bills doubled this winter. We live in {home}. What actually makes a difference?"
    a = (pick(rng, f"In {home}, heating is usually the largest cost, so start there.", "Heating is usually the largest cost, so start there.")
         + " Turning the thermostat down by one degree typically saves a few "
         "percent of heating energy. Seal draughts around windows and doors with cheap foam strips and draught excluders; in "
         "older homes this is often the best value per dollar. Close curtains at dusk and bleed radiators if they're cold at "
         "the top.\n\n"
         + pick(rng, "Wash clothes at 30°C, run full loads, and air-dry when you can; tumble dryers are energy-hungry.",
                "Check for appliances left on standby and replace the most-used bulbs with LEDs.")
         + " If you rent, ask the landlord about insulation; in many places there are grants that cover part of the cost.")
    return [U(ask(rng, q)), A(a)]


def g_language(rng: random.Random) -> list[Turn]:
    lang, mins = rng.choice(["Spanish", "Japanese", "German", "Portuguese", "Korean", "Italian"]), rng.choice([15, 20, 30, 45])
    q = f"I want to learn {lang} but I only have about {mins} minutes a day. What's the most effective approach?"
    a = (f"{mins} minutes a day is plenty if it's consistent. Split it roughly into three parts: a few minutes of spaced-repetition "
         "flashcards for vocabulary, some listening to material slightly above your level, and a little speaking or writing, "
         "even if it's just describing your day out loud.\n\nFocus on the most common words first; a few hundred of them cover "
         "a large share of everyday conversation. "
         + ("Learn the writing system early; it pays off quickly. " if lang in ("Japanese", "Korean") else "")
         + "After a couple of months, find a conversation partner or tutor, because speaking with a real person is where things "
           "click. Don't wait until you feel ready; nobody ever does.")
    return [U(ask(rng, q)), A(a)]


def g_pets(rng: random.Random) -> list[Turn]:
    pet = rng.choice(["rescue cat", "puppy", "adult rescue dog", "kitten"])
    q = f"We're bringing home a {pet} this weekend. What should the first week look like?"
    cat = "cat" in pet or "kitten" in pet
    a = ("Keep the first week calm and predictable. Set up one quiet room with food, water, a bed and "
         + ("a litter tray placed away from the food, " if cat else "a crate or bed, with easy access to the garden or a walk route, ")
         + "and let the animal explore the rest of the home gradually. Stick to regular times for meals"
         + (" and play" if cat else ", walks and toilet breaks") + ", and keep visitors to a minimum.\n\n"
         + ("Let the cat come to you; hiding for a few days is normal. " if cat else "Start short training sessions with treats, and reward calm behaviour. ")
         + "Book a vet check in the first week or two, keep feeding the food it's used to at first, and switch gradually if you "
           "want to change it. Patience now pays off for years.")
    return [U(ask(rng, q)), A(a)]


TIPPING = {"the United States": "Tipping is expected: 15 to 20% at sit-down restaurants, a dollar or two per drink at bars, and "
           "around 15% for taxis. Servers' wages often assume tips, so leaving nothing is read as a complaint.",
           "Japan": "Tipping isn't part of the culture and can cause confusion; good service is simply expected. A sincere thank "
           "you is the norm. Some high-end hotels or guides may accept a gift, handed over discreetly in an envelope.",
           "Germany": "Rounding up or adding about 5 to 10% is common in restaurants. Rather than leaving money on the table, "
           "you tell the server the total you want to pay when they bring the bill.",
           "the United Kingdom": "In restaurants 10 to 12.5% is typical, but check the bill, because a service charge is often "
           "already included. Tipping in pubs when ordering at the bar isn't expected."}


def g_tipping(rng: random.Random) -> list[Turn]:
    c = draw(rng, "TIPPING", sorted(TIPPING))
    q = pick(rng, f"How does tipping work in {c}? Don't want to be rude.", f"What are the tipping customs in {c} for restaurants and taxis?")
    return [U(ask(rng, q)), A(TIPPING[c] + " " + pick(rng, "Customs shift over time, so follow what locals around you do.",
                                                           "When in doubt, ask the staff at your hotel; they'll tell you honestly."))]


HOME = {"a flat tyre on the car": "Park on flat ground away from traffic, switch on the hazard lights and apply the handbrake. "
        "Loosen the wheel nuts about half a turn while the wheel is still on the ground, then jack the car up at the lifting point "
        "shown in the manual. Remove the nuts and the wheel, fit the spare, and tighten the nuts by hand in a star pattern. "
        "Lower the car and tighten them fully, again in a star pattern. Space-saver spares are usually limited to about 80 km/h, "
        "so get the tyre repaired soon.",
        "a running toilet": "Lift the tank lid and look at the flapper at the bottom. If water trickles past it into the bowl, "
        "the flapper is worn or the chain is too tight; adjust the chain so it has a little slack, or replace the flapper, which "
        "is cheap. If water instead runs into the overflow tube, the fill level is too high: lower the float until the water "
        "stops about 2 to 3 cm below the top of the tube.",
        "a slow bathroom drain": "Most slow bathroom drains are hair and soap clogs close to the surface. Remove the stopper, "
        "pull out what you can with a plastic drain snake, then flush with very hot water. A plunger can help if you cover the "
        "overflow hole with a wet cloth. Avoid mixing chemical drain cleaners, and if several drains are slow at once, the "
        "problem is further down and needs a plumber.",
        "hanging a heavy mirror": "Find out what the wall is made of first. On plasterboard, use a stud finder and screw into a "
        "wooden stud if you can; otherwise use heavy-duty hollow-wall anchors rated well above the mirror's weight. On brick or "
        "concrete, drill with a masonry bit and use wall plugs. Use two fixing points rather than one for stability, and check "
        "with a level before the final tightening."}


def g_home(rng: random.Random) -> list[Turn]:
    job = draw(rng, "HOME", sorted(HOME))
    q = pick(rng, f"How do I deal with {job}? I'm not very handy.", f"Step by step, how do I handle {job} myself?")
    return [U(ask(rng, q)), A(rng.choice(GEN_INTROS) + HOME[job])]


def g_screen(rng: random.Random) -> list[Turn]:
    hrs = rng.choice([7, 8, 9, 10])
    q = f"I work at a computer about {hrs} hours a day and my eyes and neck are killing me by the evening. What helps?"
    a = ("Try the 20-20-20 rule for your eyes: every 20 minutes, look at something about 20 feet (6 metres) away for 20 seconds. "
         "We blink less when staring at screens, so deliberate blinking and good room lighting help with dryness too.\n\nFor the "
         "neck, set the top of the monitor at or slightly below eye level, about an arm's length away, and keep the keyboard "
         "close enough that your elbows rest near your sides. "
         + pick(rng, "A laptop on its own forces you to look down; a stand plus a separate keyboard fixes that.",
                "Stand up and move for a couple of minutes every hour.")
         + f" Over {hrs} hours, small breaks add up. If the eye strain persists, get an eye test; a mild prescription can make a big difference.")
    return [U(ask(rng, q)), A(a)]


QUICK_FACTS = {
    "What's the tallest mountain in Africa?": "Mount Kilimanjaro in Tanzania, at about 5,895 metres (19,341 feet). It's a dormant "
        "volcano and the highest free-standing mountain in the world, meaning it rises on its own rather than as part of a "
        "range. Climbers can reach the summit without technical gear, but altitude sickness is the real challenge, so routes "
        "that take more days to acclimatise have better success rates.",
    "how long should I boil an egg?": "From a rolling boil, lower the eggs in gently: about 6 minutes for a runny yolk, 7 for "
        "jammy, and 9 to 10 for fully hard-boiled. Move them into cold water straight away to stop the cooking; that also "
        "makes them easier to peel. Very fresh eggs are harder to peel, so eggs that are a week or two old work best.",
    "why do cats purr?": "Cats purr by rapidly twitching the muscles of the larynx as they breathe in and out, which makes the "
        "vocal folds vibrate. They purr when content, but also when stressed, hurt or giving birth, so it seems to be a "
        "general signal and a way to soothe themselves. Kittens purr while nursing, which may help the mother locate them.",
    "How much water should I drink a day?": "There's no single number that fits everyone. A common guideline is roughly 2 litres "
        "of fluid a day for women and 2.5 to 3 for men, but that includes water from food, tea and coffee. Needs rise with heat, "
        "exercise and illness. For most healthy people, drinking when thirsty and having pale yellow urine is a good sign you're "
        "getting enough.",
    "What's the longest river in the world?": "It's usually given as the Nile, at roughly 6,650 km, with the Amazon close behind. "
        "Some researchers argue the Amazon is longer, depending on where you decide its source is. Measuring rivers is "
        "surprisingly hard because deltas, seasonal channels and the choice of source all change the answer. By volume of "
        "water, the Amazon wins easily.",
    "why do onions make you cry?": "Cutting an onion breaks its cells, and enzymes convert sulfur compounds into a volatile "
        "gas called syn-propanethial-S-oxide. When it reaches your eyes, it irritates them and triggers tears to wash it away. "
        "Chilling the onion first, using a sharp knife that crushes fewer cells, and cutting the root end last all reduce it.",
    "How do birds know where to migrate?": "Birds combine several cues. Many use the position of the sun and, at night, the "
        "stars; they can sense Earth's magnetic field; and they recognise landmarks such as coastlines and mountain ranges. "
        "Young birds of some species migrate alone on their first trip, which shows much of the route is inherited, while "
        "others learn it by following adults.",
    "What's the largest desert on Earth?": "Technically Antarctica, because a desert is defined by low precipitation, not heat, "
        "and Antarctica gets very little. The largest hot desert is the Sahara in northern Africa, at around 9 million square "
        "kilometres, roughly the size of the United States or China.",
    "how do I keep cut flowers fresh longer?": "Trim the stems at an angle under running water, remove any leaves that would sit "
        "below the waterline, and use a clean vase. Change the water every two days and re-trim the stems. Keep the vase "
        "away from direct sun, heaters and fruit bowls; ripening fruit releases ethylene, which makes flowers age faster.",
    "Who built the pyramids of Giza?": "They were built for pharaohs of Egypt's Fourth Dynasty, roughly 2600 to 2500 BCE; the "
        "Great Pyramid was made for Khufu. The builders were organised crews of Egyptian workers, not slaves as often "
        "claimed: archaeologists have excavated their nearby villages, bakeries and cemeteries. Stone was quarried, moved on "
        "sledges and ramps, and much of it floated along the Nile.",
    "how do I get rid of fruit flies in my kitchen?": "Remove what they breed in first: overripe fruit, the compost caddy, "
        "sticky recycling and damp drain gunk. Then trap the adults with a small jar of apple cider vinegar plus a drop of dish "
        "soap, which breaks the surface tension so they sink. Cover it with cling film poked with a few holes if they keep "
        "escaping. Within a week or so the population collapses.",
    "How can I fall asleep faster?": "Keep a fixed wake-up time, give yourself a 30-minute wind-down without screens, and keep "
        "the room cool and dark. If you're still awake after about 20 minutes, get up and do something dull in dim light until "
        "you feel sleepy; lying there frustrated teaches your brain that bed is for worrying. Avoid caffeine after lunch and "
        "big meals late in the evening.",
    "Why is the ocean salty?": "Rain is slightly acidic, so it slowly dissolves minerals from rocks, and rivers carry those "
        "dissolved salts to the sea. When seawater evaporates, the water leaves but the salts stay behind, so they have "
        "accumulated over hundreds of millions of years. Hydrothermal vents on the sea floor add more. On average seawater is "
        "about 3.5% salt, mostly sodium chloride.",
    "When did the Berlin Wall fall?": "On the night of 9 November 1989, after an East German official mistakenly announced "
        "that new travel rules took effect immediately. Crowds gathered at the crossings, and the border guards eventually "
        "opened the gates. The wall had stood since August 1961. Germany was formally reunified less than a year later, on "
        "3 October 1990.",
    "How do I clean a cast iron pan?": "While it's still warm, rinse it with hot water and scrub with a brush or scraper; a "
        "little dish soap is fine despite the myth. Don't soak it or put it in the dishwasher. Dry it completely, ideally on "
        "the hob for a minute, then rub a very thin layer of oil over the inside. That keeps the seasoning intact and stops rust.",
    "What's the best way to store fresh herbs?": "Treat soft herbs like flowers: trim the stems and stand parsley, coriander or "
        "mint in a glass of water in the fridge with a loose bag over the top. Basil prefers the counter, since cold blackens "
        "its leaves. Hardy herbs like rosemary and thyme keep best wrapped in a slightly damp paper towel in a container in the fridge.",
    "Why do we have leap years?": "Earth takes about 365.2422 days to orbit the Sun, not exactly 365. Without correction the "
        "calendar would drift by about a day every four years. Adding 29 February every fourth year overcorrects slightly, so "
        "century years are skipped unless divisible by 400: 1900 was not a leap year, but 2000 was.",
    "What causes the northern lights?": "The Sun constantly emits charged particles, the solar wind. Earth's magnetic field "
        "funnels some of them toward the polar regions, where they collide with gases in the upper atmosphere. Oxygen glows "
        "green or red and nitrogen blue or purple. Strong solar storms push the aurora further from the poles, which is when "
        "people at lower latitudes get to see it.",
    "Is it safe to refreeze meat that has thawed?": "If it thawed in the fridge and stayed cold, yes, you can refreeze it, "
        "though the texture may suffer a little. If it thawed on the counter, in warm water or in the microwave, cook it first; "
        "cooked meat can then be frozen. When in doubt about how long it sat out, throw it away.",
}


def g_quickfact(rng: random.Random) -> list[Turn]:
    q = draw(rng, "QUICK_FACTS", sorted(QUICK_FACTS))
    return [U(ask(rng, q)), A(rng.choice(GEN_INTROS) + QUICK_FACTS[q])]


GENERAL_TEMPLATES: list[Template] = [g_capital, g_travel, g_science, g_history, g_cooking, g_substitute, g_sleep, g_running,
                                     g_stain, g_plants, g_itinerary, g_jetlag, g_budget, g_energy, g_language, g_pets,
                                     g_tipping, g_home, g_screen, g_quickfact, g_quickfact, g_quickfact]


# ----------------------------------------------------------------------------- research domain
STUDIES = [("a mindfulness app", "self-reported stress", "office workers"), ("a peer tutoring program", "maths test scores", "ninth-graders"),
           ("a redesigned onboarding email", "30-day retention", "new users"), ("a low-sodium meal plan", "systolic blood pressure", "adults over 50"),
           ("a code-review checklist", "post-release defects", "software teams"), ("sit-stand desks", "lower-back pain scores", "call-centre staff"),
           ("a text-message reminder", "vaccination uptake", "clinic patients"), ("a gamified reading app", "reading fluency", "second-graders")]


def phi(z: float) -> float:
    """Standard normal CDF."""
    return 0.5 * math.erfc(-z / math.sqrt(2))


def p_two_sided(z: float) -> float:
    return 2 * (1 - phi(abs(z)))


def fmt_p(p: float) -> str:
    return "< 0.001" if p < 0.001 else f"= {p:.3f}"


def r_abtest(rng: random.Random) -> list[Turn]:
    n1, n2 = rng.choice([1200, 2500, 4000, 8000]), rng.choice([1200, 2500, 4000, 8000])
    p1 = rng.choice([0.04, 0.08, 0.12, 0.2])
    p2 = p1 * rng.choice([0.95, 1.05, 1.1, 1.2, 1.3])
    x1, x2 = round(n1 * p1), round(n2 * p2)
    r1, r2 = x1 / n1, x2 / n2
    pool = (x1 + x2) / (n1 + n2)
    z = (r2 - r1) / math.sqrt(pool * (1 - pool) * (1 / n1 + 1 / n2))
    se = math.sqrt(r1 * (1 - r1) / n1 + r2 * (1 - r2) / n2)
    lo, hi = (r2 - r1) - 1.96 * se, (r2 - r1) + 1.96 * se
    q = (f"We ran an A/B test: control converted {x1} of {n1:,} visitors, the variant {x2} of {n2:,}. Is the difference real? "
         f"How should I report it?")
    p = p_two_sided(z)
    a = (f"Conversion is {r1:.2%} for control and {r2:.2%} for the variant, a difference of {(r2 - r1) * 100:+.2f} percentage points "
         f"({(r2 / r1 - 1):+.1%} relative). A two-proportion z-test gives z = {z:.2f}, p {fmt_p(p)}, and the 95% confidence "
         f"interval for the difference is [{lo * 100:+.2f}, {hi * 100:+.2f}] points.\n\n"
         + ("The interval excludes zero, so at the usual 5% level the data are hard to explain by chance alone. "
            if p < 0.05 else "The interval includes zero, so you can't rule out that the variant does nothing, or even slightly worse. ")
         + "Report the interval, not just the p-value, because it shows how large the effect plausibly is. Also confirm the "
           "test ran for the planned duration; stopping as soon as p dips below 0.05 inflates false positives.")
    return [U(ask(rng, q)), A(a)]


def r_ci_interp(rng: random.Random) -> list[Turn]:
    tr, outcome, pop = rng.choice(STUDIES)
    diff, half = round(rng.uniform(0.5, 6), 1), round(rng.uniform(0.8, 5), 1)
    lo, hi = round(diff - half, 1), round(diff + half, 1)
    z = diff / (half / 1.96)
    q = (f"A paper on {tr} for {pop} reports a mean difference in {outcome} of {diff} points, 95% CI [{lo}, {hi}], p {fmt_p(p_two_sided(z))}. "
         f"How do I interpret that in plain language?")
    a = (f"The best single estimate is that {tr} changed {outcome} by {diff} points relative to the comparison group. The "
         f"confidence interval says the data are compatible with effects anywhere from {lo} to {hi} points. "
         + ("Because the interval crosses zero, the study can't distinguish a small benefit from no effect or even a small harm. "
            if lo <= 0 else "Because the whole interval is above zero, a true effect of zero is not well supported. ")
         + "\n\nTwo cautions. A 95% interval doesn't mean a 95% chance the true value lies in this particular range; it describes "
           "how the procedure performs over repeated studies. And statistical significance says nothing about practical "
           f"importance: ask whether even {hi} points on this {outcome} scale would matter to {pop}.")
    return [U(ask(rng, q)), A(a)]


def r_sample_size(rng: random.Random) -> list[Turn]:
    base, lift = rng.choice([0.05, 0.1, 0.2, 0.3]), rng.choice([0.01, 0.02, 0.03, 0.05])
    power = rng.choice([0.8, 0.9])
    zb = 0.8416 if power == 0.8 else 1.2816
    p1, p2 = base, base + lift
    n = math.ceil((1.96 + zb) ** 2 * (p1 * (1 - p1) + p2 * (1 - p2)) / lift ** 2)
    q = (f"I'm designing an experiment. Baseline rate is about {base:.0%}, and I want to detect an increase to {p2:.0%}. "
         f"How many participants per group for {power:.0%} power at alpha 0.05?")
    a = (f"Using the normal approximation for two proportions:\n\nn per group = (z_(α/2) + z_β)² · [p1(1-p1) + p2(1-p2)] / (p2 - p1)²\n\n"
         f"With z_(α/2) = 1.96, z_β = {zb} for {power:.0%} power, p1 = {p1:g}, p2 = {p2:g}:\n\n"
         f"n = ({1.96 + zb:.4f})² x ({p1 * (1 - p1):.4f} + {p2 * (1 - p2):.4f}) / {lift:g}² ≈ **{n:,} per group**, "
         f"{2 * n:,} in total.\n\nAdd a margin for dropout, perhaps 10-15%. Notice how sensitive this is to the effect size: "
         f"halving the detectable difference roughly quadruples the sample. If {2 * n:,} is out of reach, consider a larger "
         f"minimum effect worth detecting or a more sensitive outcome measure.")
    return [U(ask(rng, q)), A(a)]


FLAWS = {
    "no control group": "Without a control group, any improvement could be due to time, seasonal change or regression to the mean.",
    "self-selected participants": "Volunteers who opt in are often more motivated, so the effect may not generalise.",
    "small sample": "With so few participants, estimates are noisy and a single outlier can drive the result.",
    "high dropout": "When many participants leave, those who remain may differ systematically; an intention-to-treat analysis is needed.",
    "unblinded outcome assessors": "Assessors who know the group assignment can unintentionally bias subjective ratings.",
    "many outcomes tested": "Testing many outcomes and highlighting the significant ones inflates the false-positive rate.",
    "short follow-up": "A short follow-up can't show whether the effect persists or fades.",
}


def r_critique(rng: random.Random) -> list[Turn]:
    tr, outcome, pop = rng.choice(STUDIES)
    flaws = rng.sample(sorted(FLAWS), 3)
    n, weeks = rng.choice([24, 38, 60, 140]), rng.choice([2, 4, 6, 12])
    desc = {"no control group": "everyone received the intervention", "self-selected participants": "participants signed up through a newsletter",
            "small sample": f"only {n // 2} completed the study", "high dropout": f"{rng.randint(30, 45)}% dropped out before the end",
            "unblinded outcome assessors": "the researchers who rated outcomes knew who was in which group",
            "many outcomes tested": f"{rng.randint(8, 20)} outcomes were measured and the paper highlights two",
            "short follow-up": f"outcomes were measured only once, {weeks} weeks in"}
    q = (f"I'm reviewing a study claiming {tr} improves {outcome} in {pop}. {n} {pop} took part; "
         + "; ".join(desc[f] for f in flaws) + ". How convincing is this?")
    a = ("I'd treat the claim as preliminary. The main concerns:\n\n"
         + "\n".join(f"- **{f.capitalize()}.** {FLAWS[f]}" for f in flaws)
         + f"\n\nA stronger design would randomise {pop} to {tr} or an active control, pre-register the primary outcome, blind "
           "the assessors and report all outcomes. Ask the authors for effect sizes with confidence intervals, not just p-values.")
    return [U(ask(rng, q)), A(a)]


def r_abstract(rng: random.Random) -> list[Turn]:
    tr, outcome, pop = rng.choice(STUDIES)
    n, pct, weeks = rng.choice([180, 412, 960, 2300]), rng.randint(4, 18), rng.choice([8, 12, 24])
    abstract = (f"Background: Evidence on whether {tr} affects {outcome} among {pop} is mixed. Methods: We conducted a randomised "
                f"trial with {n} {pop} assigned 1:1 to {tr} or usual practice for {weeks} weeks. The primary outcome was {outcome}; "
                f"secondary outcomes included engagement and satisfaction. Results: The intervention group improved by {pct}% "
                f"relative to control on the primary outcome. Engagement declined steadily after week {weeks // 2}. "
                f"Conclusions: {tr[0].upper() + tr[1:]} produced a modest improvement, though sustaining engagement remains a challenge.")
    q = pick(rng, "Summarize this abstract for a non-specialist and tell me what's missing:", "What's the takeaway here, and what would you want to know before trusting it?")
    a = (f"In plain terms: {n} {pop} were randomly split into two groups, and those who used {tr} for {weeks} weeks did about "
         f"{pct}% better on {outcome} than those who didn't. People used it less as time went on.\n\nWhat the abstract leaves out: "
         "the absolute numbers behind the relative improvement, confidence intervals, how many people dropped out, whether "
         "the analysis was pre-registered, and whether the effect lasted after the study ended. The falling engagement also "
         "raises the question of whether the effect would hold up outside a trial.")
    return [U(ask(rng, q) + "\n\n" + abstract), A(a)]


def r_cohen(rng: random.Random) -> list[Turn]:
    tr, outcome, pop = rng.choice(STUDIES)
    m1, m2 = round(rng.uniform(40, 70), 1), 0.0
    sd1, sd2 = round(rng.uniform(8, 15), 1), round(rng.uniform(8, 15), 1)
    m2 = round(m1 + rng.uniform(1, 9), 1)
    n1, n2 = rng.randint(30, 120), rng.randint(30, 120)
    sp = math.sqrt(((n1 - 1) * sd1 ** 2 + (n2 - 1) * sd2 ** 2) / (n1 + n2 - 2))
    d = (m2 - m1) / sp
    size = "negligible" if d < 0.2 else "small" if d < 0.5 else "medium" if d < 0.8 else "large"
    q = (f"Control: mean {m1}, SD {sd1}, n = {n1}. Treatment ({tr}): mean {m2}, SD {sd2}, n = {n2}. Outcome is {outcome}. "
         f"What's the effect size?")
    a = (f"Cohen's d uses the pooled standard deviation:\n\ns_p = sqrt(((n1-1)s1² + (n2-1)s2²) / (n1+n2-2)) = "
         f"sqrt(({n1 - 1} x {sd1}² + {n2 - 1} x {sd2}²) / {n1 + n2 - 2}) = {sp:.2f}\n\nd = ({m2} - {m1}) / {sp:.2f} = **{d:.2f}**\n\n"
         f"By Cohen's rough benchmarks (0.2 small, 0.5 medium, 0.8 large) that's a {size} effect. Those labels are conventions, "
         f"though; whether a {m2 - m1:.1f}-point change in {outcome} matters depends on the field. With samples this size, "
         f"Hedges' g, which corrects a slight upward bias, would be almost identical.")
    return [U(ask(rng, q)), A(a)]


def r_multiple(rng: random.Random) -> list[Turn]:
    k = rng.randint(5, 9)
    ps = sorted(round(rng.choice([rng.uniform(0.0005, 0.012), rng.uniform(0.012, 0.06), rng.uniform(0.06, 0.6)]), 4) for _ in range(k))
    alpha = 0.05
    bonf = [p for p in ps if p < alpha / k]
    holm = []
    for i, p in enumerate(ps):
        if p < alpha / (k - i):
            holm.append(p)
        else:
            break
    q = f"I tested {k} hypotheses and got p-values {', '.join(str(p) for p in ps)}. Which survive a multiple-comparison correction?"
    a = (f"With {k} tests at α = 0.05, Bonferroni compares each p-value to 0.05/{k} = {alpha / k:.4f}. "
         f"{len(bonf)} {'survives' if len(bonf) == 1 else 'survive'}: {', '.join(map(str, bonf)) or 'none'}.\n\nHolm's step-down method is uniformly more powerful and "
         f"still controls the family-wise error rate: sort the p-values and compare the i-th smallest to 0.05/({k} - i + 1), "
         f"stopping at the first failure. Here {len(holm)} {'survives' if len(holm) == 1 else 'survive'}: {', '.join(map(str, holm)) or 'none'}.\n\n"
         "If the analyses are exploratory and you can tolerate some false discoveries, controlling the false discovery rate "
         "with Benjamini-Hochberg is a common alternative. Whatever you choose, state it in the methods before looking at results.")
    return [U(ask(rng, q)), A(a)]


def r_correlation(rng: random.Random) -> list[Turn]:
    r, n = round(rng.uniform(0.15, 0.7), 2), rng.choice([40, 85, 150, 600])
    x, y = rng.choice([("hours of sleep", "exam scores"), ("screen time", "anxiety scores"), ("coffee consumption", "productivity ratings"),
                       ("team size", "deployment frequency"), ("green space near home", "self-rated wellbeing")])
    t = r * math.sqrt((n - 2) / (1 - r * r))
    q = f"We found r = {r} between {x} and {y} (n = {n}). Can we say {x} affects {y}?"
    a = (f"r = {r} is a {'weak' if r < 0.3 else 'moderate' if r < 0.5 else 'fairly strong'} positive association; "
         f"r² = {r * r:.2f}, so about {r * r:.0%} of the variance in {y} is shared with {x}. With n = {n}, t = {t:.2f} on "
         f"{n - 2} degrees of freedom, p {fmt_p(p_two_sided(t))} (normal approximation).\n\nBut correlation alone can't show "
         f"that {x} affects {y}. The arrow could point the other way, or a third factor such as income, age or health could "
         "drive both. To move toward a causal claim you'd want an experiment, a natural experiment, longitudinal data showing "
         "the order of changes, or at least adjustment for the obvious confounders, stated before the analysis.")
    return [U(ask(rng, q)), A(a)]


def r_regression(rng: random.Random) -> list[Turn]:
    b, se = round(rng.uniform(-3, 5), 2), round(rng.uniform(0.4, 1.8), 2)
    xv, yv, unit = rng.choice([("years of experience", "salary (thousands)", "year"), ("weekly training hours", "race time (minutes)", "hour"),
                               ("fertilizer dose", "yield (kg/plot)", "gram per m²")])
    t = b / se
    q = (f"In my linear regression of {yv} on {xv} (plus age and region as controls), the coefficient for {xv} is {b} with SE {se}. "
         f"What does that mean?")
    a = (f"Holding age and region fixed, each additional {unit} of {xv} is associated with a {b:+} change in {yv} on average. "
         f"The t-statistic is {b} / {se} = {t:.2f}, and an approximate 95% CI is {b} ± 1.96 x {se} = [{b - 1.96 * se:.2f}, {b + 1.96 * se:.2f}]. "
         + ("The interval excludes zero. " if abs(t) > 1.96 else "The interval includes zero, so the data are consistent with no association. ")
         + "\n\nKeep in mind this is an association conditional on the controls, not a causal effect, and the linear form "
           "assumes the relationship is the same at every level; plot residuals against the predictor to check.")
    return [U(ask(rng, q)), A(a)]


def r_kappa(rng: random.Random) -> list[Turn]:
    a_, d_ = rng.randint(20, 60), rng.randint(20, 60)
    b_, c_ = rng.randint(2, 15), rng.randint(2, 15)
    n = a_ + b_ + c_ + d_
    po = (a_ + d_) / n
    pe = ((a_ + b_) * (a_ + c_) + (c_ + d_) * (b_ + d_)) / n ** 2
    k = (po - pe) / (1 - pe)
    code = rng.choice(["'mentions cost'", "'expresses frustration'", "'requests a feature'"])
    q = (f"Two coders labelled {n} interview excerpts for the code {code}. Both yes: {a_}; both no: {d_}; coder 1 yes and coder 2 no: {b_}; "
         f"coder 1 no and coder 2 yes: {c_}. Is agreement acceptable?")
    a = (f"Observed agreement p_o = ({a_} + {d_}) / {n} = {po:.3f}. Chance agreement from the marginals: "
         f"p_e = ({a_ + b_}·{a_ + c_} + {c_ + d_}·{b_ + d_}) / {n}² = {pe:.3f}.\n\nCohen's kappa = (p_o - p_e) / (1 - p_e) = **{k:.2f}**.\n\n"
         + ("That's usually described as substantial agreement" if k > 0.6 else "That's only moderate agreement at best")
         + ", using the common Landis and Koch bands. Beyond the number, read the disagreements together: they often reveal "
           "that the code's definition is ambiguous, and a sharper codebook entry with examples helps more than another round of coding.")
    return [U(ask(rng, q)), A(a)]


def r_heterogeneity(rng: random.Random) -> list[Turn]:
    k = rng.randint(6, 25)
    qstat = round(rng.uniform(k * 0.8, k * 4), 1)
    i2 = max(0.0, (qstat - (k - 1)) / qstat)
    q = f"My meta-analysis pools {k} studies and reports Q = {qstat} with {k - 1} df. What's I², and should I worry?"
    lvl = "low" if i2 < 0.3 else "moderate" if i2 < 0.6 else "substantial"
    a = (f"I² = (Q - df) / Q = ({qstat} - {k - 1}) / {qstat} = **{i2:.0%}** (truncated at 0). That's {lvl} heterogeneity: roughly "
         f"{i2:.0%} of the variation in effect estimates reflects real differences between studies rather than sampling error.\n\n"
         + ("With this much heterogeneity a single pooled estimate can mislead. Use a random-effects model, report a prediction "
            "interval, and explore pre-specified moderators such as population, dose or study quality. "
            if i2 >= 0.3 else "A random-effects model is still a reasonable default, but the pooled estimate is fairly representative. ")
         + f"With only {k} studies, I² itself is imprecise, so report its confidence interval too.")
    return [U(ask(rng, q)), A(a)]


def r_missing(rng: random.Random) -> list[Turn]:
    pct, var = rng.randint(8, 35), rng.choice(["household income", "follow-up weight", "sleep diary entries", "exit survey responses"])
    q = f"About {pct}% of {var} values are missing in my dataset. Can I just drop those rows?"
    a = (f"Dropping rows (complete-case analysis) is only unbiased if the data are missing completely at random (MCAR), meaning "
         f"missingness is unrelated to anything. With {var}, that's doubtful; people with certain characteristics are often "
         f"more likely to skip it. First compare respondents with and without {var} on the variables you do have.\n\nIf "
         "missingness depends on observed variables (MAR), multiple imputation using those variables gives less biased "
         f"estimates and keeps the {pct}% of rows' other information. If it may depend on the missing value itself (MNAR), no "
         "method fully fixes it; run sensitivity analyses showing how conclusions change under plausible assumptions. Report "
         "the amount of missing data and your approach either way.")
    return [U(ask(rng, q)), A(a)]


def r_ablation(rng: random.Random) -> list[Turn]:
    comps = rng.sample(["a retrieval step", "a data-augmentation stage", "a curriculum schedule", "an auxiliary loss", "a re-ranking module", "a calibration layer"], 3)
    seeds = rng.choice([3, 5])
    q = f"Reviewers want an ablation study. Our method has {', '.join(comps[:-1])} and {comps[-1]}. How do I design it properly?"
    a = ("Remove one component at a time from the full method, keeping everything else fixed (data, budget, hyperparameters), and "
         "report each variant's score next to the full system:\n\n"
         + "\n".join(f"- full method without {c}" for c in comps)
         + f"\n\nRun every configuration with {seeds} or more random seeds and report the mean and spread, since a difference "
           "smaller than the seed-to-seed variation isn't evidence of anything. If components may interact, add the variant with "
           "only the base model plus each single component. Keep the tuning budget equal for all variants; re-tuning only the "
           "full model quietly favours it. Finally, say clearly which ablations were planned and which were added after seeing results.")
    return [U(ask(rng, q)), A(a)]


def r_survey(rng: random.Random) -> list[Turn]:
    topic = rng.choice(["the new parking policy", "remote work", "the cafeteria menu", "the recent software migration"])
    bad = f"Don't you agree that {topic} has caused serious problems for staff?"
    q = f"Is this a good survey question? \"{bad}\" We'll send it to about {rng.choice([200, 500, 1500])} employees."
    a = ("It's a leading question: 'Don't you agree' invites agreement, and 'serious problems' presupposes the answer. It's also "
         "a yes/no question, which throws away how strongly people feel. A neutral version:\n\n"
         f"\"How has {topic} affected your work?\" with a balanced scale (very negatively, somewhat negatively, no effect, somewhat "
         "positively, very positively) and an optional free-text follow-up.\n\nPilot the survey with a handful of people and ask "
         "them to think aloud while answering. Also think about who responds: people with strong opinions are more likely to reply, "
         "so report the response rate and compare respondents with the whole staff where you can.")
    return [U(ask(rng, q)), A(a)]


def r_related(rng: random.Random) -> list[Turn]:
    topic = rng.choice(["automated feedback on student essays", "predicting equipment failures from sensor data", "urban heat islands and tree cover",
                        "remote patient monitoring for heart failure", "misinformation correction on social media"])
    q = f"How should I structure the related-work section of my thesis on {topic}? I have about 40 papers and it reads like a list."
    a = ("Organise by ideas, not by paper. Group the work into three to five themes, each a paragraph or subsection, for example: "
         f"how the problem of {topic} has been framed, the main families of methods, how they have been evaluated, and open "
         "gaps. Within each theme, say what the studies have in common, where they disagree and why, then cite them together "
         "rather than summarising one per sentence.\n\nEnd each theme with a sentence on its limitation that your work "
         "addresses, so the section builds toward your contribution. A small table comparing approaches on a few dimensions "
         "(data, method, evaluation, limitation) often replaces pages of prose. Finally, make sure the most recent work is "
         "covered; examiners notice missing recent papers first.")
    return [U(ask(rng, q)), A(a)]


def r_confusion(rng: random.Random) -> list[Turn]:
    tp, fp, fn, tn = rng.randint(40, 200), rng.randint(5, 80), rng.randint(5, 80), rng.randint(300, 2000)
    task = rng.choice(["fraud detection", "tumour screening", "spam filtering", "defect detection on a production line"])
    prec, rec = tp / (tp + fp), tp / (tp + fn)
    f1, acc = 2 * prec * rec / (prec + rec), (tp + tn) / (tp + fp + fn + tn)
    q = f"Our {task} model's confusion matrix: TP = {tp}, FP = {fp}, FN = {fn}, TN = {tn}. Accuracy looks great. Is the model good?"
    a = (f"- Accuracy = ({tp} + {tn}) / {tp + fp + fn + tn} = {acc:.3f}\n- Precision = {tp} / ({tp} + {fp}) = {prec:.3f}\n"
         f"- Recall = {tp} / ({tp} + {fn}) = {rec:.3f}\n- F1 = {f1:.3f}\n\nAccuracy is flattered by the {tn} true negatives: "
         f"positives are only {(tp + fn) / (tp + fp + fn + tn):.1%} of cases, so a model that always said 'negative' would already "
         f"score {(fp + tn) / (tp + fp + fn + tn):.1%}. For {task}, the key question is which error costs more. The model misses "
         f"{fn} of {tp + fn} real positives ({1 - rec:.1%}). Look at the precision-recall curve and choose the threshold based on those costs.")
    return [U(ask(rng, q)), A(a)]


def r_power(rng: random.Random) -> list[Turn]:
    n, d = rng.choice([15, 20, 30, 40]), rng.choice([0.3, 0.4, 0.5])
    power = phi(d * math.sqrt(n / 2) - 1.96)
    need = math.ceil(2 * ((1.96 + 0.8416) / d) ** 2)
    tr, outcome, pop = rng.choice(STUDIES)
    q = (f"Our pilot of {tr} with {n} {pop} per group found no significant effect on {outcome} (p = {rng.uniform(0.2, 0.7):.2f}). "
         f"Can we conclude it doesn't work?")
    a = (f"Not from this alone. If the true effect were a plausible d = {d}, a two-group study with {n} per group would detect it "
         f"only about {power:.0%} of the time (normal approximation), so a non-significant result was the likely outcome even if it "
         f"works. Absence of evidence isn't evidence of absence here.\n\nTo have 80% power for d = {d} you'd need about {need} per "
         "group. If you want to argue the effect is negligible, use an equivalence test (TOST) against a pre-specified smallest "
         "effect of interest, or report the confidence interval and show it excludes meaningful effects.")
    return [U(ask(rng, q)), A(a)]


def r_hypothesis(rng: random.Random) -> list[Turn]:
    tr, outcome, pop = rng.choice(STUDIES)
    q = f"My idea is that {tr} is 'good for' {pop}. My advisor says it's not testable yet. How do I turn it into proper hypotheses?"
    a = (f"Make each part concrete. Define the population ({pop}, with inclusion criteria), the intervention ({tr}, with dose and "
         f"duration), the comparison (usual practice or an active control) and one primary outcome ({outcome}, with the "
         "instrument and time point).\n\nThen write a directional hypothesis, for example: compared with the control group, "
         f"{pop} who use {tr} for eight weeks will show a greater improvement in {outcome} at week eight. Add the smallest effect "
         "you'd consider meaningful, since that drives the sample size.\n\nFinally, pre-register the hypothesis, primary "
         "outcome, analysis model and exclusion rules before collecting data. Secondary questions are fine, but label them as "
         "exploratory.")
    return [U(ask(rng, q)), A(a)]


def r_limitations(rng: random.Random) -> list[Turn]:
    tr, outcome, pop = rng.choice(STUDIES)
    q = pick(rng, f"How do I write the limitations section of a paper? Ours is a study of {tr} and {outcome} in {pop}.",
             f"My supervisor says my limitations paragraph is too defensive. The study looked at {tr} for {pop}. How should it read?")
    a = ("A good limitations section is specific, honest and tells the reader what each limitation means for the conclusions. "
         "For each one: name it, explain the likely direction and size of its effect, and say what you did to mitigate it or "
         f"what future work should do. For a study of {tr}, typical candidates are the sample (were {pop} recruited in a way "
         f"that limits generalisation?), the measurement of {outcome} (self-report, single time point), the design (can "
         "confounding be ruled out?) and statistical power.\n\nAvoid a generic list that could appear in any paper, and avoid "
         "undermining your own findings: prioritise the two or three limitations that matter most, and end with what the "
         "study can still reliably conclude.")
    return [U(ask(rng, q)), A(a)]


def r_test_choice(rng: random.Random) -> list[Turn]:
    n1, n2 = rng.randint(12, 60), rng.randint(12, 60)
    skew = rng.random() < 0.5
    what = rng.choice(["task completion times", "hospital stay lengths", "reaction times", "annual spending"])
    q = (f"I'm comparing {what} between two independent groups (n = {n1} and n = {n2}). "
         + ("The data are heavily right-skewed. " if skew else "Histograms look roughly symmetric. ")
         + "Should I use a t-test or Mann-Whitney U?")
    a = (("With heavy skew and these sample sizes, the mean is pulled around by a few large values, so the t-test's "
          "comparison of means may not answer the question you care about. " if skew else
          "With roughly symmetric data and these sample sizes, Welch's t-test is a good default; it doesn't assume equal "
          "variances, so use it rather than Student's t-test. ")
         + "Mann-Whitney U compares whether values in one group tend to be larger than in the other; it isn't strictly a test "
           "of medians unless the distributions have the same shape.\n\nAlternatives worth considering: a t-test on "
           f"log-transformed {what} (which compares geometric means), or a bootstrap confidence interval for the difference in "
           "medians. Whatever you choose, report an effect size with its interval, and decide before looking at the results.")
    return [U(ask(rng, q)), A(a)]


def r_hazard(rng: random.Random) -> list[Turn]:
    hr = round(rng.choice([0.55, 0.62, 0.7, 0.81, 1.25, 1.4]), 2)
    lo, hi = round(hr * rng.uniform(0.7, 0.9), 2), round(hr * rng.uniform(1.1, 1.35), 2)
    ev = rng.choice(["hospital readmission", "relapse", "equipment failure", "subscription cancellation"])
    q = f"What does a hazard ratio of {hr} (95% CI {lo} to {hi}) for {ev} mean? Is that a {abs(1 - hr):.0%} reduction in risk?"
    direction = "lower" if hr < 1 else "higher"
    a = (f"A hazard ratio of {hr} means that, at any given moment during follow-up, the group of interest experienced {ev} at "
         f"about {abs(1 - hr):.0%} {direction} instantaneous rate than the comparison group, assuming the ratio is constant over "
         "time (the proportional hazards assumption).\n\nIt's not quite the same as a "
         f"{abs(1 - hr):.0%} change in overall risk: cumulative risk over a fixed period depends on the baseline rate, and "
         "the two only roughly match when events are rare. "
         + (f"The interval {lo}-{hi} crosses 1, so the data are also compatible with no difference. " if lo <= 1 <= hi else
            f"The interval {lo}-{hi} excludes 1. ")
         + "Check the Kaplan-Meier curves too: if they cross, a single hazard ratio is a misleading summary.")
    return [U(ask(rng, q)), A(a)]


RESEARCH_TEMPLATES: list[Template] = [r_abtest, r_ci_interp, r_sample_size, r_critique, r_abstract, r_cohen, r_multiple,
                                      r_correlation, r_regression, r_kappa, r_heterogeneity, r_missing, r_ablation, r_survey,
                                      r_related, r_confusion, r_power, r_hypothesis, r_limitations, r_test_choice, r_hazard]


# ----------------------------------------------------------------------------- shared variation
USER_CONTEXT: dict[str, tuple[str, ...]] = {
    "code": ("This is for a side project, so simplicity beats cleverness.", "It's part of a service that's already in production.",
             "I'm coming from a different language, so please point out anything non-idiomatic.",
             "Our CI runs the linters with warnings as errors.", "A reviewer flagged this and I'd like to understand why.",
             "I'd like to keep the public signature unchanged if possible.", "Performance matters less than readability here."),
    "ops": ("This is on Ubuntu 22.04.", "The server runs Debian 12.", "Production is affected, so I need something safe to run now.",
            "We're a small team with no dedicated ops person.", "I'd like something I can paste into our runbook.",
            "I have sudo on the box but can't install new packages.", "This is a VM in the cloud behind a load balancer."),
    "math": ("This is from my kid's homework and I want to explain it properly.", "I keep getting a different answer from the book.",
             "Please show every step; I'm revising for an exam.", "I'd like to understand the method, not just the answer.",
             "My calculator gives something odd, so I want to check it by hand.", "I'm rusty; last did this at school."),
    "writing": ("It's for work, so nothing too casual.", "English isn't my first language, so please keep it natural.",
                "I've rewritten it three times and it still sounds stiff.", "Warm but professional is the tone I'm after.",
                "Please avoid clichés if you can.", "I'll tweak the details afterwards, I mainly need a good draft."),
    "general": ("I've read conflicting things online.", "Asking for my parents, who are in their seventies.",
                "My partner and I disagree about this.", "I'm a complete beginner at this.",
                "We're on a fairly tight budget.", "I'd like the reasoning too, not just a list of tips."),
    "research": ("This is for my dissertation.", "A reviewer raised this and I want a solid answer.",
                 "I'm preparing a journal-club presentation.", "Our lab doesn't have a statistician to ask.",
                 "I'd like wording I could adapt for the methods section.", "The audience is clinicians rather than statisticians."),
}
ASSISTANT_CLOSERS: dict[str, tuple[str, ...]] = {
    "code": ("If you paste the calling code, I can check the call sites too.", "Run the existing tests after the change to be safe.",
             "Happy to show a version with logging if you need to debug it in production."),
    "ops": ("Try it on a staging box first if you have one.", "Commit the config to version control so the change is reviewable.",
            "If anything looks off, paste the output and I'll take a look."),
    "math": ("Plugging the answer back in is the quickest way to catch arithmetic slips.",
             "Let me know if you'd like the same problem solved a different way.",
             "Rounding only at the last step keeps the answer accurate."),
    "writing": ("Happy to adjust the tone if it's going to someone more senior.", "Want a shorter version for a text message?",
                "Feel free to swap in details only you would know; that makes it sound like you."),
    "general": ("Hope that helps!", "Happy to go into more detail on any part of this.",
                "Let me know if you'd like a shorter version."),
    "research": ("If you can share the full table, I can check the numbers.",
                 "It's worth stating these choices explicitly in the methods section.",
                 "A short sensitivity analysis would make the conclusion more robust."),
}


def vary(rng: random.Random, domain: str, turns: list[Turn]) -> list[Turn]:
    """Add a context sentence to the first user turn and a closing line to some assistant turns."""
    out = [dict(t) for t in turns]
    if rng.random() < (0.8 if domain == "general" else 0.55):
        head, sep, rest = out[0]["content"].partition("\n\n")
        out[0]["content"] = head + " " + rng.choice(USER_CONTEXT[domain]) + sep + rest
    for t in out:
        if t["role"] == "assistant" and rng.random() < 0.3:
            t["content"] += "\n\n" + rng.choice(ASSISTANT_CLOSERS[domain])
    return out


# ----------------------------------------------------------------------------- assembly
Sample = tuple[list[Turn], list[str], str]


def simple_domain(domain: str, templates: list[Template],
                  followup: Callable[[random.Random, list[Turn]], list[Turn]] | None = None
                  ) -> Callable[[random.Random, int], list[Sample]]:
    """Generator for a prose/number domain; ~30% of conversations get 1-2 follow-up user turns."""
    def gen(rng: random.Random, n: int) -> list[Sample]:
        out: list[Sample] = []
        for i, tmpl in enumerate(schedule(rng, templates, n), 1):
            turns = tmpl(rng)
            extra = 0 if rng.random() > 0.3 else (1 if rng.random() > 0.3 else 2)
            for _ in range(extra):
                more = followup(rng, turns) if followup is not None and rng.random() < 0.5 else []
                if more:
                    turns += more
                else:
                    nxt = rng.choice([t for t in templates if t is not tmpl])(rng)
                    turns += [U(lead_in(rng.choice(FOLLOW_LEADS), nxt[0]["content"])), nxt[1]]
            out.append((turns, [], f"{domain}-{i:04d}"))
        return out
    return gen


def finalize(rng: random.Random, domain: str, sample: Sample) -> dict[str, Any]:
    """Attach source, model, timestamp, tags and id to one conversation."""
    turns, tags, cid = sample
    turns = vary(rng, domain, turns)
    source = rng.choice(sorted(SOURCES))
    model = rng.choice(SOURCES[source]) if rng.random() < 0.85 else None
    messages = []
    for t in turns:
        m = dict(t, content=re.sub(r"[ \t]+\n", "\n", t["content"]).strip())
        if m["role"] == "assistant" and model:
            m["model"] = model
        messages.append(m)
    return {"messages": messages, "source": source, "created_at": BASE_MS + rng.randrange(SPAN_MS),
            "tags": [domain, *tags], "id": cid}


def words(rec: dict[str, Any]) -> int:
    return sum(len(m["content"].split()) for m in rec["messages"])


def build(seed: int, per_domain: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Generate every domain and split it ~80/20 (stratified by domain)."""
    train: list[dict[str, Any]] = []
    test: list[dict[str, Any]] = []
    for domain in DOMAINS:
        rng = random.Random(f"{seed}:{domain}")
        _DRAWN.clear()
        recs = [finalize(rng, domain, s) for s in GENERATORS[domain](rng, per_domain)]
        ids = sorted(r["id"] for r in recs)
        random.Random(f"{seed}:split:{domain}").shuffle(ids)
        test_ids = set(ids[: round(len(ids) * 0.2)])
        for r in recs:
            (test if r["id"] in test_ids else train).append(r)
    return sorted(train, key=lambda r: r["id"]), sorted(test, key=lambda r: r["id"])


def write_jsonl(path: Path, recs: list[dict[str, Any]]) -> None:
    with path.open("w", encoding="utf-8", newline="\n") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def readme(seed: int, per_domain: int, train: list[dict[str, Any]], test: list[dict[str, Any]]) -> str:
    """Markdown description with per-domain, per-split counts and length statistics."""
    rows = []
    for d in DOMAINS:
        tr = [r for r in train if r["tags"][0] == d]
        te = [r for r in test if r["tags"][0] == d]
        both = tr + te
        multi = sum(1 for r in both if sum(m["role"] == "user" for m in r["messages"]) > 1)
        rows.append(f"| `{d}` | {len(tr)} | {len(te)} | {len(both)} | {statistics.mean(map(words, both)):.0f} | {multi} |")
    allr = train + test
    langs = {lg: sum(1 for r in allr if f"lang:{lg}" in r["tags"]) for lg in LANGS}
    return f"""# Example calibration corpus

Synthetic multi-domain conversations in ai-data-extraction JSONL format, used as example
calibration / classifier-training data for REAP-swap. Every line of `train.jsonl` and
`test.jsonl` is one conversation. All text is produced by `build_corpus.py` from its own
templates, randomized slots and programmatic code/math generation (standard library only,
no network, nothing copied from external sources).

## Counts (seed {seed}, {per_domain} per domain)

| domain | train | test | total | mean words / conversation | multi-turn |
| --- | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}
| **all** | {len(train)} | {len(test)} | {len(allr)} | {statistics.mean(map(words, allr)):.0f} | |

Code languages (tag `lang:<language>`): {", ".join(f"{lg} {c}" for lg, c in langs.items())}.

## Domains

- `code`: writing, explaining, reviewing, porting and testing functions in Python, TypeScript, Rust, Go and C;
  bug fixes with `suggested_diffs`; compiler/runtime error explanations; SQL queries, indexes and schema fixes.
- `ops`: shell pipelines, systemd units, Dockerfiles and compose, Kubernetes manifests and triage, nginx,
  git workflows, cron, log triage, disk/network/TLS debugging.
- `math`: word problems, algebra, calculus, probability, number theory and statistics with worked,
  computed step-by-step solutions.
- `writing`: drafting emails and notes, editing paragraphs, short fiction, product copy, summaries, tone changes.
- `general`: everyday knowledge and advice: geography, history, cooking, travel, health habits, science, how-to.
- `research`: study critique, experiment design, statistics interpretation, effect sizes, power, surveys,
  literature-review structure (all studies are invented; no real papers are cited).

## Record format

```json
{{"messages": [{{"role": "user", "content": "...", "code_context": [{{"file": "src/app.py", "code": "...",
                "range": {{"selectionStartLineNumber": 1, "selectionEndLineNumber": 9}}}}]}},
              {{"role": "assistant", "content": "...", "suggested_diffs": [{{"file": "...", "diff": "..."}}],
               "model": "claude-sonnet-4-5"}}],
 "source": "cursor-composer", "created_at": 1705414222000, "tags": ["code", "lang:python"], "id": "code-python-0001"}}
```

- `messages`: alternating `user` / `assistant` turns (1-3 user turns). `code_context` (editor selection) and
  `suggested_diffs` (unified diff) are optional and appear on some code turns; `model` appears on assistant
  turns of most conversations.
- `source`: one of {", ".join(sorted(SOURCES))}.
- `created_at`: deterministic pseudo-random millisecond timestamp in 2024-2025.
- `tags`: first tag is the domain; code conversations also carry `lang:<language>`.
- `id`: `code-<lang>-NNNN` or `<domain>-NNNN`, unique and stable for a given seed.

## How it was made

Each domain has 15+ templates (functions) that fill randomized slots (names, identifiers, numbers,
topics, tones, lengths); code snippets exist per language with injected bugs for fix-it requests, math
answers are computed exactly with `fractions`, and roughly a fifth to a third of conversations get 1-2 follow-up
turns. Templates are scheduled in shuffled blocks so each is used about equally often. The split is a
seeded shuffle of ids within each domain (20% test); both files are sorted by id.

## Regenerate

```bash
python example/corpus/build_corpus.py            # writes train.jsonl, test.jsonl, README.md here
python example/corpus/build_corpus.py --seed 7 --per-domain 100 --out /tmp/corpus
```

Output is byte-identical for the same `--seed` and `--per-domain` (seeded `random.Random`, no clock).
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--per-domain", type=int, default=100)
    args = ap.parse_args()
    train, test = build(args.seed, args.per_domain)
    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "train.jsonl", train)
    write_jsonl(args.out / "test.jsonl", test)
    (args.out / "README.md").write_text(readme(args.seed, args.per_domain, train, test), encoding="utf-8")
    print(f"wrote {len(train)} train / {len(test)} test conversations to {args.out}")


GENERATORS: dict[str, Callable[[random.Random, int], list[Sample]]] = {
    "code": gen_code,
    "ops": simple_domain("ops", OPS_TEMPLATES),
    "math": simple_domain("math", MATH_TEMPLATES),
    "writing": simple_domain("writing", WRITING_TEMPLATES, writing_followup),
    "general": simple_domain("general", GENERAL_TEMPLATES),
    "research": simple_domain("research", RESEARCH_TEMPLATES),
}

if __name__ == "__main__":
    main()
