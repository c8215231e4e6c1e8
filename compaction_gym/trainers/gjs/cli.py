"""``compaction-gym train gjs``: top-K GJS self-distillation on env rollouts.

Example::

    compaction-gym train gjs --model path/to/model --env AttnMatch-Math-v0 --episodes 256 \\
        --num-generations 4 --gjs-k 20 --gjs-alpha 0.5 --output-dir runs/gjs
    compaction-gym train gjs --config gjs.toml --max-steps 10   # flags override the file

The TOML file holds any of the flags' names (``model = "..."``, ``gjs_k = 20``), ``env_kwargs`` and
``compaction`` tables, and an optional ``[training]`` table passed straight to
:class:`~compaction_gym.trainers.gjs.gjs_config.GJSDistillationConfig`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from compaction_gym.cli_args import (
    add_dataclass_arguments,
    add_script_command,
    flag,
    load_script_arguments,
    run_script,
    script_parser,
)
from compaction_gym.errors import InvalidArgumentError

#: Script fields copied verbatim onto GJSDistillationConfig.
_CONFIG_FIELDS = (
    "output_dir", "max_steps", "num_train_epochs", "learning_rate", "num_generations",
    "per_device_train_batch_size", "gradient_accumulation_steps", "temperature", "gjs_k", "gjs_alpha",
    "gjs_support", "distillation_coef", "policy_loss_coef", "teacher_kind", "teacher_scoring",
    "teacher_context", "logging_steps", "seed", "report_to",
)  # fmt: skip


@dataclass
class GJSScriptArguments:
    """Arguments of ``compaction-gym train gjs`` (also the keys of its ``--config`` TOML file)."""

    model: str | None = field(default=None, metadata={"help": "model path or hub id (required)"})
    env: str = field(
        default="AttnMatch-Math-v0", metadata={"help": "registered env id (several: comma-separated)"}
    )
    env_kwargs: dict[str, Any] = field(default_factory=dict, metadata={"help": "JSON object of env kwargs"})
    episodes: int = field(default=256, metadata={"help": "distinct env seeds in the dataset"})
    first_seed: int = field(default=0, metadata={"help": "env seeds are first_seed .. first_seed+episodes-1"})
    compaction: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "JSON object of CompactionConfig fields for the rollouts"}
    )
    prompt_format: str | None = field(
        default=None, metadata={"help": "balrog, reasoning or raw (default: balrog for BabyAI, else raw)"}
    )
    output_dir: str = field(default="runs/gjs", metadata={"help": "checkpoints and logs"})
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps (-1: use --num-train-epochs)"})
    num_train_epochs: float = field(default=1.0, metadata={"help": "epochs over the episodes"})
    learning_rate: float = field(default=1e-6, metadata={"help": "peak learning rate"})
    num_generations: int = field(default=4, metadata={"help": "rollouts per episode seed (a group)"})
    per_device_train_batch_size: int = field(default=4, metadata={"help": "rollouts per micro-batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    max_turn_tokens: int | None = field(
        default=None, metadata={"help": "tokens the agent may sample per turn (default: the prompt format's)"}
    )
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    gjs_k: int = field(default=20, metadata={"help": "top-k of the GJS support"})
    gjs_alpha: float = field(default=0.5, metadata={"help": "GJS α (0: KL(T||S), 1: KL(S||T))"})
    gjs_support: str = field(
        default="teacher", metadata={"help": "support", "choices": ("teacher", "student", "union")}
    )
    distillation_coef: float = field(default=1.0, metadata={"help": "weight of the distillation term"})
    policy_loss_coef: float = field(default=0.0, metadata={"help": "weight of the GRPO surrogate"})
    teacher_kind: str = field(default="policy", metadata={"help": "teacher", "choices": ("policy", "ema")})
    teacher_scoring: str = field(
        default="generation", metadata={"help": "when the teacher runs", "choices": ("generation", "loss")}
    )
    teacher_context: str = field(
        default="success_or_feedback",
        metadata={
            "help": "what the teacher sees",
            "choices": ("success_or_feedback", "success", "feedback", "success_and_feedback"),
        },
    )
    logging_steps: int = field(default=1, metadata={"help": "log every N steps"})
    seed: int = field(default=0, metadata={"help": "training seed"})
    dtype: str = field(
        default="auto",
        metadata={"help": "weights dtype (auto: bfloat16 on CUDA, float32 on CPU)",
                  "choices": ("auto", "float32", "bfloat16", "float16")},
    )  # fmt: skip
    report_to: str = field(
        default="tensorboard", metadata={"help": "trackers (tensorboard, wandb, none, ...)"}
    )
    save: bool = field(default=True, metadata={"help": "save the final model to --output-dir"})
    training: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TOML only: extra GJSDistillationConfig fields"}
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`GJSScriptArguments` field (plus ``--config``); dict fields take JSON."""
    add_dataclass_arguments(parser, GJSScriptArguments, skip=("training",))


