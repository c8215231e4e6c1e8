"""``compaction-gym train gjs``: top-K GJS self-distillation on env rollouts.

Example::

    compaction-gym train gjs --model path/to/model --env AttnMatch-Math-v0 --num-episodes 256 \\
        --num-generations 4 --gjs-k 20 --gjs-alpha 0.5 --output-dir runs/gjs
    compaction-gym train gjs --config gjs.toml --max-steps 10   # flags override the file

Built by :mod:`compaction_gym.trainers.cli` like ``train grpo`` (same script arguments and
``CompactionConfig`` flags) with :class:`~compaction_gym.trainers.gjs.gjs_config.GJSDistillationConfig`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from compaction_gym.trainers.cli import cli as _cli


def main(script: Any, config: Any, model: Any, tokenizer: Any, peft_config: Any) -> dict[str, Any]:
    """Train :class:`~compaction_gym.trainers.gjs.gjs_trainer.GJSDistillationTrainer`."""
    from compaction_gym.trainers.gjs.gjs_trainer import GJSDistillationTrainer

    trainer = GJSDistillationTrainer(model, config, processing_class=tokenizer, peft_config=peft_config)
    result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    if script.save:
        trainer.save_model(config.output_dir)
    return {
        "train_loss": result.training_loss,
        "steps": result.global_step,
        "divergence_mode": trainer.divergence_mode,
    }


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m compaction_gym.trainers.gjs.cli ...``."""
    return _cli("gjs", argv)


if __name__ == "__main__":
    sys.exit(cli())
