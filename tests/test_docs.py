"""The README stays a five-minute read and the docs it points to stay whole: its length, its links,
every command in the CLI reference, and the words a newcomer needs spelled out."""

from __future__ import annotations

import re
from pathlib import Path

from reap_swap.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))


def test_readme_is_short_and_points_to_every_doc() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    for doc in DOCS:
        assert f"](docs/{doc.name})" in text, f"the README does not link docs/{doc.name}"


def test_readme_spells_out_what_a_newcomer_meets() -> None:
    text = README.read_text()
    assert "Router-weighted Expert Activation Pruning" in text and "arxiv.org/abs/2510.13999" in text
    assert "0xSero/reap-expert-swap" in text  # the seed
    for word in ("**Slices**", "**Core**", "make demo", "make test"):
        assert word in text
    assert not re.search(r"\bissues? \d+", text, re.I), "the README names issue numbers"


def test_relative_links_resolve() -> None:
    for page in [README, *DOCS]:
        for target in re.findall(r"\]\((?!https?:|#)([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.relative_to(REPO)}: broken link {target}"


def test_cli_reference_lists_every_command() -> None:
    text = (REPO / "docs" / "cli.md").read_text()
    for name in COMMANDS:
        assert f"`reap-swap {name}" in text, f"docs/cli.md does not list reap-swap {name}"
