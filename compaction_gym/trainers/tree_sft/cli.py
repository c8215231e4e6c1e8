"""``compaction-gym train sft``: tree-packed SFT (or its per-branch baseline) from a file of trees,
chat conversations or agent trajectories.

Example::

    compaction-gym train sft --model path/to/model --dataset demos.jsonl --group-size 4 \\
        --tree-attn-implementation flex_attention --seq-len 8192 --max-packed-tokens 32768 --output-dir runs/tree-sft
    compaction-gym train sft --config sft.toml --max-steps 10   # flags override the file

Built by :mod:`compaction_gym.trainers.cli` from :class:`TreeSFTScriptArguments` and
:class:`~compaction_gym.trainers.tree_sft.TreeSFTConfig` (every TRL/HF flag; ``attn`` and
``normalizer`` are accepted for ``tree_attn_implementation`` and ``loss_normalizer``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.cli import TrainScriptArguments
from compaction_gym.trainers.cli import cli as _cli

DATASET_FORMATS = ("auto", "tree", "chat", "trajectory")


@dataclass
class TreeSFTScriptArguments(TrainScriptArguments):
    """Script arguments of ``compaction-gym train sft`` (besides the TreeSFTConfig's)."""

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
    select_top: int | None = field(
        default=None, metadata={"help": "keep the N trees with the highest --selection-metric"}
    )
    selection_metric: str = field(
        default="branching_score", metadata={"help": "tree_stats column used by --select-top"}
    )
    num_proc: int | None = field(default=None, metadata={"help": "datasets.map workers for tree stats"})
    dry_run: bool = field(default=False, metadata={"help": "build and summarise the trees, do not train"})


def prepare(script: TreeSFTScriptArguments, training: dict[str, Any]) -> None:
    """Check the data options before anything is loaded."""
    if script.group_size < 1:
        raise InvalidArgumentError(f"--group-size must be >= 1, got {script.group_size}")
    missing = [str(p) for p in dataset_paths(script.dataset) if not p.exists()]
    if missing:
        raise InvalidArgumentError(f"--dataset {' '.join(missing)}: no such file or directory")


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
def main(script: TreeSFTScriptArguments, config: Any, model: Any, tokenizer: Any, peft_config: Any) -> dict:
    """Build the trees (printing their summary), then train unless ``dry_run``."""
    from compaction_gym.trainers.tree_sft.builders import add_tree_stats, select_trees

    dataset = load_tree_dataset(script, tokenizer)
    dataset = add_tree_stats(dataset, num_proc=script.num_proc)
    if script.select_top is not None:
        dataset = select_trees(
            dataset,
            seq_len=config.seq_len,
            max_packed_tokens=config.max_packed_tokens,
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

    from compaction_gym.trainers import TreeSFTTrainer

    trainer = TreeSFTTrainer(
        model, config, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )
    result = trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    if script.save:
        trainer.save_model(config.output_dir)
    return {"train_loss": result.training_loss, "steps": result.global_step}


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m compaction_gym.trainers.tree_sft.cli ...``."""
    return _cli("sft", argv)


if __name__ == "__main__":
    sys.exit(cli())
