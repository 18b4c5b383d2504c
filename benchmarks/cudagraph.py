"""The CUDA-graph batch sizes every benchmark engine captures (bench-gpu's arms and bench-serve's servers alike).

Why one rule: a decode step of B requests replays a graph only if a captured size is >= B; a bench that times
batch 32 with graphs captured up to 8 measures eager steps in every arm (stock all-GPU: 32.1 ms a step at 32
tokens against 4.8 at 8 on the 30B-A3B shape, H100), which no server configured like ``reap-swap serve`` runs.
"""

from __future__ import annotations

POWERS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Powers of two up to ``max_num_seqs``, and ``max_num_seqs`` itself: every batch up to it replays a graph."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return sorted({n for n in POWERS if n <= max_num_seqs} | {max_num_seqs})
