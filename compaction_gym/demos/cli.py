"""``compaction-gym demos``: record expert-bot BabyAI demonstrations (see :mod:`compaction_gym.demos.recorder`)."""

from __future__ import annotations

import argparse
import sys

import compaction_gym.demos as package
from compaction_gym.cli_args import (
    add_dataclass_arguments,
    add_script_command,
    check_output_dir,
    load_script_arguments,
    run_script,
    script_parser,
)
from compaction_gym.demos.demos_config import DemosConfig
from compaction_gym.errors import InvalidArgumentError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`DemosConfig` field (``init`` is TOML-only) plus ``--config``."""
    add_dataclass_arguments(parser, DemosConfig, skip=("init",))


def parse_script_arguments(args: argparse.Namespace) -> DemosConfig:
    """Merge defaults < ``--config`` TOML < flags, and validate."""
    script = load_script_arguments(DemosConfig, args)
    from compaction_gym.envs.registration import BABYAI_TASK_IDS

    bad = [t for t in script.tasks if t not in BABYAI_TASK_IDS]
    if bad:
        raise InvalidArgumentError(f"unknown tasks {bad}; valid: {list(BABYAI_TASK_IDS)}")
    if not script.model:
        raise InvalidArgumentError("--model is required (a flag or the config key 'model')")
    if min(script.episodes_per_task, script.batch, script.group_size, script.workers) < 1:
        raise InvalidArgumentError("--episodes-per-task, --batch, --group-size and --workers must be >= 1")
    if script.max_turns is not None and script.max_turns < 1:
        raise InvalidArgumentError(f"--max-turns must be >= 1, got {script.max_turns}")
    if script.seed < script.eval_seed_limit:
        raise InvalidArgumentError(
            f"--seed {script.seed} overlaps the evaluation seeds [0, {script.eval_seed_limit}); "
            f"use --seed >= {script.eval_seed_limit}"
        )
    check_output_dir(script.output_dir, "--output-dir")
    return script


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demos`` command."""
    add_script_command(
        subparsers,
        "demos",
        help="record expert-bot BabyAI demonstrations through compacted sessions (SFT data)",
        doc=package.__doc__,
        add_arguments=add_arguments,
        run=run,
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``compaction-gym demos``."""
    from compaction_gym.demos import recorder

    return run_script("compaction-gym demos", args, parse_script_arguments, recorder.main)


def make_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m compaction_gym.demos.cli``)."""
    return script_parser("compaction-gym demos", package.__doc__, add_arguments)


if __name__ == "__main__":
    sys.exit(run(make_parser().parse_args()))