def parse_script_arguments(args: argparse.Namespace) -> GJSScriptArguments:
    """Merge defaults < ``--config`` TOML < command-line flags into :class:`GJSScriptArguments`."""
    script = load_script_arguments(
        GJSScriptArguments,
        args,
        required=("model",),
        hint="GJSDistillationConfig fields go in a [training] table",
    )
    for name in ("env_kwargs", "compaction"):
        if not isinstance(getattr(script, name), dict):
            raise InvalidArgumentError(f"{flag(name)} must be a JSON object, got {getattr(script, name)!r}")
    if script.episodes < 1:
        raise InvalidArgumentError(f"--episodes must be >= 1, got {script.episodes}")
    return script


def register_train(subparsers: argparse._SubParsersAction) -> None:
    """Add ``gjs`` to ``compaction-gym train``."""
    add_script_command(
        subparsers,
        "gjs",
        help="top-K GJS self-distillation on env rollouts (SDPO-style)",
        doc=__doc__,
        add_arguments=add_arguments,
        run=run,
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``compaction-gym train gjs``."""
    return run_script("compaction-gym train gjs", args, parse_script_arguments, main)


def main(script: GJSScriptArguments) -> int:
    """Build the config and the trainer (one episode per env seed), then train."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compaction_gym.trainers.gjs.gjs_config import GJSDistillationConfig
    from compaction_gym.trainers.gjs.gjs_trainer import GJSDistillationTrainer

    cuda = torch.cuda.is_available()
    dtype_name = script.dtype if script.dtype != "auto" else ("bfloat16" if cuda else "float32")
    tokenizer = AutoTokenizer.from_pretrained(script.model)
    model = AutoModelForCausalLM.from_pretrained(script.model, dtype=getattr(torch, dtype_name))
    training = {name: getattr(script, name) for name in _CONFIG_FIELDS}
    training.update(
        env_id=script.env,
        env_kwargs=script.env_kwargs or None,
        num_episodes=script.episodes,
        episode_seed=script.first_seed,
        compaction=script.compaction or None,
        prompt_format=script.prompt_format or ("balrog" if "BabyAI" in script.env else "raw"),
        max_turn_tokens=script.max_turn_tokens,
        save_strategy="no",
        bf16=dtype_name == "bfloat16" and cuda,
        use_cpu=not cuda,
        **script.training,
    )
    trainer = GJSDistillationTrainer(model, GJSDistillationConfig(**training), processing_class=tokenizer)
    result = trainer.train()
    if script.save:
        trainer.save_model(script.output_dir)
    print(
        json.dumps(
            {
                "train_loss": result.training_loss,
                "steps": result.global_step,
                "divergence_mode": trainer.divergence_mode,
            }
        )
    )
    return 0


def make_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m compaction_gym.trainers.gjs.cli``)."""
    return script_parser("compaction-gym train gjs", __doc__, add_arguments)


def cli(argv: Sequence[str] | None = None) -> int:
    return run(make_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
