"""``compaction-gym eval``: run an agent on an env for N episodes per task and summarise.

Writes ``OUTPUT/trajectories.jsonl`` and ``OUTPUT/summary.json`` and prints a per-task table
(``docs/eval.md``). Flags come from :class:`EvalConfig`, ``CompactionConfig`` and
``SamplingParams`` (``compaction_gym.cli_args``); ``--config FILE.toml`` holds the same options,
``EvalConfig`` keys at the top level and ``[compaction]`` / ``[sampling]`` tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compaction_gym.agents.evaluate import DEFAULT_MODEL, POLICIES, default_max_new_tokens, default_prompt
from compaction_gym.agents.prompts import PROMPT_FORMATS, get_prompt_format
from compaction_gym.cli_args import add_dataclass_arguments, check_output_dir, given_fields, read_toml_config
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import CompactionGymError, InvalidArgumentError

#: ``SamplingParams`` fields without an ``eval`` flag (``seed`` is the env seed's flag; TOML only).
SAMPLING_TOML_ONLY = ("seed",)


@dataclass
class EvalConfig:
    """What ``compaction-gym eval`` runs (besides the compaction and sampling configs)."""

    env: str = field(default="AttnMatch-BabyAI-v0", metadata={"help": "env id"})
    task: list[str] | None = field(
        default=None,
        metadata={"help": "tasks to run (BabyAI tasks or math datasets; repeatable); unset: all"},
    )
    model: str = field(
        default=DEFAULT_MODEL,
        metadata={"help": "model directory, registered name (babyai-tiny, tiny-random) or hub id"},
    )
    episodes: int = field(default=10, metadata={"help": "episodes per task"})
    seed: int = field(default=0, metadata={"help": "episode i uses env seed SEED+i"})
    output: str | None = field(
        default=None,
        metadata={
            "help": "directory for trajectories.jsonl, run.json and summary.json; an interrupted run "
            "with the same settings resumes there"
        },
    )
    overwrite: bool = field(
        default=False, metadata={"help": "replace the episodes --output holds from a run with other settings"}
    )
    batch: int = field(default=1, metadata={"help": "episodes played concurrently"})
    max_steps: int | None = field(default=None, metadata={"help": "env step limit (BabyAI: BALROG's 64/128)"})
    env_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "extra gym.make kwargs as JSON"}
    )
    policy: str = field(
        default="model",
        metadata={
            "help": "model: the agent acts; expert: BabyAI's expert bot, teacher-forced through the same "
            "compacted session (a sanity row whose trajectories are demonstrations)",
            "choices": POLICIES,
        },
    )
    prompt: str | None = field(
        default=None,
        metadata={
            "help": "prompt format (unset: the model's, balrog for BabyAI, raw else)",
            "choices": sorted(PROMPT_FORMATS),
        },
    )
    progress: bool = field(default=True, metadata={"help": "show a progress bar"})
    device: str | None = field(default=None, metadata={"help": "cuda / cpu (unset: cuda when available)"})
    dtype: str | None = field(
        default=None,
        metadata={"help": "float32 / bfloat16 / ... (unset: float32 on CPU, checkpoint dtype on GPU)"},
    )
    capacity: int | None = field(
        default=None, metadata={"help": "KV rows per session slot (unset: engine's)"}
    )
    tensorboard: bool = field(
        default=True,
        metadata={"help": "write TensorBoard event files to OUTPUT/tensorboard (docs/tensorboard.md)"},
    )
    record_mass: bool = field(
        default=False,
        metadata={
            "help": "record each compaction event's attention mass kept (for `compaction-gym plot mass`; "
            "one more probes x span product per event)"
        },
    )

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            k: v
            for k, v in (
                ("device", self.device), ("dtype", self.dtype), ("capacity", self.capacity),
                ("record_mass", self.record_mass),
            )  # fmt: skip
            if v
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``eval`` flags: :class:`EvalConfig`, then ``CompactionConfig`` and ``SamplingParams`` groups."""
    add_dataclass_arguments(parser.add_argument_group("run"), EvalConfig)
    add_dataclass_arguments(parser.add_argument_group("compaction"), CompactionConfig, config=False)
    add_dataclass_arguments(
        parser.add_argument_group("sampling"),
        SamplingParams,
        config=False,
        skip=SAMPLING_TOML_ONLY,
        defaults={"temperature": "0.0 (greedy)", "max_new_tokens": "the model's or prompt format's"},
    )


