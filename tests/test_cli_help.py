"""Every flag of every ``compaction-gym`` subcommand (``train`` trainers' full parsers included) has help."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from compaction_gym.cli import make_parser
from compaction_gym.trainers.cli import TRAIN_COMMANDS, build_parser


def parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """``parser`` and every sub-parser below it, with its command line."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from parsers(sub, f"{name} {sub_name}")


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Flags and positionals whose help is missing, blank or only the appended command default."""
    out = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._SubParsersAction):
            continue
        text = (action.help or "").strip()
        if not text or text.startswith("(this command's default"):
            out.append("/".join(action.option_strings) or action.dest)
    return out


def all_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    found = list(parsers(make_parser(), "compaction-gym"))
    found += [(f"compaction-gym train {c.name}", build_parser(c).parser) for c in TRAIN_COMMANDS]
    return found


def test_the_walk_reaches_every_command():
    names = {name for name, _ in all_parsers()}
    for want in ("eval", "leaderboard run", "serve", "train", "train grpo", "train gjs", "train sft", "plot episode"):
        assert f"compaction-gym {want}" in names, want


@pytest.mark.parametrize(("name", "parser"), all_parsers(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_flag_has_help(name, parser):
    assert undocumented(parser) == [], f"{name}: flags without help"


def test_the_check_catches_a_flag_without_help():
    parser = argparse.ArgumentParser()
    parser.add_argument("--documented", help="does a thing")
    parser.add_argument("--bare")
    parser.add_argument("--only-default", help="(this command's default: 3)")
    assert undocumented(parser) == ["--bare", "--only-default"]
