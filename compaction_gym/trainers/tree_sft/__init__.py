"""Tree-packed SFT: trees of token nodes, DFS packing with ancestor-only attention, and a weighted
NLL that equals per-branch training exactly. Pure torch (no trl); the trainer is
:class:`compaction_gym.trainers.TreeSFTTrainer`."""

from compaction_gym.trainers.tree_sft.builders import (
    add_tree_stats,
    branching_score,
    chat_samples,
    fold_extensions,
    select_trees,
    split_reasoning,
    trajectory_samples,
    tree_from_chat,
    tree_from_group,
    tree_from_sequences,
    tree_from_trajectories,
    tree_from_trajectory,
    tree_stats,
    trees_to_dataset,
)
from compaction_gym.trainers.tree_sft.loss import (
    attn_implementation_of,
    branch_batch,
    branch_loss,
    branch_nll_loss,
    tree_forward,
    tree_loss,
    tree_nll_loss,
)
from compaction_gym.trainers.tree_sft.masks import (
    clear_block_mask_cache,
    dense_tree_mask,
    set_block_mask_cache_size,
    tree_block_mask,
    tree_mask_mod,
)
from compaction_gym.trainers.tree_sft.packing import (
    ATTN_IMPLEMENTATIONS,
    NORMALIZERS,
    PackedTree,
    check_tree_limits,
    pack_tree,
    tree_fits,
)
from compaction_gym.trainers.tree_sft.tree import InvalidTreeError, Tree, TreeNode, TreeTooLongError

__all__ = [
    "ATTN_IMPLEMENTATIONS",
    "NORMALIZERS",
    "InvalidTreeError",
    "PackedTree",
    "Tree",
    "TreeNode",
    "TreeTooLongError",
    "add_tree_stats",
    "attn_implementation_of",
    "branch_batch",
    "branch_loss",
    "branch_nll_loss",
    "branching_score",
    "chat_samples",
    "check_tree_limits",
    "clear_block_mask_cache",
    "dense_tree_mask",
    "fold_extensions",
    "pack_tree",
    "select_trees",
    "set_block_mask_cache_size",
    "split_reasoning",
    "trajectory_samples",
    "tree_block_mask",
    "tree_fits",
    "tree_forward",
    "tree_from_chat",
    "tree_from_group",
    "tree_from_sequences",
    "tree_from_trajectories",
    "tree_from_trajectory",
    "tree_loss",
    "tree_mask_mod",
    "tree_nll_loss",
    "tree_stats",
    "trees_to_dataset",
]
