"""Attention with a float32 per-key bias (β) on the GPU, through PyTorch's FlexAttention.

One-pass replay attends every piece of a trajectory over its cache snapshot with the snapshot's β
added to the logits (docs/grpo.md, "Replay in one pass"). SDPA's fused kernels take no such bias:
the portable route folds β into three extra head-dim columns
(:func:`~compaction_gym.engine.attention.folded_bias_sdpa`), and at head dim 136 cuDNN runs about
3× slower than at 128. FlexAttention adds ``β`` to the float32 scores inside a Triton flash kernel
at the model's own head dim (as the engine's decode kernels form ``S + β``), and skips the blocks
its :class:`BlockMask` rules out, so neither a dense mask nor the folded columns are read.

The kernel is compiled once per process with dynamic shapes (a GRPO batch's pieces change every
step; static shapes would recompile per bucket and hit dynamo's recompile limit); the first call
pays the compile (tens of seconds), docs/fast-path.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from compaction_gym.engine.fast.kernels import HAS_TRITON

try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch without FlexAttention
    BlockMask = flex_attention = None

logger = logging.getLogger(__name__)

_compiled: Callable[..., torch.Tensor] | None = None
#: Why the compiled kernel failed in this process (it is not tried again), or None.
_failure: str | None = None


class FlexUnavailable(RuntimeError):
    """FlexAttention failed to compile or run here; callers take another attention path."""


def flex_bias_supported(x: torch.Tensor) -> bool:
    """Whether :func:`key_bias_attention` runs for tensors like ``x``: a CUDA half-precision tensor,
    Triton and FlexAttention present."""
    return (
        flex_attention is not None
        and _failure is None
        and HAS_TRITON
        and x.is_cuda
        and x.dtype in (torch.bfloat16, torch.float16)
    )


def position_block_mask(colpos: torch.Tensor, qpos: torch.Tensor, groups: int, block: int = 128) -> BlockMask:
    """The :class:`BlockMask` of ``allowed[p, g·n + i, k] = colpos[p, k] ≤ qpos[p, i]`` for queries
    laid out grouped by KV head (``groups`` query heads per KV head, ``n`` tokens each), from a
    column's token position ``colpos`` ``[P, W]`` and a query's ``qpos`` ``[P, n]``.

    Built from the positions' extremes per tile instead of a dense ``[P, Q, W]`` evaluation: a tile
    has some allowed entry iff its smallest column position ≤ its largest query position, and all
    entries allowed iff its largest column position ≤ its smallest query position (tiles cut by the
    sequence ends are never called full, as ``create_block_mask`` has them)."""
    pieces, width = colpos.shape
    n = qpos.shape[1]
    qp = qpos.repeat(1, groups)  # [P, Q]
    lo, hi = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max

    def tiles(x: torch.Tensor, pad: int) -> torch.Tensor:  # [P, L] -> [P, ceil(L / block), block]
        fill = x.new_full((pieces, -x.shape[1] % block), pad)  # not F.pad: its value goes through a float
        return torch.cat([x, fill], 1).reshape(pieces, -1, block)

    q_min, q_max = tiles(qp, hi).amin(-1), tiles(qp, lo).amax(-1)
    c_min, c_max = tiles(colpos, hi).amin(-1), tiles(colpos, lo).amax(-1)
    some = c_min[:, None, :] <= q_max[:, :, None]  # [P, Q tiles, KV tiles]
    full = c_max[:, None, :] <= q_min[:, :, None]
    if qp.shape[1] % block:
        full[:, -1] = False
    if width % block:
        full[:, :, -1] = False
    partial = some & ~full

    def listed(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return m.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    def allowed(b: Any, h: Any, q: Any, k: Any) -> Any:
        return colpos[b, k] <= qpos[b, q % n]

    return BlockMask.from_kv_blocks(
        *listed(partial), *listed(full), BLOCK_SIZE=block, mask_mod=allowed, seq_lengths=(qp.shape[1], width)
    )


def key_bias_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    block_mask: BlockMask,
    *,
    scaling: float | None = None,
) -> torch.Tensor:
    """``softmax(scale · q kᵀ + bias[k]) v`` under ``block_mask``, the bias added in float32.

    Args:
        query: ``[P, H_kv, Q, d]`` (query heads grouped by KV head, as
            :func:`~compaction_gym.engine.attention.grouped_sdpa` lays them out).
        key / value: ``[P, H_kv, W, d]``.
        bias: ``[P, H_kv, W]`` float32, constant (no gradient flows to it).
        block_mask: from :func:`position_block_mask`.

    Returns:
        ``[P, H_kv, Q, d]`` in ``query``'s dtype.

    Raises:
        FlexUnavailable: the kernel failed to compile or run (logged once; :func:`flex_bias_supported`
            is False from then on).
    """
    global _compiled, _failure
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=True)

    def add_bias(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        return score + bias[b, h, k]

    try:  # the inputs are already half precision: a trainer's autocast has nothing to cast
        with torch.autocast(query.device.type, enabled=False):
            return _compiled(query, key, value, score_mod=add_bias, block_mask=block_mask, scale=scaling)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compiler or Triton failure: not retried in this process
        _failure = f"{type(e).__name__}: {e}"
        logger.warning("FlexAttention failed (%s); β attention takes the SDPA paths from now on", _failure)
        raise FlexUnavailable(_failure) from e
