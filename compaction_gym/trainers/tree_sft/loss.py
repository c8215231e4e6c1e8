"""Weighted tree NLL, the one-call ``tree_loss`` and the per-branch reference it equals.

With weights w_t from :class:`~.packing.PackedTree`,

    tree_nll = Σ_t w_t · CE(logits[prev_map[t]], token_t) / Σ_t w_t,

which equals the token-mean loss of training on the K root→leaf branches separately (``normalizer=
"token"``) or the mean over branches of each branch's token-mean (``normalizer="sequence"``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from compaction_gym.trainers.tree_sft.packing import (
    Normalizer,
    PackedTree,
    check_attn_implementation,
    check_normalizer,
    pack_tree,
)
from compaction_gym.trainers.tree_sft.tree import Tree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

REDUCTIONS = ("mean", "sum")

logger = logging.getLogger(__name__)

#: Why FlexAttention is not run on CPU (logged once per process when it is replaced by SDPA).
CPU_FLEX_REASON = (
    "flex_attention on CPU compiles a C++ kernel per tree shape with Inductor, which fails for some "
    "shapes (a CppCompileError on the second tree in a process) and has no backward pass; using sdpa "
    "(the dense ancestor mask: the same attention, exactly)"
)
_warned_cpu_flex = False


def effective_attn_implementation(attn_implementation: str, device: torch.device | str) -> str:
    """The backend a tree forward really uses on ``device``: ``flex_attention`` becomes ``sdpa`` on CPU
    (logged once, with :data:`CPU_FLEX_REASON`); anything else is returned unchanged."""
    global _warned_cpu_flex
    check_attn_implementation(attn_implementation)
    if attn_implementation == "flex_attention" and torch.device(device).type == "cpu":
        if not _warned_cpu_flex:
            logger.warning(CPU_FLEX_REASON)
            _warned_cpu_flex = True
        return "sdpa"
    return attn_implementation


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-row cross entropy computed in at least float32 (bf16 logits are upcast)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, targets, reduction="none")


def _reduce(weighted: torch.Tensor, weights: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    total = weighted.sum()
    if reduction == "sum":
        return total
    return total / weights.sum().clamp(min=torch.finfo(weights.dtype).tiny)


def tree_nll_loss(
    logits: torch.Tensor,
    packed: PackedTree,
    *,
    normalizer: Normalizer = "token",
    reduction: str = "mean",
    gathered: bool = False,
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Weighted next-token NLL over a packed tree.

    Args:
        logits: ``[N, V]`` or ``[1, N, V]`` logits at every packed token, or with ``gathered=True``
            ``[M, V]`` logits already read at ``packed.source_index`` (M trainable tokens; what
            ``model(..., logits_to_keep=packed.source_index)`` returns, which saves the N×V logits).
            With ``lm_head``, hidden states of the same shapes instead of logits.
        lm_head: applied to the M rows that predict a target only (for models without
            ``logits_to_keep``: pass the last hidden states and ``model.lm_head``).
        packed: the packed tree.
        normalizer: ``"token"`` (per-branch token mean) or ``"sequence"`` (mean of branch means).
        reduction: ``"mean"`` divides by Σ w_t; ``"sum"`` returns Σ w_t·CE_t (for normalising across
            micro-batches and ranks yourself).

    Returns:
        A scalar tensor in the logits' dtype (float32 for half-precision logits). Zero when the tree
        has no trainable token.
    """
    check_normalizer(normalizer)
    if logits.dim() == 3:
        if logits.shape[0] != 1:
            raise ValueError(f"expected logits of one packed tree, got batch size {logits.shape[0]}")
        logits = logits[0]
    target_index = packed.target_index.to(logits.device)
    if gathered:
        if logits.shape[0] != target_index.numel():
            raise ValueError(
                f"gathered logits have {logits.shape[0]} rows, the tree has {target_index.numel()} targets"
            )
        rows = logits
    else:
        if logits.shape[0] != packed.num_tokens:
            raise ValueError(
                f"logits have {logits.shape[0]} rows, the packed tree {packed.num_tokens} tokens"
            )
        rows = logits[packed.prev_map.to(logits.device)[target_index]]
    if lm_head is not None:
        rows = lm_head(rows)
    ce = _ce(rows, packed.input_ids.to(logits.device)[target_index])
    weights = packed.weights(normalizer).to(device=ce.device, dtype=ce.dtype)[target_index]
    return _reduce(weights * ce, weights, reduction)


