"""``compaction-gym train grpo``: GRPO on env episodes with compacted sessions and exact replay.

Example::

    compaction-gym train grpo --env AttnMatch-BabyAI-GoTo-v0 --model Qwen/Qwen3-0.6B \\
        --compaction-mode attention_matching --max-kv-len 2048 --compute-beta --output-dir runs/grpo
    compaction-gym train grpo --config grpo.toml --max-steps 10      # flags override the file

The TOML file holds any of the flags' names (``model = "..."``, ``max_kv_len = 2048``), an optional
``[compaction]`` table of :class:`~compaction_gym.engine.CompactionConfig` fields (merged over the
flags' compaction options) and an optional ``[training]`` table passed straight to
:class:`~compaction_gym.trainers.grpo.CompactionGRPOConfig` (``beta``, ``loss_type``, ...).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from compaction_gym.cli_args import (
    add_dataclass_arguments,
    add_script_command,
    load_script_arguments,
    run_script,
    script_parser,
)

#: ``CompactionConfig``'s modes, spelled out so that building the parser imports no engine (a test
#: checks they match ``compaction_gym.engine.config.COMPACTION_MODES``).
COMPACTION_MODES = ("none", "attention_matching", "markovian", "h2o", "snapkv", "streaming", "random", "tova", "knorm")


@dataclass
class GRPOScriptArguments:
    """Arguments of ``compaction-gym train grpo`` (also the keys of its ``--config`` TOML file)."""

    model: str | None = field(
        default=None, metadata={"help": "model path, hub id or 'tiny-random' (required)"}
    )
    env: str = field(
        default="AttnMatch-BabyAI-v0", metadata={"help": "env id, or several separated by commas"}
    )
    env_max_steps: int | None = field(
        default=None, metadata={"help": "cap on env steps per episode (gym.make max_episode_steps)"}
    )
    prompt_format: str = field(
        default="balrog", metadata={"help": "agent prompt format", "choices": ("balrog", "reasoning", "raw")}
    )
    max_turn_tokens: int | None = field(default=None, metadata={"help": "tokens sampled per turn"})
    compaction_mode: str = field(
        default="none", metadata={"help": "session compaction mode", "choices": COMPACTION_MODES}
    )
    max_kv_len: int | None = field(default=None, metadata={"help": "KV-budget trigger length"})
    compact_window: int | None = field(default=None, metadata={"help": "rows compacted per KV-budget event"})
    compact_target_ratio: float = field(default=0.25, metadata={"help": "kept fraction of a span"})
    n_protect_turns: int = field(default=-1, metadata={"help": "turn-based trigger (-1: off)"})
    compute_beta: bool = field(default=False, metadata={"help": "fit the per-key logit bias β"})
    probe_queries: str = field(
        default="suffix", metadata={"help": "probe source", "choices": ("suffix", "keys", "random")}
    )
    grad_through_compaction: bool = field(
        default=True, metadata={"help": "gradients through C1/C2 (--no-grad-through-compaction detaches)"}
    )
    num_generations: int = field(default=8, metadata={"help": "episodes per GRPO group"})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "episodes per micro-batch"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    learning_rate: float = field(default=1e-6, metadata={"help": "peak learning rate"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature"})
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the reference model"})
    lora_r: int = field(
        default=0, metadata={"help": "train a LoRA adapter of this rank (0: full fine-tuning)"}
    )
    output_dir: str = field(default="runs/grpo", metadata={"help": "checkpoints and logs"})
    max_steps: int = field(default=100, metadata={"help": "optimizer steps"})
    logging_steps: int = field(default=1, metadata={"help": "log every N steps"})
    seed: int = field(
        default=0, metadata={"help": "training seed (episode and sampling seeds derive from it)"}
    )
    dtype: str = field(
        default="auto",
        metadata={
            "help": "model weights dtype (auto: bfloat16 on CUDA, float32 on CPU)",
            "choices": ("auto", "float32", "bfloat16", "float16"),
        },
    )
    report_to: str = field(
        default="tensorboard", metadata={"help": "trackers (tensorboard, wandb, none, ...)"}
    )
    save: bool = field(default=True, metadata={"help": "save the final model to --output-dir"})
    compaction: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TOML only: CompactionConfig fields"}
    )
    training: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TOML only: extra CompactionGRPOConfig fields"}
    )

    def compaction_dict(self) -> dict[str, Any]:
        """The sessions' ``CompactionConfig`` fields from the flags, then the ``[compaction]`` table."""
        out: dict[str, Any] = {"mode": self.compaction_mode}
        if self.compaction_mode != "none":
            out.update(
                max_kv_len=self.max_kv_len,
                compact_window=self.compact_window,
                compact_target_ratio=self.compact_target_ratio,
                n_protect_turns=self.n_protect_turns,
                compute_beta=self.compute_beta,
                queries=self.probe_queries,
            )
        return {**out, **self.compaction}


