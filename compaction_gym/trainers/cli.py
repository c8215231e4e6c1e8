"""``compaction-gym train sft|grpo|gjs``: one command shape for every trainer, built from a table.

Every train command is made the same way from three dataclasses (docs/design-notes.md, "Trainers
and their CLIs"):

* the command's **script arguments** (a :class:`TrainScriptArguments` subclass: ``--model``, the
  weights ``--dtype``, LoRA ``--lora-r/--lora-alpha/--lora-dropout/--lora-target-modules``,
  ``--save``, and the command's data options);
* the trainer's **TRL config** through ``transformers.HfArgumentParser``, so every TRL/HF flag works
  in either spelling (``--per_device_train_batch_size`` / ``--per-device-train-batch-size``,
  ``--bf16``, ``--output_dir``, ``--report_to``, ``--resume_from_checkpoint``, ``--push_to_hub``...);
* for trainers whose rollouts run compacted sessions, :class:`~compaction_gym.engine.CompactionConfig`
  (``--mode --max-kv-len --compact-window --compact-target-ratio/--ratio ...``).

``--config FILE.toml`` holds any of these names as top-level keys, plus optional ``[training]``
(TRL config) and ``[compaction]`` tables; defaults < file < flags. Commands differ only by their
row in :data:`TRAIN_COMMANDS`. The sub-commands registered at start-up are stubs that pass their
arguments on, so ``compaction-gym --help`` imports neither trl nor torch; the full parser (and its
``--help``) is built when a train command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import logging
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from compaction_gym.cli_args import add_dataclass_arguments, flag, given_fields, read_toml_config
from compaction_gym.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

#: Weight dtypes a command loads the model in (``auto``: bfloat16 on CUDA, float32 elsewhere).
DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")


@dataclass
class TrainScriptArguments:
    """Arguments every ``compaction-gym train`` command has (its data options are added by subclasses)."""

    model: str | None = field(
        default=None,
        metadata={"help": "model directory, hub id or registered name (babyai-tiny, tiny-random) (required)"},
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "weights dtype (auto: bfloat16 on CUDA, float32 elsewhere); bf16 mixed precision follows it "
            "unless --bf16/--no-bf16 is given",
            "choices": DTYPES,
        },
    )
    lora_r: int = field(default=0, metadata={"help": "train a LoRA adapter of this rank (0: full fine-tuning)"})
    lora_alpha: float | None = field(default=None, metadata={"help": "LoRA alpha (default: 2 * lora_r)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout"})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"], metadata={"help": "modules LoRA adapts (peft names)"}
    )
    save: bool = field(default=True, metadata={"help": "save the final model (or adapter) to the output dir"})

    def peft_config(self) -> Any:
        """A ``peft.LoraConfig`` when ``lora_r > 0``, else ``None``."""
        if self.lora_r < 0:
            raise InvalidArgumentError(f"--lora-r must be >= 0, got {self.lora_r}")
        if self.lora_r == 0:
            return None
        from peft import LoraConfig

        targets = self.lora_target_modules
        return LoraConfig(
            r=self.lora_r,
            lora_alpha=self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_r,
            lora_dropout=self.lora_dropout,
            target_modules=targets[0] if targets == ["all-linear"] else list(targets),
            task_type="CAUSAL_LM",
        )


@dataclass(frozen=True)
class TrainCommand:
    """One row of :data:`TRAIN_COMMANDS`.

    Attributes:
        name: the sub-command (``compaction-gym train NAME``).
        help: its one-line help.
        description: the parser's description.
        script: ``"module:Class"`` of its :class:`TrainScriptArguments` subclass.
        config: ``"module:Class"`` of its TRL config.
        main: ``"module:function"``; ``main(script, config, model, tokenizer, peft_config) -> dict`` trains
            and returns the summary printed as one JSON line.
        sessions: whether rollouts run compacted sessions (``CompactionConfig`` flags).
        defaults: TRL config values that differ from the config's own defaults for this command.
        aliases: older or shorter names → field names (flags and TOML keys), e.g. ``env`` → ``env_id``.
        prepare: ``"module:function"`` run on the merged ``(script, training)`` before the config is
            built (command-specific defaults and checks), or ``None``.
    """

    name: str
    help: str
    description: str
    script: str
    config: str
    main: str
    sessions: bool = False
    defaults: Mapping[str, Any] = field(default_factory=dict)
    aliases: Mapping[str, str] = field(default_factory=dict)
    prepare: str | None = None


_SESSION_ALIASES = {"env": "env_id", "episodes": "num_episodes", "first_seed": "episode_seed"}

#: The train commands, in help order.
TRAIN_COMMANDS: tuple[TrainCommand, ...] = (
    TrainCommand(
        name="sft",
        help="tree-packed SFT (exactly per-branch training, one forward per tree)",
        description="Tree-packed SFT (or its per-branch baseline) from a file of trees, chat conversations or "
        "agent trajectories.",
        script="compaction_gym.trainers.tree_sft.cli:TreeSFTScriptArguments",
        config="compaction_gym.trainers.tree_sft.tree_sft_config:TreeSFTConfig",
        main="compaction_gym.trainers.tree_sft.cli:main",
        defaults={"output_dir": "runs/tree-sft", "report_to": "tensorboard", "logging_steps": 1, "max_length": None},
        aliases={"attn": "tree_attn_implementation", "normalizer": "loss_normalizer"},
        prepare="compaction_gym.trainers.tree_sft.cli:prepare",
    ),
    TrainCommand(
        name="grpo",
        help="GRPO on env episodes with compacted sessions and exact compaction replay",
        description="GRPO on env episodes whose KV cache is compacted while the agent acts; every log-prob "
        "pass replays the episode's compaction.",
        script="compaction_gym.trainers.grpo.cli:GRPOScriptArguments",
        config="compaction_gym.trainers.grpo.grpo_config:CompactionGRPOConfig",
        main="compaction_gym.trainers.grpo.cli:main",
        sessions=True,
        defaults={"output_dir": "runs/grpo", "learning_rate": 1e-6, "num_generations": 8, "max_steps": 100},
        aliases=_SESSION_ALIASES,
        prepare="compaction_gym.trainers.grpo.cli:prepare",
    ),
    TrainCommand(
        name="gjs",
        help="top-K GJS self-distillation on env rollouts (SDPO-style)",
        description="On-policy top-K GJS self-distillation: the policy's rollouts, scored by the policy (or an "
        "EMA) reading a reprompt with a successful sibling's solution and/or env feedback.",
        script="compaction_gym.trainers.grpo.cli:GRPOScriptArguments",
        config="compaction_gym.trainers.gjs.gjs_config:GJSDistillationConfig",
        main="compaction_gym.trainers.gjs.cli:main",
        sessions=True,
        defaults={
            "output_dir": "runs/gjs",
            "env_id": "AttnMatch-Math-v0",
            "learning_rate": 1e-6,
            "num_generations": 4,
            "per_device_train_batch_size": 4,
            "num_episodes": 256,
        },
        aliases=_SESSION_ALIASES,
        prepare="compaction_gym.trainers.grpo.cli:prepare",
    ),
)


def command(name: str) -> TrainCommand:
    """The row of :data:`TRAIN_COMMANDS` called ``name``."""
    for row in TRAIN_COMMANDS:
        if row.name == name:
            return row
    raise InvalidArgumentError(f"unknown train command {name!r}; one of {[c.name for c in TRAIN_COMMANDS]}")


def _load(spec: str) -> Any:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------------ parser
@dataclass
class _Parser:
    parser: argparse.ArgumentParser
    script_cls: type
    config_cls: type
    script_names: set[str]
    config_names: set[str]
    compaction_names: set[str]


def build_parser(cmd: TrainCommand) -> _Parser:
    """The full parser of ``compaction-gym train NAME``: script arguments, the TRL config's flags (both
    spellings, via ``HfArgumentParser``) and, with sessions, ``CompactionConfig`` flags. Every flag
    defaults to ``argparse.SUPPRESS``, so only flags given override the TOML file."""
    from transformers import HfArgumentParser

    script_cls, config_cls = _load(cmd.script), _load(cmd.config)
    parser = HfArgumentParser(
        config_cls,
        prog=f"compaction-gym train {cmd.name}",
        description=cmd.description,
    )
    config_names = {f.name for f in dataclasses.fields(config_cls) if f.init}
    for action in parser._actions:
        if action.dest in config_names:
            action.default = argparse.SUPPRESS
            if getattr(action.type, "__name__", "") == "string_to_bool" and action.nargs is None:
                # `bool | None` fields (TRL's bf16, tf32): a bare `--bf16` means true, as for plain bools
                action.nargs, action.const = "?", True
            if action.dest in cmd.defaults:
                action.help = f"{action.help or ''} (this command's default: {cmd.defaults[action.dest]!r})"
    script_group = parser.add_argument_group(f"compaction-gym train {cmd.name}")
    add_dataclass_arguments(script_group, script_cls)
    compaction_names: set[str] = set()
    if cmd.sessions:
        from compaction_gym.engine.config import CompactionConfig

        add_dataclass_arguments(
            parser.add_argument_group("compaction (CompactionConfig of the rollout sessions)"),
            CompactionConfig,
            config=False,
        )
        compaction_names = {f.name for f in dataclasses.fields(CompactionConfig)}
    for alias, target in cmd.aliases.items():
        action = parser._option_string_actions.get(flag(target)) or parser._option_string_actions.get(
            "--" + target
        )
        if action is not None:
            for text in {flag(alias), "--" + alias}:
                action.option_strings.append(text)
                parser._option_string_actions[text] = action
    return _Parser(
        parser,
        script_cls,
        config_cls,
        {f.name for f in dataclasses.fields(script_cls)},
        config_names,
        compaction_names,
    )


# ------------------------------------------------------------------------------------------ merging
def _split_toml(cmd: TrainCommand, p: _Parser, path: str) -> tuple[dict, dict, dict]:
    """``--config`` file → (script, training, compaction) values; unknown keys are named."""
    tables = {"training": p.config_names, "compaction": p.compaction_names} if cmd.sessions else {
        "training": p.config_names
    }
    valid = p.script_names | p.config_names | p.compaction_names | set(cmd.aliases) | set(tables)
    hint = "TRL config fields may also go in a [training] table" + (
        ", CompactionConfig fields in a [compaction] table" if cmd.sessions else ""
    )
    raw = read_toml_config(path, valid, hint=hint)
    script: dict[str, Any] = {}
    training: dict[str, Any] = {}
    compaction: dict[str, Any] = {}
    for key, value in raw.items():
        if key in tables and isinstance(value, dict) and key not in p.script_names:
            unknown = sorted(set(value) - tables[key])
            if unknown:
                raise InvalidArgumentError(f"{path}: unknown keys {unknown} in [{key}]")
            (training if key == "training" else compaction).update(value)
            continue
        if key == "compaction" and key in p.config_names and isinstance(value, dict) and cmd.sessions:
            compaction.update(value)
            continue
        name = cmd.aliases.get(key, key)
        if name in p.script_names:
            script[name] = value
        elif name in p.compaction_names:
            compaction[name] = value
        else:
            training[name] = value
    return script, training, compaction


def merge_arguments(cmd: TrainCommand, p: _Parser, ns: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """Defaults < ``--config`` TOML < flags → (script arguments, TRL config keyword arguments)."""
    toml_script, toml_training, toml_compaction = (
        _split_toml(cmd, p, ns.config) if getattr(ns, "config", None) else ({}, {}, {})
    )
    script = p.script_cls(**{**toml_script, **given_fields(p.script_cls, ns)})
    if not script.model:
        raise InvalidArgumentError("--model is required (a flag or the config key 'model')")
    training: dict[str, Any] = {**cmd.defaults, **toml_training}
    training.update({k: v for k, v in vars(ns).items() if k in p.config_names})
    if cmd.sessions:
        from compaction_gym.engine.config import CompactionConfig

        base = training.get("compaction") or {}
        if isinstance(base, str):
            base = json.loads(base)
        flags = given_fields(CompactionConfig, ns)
        training["compaction"] = {**base, **toml_compaction, **flags} or None
    return script, training


def _bf16_default(script: TrainScriptArguments, training: dict[str, Any]) -> str:
    """The weights dtype; ``bf16`` follows it unless given (float32 weights: no autocast)."""
    import torch

    cuda = torch.cuda.is_available()
    name = script.dtype if script.dtype != "auto" else ("bfloat16" if cuda else "float32")
    if "bf16" not in training and "fp16" not in training:
        training["bf16"] = name == "bfloat16"
    return name


def _offline_push(training: dict[str, Any]) -> str | None:
    """One line when ``push_to_hub`` is asked for but the hub is offline (``HF_HUB_OFFLINE``)."""
    if not training.get("push_to_hub"):
        return None
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        training["push_to_hub"] = False
        return "push_to_hub skipped: the Hugging Face Hub is offline (HF_HUB_OFFLINE=1); the model is saved locally"
    return None


def _is_hub_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is a network or Hub error (not a training bug)."""
    seen: BaseException | None = exc
    while seen is not None:
        module = type(seen).__module__.split(".")[0]
        if isinstance(seen, ConnectionError) or module in ("httpx", "httpx2", "httpcore", "requests", "urllib3"):
            return True
        if module == "huggingface_hub":
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def run_command(name: str, argv: Sequence[str]) -> int:
    """Parse ``argv`` for ``compaction-gym train NAME``, build the model and trainer config, train.

    Bad arguments print ``PROG: message`` on stderr and return 2; the summary is one JSON line.
    """
    cmd = command(name)
    p = build_parser(cmd)
    prog = p.parser.prog
    ns = p.parser.parse_args(list(argv))
    try:
        script, training = merge_arguments(cmd, p, ns)
        if cmd.prepare:
            _load(cmd.prepare)(script, training)
        dtype_name = _bf16_default(script, training)
        note = _offline_push(training)
        if note:
            print(f"{prog}: {note}", file=sys.stderr)
        peft_config = script.peft_config()
        config = p.config_cls(**training)
        from compaction_gym.models.registry import resolve_model

        path = resolve_model(script.model)
    except (InvalidArgumentError, TypeError, ValueError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name))
    main: Callable[..., Any] = _load(cmd.main)
    try:
        summary = main(script, config, model, tokenizer, peft_config)
    except Exception as exc:
        if not (config.push_to_hub and _is_hub_error(exc)):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"{prog}: push_to_hub failed, the Hugging Face Hub is unreachable ({type(exc).__name__}: {first}); "
            "pass --push_to_hub false, or set HF_HUB_OFFLINE=1 to train without pushing",
            file=sys.stderr,
        )
        return 1
    if isinstance(summary, int):
        return summary
    print(json.dumps(summary))
    return 0


# ------------------------------------------------------------------------------------------ dispatcher
def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``train`` and one stub per :data:`TRAIN_COMMANDS` row (arguments parsed by :func:`run_command`)."""
    train = subparsers.add_parser(
        "train",
        help="train with GRPO replay, tree SFT or GJS distillation",
        description="Train a model with one of the compaction-gym trainers; "
        "`compaction-gym train NAME --help` lists a trainer's flags.",
    )
    sub = train.add_subparsers(dest="trainer", metavar="TRAINER")
    for row in TRAIN_COMMANDS:
        stub = sub.add_parser(row.name, help=row.help, add_help=False, prefix_chars="\x01")
        stub.add_argument("train_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        stub.set_defaults(func=lambda args, _name=row.name: run_command(_name, args.train_args))

    def run(args: argparse.Namespace) -> int:
        train.print_help()
        return 0

    train.set_defaults(func=run)


def cli(name: str, argv: Sequence[str] | None = None) -> int:
    """``python -m compaction_gym.trainers.<trainer>.cli ...``."""
    return run_command(name, sys.argv[1:] if argv is None else argv)
