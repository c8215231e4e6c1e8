"""The command-line entry point."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

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


@pytest.mark.parametrize("argv", [["--help"], ["version"], ["eval", "--help"], ["serve", "--help"], ["demos", "--help"], ["leaderboard", "--help"], ["eval-lm", "--help"]])
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


def test_thread_default_and_flag(monkeypatch):
    """One thread by default on a <= 2-core machine (a busy 2-core box runs 10x slower with two);
    --threads and $COMPACTION_GYM_THREADS override it; bad values are a usage error (exit 2)."""
    import os

    from compaction_gym import cli

    monkeypatch.delenv("COMPACTION_GYM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert cli.cpu_threads(None) == 1
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert cli.cpu_threads(None) is None and cli.cpu_threads(3) == 3
    monkeypatch.setenv("COMPACTION_GYM_THREADS", "2")
    assert cli.cpu_threads(None) == 2
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--threads", "0", "version"])
    assert exit_info.value.code == 2


def test_interrupt_and_library_errors_end_in_one_line(monkeypatch, capsys):
    from compaction_gym import cli
    from compaction_gym.errors import InvalidArgumentError

    def interrupted(args):
        raise KeyboardInterrupt

    def refused(args):
        raise InvalidArgumentError("max_kv_len must be positive")

    make_parser = cli.make_parser
    for func, code, text in ((interrupted, 130, "interrupted"), (refused, 2, "max_kv_len must be positive")):
        parser = make_parser()
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        commands.add_parser("boom").set_defaults(func=func)
        monkeypatch.setattr(cli, "make_parser", lambda parser=parser: parser)
        assert cli.main(["boom"]) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and text in err[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "--model", "tiny-random", "--output", "{file}"],
        ["eval-lm", "--model", "tiny-random", "--output", "{dir}"],
        ["leaderboard", "run", "babyai-balrog", "--output", "{file}"],
        ["demos", "--model", "tiny-random", "--output-dir", "{file}/sub"],
    ],
)
def test_bad_output_paths_fail_fast_with_one_line(tmp_path, capsys, monkeypatch, argv):
    """A file where a directory goes (or the reverse) is refused before any model loads: exit 2
    and one line naming the flag (loading would take 30 s before a traceback)."""
    from compaction_gym import cli

    file = tmp_path / "a-file"
    file.write_text("x")
    argv = [a.format(file=file, dir=tmp_path) for a in argv]
    code = cli.main(argv)
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--output" in lines[0], lines
