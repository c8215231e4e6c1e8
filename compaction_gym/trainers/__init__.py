"""TRL trainers that learn from ``env.step`` rollouts: tree SFT, GRPO with compaction replay, top-K GJS.

Names are imported lazily, so ``import compaction_gym.trainers`` does not import trl.
"""

from __future__ import annotations

from compaction_gym.lazy import lazy_exports

#: public name -> module that defines it (other trainers add their entries here)
_EXPORTS: dict[str, str] = {
    "TreeSFTConfig": "compaction_gym.trainers.tree_sft.tree_sft_config",
    "TreeSFTTrainer": "compaction_gym.trainers.tree_sft.tree_sft_trainer",
    "TreeCollator": "compaction_gym.trainers.tree_sft.tree_sft_trainer",
    "Tree": "compaction_gym.trainers.tree_sft",
    "TreeNode": "compaction_gym.trainers.tree_sft",
    "PackedTree": "compaction_gym.trainers.tree_sft",
    "pack_tree": "compaction_gym.trainers.tree_sft",
    "tree_loss": "compaction_gym.trainers.tree_sft",
    "tree_nll_loss": "compaction_gym.trainers.tree_sft",
    "CompactionGRPOConfig": "compaction_gym.trainers.grpo.grpo_config",
    "CompactionGRPOTrainer": "compaction_gym.trainers.grpo.grpo_trainer",
    "env_reward": "compaction_gym.trainers.grpo.grpo_trainer",
    "episode_dataset": "compaction_gym.trainers.grpo.grpo_trainer",
    "replay_logprobs": "compaction_gym.trainers.replay",
    "replay_logprobs_batch": "compaction_gym.trainers.replay",
    "ReplayOutput": "compaction_gym.trainers.replay",
    "ReplayPlanCache": "compaction_gym.trainers.replay_cache",
    "EnvRollouts": "compaction_gym.trainers.rollouts",
    "EpisodeSpec": "compaction_gym.trainers.rollouts",
    "group_specs": "compaction_gym.trainers.rollouts",
    "rollout_batch": "compaction_gym.trainers.rollouts",
    "GJSLossConfig": "compaction_gym.trainers.gjs",
    "divergence_mode": "compaction_gym.trainers.gjs",
    "topk_gjs": "compaction_gym.trainers.gjs",
    "topk_gjs_from_lists": "compaction_gym.trainers.gjs",
    "topk_gjs_from_teacher_topk": "compaction_gym.trainers.gjs",
    "GJSDistillationConfig": "compaction_gym.trainers.gjs.gjs_config",
    "GJSDistillationTrainer": "compaction_gym.trainers.gjs.gjs_trainer",
    "TeacherEMACallback": "compaction_gym.trainers.gjs.gjs_trainer",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
