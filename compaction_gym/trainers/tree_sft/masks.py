"""Ancestor-only attention masks: dense (SDPA, eager) and FlexAttention ``BlockMask``.

Both come from one per-token vector, ``subtree_end`` (see :mod:`.packing`): key k is visible to query
q iff ``k <= q < subtree_end[k]``. The dense mask costs N² bytes; the BlockMask lets FlexAttention skip
the sibling blocks entirely, which is where tree packing gets its speed at high branching.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


class PackedLike(Protocol):
    """What the mask builders read of a :class:`~compaction_gym.trainers.tree_sft.packing.PackedTree`."""

    tree: Any
    num_tokens: int
    subtree_end: torch.Tensor

logger = logging.getLogger(__name__)

#: FlexAttention's default (and Triton's preferred) block size.
FLEX_BLOCK_SIZE = 128

_BLOCK_MASK_CACHE: OrderedDict[tuple, BlockMask] = OrderedDict()
_block_mask_cache_size = 64
_compiled_create_block_mask: Callable | None = None


def dense_tree_mask(subtree_end: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` bool mask from ``subtree_end`` (``mask[q, k]`` = q attends k)."""
    n = subtree_end.numel()
    idx = torch.arange(n, device=subtree_end.device)
    q, k = idx[:, None], idx[None, :]
    return (k <= q) & (q < subtree_end[None, :])


def tree_mask_mod(subtree_end: torch.Tensor) -> Callable:
    """A FlexAttention ``mask_mod`` for the tree; ``subtree_end`` must cover every kv index the kernel
    may evaluate (pad it to a multiple of the block size with zeros: padded keys are never visible)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    return mask_mod


def set_block_mask_cache_size(size: int) -> None:
    """How many BlockMasks (distinct tree shapes × devices) to keep; 0 disables the cache."""
    global _block_mask_cache_size
    if size < 0:
        raise ValueError(f"cache size must be >= 0, got {size}")
    _block_mask_cache_size = size
    while len(_BLOCK_MASK_CACHE) > size:
        _BLOCK_MASK_CACHE.popitem(last=False)


def clear_block_mask_cache() -> None:
    _BLOCK_MASK_CACHE.clear()


def _create_block_mask_fn(device: torch.device) -> Callable:
    """``create_block_mask``, compiled on CUDA (no N×N materialisation), eager elsewhere."""
    global _compiled_create_block_mask
    from torch.nn.attention.flex_attention import create_block_mask

    if device.type != "cuda":
        return create_block_mask
    if _compiled_create_block_mask is None:
        _compiled_create_block_mask = torch.compile(create_block_mask, dynamic=True)
    return _compiled_create_block_mask


def tree_block_mask(
    packed: PackedLike, *, device: torch.device | str | None = None, block_size: int = FLEX_BLOCK_SIZE
) -> BlockMask:
    """FlexAttention ``BlockMask`` for ``packed`` (B = H = 1, broadcast over batch and heads).

    Cached per (tree shape, device, block size): trees with the same parents and node lengths share
    one mask, so repeated epochs and GRPO groups of equal shape pay mask construction once.
    """
    global _compiled_create_block_mask
    device = torch.device(device) if device is not None else torch.device("cpu")
    key = (packed.tree.shape_key(), str(device), block_size)
    cached = _BLOCK_MASK_CACHE.get(key)
    if cached is not None:
        _BLOCK_MASK_CACHE.move_to_end(key)
        return cached
    n = packed.num_tokens
    padded = -(-n // block_size) * block_size
    subtree_end = torch.zeros(padded, dtype=torch.long)
    subtree_end[:n] = packed.subtree_end
    subtree_end = subtree_end.to(device)
    mask_mod = tree_mask_mod(subtree_end)
    try:
        mask = _create_block_mask_fn(device)(mask_mod, None, None, n, n, device=device, BLOCK_SIZE=block_size)
    except Exception as exc:  # a torch.compile failure must not stop training: build it eagerly
        from torch.nn.attention.flex_attention import create_block_mask

        if device.type != "cuda":
            raise
        logger.warning("compiled create_block_mask failed (%s); building BlockMasks eagerly", exc)
        _compiled_create_block_mask = create_block_mask
        mask = create_block_mask(mask_mod, None, None, n, n, device=device, BLOCK_SIZE=block_size)
    if _block_mask_cache_size > 0:
        _BLOCK_MASK_CACHE[key] = mask
        while len(_BLOCK_MASK_CACHE) > _block_mask_cache_size:
            _BLOCK_MASK_CACHE.popitem(last=False)
    return mask