@contextlib.contextmanager
def attn_implementation_of(model: PreTrainedModel, attn_implementation: str) -> Iterator[None]:
    """Temporarily switch a Hugging Face model's attention backend (a no-op when it already uses it)."""
    check_attn_implementation(attn_implementation)
    current = model.config._attn_implementation
    if current == attn_implementation:
        yield
        return
    model.set_attn_implementation(attn_implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def tree_forward(
    model: PreTrainedModel,
    packed: PackedTree,
    *,
    attn_implementation: str = "sdpa",
    logits_to_keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits of one packed tree: ``[N, V]``, or ``[len(logits_to_keep), V]`` at those packed rows.

    The model gets depth ``position_ids`` and a 4-D ancestor mask (a ``BlockMask`` for
    ``flex_attention``), which transformers passes to the attention function unchanged. On CPU
    ``flex_attention`` runs as ``sdpa`` (:func:`effective_attn_implementation`).
    """
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    attn_implementation = effective_attn_implementation(attn_implementation, device)
    inputs = packed.model_inputs(attn_implementation, device=device, dtype=dtype)
    kwargs = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep.to(device)}
    with attn_implementation_of(model, attn_implementation):
        out = model(**inputs, use_cache=False, **kwargs)
    return out.logits[0]


def tree_loss(
    model: PreTrainedModel,
    tree: Tree | PackedTree,
    *,
    attn_implementation: str = "sdpa",
    normalizer: Normalizer = "token",
    reduction: str = "mean",
    seq_len: int | None = None,
    max_packed_tokens: int | None = None,
) -> torch.Tensor:
    """Pack ``tree``, run one forward with the tree mask and depth positions, return the weighted NLL.

    Only the rows that predict a target go through the LM head (``logits_to_keep``).

    Args:
        model: a Hugging Face causal LM whose forward accepts ``position_ids``, a 4-D
            ``attention_mask`` and a tensor ``logits_to_keep`` (Llama/Qwen-style models do).
        tree: a :class:`Tree` (packed here) or an already packed tree.
        attn_implementation: ``"sdpa"`` (dense bool mask), ``"flex_attention"`` (BlockMask) or
            ``"eager"`` (dense additive mask); the model is switched to it for the call.
        normalizer, reduction: see :func:`tree_nll_loss`.
        seq_len, max_packed_tokens: limits checked when packing.

    Returns:
        The loss; differentiable w.r.t. the model's parameters.

    Example:
        >>> loss = tree_loss(model, tree)  # doctest: +SKIP
        >>> loss.backward()  # doctest: +SKIP
    """
    packed = (
        tree
        if isinstance(tree, PackedTree)
        else pack_tree(tree, seq_len=seq_len, max_packed_tokens=max_packed_tokens)
    )
    if packed.target_index.numel() == 0:
        return next(model.parameters()).sum() * 0.0
    logits = tree_forward(
        model, packed, attn_implementation=attn_implementation, logits_to_keep=packed.source_index
    )
    return tree_nll_loss(logits, packed, normalizer=normalizer, reduction=reduction, gathered=True)


# -- the per-branch baseline ------------------------------------------------------------------------
def branch_batch(
    tree: Tree, *, normalizer: Normalizer = "token", pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """The K root→leaf branches as a right-padded batch with per-token loss weights.

    ``weights[b, j]`` weighs the prediction of ``input_ids[b, j]`` from position ``j-1``; the weights are
    the tree's (1/K per trainable token for ``"token"``; 1/(K'·n_b) for ``"sequence"``), so the weighted
    sum over this batch equals the packed tree's and one normaliser serves both modes.

    Returns:
        ``input_ids``, ``attention_mask`` (long, ``[K, L]``) and ``weights`` (float64, ``[K, L]``).
    """
    check_normalizer(normalizer)
    branches = tree.branches()
    k = len(branches)
    length = max(len(ids) for ids, _ in branches)
    input_ids = torch.full((k, length), pad_token_id, dtype=torch.long)
    attention = torch.zeros((k, length), dtype=torch.long)
    trainable = torch.zeros((k, length), dtype=torch.float64)
    for b, (ids, mask) in enumerate(branches):
        input_ids[b, : len(ids)] = torch.tensor(ids)
        attention[b, : len(ids)] = 1
        trainable[b, 1 : len(ids)] = torch.tensor(mask[1:], dtype=torch.float64)
    if normalizer == "token":
        weights = trainable / k
    else:
        counts = trainable.sum(1, keepdim=True)
        used = int((counts > 0).sum())
        weights = torch.where(counts > 0, trainable / counts.clamp(min=1), 0.0) / max(used, 1)
    return {"input_ids": input_ids, "attention_mask": attention, "weights": weights}


def branch_nll_loss(
    logits: torch.Tensor, input_ids: torch.Tensor, weights: torch.Tensor, *, reduction: str = "mean"
) -> torch.Tensor:
    """Weighted next-token NLL of a padded branch batch (``logits`` ``[K, L, V]``)."""
    targets = weights[:, 1:] > 0
    rows = logits[:, :-1][targets]
    ce = _ce(rows, input_ids[:, 1:][targets])
    w = weights[:, 1:][targets].to(device=ce.device, dtype=ce.dtype)
    return _reduce(w * ce, w, reduction)


def branch_loss(
    model: PreTrainedModel,
    tree: Tree,
    *,
    normalizer: Normalizer = "token",
    reduction: str = "mean",
    attn_implementation: str | None = None,
) -> torch.Tensor:
    """The per-branch baseline: the K branches as one padded causal batch, same weights as the tree.

    Equal to :func:`tree_loss` up to floating-point error; K× the attention and MLP work of the
    shared prefixes. Used for ablations (``TreeSFTConfig(tree_mode="per_branch")``).
    """
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in branch_batch(tree, normalizer=normalizer).items()}
    ctx = (
        attn_implementation_of(model, attn_implementation)
        if attn_implementation is not None
        else contextlib.nullcontext()
    )
    with ctx:
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
    return branch_nll_loss(logits, batch["input_ids"], batch["weights"], reduction=reduction)
