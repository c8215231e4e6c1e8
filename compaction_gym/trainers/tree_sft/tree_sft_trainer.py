"""``TreeSFTConfig`` + ``TreeSFTTrainer``: SFT on tree-packed data, equal to per-branch training.

One micro-batch is one tree (see :mod:`compaction_gym.trainers.tree_sft`): its nodes are packed once in
DFS order, each token attends to its ancestors only, positions are depths, and the loss weighs each
target by the fraction of branches that contain it. The optimizer step's loss is normalised by the
total weight Σ w_t of all its micro-batches on all ranks, so the gradient equals the per-branch
token-mean gradient over the same trees, whatever ``gradient_accumulation_steps`` and world size.
``tree_mode="per_branch"`` trains the same trees unrolled into their branches (the ablation baseline).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from trl import SFTTrainer

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.tree_sft.builders import add_tree_stats, trees_to_dataset
from compaction_gym.trainers.tree_sft.loss import (
    branch_batch,
    branch_nll_loss,
    effective_attn_implementation,
    tree_nll_loss,
)
from compaction_gym.trainers.tree_sft.masks import set_block_mask_cache_size
from compaction_gym.trainers.tree_sft.packing import NORMALIZERS, pack_tree
from compaction_gym.trainers.tree_sft.tree import Tree
from compaction_gym.trainers.tree_sft.tree_sft_config import TREE_MODES, TreeSFTConfig

logger = logging.getLogger(__name__)

@dataclass
class TreeCollator:
    """Turns one dataset row (a tree) into a micro-batch.

    ``tree_mode="tree"``: ``input_ids``/``position_ids`` ``[1, N]`` and the :class:`PackedTree` under
    ``"tree"`` (the mask is built on the model's device in the trainer). ``"per_branch"``: the padded
    branches (``input_ids``, ``attention_mask``, ``weights``). Both carry ``loss_weight_sum`` (Σ w_t,
    identical in both modes) and ``tree_info`` (sizes, for logging).
    """

    tree_mode: str = "tree"
    loss_normalizer: str = "token"
    pad_token_id: int = 0
    seq_len: int | None = None
    max_packed_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.tree_mode not in TREE_MODES:
            raise InvalidArgumentError(f"tree_mode must be one of {TREE_MODES}, got {self.tree_mode!r}")
        if self.loss_normalizer not in NORMALIZERS:
            raise InvalidArgumentError(
                f"loss_normalizer must be one of {NORMALIZERS}, got {self.loss_normalizer!r}"
            )

    def __call__(self, examples: Sequence[Mapping[str, Any] | Tree]) -> dict[str, Any]:
        if len(examples) != 1:
            raise InvalidArgumentError(
                f"TreeCollator takes one tree per micro-batch, got {len(examples)}; set per_device_*_batch_size=1"
            )
        row = examples[0]
        tree = row if isinstance(row, Tree) else Tree.from_dict(row)
        packed = pack_tree(tree, seq_len=self.seq_len, max_packed_tokens=self.max_packed_tokens)
        weights = packed.weights(self.loss_normalizer)
        info = {
            "num_leaves": tree.num_leaves,
            "packed_tokens": tree.num_tokens,
            "branch_tokens": tree.branch_tokens,
            "seq_len": tree.seq_len,
        }
        batch: dict[str, Any] = {"loss_weight_sum": weights.sum(), "tree_info": info}
        if self.tree_mode == "tree":
            batch["input_ids"] = packed.input_ids[None]
            batch["position_ids"] = packed.position_ids[None]
            batch["tree"] = packed
        else:
            batch.update(branch_batch(tree, normalizer=self.loss_normalizer, pad_token_id=self.pad_token_id))
        return batch


class TreeSFTTrainer(SFTTrainer):
    """:class:`trl.SFTTrainer` on trees: one packed tree per micro-batch, exact per-branch loss.

    Args:
        model: a model id/path or a ``PreTrainedModel`` (Llama/Qwen-style: accepts ``position_ids``, a
            4-D ``attention_mask`` and a tensor ``logits_to_keep``).
        args: a :class:`TreeSFTConfig`.
        train_dataset, eval_dataset: ``datasets.Dataset`` of tree rows, or lists of :class:`Tree`.
        processing_class: the tokenizer (used for saving and the pad id of ``per_branch`` mode).
        **kwargs: passed to :class:`trl.SFTTrainer` (callbacks, optimizers, peft_config, ...).

    Raises:
        InvalidArgumentError: overlong trees with ``overlong_trees="error"``, no tree left after
            filtering, ``flex_attention`` training on a device without FlexAttention backward.

    Example:
        >>> trees = [tree_from_chat(conv, tokenizer) for conv in conversations]  # doctest: +SKIP
        >>> trainer = TreeSFTTrainer(model, TreeSFTConfig("out"), train_dataset=trees,
        ...                          processing_class=tokenizer)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    # Our compute_loss divides by the weight of the whole optimizer step (num_items_in_batch), so the
    # Trainer must not divide by gradient_accumulation_steps again.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model,
        args: TreeSFTConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        data_collator=None,
        **kwargs,
    ) -> None:
        if args is None:
            args = TreeSFTConfig("tree-sft-output")
        if not isinstance(args, TreeSFTConfig):
            raise InvalidArgumentError(f"args must be a TreeSFTConfig, got {type(args).__name__}")
        set_block_mask_cache_size(args.block_mask_cache_size)
        train_dataset = self._prepare_trees(train_dataset, args, "train")
        if isinstance(eval_dataset, Mapping):
            eval_dataset = {k: self._prepare_trees(v, args, k) for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._prepare_trees(eval_dataset, args, "eval")
        if data_collator is None:
            tok = getattr(processing_class, "tokenizer", processing_class)
            pad = getattr(tok, "pad_token_id", None)
            if pad is None:
                pad = getattr(tok, "eos_token_id", None) or 0
            data_collator = TreeCollator(
                tree_mode=args.tree_mode,
                loss_normalizer=args.loss_normalizer,
                pad_token_id=pad,
                seq_len=args.seq_len,
                max_packed_tokens=args.max_packed_tokens,
            )
        super().__init__(
            model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        if self.args.n_gpu > 1:
            raise InvalidArgumentError(
                "TreeSFTTrainer does not support DataParallel (several GPUs in one process); launch one process "
                "per GPU with torchrun or accelerate"
            )
        # FlexAttention on CPU: SDPA instead, with the reason logged (docs/tree-sft.md, "CPU")
        self._attn = effective_attn_implementation(args.tree_attn_implementation, self.args.device)
        base = self.accelerator.unwrap_model(self.model)
        if base.config._attn_implementation != self._attn:
            base.set_attn_implementation(self._attn)

    # -- data ----------------------------------------------------------------------------------
    @staticmethod
    def _prepare_trees(dataset, args: TreeSFTConfig, name: str):
        """Accept a list of trees or a dataset of tree rows; drop (or reject) overlong trees and
        trees without a target token."""
        from datasets import Dataset

        if dataset is None:
            raise InvalidArgumentError("train_dataset is required (a Dataset of tree rows or a list of Tree)")
        if isinstance(dataset, Sequence) and not isinstance(dataset, Dataset):
            trees = [t if isinstance(t, Tree) else Tree.from_dict(t) for t in dataset]
            dataset = trees_to_dataset(trees)
        if not isinstance(dataset, Dataset):
            raise InvalidArgumentError(f"{name} dataset must be a datasets.Dataset or a list of Tree")
        missing = {"parents", "token_ids"} - set(dataset.column_names)
        if missing:
            raise InvalidArgumentError(
                f"the {name} dataset lacks tree columns {sorted(missing)}; build rows with Tree.to_dict() or "
                "compaction_gym.trainers.tree_sft.trees_to_dataset"
            )
        if "seq_len" not in dataset.column_names or "packed_tokens" not in dataset.column_names:
            dataset = add_tree_stats(dataset, num_proc=args.dataset_num_proc)

        def fits(row) -> bool:
            return (args.seq_len is None or row["seq_len"] <= args.seq_len) and (
                args.max_packed_tokens is None or row["packed_tokens"] <= args.max_packed_tokens
            )

        def has_target(row) -> bool:
            return bool(pack_tree(Tree.from_dict(row)).trainable.any())

        kept = dataset.filter(fits, num_proc=args.dataset_num_proc, desc=f"{name}: tree limits")
        dropped = len(dataset) - len(kept)
        if dropped:
            msg = (
                f"{dropped} of {len(dataset)} {name} trees exceed seq_len={args.seq_len} or "
                f"max_packed_tokens={args.max_packed_tokens}"
            )
            if args.overlong_trees == "error":
                raise InvalidArgumentError(msg + "; raise the limits or set overlong_trees='drop'")
            logger.warning("%s; dropped", msg)
        before = len(kept)
        kept = kept.filter(has_target, num_proc=args.dataset_num_proc, desc=f"{name}: trees with targets")
        if len(kept) < before:
            logger.warning("dropped %d %s trees without a target token", before - len(kept), name)
        if len(kept) == 0:
            raise InvalidArgumentError(
                f"no {name} tree is left after filtering; check seq_len/max_packed_tokens"
            )
        return kept

    # -- loss ----------------------------------------------------------------------------------
    # Override: the optimizer step's normaliser is Σ w_t over its micro-batches and all ranks (the
    # trees' total branch weight), not the count of label tokens Trainer would compute.
    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | None:
        if not batch_samples:
            return None
        total = torch.stack(
            [torch.as_tensor(b["loss_weight_sum"], dtype=torch.float64) for b in batch_samples]
        )
        total = total.sum().to(device)
        if self.args.world_size > 1:
            total = self.accelerator.gather(total[None]).sum()
        return total

    # Override: the weighted tree NLL replaces TRL's token-mean NLL; see the module docstring.
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        if self.args.tree_mode == "tree":
            loss_sum, correct, targets = self._tree_loss_sum(model, inputs)
            processed = inputs["tree_info"]["packed_tokens"]
        else:
            loss_sum, correct, targets = self._branch_loss_sum(model, inputs)
            processed = inputs["tree_info"]["branch_tokens"]
        if num_items_in_batch is None:
            normaliser, scale = inputs["loss_weight_sum"], 1
        else:
            # num_items_in_batch sums every rank's weight and DDP averages gradients over ranks
            normaliser, scale = num_items_in_batch, self.accelerator.num_processes
        normaliser = torch.as_tensor(normaliser, device=loss_sum.device).to(loss_sum.dtype)
        loss = loss_sum / normaliser.clamp(min=torch.finfo(loss_sum.dtype).tiny) * scale
        self._log_tree_metrics(mode, inputs["tree_info"], processed, correct, targets)
        return (loss, None) if return_outputs else loss

    def _tree_loss_sum(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Σ w_t·CE_t of one packed tree; only rows predicting a target go through the LM head."""
        packed = inputs["tree"]
        device = inputs["input_ids"].device
        mask = packed.attention_mask(
            self._attn, device=device, dtype=self._compute_dtype()
        )
        sources = packed.source_index.to(device)
        logits = model(
            input_ids=inputs["input_ids"],
            position_ids=inputs["position_ids"],
            attention_mask=mask,
            logits_to_keep=sources,
            use_cache=False,
        ).logits[0]
        loss_sum = tree_nll_loss(
            logits, packed, normalizer=self.args.loss_normalizer, reduction="sum", gathered=True
        )
        targets = packed.input_ids.to(device)[packed.target_index.to(device)]
        correct = (logits.detach().argmax(-1) == targets).sum()
        return loss_sum, correct, targets.numel()

    def _branch_loss_sum(self, model, inputs) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Σ w_t·CE_t of the tree's branches, as one padded causal batch (the baseline)."""
        logits = model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
        ).logits
        weights = inputs["weights"]
        loss_sum = branch_nll_loss(logits, inputs["input_ids"], weights, reduction="sum")
        sel = weights[:, 1:] > 0
        correct = (logits[:, :-1].detach().argmax(-1)[sel] == inputs["input_ids"][:, 1:][sel]).sum()
        return loss_sum, correct, int(sel.sum())

    def _compute_dtype(self) -> torch.dtype:
        dtype = next(self.model.parameters()).dtype
        if self.args.bf16:
            return torch.bfloat16
        if self.args.fp16:
            return torch.float16
        return dtype

    def _log_tree_metrics(
        self, mode: str, info: Mapping[str, int], processed: int, correct, targets: int
    ) -> None:
        metrics = self._metrics[mode]
        for key in ("num_leaves", "packed_tokens", "branch_tokens", "seq_len"):
            metrics[f"tree/{key}"].append(float(info[key]))
        stats = torch.tensor(
            [float(correct), float(targets), float(processed)], device=self.accelerator.device
        )
        stats = self.accelerator.gather_for_metrics(stats[None]).sum(0)
        metrics["mean_token_accuracy"].append((stats[0] / stats[1]).item() if stats[1] > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(stats[2].item())
            metrics["num_tokens"] = [self._total_train_tokens]

    # Override: tree logits are gathered per target and do not align with label tensors, so
    # evaluation reports the loss only.
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None
