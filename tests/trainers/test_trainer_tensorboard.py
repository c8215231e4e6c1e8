"""Every trainer writes TensorBoard by default: GRPO's rollout histograms (the shared
``TrajectoryLogger``) and tree SFT's scalars, read back with TensorBoard's EventAccumulator."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer
from tree_helpers import random_tree


def _acc(root: Path) -> EventAccumulator:
    files = sorted(root.rglob("events.out.tfevents*"))
    assert files, f"no TensorBoard event file under {root}"
    acc = EventAccumulator(str(files[-1].parent), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_grpo_logs_histograms_of_each_steps_rollouts(tiny_model_path, tmp_path):
    from compaction_gym.trainers.grpo.grpo_trainer import CompactionGRPOConfig, CompactionGRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    args = CompactionGRPOConfig(
        str(tmp_path / "run"), env_id="AttnMatch-BabyAI-GoTo-v0", env_kwargs={"max_episode_steps": 3},
        compaction={"mode": "attention_matching", "n_protect_turns": 1}, max_turn_tokens=4,
        num_generations=2, per_device_train_batch_size=2, max_steps=2, num_episodes=4,
        bf16=False, use_cpu=True, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    assert args.report_to == ["tensorboard"]  # the default
    trainer = CompactionGRPOTrainer(model, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_path))
    batches: list[list] = []
    trainer.rollouts.listeners.append(batches.append)
    trainer.train()
    assert len(batches) == 2  # one rollout batch per optimizer step
    assert any(t.events for b in batches for t in b)
    acc = _acc(tmp_path / "run")
    hists = {h.step: h.histogram_value for h in acc.Histograms("train/compaction/span_ratio")}
    peaks = {h.step: h.histogram_value for h in acc.Histograms("train/episode/peak_kv_len")}
    for step, batch in enumerate(batches, 1):
        want = [max([t.prompt_len, *(turn.peak_kv_len for turn in t.turns)]) for t in batch]
        assert (peaks[step].num, peaks[step].sum, peaks[step].max) == (len(want), sum(want), max(want))
        ratios = [e.target / (e.span[1] - e.span[0]) for t in batch for e in t.events]
        if not ratios:  # an episode solved in one turn never compacts: no histogram at that step
            assert step not in hists
            continue
        assert hists[step].num == len(ratios)
        assert hists[step].sum == pytest.approx(sum(ratios), rel=1e-6)
        assert (hists[step].min, hists[step].max) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
    scalars = {e.step: e.value for e in acc.Scalars("train/rollout/compaction_events")}
    assert scalars == {s: pytest.approx(sum(len(t.events) for t in b) / len(b)) for s, b in enumerate(batches, 1)}


def test_grpo_without_tensorboard_adds_no_histograms(tiny_model_path, tmp_path):
    from compaction_gym.trainers.grpo.grpo_trainer import CompactionGRPOConfig, CompactionGRPOTrainer
    from compaction_gym.trainers.tensorboard import RolloutHistogramCallback

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    args = CompactionGRPOConfig(str(tmp_path / "off"), env_id="AttnMatch-BabyAI-GoTo-v0", num_generations=2,
                                per_device_train_batch_size=2, bf16=False, use_cpu=True, report_to="none")  # fmt: skip
    trainer = CompactionGRPOTrainer(model, args, processing_class=AutoTokenizer.from_pretrained(tiny_model_path))
    assert not any(isinstance(c, RolloutHistogramCallback) for c in trainer.callback_handler.callbacks)
    assert trainer.rollouts.listeners == []


def test_tree_sft_writes_tensorboard_by_default(tiny_model_path, tiny_tokenizer, tmp_path):
    from compaction_gym.trainers.tree_sft import trees_to_dataset
    from compaction_gym.trainers.tree_sft.tree_sft_config import TreeSFTConfig
    from compaction_gym.trainers.tree_sft.tree_sft_trainer import TreeSFTTrainer

    rng = random.Random(0)
    trees = [random_tree(rng, 200) for _ in range(2)]
    args = TreeSFTConfig(str(tmp_path / "sft"), use_cpu=True, bf16=False, save_strategy="no", max_steps=2,
                         disable_tqdm=True, max_length=None)  # fmt: skip
    assert args.report_to == ["tensorboard"] and args.logging_steps == 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    trainer = TreeSFTTrainer(model, args, train_dataset=trees_to_dataset(trees), processing_class=tiny_tokenizer)
    trainer.train()
    acc = _acc(tmp_path / "sft")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx(losses, rel=1e-6) and len(losses) == 2
    packed = {float(t.num_tokens) for t in trees}
    assert {e.value for e in acc.Scalars("train/tree/packed_tokens")} <= packed
