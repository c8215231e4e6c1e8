"""``compaction-gym rsa``: Recursive Self-Aggregation vs plain sampling on a math env (docs/rsa.md).

Flags come from :class:`RSAArgs`, :class:`~compaction_gym.agents.rsa.RSAConfig`,
``CompactionConfig`` and ``SamplingParams`` (``compaction_gym.cli_args``, each declared once).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any

from compaction_gym.agents.rsa import RSAConfig
from compaction_gym.cli_args import add_dataclass_arguments, given_fields
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import CompactionGymError, InvalidArgumentError
from compaction_gym.evaluation.rsa import ANSWER_FORMATS, METHODS

#: fields without a flag: the RSA seed and the sampling seed are the episode's env seed
SKIPPED_SEEDS = ("seed",)


@dataclass
class RSAArgs:
    """What ``compaction-gym rsa`` runs besides RSA's, the compaction and the sampling settings."""

    env: str = field(default="AttnMatch-Math-v0", metadata={"help": "env id (AttnMatch-Math-v0 or AttnMatch-RGMix-v0)"})
    task: list[str] | None = field(default=None, metadata={"help": "math datasets (repeatable); unset: the env's"})
    model: str = field(default="smollm2-135m-instruct", metadata={"help": "registered name, directory or hub id"})
    episodes: int = field(default=4, metadata={"help": "questions per task"})
    env_seed: int = field(default=0, metadata={"help": "question i uses env seed ENV_SEED+i (and RSA seed)"})
    env_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "extra gym.make kwargs as JSON"})
    answer_format: str = field(
        default="tag",
        metadata={
            "help": "tag: the env's rule (last <answer> tag); last_number: a response without a tag is "
            "scored on its last number (small models that ignore the tag instruction)",
            "choices": ANSWER_FORMATS,
        },
    )
    baseline: bool = field(
        default=True,
        metadata={"help": "also run plain sampling: N*(T+1) solutions, and as many sampled tokens as RSA's"},
    )
    output: str | None = field(default=None, metadata={"help": "directory for rsa.jsonl and rsa_summary.json"})
    max_slots: int = field(default=16, metadata={"help": "engine session slots (members run in groups that fit)"})
    capacity: int | None = field(default=None, metadata={"help": "KV rows per session slot (unset: engine's)"})
    device: str | None = field(default=None, metadata={"help": "cuda / cpu (unset: cuda when available)"})
    dtype: str | None = field(default=None, metadata={"help": "float32 / bfloat16 / ... (unset: the engine's)"})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_dataclass_arguments(parser, RSAArgs, config=False)
    add_dataclass_arguments(parser.add_argument_group("RSA (RSAConfig)"), RSAConfig, skip=SKIPPED_SEEDS, config=False)
    add_dataclass_arguments(
        parser.add_argument_group("compaction of every member (CompactionConfig)"), CompactionConfig, config=False
    )
    add_dataclass_arguments(
        parser.add_argument_group("sampling of every member (SamplingParams)"),
        SamplingParams,
        skip=SKIPPED_SEEDS,
        config=False,
        defaults={"temperature": "1.0", "max_new_tokens": "256"},
    )


def load_configs(args: argparse.Namespace) -> tuple[RSAArgs, RSAConfig, CompactionConfig, SamplingParams]:
    """The four configs from the flags given (dataclass defaults otherwise).

    Raises:
        InvalidArgumentError: a config that fails validation (named).
    """
    cfg = RSAArgs(**given_fields(RSAArgs, args))
    if cfg.episodes < 1:
        raise InvalidArgumentError(f"episodes must be >= 1, got {cfg.episodes}")
    rsa = RSAConfig(**{k: v for k, v in given_fields(RSAConfig, args).items() if k not in SKIPPED_SEEDS})
    compaction = CompactionConfig(**given_fields(CompactionConfig, args))
    samp = {k: v for k, v in given_fields(SamplingParams, args).items() if k not in SKIPPED_SEEDS}
    return cfg, rsa, compaction, SamplingParams(**samp)


def register(subparsers: Any) -> None:
    """Add ``rsa`` to the ``compaction-gym`` command."""
    parser = subparsers.add_parser(
        "rsa",
        help="Recursive Self-Aggregation vs plain sampling on a math env (accuracy vs tokens)",
        description="Per question: RSA (population N, K solutions per aggregation prompt, T rounds; "
        "the shared prefix prefilled once, members forked and batched) and plain sampling of N*(T+1) "
        "solutions, scored by the env (per-member mean and majority vote), with token counts.",
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``compaction-gym rsa``; returns the exit code."""
    from compaction_gym.engine import Engine
    from compaction_gym.evaluation.rsa import evaluate_rsa, markdown_table

    try:
        cfg, rsa, compaction, sampling = load_configs(args)
        kwargs: dict[str, Any] = {"max_slots": cfg.max_slots}
        for name in ("capacity", "device", "dtype"):
            if getattr(cfg, name) is not None:
                kwargs[name] = getattr(cfg, name)
        engine = Engine.from_pretrained(cfg.model, **kwargs)

        def report(row: dict[str, Any]) -> None:
            cells = ", ".join(f"{m} mean {row[m]['mean']:.2f} vote {row[m]['vote']:.0f}" for m in METHODS if m in row)
            print(f"{row['task']} seed {row['seed']} (answer {row['answer']}): {cells}", flush=True)

        result = evaluate_rsa(
            engine, cfg.env, rsa, tasks=cfg.task or [None], episodes=cfg.episodes, seed=cfg.env_seed,
            compaction=compaction, sampling=sampling, baseline=cfg.baseline, env_kwargs=cfg.env_kwargs, answer_format=cfg.answer_format, output=cfg.output, on_question=report,
        )  # fmt: skip
    except CompactionGymError as exc:
        print(f"compaction-gym rsa: {exc}", file=sys.stderr)
        return 2
    print(markdown_table(result["summary"], rsa))
    return 0
