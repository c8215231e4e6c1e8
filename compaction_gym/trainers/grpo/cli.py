"""``compaction-gym train grpo`` (and the episode options ``train gjs`` shares).

Example::

    compaction-gym train grpo --env AttnMatch-BabyAI-GoTo-v0 --model Qwen/Qwen3-0.6B \\
        --mode attention_matching --max-kv-len 2048 --compute-beta --lora-r 16 --output-dir runs/grpo
    compaction-gym train grpo --config grpo.toml --max-steps 10      # flags override the file

The command is built by :mod:`compaction_gym.trainers.cli` from :class:`GRPOScriptArguments`,
:class:`~compaction_gym.trainers.grpo.CompactionGRPOConfig` (every TRL flag) and
:class:`~compaction_gym.engine.CompactionConfig` (``--mode``, ``--max-kv-len``, ...).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.cli import TrainScriptArguments
from compaction_gym.trainers.cli import cli as _cli


@dataclass
class GRPOScriptArguments(TrainScriptArguments):
    """Script arguments of ``compaction-gym train grpo`` and ``train gjs`` (besides the TRL config's)."""

    env_max_steps: int | None = field(
        default=None,
        metadata={"help": "cap on env steps per episode (sets env_kwargs max_episode_steps)"},
    )


def prepare(script: GRPOScriptArguments, training: dict[str, Any]) -> None:
    """Episode defaults: ``--env-max-steps`` into ``env_kwargs``; without ``--prompt-format``, ``balrog``
    for BabyAI env ids and ``raw`` for the others."""
    if script.env_max_steps is not None:
        if script.env_max_steps < 1:
            raise InvalidArgumentError(f"--env-max-steps must be >= 1, got {script.env_max_steps}")
        kwargs = training.get("env_kwargs") or {}
        if isinstance(kwargs, str):
            import json

            kwargs = json.loads(kwargs)
        training["env_kwargs"] = {**kwargs, "max_episode_steps": script.env_max_steps}
    if "prompt_format" not in training:
        env_id = str(training.get("env_id", "AttnMatch-BabyAI-v0"))
        training["prompt_format"] = "balrog" if "BabyAI" in env_id else "raw"


def main(script: GRPOScriptArguments, config: Any, model: Any, tokenizer: Any, peft_config: Any) -> dict[str, Any]:
    """Train :class:`~compaction_gym.trainers.grpo.CompactionGRPOTrainer`; the summary's last replay
    and reward metrics."""
    from compaction_gym.trainers import CompactionGRPOTrainer

    trainer = CompactionGRPOTrainer(model, config, processing_class=tokenizer, peft_config=peft_config)
    result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    if script.save:
        trainer.save_model(config.output_dir)
    last = {
        k: v
        for h in trainer.state.log_history
        for k, v in h.items()
        if k.startswith(("replay/", "reward", "rollout/", "compaction/"))
    }
    return {"train_loss": result.training_loss, "steps": result.global_step, **last}


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m compaction_gym.trainers.grpo.cli ...``."""
    return _cli("grpo", argv)


if __name__ == "__main__":
    sys.exit(cli())
