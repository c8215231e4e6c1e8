"""``TreeSFTConfig``: :class:`trl.SFTConfig` plus the tree-packing options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trl import SFTConfig

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.devices import use_cpu_without_accelerator
from compaction_gym.trainers.tree_sft.packing import ATTN_IMPLEMENTATIONS, NORMALIZERS

TREE_MODES = ("tree", "per_branch")
OVERLONG_POLICIES = ("drop", "error")


@dataclass
class TreeSFTConfig(SFTConfig):
    """:class:`trl.SFTConfig` plus the tree-packing options.

    The dataset holds one tree per row (columns ``parents``, ``token_ids``, ``loss_mask``; see
    :meth:`Tree.to_dict`) and is used as is (``skip_prepare_dataset``). One tree per micro-batch:
    ``per_device_train_batch_size`` is 1, use ``gradient_accumulation_steps`` for more trees per step.

    Example:
        >>> args = TreeSFTConfig("out", tree_attn_implementation="flex_attention", seq_len=8192,
        ...                      max_packed_tokens=32768, gradient_accumulation_steps=4)  # doctest: +SKIP
    """

    # -- tree packing --------------------------------------------------------------------------
    tree_mode: str = field(
        default="tree",
        metadata={
            "help": "'tree': one packed forward per tree; 'per_branch': the same trees unrolled into their "
            "root→leaf branches (one padded causal batch per tree), the ablation baseline.",
            "choices": list(TREE_MODES),
        },
    )
    tree_attn_implementation: str = field(
        default="sdpa",
        metadata={
            "help": "Attention backend the model is switched to: 'sdpa' (dense N×N ancestor mask), "
            "'flex_attention' (BlockMask that skips sibling blocks; CUDA only for training) or 'eager'.",
            "choices": list(ATTN_IMPLEMENTATIONS),
        },
    )
    loss_normalizer: str = field(
        default="token",
        metadata={
            "help": "'token': the token-mean over all branches (each branch weighted 1/K of its tree); "
            "'sequence': each branch's token-mean, averaged over branches.",
            "choices": list(NORMALIZERS),
        },
    )
    seq_len: int | None = field(
        default=None,
        metadata={
            "help": "Cap on the longest root→leaf path (the context one branch needs). None: max_length."
        },
    )
    max_packed_tokens: int | None = field(
        default=None,
        metadata={"help": "Cap on the whole packed tree (memory/step time bound). None: no cap."},
    )
    overlong_trees: str = field(
        default="drop",
        metadata={
            "help": "Trees over seq_len/max_packed_tokens: 'drop' (logged) or 'error'.",
            "choices": list(OVERLONG_POLICIES),
        },
    )
    block_mask_cache_size: int = field(
        default=64, metadata={"help": "FlexAttention BlockMasks kept per tree shape (0 disables caching)."}
    )

    # -- defaults changed from SFTConfig -------------------------------------------------------
    report_to: None | str | list[str] = field(
        default="tensorboard",
        metadata={"help": "Trackers to log to (TensorBoard by default; 'none' turns logging off)."},
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    per_device_train_batch_size: int = field(
        default=1, metadata={"help": "Trees per micro-batch; must be 1."}
    )
    per_device_eval_batch_size: int = field(default=1, metadata={"help": "Trees per eval batch; must be 1."})
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Must stay False: the collator reads the tree columns."}
    )
    dataset_kwargs: dict[str, Any] | str | None = field(
        default_factory=lambda: {"skip_prepare_dataset": True},
        metadata={"help": "Kept at skip_prepare_dataset=True: rows are trees, not text."},
    )

    def __post_init__(self) -> None:
        use_cpu_without_accelerator(self)  # TRL's bf16=True default must build on CPU
        super().__post_init__()
        for name, valid in (
            ("tree_mode", TREE_MODES),
            ("tree_attn_implementation", ATTN_IMPLEMENTATIONS),
            ("loss_normalizer", NORMALIZERS),
            ("overlong_trees", OVERLONG_POLICIES),
        ):
            if getattr(self, name) not in valid:
                raise InvalidArgumentError(f"{name} must be one of {valid}, got {getattr(self, name)!r}")
        if self.per_device_train_batch_size != 1 or self.per_device_eval_batch_size != 1:
            raise InvalidArgumentError(
                "TreeSFTTrainer packs one tree per micro-batch: set per_device_train_batch_size=1 and "
                "per_device_eval_batch_size=1, and raise gradient_accumulation_steps for more trees per step"
            )
        if self.packing or self.padding_free:
            raise InvalidArgumentError(
                "packing and padding_free must be False: trees are packed by TreeSFTTrainer"
            )
        if self.remove_unused_columns:
            raise InvalidArgumentError(
                "remove_unused_columns must be False: the collator reads the tree columns"
            )
        if self.seq_len is None:
            self.seq_len = self.max_length
        for name in ("seq_len", "max_packed_tokens"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise InvalidArgumentError(f"{name} must be >= 2 or None, got {value}")
        if self.block_mask_cache_size < 0:
            raise InvalidArgumentError(
                f"block_mask_cache_size must be >= 0, got {self.block_mask_cache_size}"
            )
        kwargs = self.dataset_kwargs if isinstance(self.dataset_kwargs, dict) else {}
        self.dataset_kwargs = {**kwargs, "skip_prepare_dataset": True}


