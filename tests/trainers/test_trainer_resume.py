"""Resume is faithful (GRPO, GJS, tree SFT): a run resumed from a checkpoint ends with the same
parameters (and, for GJS, the same EMA teacher) as the uninterrupted run — sampling seeds and
teacher state come back with the checkpoint (docs/grpo.md and docs/gjs.md, "Checkpoints and resume")."""

from __future__ import annotations

from pathlib import Path

import torch
from replay_helpers import even_tokens
from transformers import AutoModelForCausalLM, AutoTokenizer

#: Turn-based β compaction, so every step's episodes replay a compaction event.
COMPACTION = {"mode": "attention_matching", "n_protect_turns": 1, "compute_beta": True, "n_probe_queries": 16}




def _common(output_dir: Path) -> dict:
    return dict(
        output_dir=str(output_dir),
        env_kwargs={"max_episode_steps": 3},
        compaction=COMPACTION,
        max_turn_tokens=5,
        num_generations=2,
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-2,
        num_episodes=16,
        bf16=False,
        use_cpu=True,
        save_strategy="steps",
        save_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=3,
    )


def _train(cls, args, model_path, resume: str | None = None):
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    trainer = cls(
        model, args, reward_funcs=[even_tokens], processing_class=AutoTokenizer.from_pretrained(model_path)
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    pb = dict(b.named_parameters())
    return max((p.detach() - pb[n].detach()).abs().max().item() for n, p in a.named_parameters())


def _moved(a: torch.nn.Module, model_path: str) -> float:
    return _max_diff(a, AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32))


def test_grpo_resumed_run_equals_the_uninterrupted_run(tiny_model_path, tmp_path):
    from compaction_gym.trainers import CompactionGRPOConfig, CompactionGRPOTrainer

    env = dict(env_id="AttnMatch-BabyAI-v0")
    full = _train(CompactionGRPOTrainer, CompactionGRPOConfig(**_common(tmp_path / "a"), **env), tiny_model_path)
    resumed = _train(
        CompactionGRPOTrainer,
        CompactionGRPOConfig(**_common(tmp_path / "b"), **env),
        tiny_model_path,
        resume=str(tmp_path / "a" / "checkpoint-2"),
    )
    assert resumed.state.global_step == full.state.global_step == 3
    assert _moved(full.model, tiny_model_path) > 1e-3  # the steps did train
    assert _max_diff(full.model, resumed.model) <= 1e-6
    # step 3's episodes are the same episodes (same sampling seeds), not merely close weights
    tokens = [[t.token_ids for t in tr._rollout_trajectories] for tr in (full, resumed)]
    assert tokens[0] == tokens[1]


def test_gjs_resumed_run_restores_the_ema_teacher(tiny_model_path, tmp_path):
    from compaction_gym.trainers.gjs.gjs_config import GJSDistillationConfig
    from compaction_gym.trainers.gjs.gjs_trainer import TEACHER_CHECKPOINT_NAME, GJSDistillationTrainer

    gjs = dict(env_id="AttnMatch-Math-v0", prompt_format="raw", gjs_k=4, teacher_kind="ema", teacher_ema_rate=0.5)
    common = {**_common(tmp_path / "a"), "env_kwargs": None}
    full = _train(GJSDistillationTrainer, GJSDistillationConfig(**common, **gjs), tiny_model_path)
    assert (tmp_path / "a" / "checkpoint-2" / TEACHER_CHECKPOINT_NAME).is_file()
    resumed = _train(
        GJSDistillationTrainer,
        GJSDistillationConfig(**{**common, "output_dir": str(tmp_path / "b")}, **gjs),
        tiny_model_path,
        resume=str(tmp_path / "a" / "checkpoint-2"),
    )
    assert _moved(full.teacher_model, tiny_model_path) > 1e-4  # the teacher did move off the initial weights
    assert _max_diff(full.model, resumed.model) <= 1e-6
    assert _max_diff(full.teacher_model, resumed.teacher_model) <= 1e-6


def test_tree_sft_resumed_run_equals_the_uninterrupted_run(tiny_model_path, tmp_path):
    """Tree SFT with AdamW, a cosine schedule and shuffled trees: resumed from step 2 of 4."""
    import random

    from tree_helpers import random_tree

    from compaction_gym.trainers.tree_sft import pack_tree
    from compaction_gym.trainers.tree_sft.tree_sft_config import TreeSFTConfig
    from compaction_gym.trainers.tree_sft.tree_sft_trainer import TreeSFTTrainer

    rng = random.Random(0)
    trees = [random_tree(rng, 200, max_nodes=6, max_len=6) for _ in range(12)]
    trees = [t for t in trees if pack_tree(t).target_index.numel() > 0][:8]
    assert len(trees) == 8

    def run(name: str, resume: str | None = None):
        args = TreeSFTConfig(
            str(tmp_path / name), use_cpu=True, bf16=False, report_to="none", max_steps=4,
            gradient_accumulation_steps=2, learning_rate=1e-2, lr_scheduler_type="cosine", save_strategy="steps",
            save_steps=1, disable_tqdm=True, seed=5, max_length=None,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        trainer = TreeSFTTrainer(
            model, args, train_dataset=trees, processing_class=AutoTokenizer.from_pretrained(tiny_model_path)
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run("a")
    resumed = run("b", resume=str(tmp_path / "a" / "checkpoint-2"))
    assert _moved(full.model, tiny_model_path) > 1e-3
    assert _max_diff(full.model, resumed.model) <= 1e-6
