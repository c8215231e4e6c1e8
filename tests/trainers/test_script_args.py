"""The shared script-arguments plumbing of the ``compaction-gym train ...`` commands."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import pytest

from compaction_gym.cli_args import (
    add_dataclass_arguments,
    flag,
    load_script_arguments,
    run_script,
    script_parser,
)
from compaction_gym.errors import InvalidArgumentError


@dataclass
class _Args:
    model: str | None = field(default=None, metadata={"help": "model (required)"})
    steps: int = field(default=3, metadata={"help": "steps"})
    ratio: float | None = field(default=None, metadata={"help": "ratio"})
    mode: str = field(default="a", metadata={"help": "mode", "choices": ("a", "b")})
    save: bool = field(default=True, metadata={"help": "save"})
    tasks: list[str] = field(default_factory=lambda: ["x"], metadata={"help": "tasks"})
    env_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "JSON object"})
    training: dict[str, Any] = field(default_factory=dict, metadata={"help": "TOML only"})


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _Args, skip=("training",))
    return parser.parse_args(argv)


def test_flags_follow_the_annotations():
    ns = _parse(
        ["--model", "m", "--steps", "5", "--ratio", "0.5", "--mode", "b", "--no-save", "--tasks", "p", "q"]
        + ["--env-kwargs", '{"k": 1}']
    )
    script = load_script_arguments(_Args, ns)
    assert script == _Args(
        model="m", steps=5, ratio=0.5, mode="b", save=False, tasks=["p", "q"], env_kwargs={"k": 1}
    )
    assert flag("env_kwargs") == "--env-kwargs"
    with pytest.raises(SystemExit):
        _parse(["--mode", "c"])
    with pytest.raises(SystemExit):
        _parse(["--training", "{}"])  # TOML only


def test_defaults_then_config_then_flags(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('model = "m"\nsteps = 7\nmode = "b"\n[training]\nlr = 0.1\n')
    script = load_script_arguments(_Args, _parse(["--config", str(config), "--steps", "9"]))
    assert (script.model, script.steps, script.mode, script.ratio, script.training) == (
        "m",
        9,
        "b",
        None,
        {"lr": 0.1},
    )


def test_errors_name_the_key_or_flag(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('model = "m"\nbogus = 1\n')
    with pytest.raises(
        InvalidArgumentError, match=r"unknown keys \['bogus'\]; valid keys: .* \(see the docs\)"
    ):
        load_script_arguments(_Args, _parse(["--config", str(config)]), hint="see the docs")
    with pytest.raises(InvalidArgumentError, match="no such file"):
        load_script_arguments(_Args, _parse(["--config", str(tmp_path / "missing.toml")]))
    with pytest.raises(
        InvalidArgumentError, match=r"--model is required \(a flag or the config key 'model'\)"
    ):
        load_script_arguments(_Args, _parse([]), required=("model",))


def test_run_script_reports_bad_arguments(capsys):
    parser = script_parser("prog", "First paragraph.\n\nMore.", lambda p: add_dataclass_arguments(p, _Args))
    assert parser.description == "First paragraph."

    def parse(ns):
        return load_script_arguments(_Args, ns, required=("model",))

    assert run_script("prog", parser.parse_args([]), parse, lambda s: 0) == 2
    assert "prog: --model is required" in capsys.readouterr().err
    assert run_script("prog", parser.parse_args(["--model", "m"]), parse, lambda s: {"summary": 1}) == 0
    assert run_script("prog", parser.parse_args(["--model", "m"]), parse, lambda s: 3) == 3
