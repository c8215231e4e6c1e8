"""The command-line entry point."""

from __future__ import annotations

import pytest

import subprocess
import sys

import compaction_gym
from compaction_gym.cli import SUBCOMMANDS, main, make_parser


def test_help_lists_every_subcommand(capsys):
    make_parser().print_help()
    out = capsys.readouterr().out
    for name in [*SUBCOMMANDS, "version"]:
        assert name in out


def test_version(capsys):
    assert main(["version"]) == 0
    assert capsys.readouterr().out.strip() == compaction_gym.__version__


def test_console_script_runs():
    out = subprocess.run(
        [sys.executable, "-m", "compaction_gym.cli", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "compaction-gym" in out


@pytest.mark.parametrize("argv", [["--help"], ["version"], ["eval", "--help"], ["serve", "--help"], ["demos", "--help"], ["leaderboard", "--help"]])
def test_parsers_build_without_heavy_imports(argv):
    """`compaction-gym --help`, `version` and most commands' help import neither torch,
    transformers nor trl (a subprocess, so this test's own imports do not count)."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\n"
        "from compaction_gym.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit): main({argv!r})\n"
        "print(sorted(m for m in ('torch', 'transformers', 'trl') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