def load_configs(args: argparse.Namespace) -> tuple[EvalConfig, CompactionConfig, SamplingParams]:
    """Defaults < ``--config`` TOML < flags, for the three configs.

    Raises:
        InvalidArgumentError: unknown TOML keys (named), or a config that fails validation.
    """
    names = [f.name for f in dataclasses.fields(EvalConfig)]
    values: dict[str, Any] = {}
    if getattr(args, "config", None):
        values = read_toml_config(
            args.config,
            [*names, "compaction", "sampling"],
            hint="compaction and sampling options go in tables",
        )
    comp = dict(values.pop("compaction", {}))
    samp = dict(values.pop("sampling", {}))
    values.update(given_fields(EvalConfig, args))
    cfg = EvalConfig(**values)
    comp.update(given_fields(CompactionConfig, args))
    samp.update({k: v for k, v in given_fields(SamplingParams, args).items() if k not in SAMPLING_TOML_ONLY})
    compaction = CompactionConfig.from_dict(comp)
    fmt = get_prompt_format(cfg.prompt or default_prompt(cfg.env, cfg.model))
    samp.setdefault("temperature", 0.0)
    samp.setdefault("max_new_tokens", default_max_new_tokens(fmt.name, cfg.model))
    cfg.prompt = fmt.name
    if cfg.episodes < 1:
        raise InvalidArgumentError(f"episodes must be >= 1, got {cfg.episodes}")
    return cfg, compaction, SamplingParams.from_dict(samp)


def register(subparsers: Any) -> None:
    """Add ``eval`` to the ``compaction-gym`` command."""
    parser = subparsers.add_parser(
        "eval",
        help="run an agent on an env for N episodes and summarise",
        description="Run an LLM agent (embedded engine) on an env for N episodes per task; write "
        "trajectories.jsonl and summary.json and print a per-task table.",
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``compaction-gym eval`` from parsed arguments; returns the exit code."""
    from rich.console import Console

    from compaction_gym.evaluation.run import evaluate
    from compaction_gym.evaluation.table import render_table

    console = Console()
    console.width = max(console.width, 100)
    try:
        cfg, compaction, sampling = load_configs(args)
        check_output_dir(cfg.output, "--output")
        if compaction.enabled and not (compaction.kv_budget or compaction.turn_based):
            console.print(
                f"[yellow]warning: --mode {compaction.mode} without --max-kv-len or --n-protect-turns "
                "never compacts[/yellow]"
            )
        env_kwargs = dict(cfg.env_kwargs)
        if cfg.max_steps is not None:
            env_kwargs["max_steps"] = cfg.max_steps
        summary = evaluate(
            cfg.model,
            cfg.env,
            tasks=cfg.task,
            compaction=compaction,
            sampling=sampling,
            prompt=cfg.prompt,
            episodes=cfg.episodes,
            seed=cfg.seed,
            output=cfg.output,
            batch=cfg.batch,
            env_kwargs=env_kwargs,
            engine_kwargs=cfg.engine_kwargs(),
            progress=cfg.progress,
            policy=cfg.policy,
            overwrite=cfg.overwrite,
            tensorboard=cfg.tensorboard,
        )
    except CompactionGymError as exc:
        print(f"compaction-gym eval: {exc}", file=sys.stderr)  # one line, unwrapped
        return 2
    render_table(summary, console)
    if cfg.output:
        console.print(
            f"wrote {Path(cfg.output) / 'summary.json'} and {Path(cfg.output) / 'trajectories.jsonl'}"
        )
    return 0
