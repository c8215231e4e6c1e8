"""Tutorial 4: tree-packed SFT on multi-turn agent trajectories.

A multi-turn episode trained the flat way is one sample per turn, each repeating the whole history.
Tree SFT packs the samples of an episode into a prefix tree, runs one forward over it with an
ancestor mask, and weights the loss so that the result *is* per-sample training (docs/tree-sft.md).

1. ``babyai-tiny`` plays a few BabyAI episodes (its own ``<think>`` reasoning, compacted sessions);
2. each trajectory becomes a tree: with ``strip_reasoning=True`` later turns see earlier outputs
   without their reasoning, so each turn's reasoning is a side leaf;
3. the packed loss equals the per-branch loss, at a fraction of the tokens;
4. ``TreeSFTTrainer`` (a ``trl.SFTTrainer``) trains on the trees.

Run it (CPU, about 20 s)::

    python docs/tutorials/t04_tree_sft.py
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import gymnasium as gym
import torch
from datasets import Dataset

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym import models
from compaction_gym.agents import CompactionAgent, run_episodes
from compaction_gym.backends import LocalBackend
from compaction_gym.engine import CompactionConfig, Engine, SamplingParams
from compaction_gym.trainers import TreeSFTConfig, TreeSFTTrainer
from compaction_gym.trainers.tree_sft import branch_loss, tree_loss
from compaction_gym.trainers.tree_sft.builders import branching_score, tree_from_trajectory


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Play, build trees, compare packed and per-branch losses, train; return the numbers."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=3)
    parser.add_argument("--task", default="goto")
    parser.add_argument("--max-steps", type=int, default=3, help="optimizer steps")
    args = parser.parse_args(argv)

    model, tokenizer = models.load("babyai-tiny")

    # 1. Trajectories. The engine runs on the very module we train (no copy).
    backend = LocalBackend(Engine(model, tokenizer, max_slots=args.episodes))
    compaction = CompactionConfig(mode="attention_matching", max_kv_len=512, compact_window=256)
    envs = [gym.make("AttnMatch-BabyAI-v0", task=args.task, action_parsing="tag") for _ in range(args.episodes)]
    agents = [CompactionAgent(backend, compaction=compaction, prompt="reasoning",
                              sampling=SamplingParams(temperature=0.0, max_new_tokens=64))
              for _ in range(args.episodes)]
    trajectories = run_episodes(envs, agents, seeds=list(range(args.episodes)))

    # 2. Trees: one per episode. The training targets see the full logical context; compaction
    #    only shaped what the model did (compaction-aware training is GRPO replay's job).
    trees = [tree_from_trajectory(t, tokenizer=tokenizer, strip_reasoning=True) for t in trajectories]
    for t, tree in zip(trajectories, trees):
        print(f"episode seed {t.seed}: {len(t.turns)} turns -> tree of {len(tree.leaves)} leaves, "
              f"{tree.num_tokens} packed tokens vs {tree.branch_tokens} per-branch "
              f"(x{branching_score(tree):.2f})")

    # 3. One packed forward == the branches as a padded causal batch (same weights, same loss).
    with torch.no_grad():
        packed = tree_loss(model, trees[0]).item()
        per_branch = branch_loss(model, trees[0]).item()
    print(f"loss of tree 0: packed {packed:.6f}, per branch {per_branch:.6f}")

    # 4. Train. The dataset is tree rows (parents, token_ids, loss_mask), one tree per micro-batch.
    dataset = Dataset.from_list([tree.to_dict() for tree in trees])
    with tempfile.TemporaryDirectory() as out:
        config = TreeSFTConfig(
            output_dir=out, max_steps=args.max_steps, learning_rate=1e-4, per_device_train_batch_size=1,
            gradient_accumulation_steps=1, logging_steps=1, report_to="none", save_strategy="no",
            use_cpu=not torch.cuda.is_available(), bf16=False,
        )
        trainer = TreeSFTTrainer(model, config, train_dataset=dataset, processing_class=tokenizer)
        trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print("training losses:", ", ".join(f"{x:.4f}" for x in losses))
    return {"trajectories": trajectories, "trees": trees, "packed": packed, "per_branch": per_branch,
            "losses": losses}


if __name__ == "__main__":
    main()
