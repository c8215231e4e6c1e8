"""``compaction-gym train sft``: tree-packed SFT (or its per-branch baseline) from a file of trees,
chat conversations or agent trajectories.

Example::

    compaction-gym train sft --model path/to/model --dataset demos.jsonl --group-size 4 \\
        --attn flex_attention --seq-len 8192 --max-packed-tokens 32768 --output-dir runs/tree-sft
    compaction-gym train sft --config sft.toml --max-steps 10   # flags override the file

The TOML file holds any of the flags' names (``model = "..."``, ``seq_len = 8192``) and an optional
``[training]`` table passed straight to :class:`~compaction_gym.trainers.tree_sft.TreeSFTConfig`
(``learning_rate``, ``warmup_steps``, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compaction_gym.cli_args import (
    add_dataclass_arguments,
    add_script_command,
    load_script_arguments,
    run_script,
    script_parser,
)
from compaction_gym.errors import InvalidArgumentError

DATASET_FORMATS = ("auto", "tree", "chat", "trajectory")


@dataclass
class TreeSFTScriptArguments:
    """Arguments of ``compaction-gym train sft`` (also the keys of its ``--config`` TOML file)."""

    model: str | None = field(default=None, metadata={"help": "model path or hub id (required)"})
    dataset: list[str] | None = field(
        default=None,
        metadata={
            "help": "a .jsonl/.json file (tree rows, chat {'messages': ...} or trajectories) or a "
            "directory saved with Dataset.save_to_disk (required); several files are concatenated"
        },
    )
    dataset_format: str = field(
        default="auto", metadata={"help": "row format; auto detects it", "choices": DATASET_FORMATS}
    )
    group_size: int = field(
        default=1, metadata={"help": "trajectories merged into one tree on their shared prefix"}
    )
    strip_reasoning: bool = field(
        default=False, metadata={"help": "trajectories: past <think> blocks become side leaves"}
    )
    targets: str = field(
        default="outputs",
        metadata={
            "help": "trajectories: train every turn's output ('outputs', incl. teacher-forced "
            "actions) or only sampled tokens",
            "choices": ("outputs", "sampled"),
        },
    )
    tree: bool = field(default=True, metadata={"help": "tree packing (--no-tree: the per-branch baseline)"})
    attn: str = field(
        default="sdpa",
        metadata={"help": "attention backend", "choices": ("sdpa", "flex_attention", "eager")},
    )
    normalizer: str = field(
        default="token", metadata={"help": "loss normaliser", "choices": ("token", "sequence")}
    )
    seq_len: int | None = field(default=None, metadata={"help": "cap on the longest root→leaf path"})
    max_packed_tokens: int | None = field(default=None, metadata={"help": "cap on the packed tree"})
    select_top: int | None = field(
        default=None, metadata={"help": "keep the N trees with the highest --selection-metric"}
    )
    selection_metric: str = field(
        default="branching_score", metadata={"help": "tree_stats column used by --select-top"}
    )
    num_proc: int | None = field(default=None, metadata={"help": "datasets.map workers for tree stats"})
    output_dir: str = field(default="runs/tree-sft", metadata={"help": "checkpoints and logs"})
    max_steps: int = field(default=-1, metadata={"help": "optimizer steps (-1: use --num-train-epochs)"})
    num_train_epochs: float = field(default=1.0, metadata={"help": "epochs over the trees"})
    learning_rate: float = field(default=1e-5, metadata={"help": "peak learning rate"})
    gradient_accumulation_steps: int = field(
        default=1, metadata={"help": "trees per optimizer step per rank"}
    )
    logging_steps: int = field(default=1, metadata={"help": "log every N steps"})
    seed: int = field(default=0, metadata={"help": "training seed"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": "model weights dtype (auto: bfloat16 on CUDA, float32 on CPU)",
            "choices": ("auto", "float32", "bfloat16", "float16", "float64"),
        },
    )
    report_to: str = field(default="none", metadata={"help": "trackers (none, tensorboard, wandb, ...)"})
    save: bool = field(default=True, metadata={"help": "save the final model to --output-dir"})
    dry_run: bool = field(default=False, metadata={"help": "build and summarise the trees, do not train"})
    training: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "TOML only: extra TreeSFTConfig fields"}
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per :class:`TreeSFTScriptArguments` field (plus ``--config``)."""
    add_dataclass_arguments(parser, TreeSFTScriptArguments, skip=("training",))