_TOML_ONLY = ("compaction", "training")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per :class:`GRPOScriptArguments` field (plus ``--config``)."""
    add_dataclass_arguments(parser, GRPOScriptArguments, skip=_TOML_ONLY)


def parse_script_arguments(args: argparse.Namespace) -> GRPOScriptArguments:
    """Merge defaults < ``--config`` TOML < command-line flags into :class:`GRPOScriptArguments`."""
    return load_script_arguments(
        GRPOScriptArguments,
        args,
        required=("model",),
        hint="CompactionConfig fields go in a [compaction] table, CompactionGRPOConfig fields in a [training] "
        "table",
    )


def register_train(subparsers: argparse._SubParsersAction) -> None:
    """Add ``grpo`` to ``compaction-gym train``."""
    add_script_command(
        subparsers,
        "grpo",
        help="GRPO on env episodes with compacted sessions and exact compaction replay",
        doc=__doc__,
        add_arguments=add_arguments,
        run=run,
    )


def run(args: argparse.Namespace) -> int:
    """Entry point of ``compaction-gym train grpo``."""
    return run_script("compaction-gym train grpo", args, parse_script_arguments, main)


def main(script: GRPOScriptArguments) -> int:
    """Load the model, build the trainer, train, save; prints a JSON summary line."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compaction_gym.models.registry import resolve_model
    from compaction_gym.trainers import CompactionGRPOConfig, CompactionGRPOTrainer

    path = resolve_model(script.model)
    cuda = torch.cuda.is_available()
    dtype_name = script.dtype if script.dtype != "auto" else ("bfloat16" if cuda else "float32")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype_name))
    peft_config = None
    if script.lora_r > 0:
        from peft import LoraConfig

        peft_config = LoraConfig(r=script.lora_r, lora_alpha=2 * script.lora_r, target_modules="all-linear")
    training: dict[str, Any] = {
        "output_dir": script.output_dir,
        "env_id": script.env,
        "env_kwargs": {"max_episode_steps": script.env_max_steps} if script.env_max_steps else None,
        "prompt_format": script.prompt_format,
        "max_turn_tokens": script.max_turn_tokens,
        "compaction": script.compaction_dict(),
        "grad_through_compaction": script.grad_through_compaction,
        "num_generations": script.num_generations,
        "per_device_train_batch_size": script.per_device_train_batch_size,
        "gradient_accumulation_steps": script.gradient_accumulation_steps,
        "learning_rate": script.learning_rate,
        "temperature": script.temperature,
        "beta": script.beta,
        "max_steps": script.max_steps,
        "logging_steps": script.logging_steps,
        "seed": script.seed,
        "report_to": script.report_to,
        "save_strategy": "no",
        "bf16": dtype_name == "bfloat16" and cuda,
        "use_cpu": not cuda,
        **script.training,
    }
    trainer = CompactionGRPOTrainer(
        model, CompactionGRPOConfig(**training), processing_class=tokenizer, peft_config=peft_config
    )
    result = trainer.train()
    if script.save:
        trainer.save_model(script.output_dir)
    last = {
        k: v for h in trainer.state.log_history for k, v in h.items() if k.startswith(("replay/", "reward"))
    }
    print(json.dumps({"train_loss": result.training_loss, "steps": result.global_step, **last}))
    return 0


def make_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m compaction_gym.trainers.grpo.cli``)."""
    return script_parser("compaction-gym train grpo", __doc__, add_arguments)


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m compaction_gym.trainers.grpo.cli ...``."""
    return run(make_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(cli())
