"""Where the files that ship with the package live (editable or installed)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def example_dir() -> Path:
    return Path(str(resources.files("reap_swap.example")))


def example_corpus_files() -> list[Path]:
    """The example calibration corpus (train + test split), sorted."""
    files = sorted((example_dir() / "corpus").glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no example corpus under {example_dir() / 'corpus'}")
    return files


def bundled_model_dir() -> Path:
    """Where the committed trained small MoE lives (models/small_moe in the repo)."""
    return Path(str(resources.files("reap_swap.models"))) / "small_moe"


def learned128_cpu_dir() -> Path:
    """The committed CPU-sized 128-expert top-8 sibling of the benchmark model (models/learned128_cpu)."""
    return Path(str(resources.files("reap_swap.models"))) / "learned128_cpu"
