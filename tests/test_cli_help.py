"""Every ``reap-swap`` command's options have help text, and their defaults show in ``--help``.

Each command's parser is taken from its real ``main``: ``ArgumentParser.parse_known_args`` (which
``parse_args`` calls too) is replaced for the test by one that hands the parser back, so the check
sees exactly the parser a user's ``reap-swap COMMAND --help`` would print.
"""

from __future__ import annotations

import argparse
import importlib
import os

import pytest

from reap_swap.cli import COMMANDS, HelpFormatter


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def command_parser(name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    def hand_back(self: argparse.ArgumentParser, args: object = None, namespace: object = None) -> None:
        raise _Parsed(self)

    module, func = COMMANDS[name][0].split(":")
    main = getattr(importlib.import_module(module), func)
    for var in [v for v in os.environ if v.startswith("REAP_")]:  # some defaults are read from REAP_* variables
        monkeypatch.delenv(var)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", hand_back)
    try:
        main(["--help"])
    except _Parsed as parsed:
        return parsed.parser
    finally:
        monkeypatch.undo()
    raise AssertionError(f"reap-swap {name}: main returned without parsing its arguments")


def has_default(action: argparse.Action) -> bool:
    """A default worth showing: not a flag, not required, something set."""
    return not (action.required or action.nargs == 0 or action.default is None or action.default == ""
                or action.default is argparse.SUPPRESS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_and_shows_its_default(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = command_parser(name, monkeypatch)
    assert parser.prog == f"reap-swap {name}"
    assert issubclass(parser.formatter_class, HelpFormatter), f"reap-swap {name}: formatter_class={parser.formatter_class.__name__}"
    formatter = parser._get_formatter()
    problems = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        label = "/".join(action.option_strings) or action.dest
        if not action.help or action.help is argparse.SUPPRESS or not action.help.strip():
            problems.append(f"{label}: no help")
            continue
        text = formatter._expand_help(action)  # the help as printed, %(default)s and the appended default included
        if has_default(action) and str(action.default) not in text:
            problems.append(f"{label}: its default {action.default!r} is not in its help {text!r}")
    assert not problems, f"reap-swap {name}:\n  " + "\n  ".join(problems)
    rendered = parser.format_help()
    assert "``" not in rendered, f"reap-swap {name} --help shows docstring markup"


def test_the_walk_finds_missing_help_and_hidden_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above fails on what it is meant to catch."""
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    bare = p.add_argument("--bare", type=int, default=3)
    hidden = p.add_argument("--hidden", type=int, default=3, help="says default but not the value (default: some)")
    shown = p.add_argument("--shown", type=int, default=3, help="appended by the formatter")
    flag = p.add_argument("--flag", action="store_true", help="a flag")
    f = p._get_formatter()
    assert not bare.help
    assert "3" not in f._expand_help(hidden)
    assert f._expand_help(shown) == "appended by the formatter (default: 3)"
    assert f._expand_help(flag) == "a flag" and not has_default(flag)
