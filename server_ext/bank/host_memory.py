"""This process's host memory, read from /proc (peak and current resident set)."""

from __future__ import annotations

from pathlib import Path


def process_memory(status_path: str = "/proc/self/status") -> dict[str, float | None]:
    """``VmHWM`` (peak resident set since start) and ``VmRSS`` in GiB; None where /proc lacks them."""
    out: dict[str, float | None] = {"peak_rss_gib": None, "rss_gib": None}
    try:
        text = Path(status_path).read_text()
    except OSError:
        return out
    keys = {"VmHWM": "peak_rss_gib", "VmRSS": "rss_gib"}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in keys:
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
                out[keys[name]] = int(fields[0]) * 1024 / 2**30
    return out