def parse_script_arguments(args: argparse.Namespace) -> TreeSFTScriptArguments:
    """Merge defaults < ``--config`` TOML < command-line flags into :class:`TreeSFTScriptArguments`."""
    script = load_script_arguments(
        TreeSFTScriptArguments,
        args,
        required=("model", "dataset"),
        hint="TreeSFTConfig fields go in a [training] table",
    )
    if script.group_size < 1:
        raise InvalidArgumentError(f"--group-size must be >= 1, got {script.group_size}")
    missing = [str(p) for p in dataset_paths(script.dataset) if not p.exists()]
    if missing:
        raise InvalidArgumentError(f"--dataset {' '.join(missing)}: no such file or directory")
    return script


def register_train(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sft`` to ``compaction-gym train``."""
    add_script_command(
        subparsers,
        "sft",
        help="tree-packed SFT (exactly per-branch training, one forward per tree)",
        doc=__doc__,
        add_arguments=add_arguments,
        run=run,
    )


# -- data --------------------------------------------------------------------------------------------
def _read_rows(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        data = json.loads(text)
        return data if isinstance(data, list) else [data]
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise InvalidArgumentError(f"{path}:{lineno}: not JSON: {exc}") from exc
    return rows


def detect_format(row: dict[str, Any]) -> str:
    """``tree``, ``chat`` or ``trajectory`` from a row's keys."""
    if "parents" in row:
        return "tree"
    if "messages" in row:
        return "chat"
    if "token_ids" in row and "turns" in row:
        return "trajectory"
    raise InvalidArgumentError(
        f"cannot tell the row format from keys {sorted(row)}: tree rows have 'parents', chat rows 'messages', "
        "trajectories 'token_ids' and 'turns'; pass --dataset-format"
    )


def dataset_paths(dataset: str | list[str] | None) -> list[Path]:
    """``--dataset`` as paths: a TOML string, or the flag's / TOML list's one or more values."""
    names = [dataset] if isinstance(dataset, str) else list(dataset or [])
    if not names:
        raise InvalidArgumentError("--dataset is required (a flag or the config key 'dataset')")
    return [Path(n) for n in names]


def load_tree_dataset(script: TreeSFTScriptArguments, tokenizer=None):
    """Read ``script.dataset`` (files concatenated in order) and return a ``datasets.Dataset`` of tree rows."""
    from datasets import Dataset, load_from_disk

    from compaction_gym.trainers.tree_sft.builders import (
        tree_from_chat,
        tree_from_trajectories,
        trees_to_dataset,
    )
    from compaction_gym.trainers.tree_sft.tree import Tree

    paths = dataset_paths(script.dataset)
    rows: Dataset | list[dict[str, Any]] = []
    for path in paths:
        if path.is_dir() and len(paths) == 1:
            rows = load_from_disk(str(path))
        elif path.is_dir():
            raise InvalidArgumentError(
                f"--dataset {path}: a saved Dataset directory cannot be mixed with other datasets"
            )
        elif path.is_file():
            part = _read_rows(path)
            if not part:
                raise InvalidArgumentError(f"--dataset {path} is empty")
            rows += part
        else:
            raise InvalidArgumentError(f"--dataset {path}: no such file or directory")
    if len(rows) == 0:
        raise InvalidArgumentError(f"--dataset {paths[0]} is empty")
    fmt = detect_format(rows[0]) if script.dataset_format == "auto" else script.dataset_format
    if fmt == "tree":
        return rows if isinstance(rows, Dataset) else trees_to_dataset(Tree.from_dict(r) for r in rows)
    if tokenizer is None and (fmt == "chat" or script.strip_reasoning):
        raise InvalidArgumentError(f"the {fmt} format needs the model's tokenizer")
    if fmt == "chat":
        trees = []
        for i, r in enumerate(rows):
            try:
                trees.append(tree_from_chat(r["messages"], tokenizer))
            except (InvalidArgumentError, KeyError) as exc:
                raise InvalidArgumentError(f"--dataset row {i}: {exc}") from exc
        return trees_to_dataset(trees)
    from compaction_gym.agents.trajectory import Trajectory

    trajs = [Trajectory.from_dict(r) for r in rows]
    groups = [trajs[i : i + script.group_size] for i in range(0, len(trajs), script.group_size)]
    return trees_to_dataset(
        tree_from_trajectories(
            g, targets=script.targets, tokenizer=tokenizer, strip_reasoning=script.strip_reasoning
        )
        for g in groups
    )


# -- command -----------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    """Entry point of ``compaction-gym train sft``."""
    return run_script("compaction-gym train sft", args, parse_script_arguments, main)


def main(script: TreeSFTScriptArguments) -> int:
    """Build the trees, then train (or summarise them with ``dry_run``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from compaction_gym.trainers.tree_sft.builders import add_tree_stats, select_trees

    tokenizer = AutoTokenizer.from_pretrained(script.model)
    dataset = load_tree_dataset(script, tokenizer)
    dataset = add_tree_stats(dataset, num_proc=script.num_proc)
    if script.select_top is not None:
        dataset = select_trees(
            dataset,
            seq_len=script.seq_len,
            max_packed_tokens=script.max_packed_tokens,
            metric=script.selection_metric,
            max_examples=script.select_top,
            num_proc=script.num_proc,
        )
    summary = {
        "trees": len(dataset),
        "mean_leaves": sum(dataset["num_leaves"]) / max(len(dataset), 1),
        "mean_packed_tokens": sum(dataset["packed_tokens"]) / max(len(dataset), 1),
        "max_seq_len": max(dataset["seq_len"], default=0),
        "branch_tokens/packed_tokens": sum(dataset["branch_tokens"]) / max(sum(dataset["packed_tokens"]), 1),
    }
    print(json.dumps(summary))
    if script.dry_run:
        return 0

    from compaction_gym.trainers import TreeSFTConfig, TreeSFTTrainer

    cuda = torch.cuda.is_available()
    dtype_name = script.dtype if script.dtype != "auto" else ("bfloat16" if cuda else "float32")
    model = AutoModelForCausalLM.from_pretrained(script.model, dtype=getattr(torch, dtype_name))
    training = {
        "output_dir": script.output_dir,
        "tree_mode": "tree" if script.tree else "per_branch",
        "tree_attn_implementation": script.attn,
        "loss_normalizer": script.normalizer,
        "seq_len": script.seq_len,
        "max_packed_tokens": script.max_packed_tokens,
        "max_steps": script.max_steps,
        "num_train_epochs": script.num_train_epochs,
        "learning_rate": script.learning_rate,
        "gradient_accumulation_steps": script.gradient_accumulation_steps,
        "logging_steps": script.logging_steps,
        "seed": script.seed,
        "report_to": script.report_to,
        "save_strategy": "no",
        "bf16": dtype_name == "bfloat16" and cuda,
        "use_cpu": not cuda,
        **script.training,
    }
    if script.seq_len is None:
        training.setdefault("max_length", None)  # TreeSFTConfig caps paths at max_length: none unless asked
    trainer = TreeSFTTrainer(
        model, TreeSFTConfig(**training), train_dataset=dataset, processing_class=tokenizer
    )
    result = trainer.train()
    if script.save:
        trainer.save_model(script.output_dir)
    print(json.dumps({"train_loss": result.training_loss, "steps": result.global_step}))
    return 0


def make_parser() -> argparse.ArgumentParser:
    """A standalone parser (``python -m compaction_gym.trainers.tree_sft.cli``)."""
    return script_parser("compaction-gym train sft", __doc__, add_arguments)


def cli(argv: Sequence[str] | None = None) -> int:
    return run(make_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli())
