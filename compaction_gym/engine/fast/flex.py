"""Attention with a float32 per-key bias (β) on the GPU, through PyTorch's FlexAttention.

One-pass replay attends every piece of a trajectory over its cache snapshot with the snapshot's β
added to the logits (docs/grpo.md, "Replay in one pass"). SDPA's fused kernels take no such bias:
the portable route folds β into three extra head-dim columns
(:func:`~compaction_gym.engine.attention.folded_bias_sdpa`), and at head dim 136 cuDNN runs about
3× slower than at 128. FlexAttention adds ``β`` to the float32 scores inside a Triton flash kernel
at the model's own head dim (as the engine's decode kernels form ``S + β``), and skips the blocks
its :class:`BlockMask` rules out, so neither a dense mask nor the folded columns are read.

The kernel is compiled once per process with dynamic shapes (a GRPO batch's pieces change every
step; static shapes would recompile per bucket and hit dynamo's recompile limit), at padded sizes
dynamo does not specialise (:class:`PositionMask`); the first forward and the first backward each
pay ~8 s of compile (docs/grpo.md, "β through FlexAttention on a GPU").
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
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


#: Tiles of the kernel's block mask (FlexAttention's default block).
BLOCK = 128


@dataclass
class PositionMask:
    """A bucket's :class:`BlockMask` and the positions its rule reads, at the padded sizes the
    compiled kernel sees: at least 2 pieces and more than one tile of queries and of keys, so that
    no bucket takes a size dynamo specialises (a dimension of 1, FlexAttention's decoding kernel
    below 128 queries) and recompiles."""

    block_mask: BlockMask
    colpos: torch.Tensor  # [P', W'] padded columns never allowed; padded pieces see column 0
    qpos: torch.Tensor  # [P', Q'] per query (grouped by KV head); padded queries see every real column


def position_block_mask(colpos: torch.Tensor, qpos: torch.Tensor, groups: int, block: int = BLOCK) -> PositionMask:
    """The :class:`BlockMask` of ``allowed[p, g·n + i, k] = colpos[p, k] ≤ qpos[p, i]`` for queries
    laid out grouped by KV head (``groups`` query heads per KV head, ``n`` tokens each), from a
    column's token position ``colpos`` ``[P, W]`` and a query's ``qpos`` ``[P, n]``.

    Built from the positions' extremes per tile instead of a dense ``[P, Q, W]`` evaluation: a tile
    has some allowed entry iff its smallest column position ≤ its largest query position, and all
    entries allowed iff its largest column position ≤ its smallest query position (tiles cut by the
    sequence ends are never called full, as ``create_block_mask`` has them)."""
    pieces, width = colpos.shape
    queries = groups * qpos.shape[1]
    P, Q, W = max(pieces, 2), max(queries, block + 1), max(width, block + 1)
    lo, hi = torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max
    cols = colpos.new_full((P, W), hi)
    cols[:pieces, :width] = colpos
    cols[pieces:, 0] = -1
    qp = qpos.new_full((P, Q), hi - 1)
    qp[:pieces, :queries] = qpos.repeat(1, groups)

    def tiles(x: torch.Tensor, pad: int) -> torch.Tensor:  # [P, L] -> [P, ceil(L / block), block]
        fill = x.new_full((P, -x.shape[1] % block), pad)  # not F.pad: its value goes through a float
        return torch.cat([x, fill], 1).reshape(P, -1, block)

    q_min, q_max = tiles(qp, hi).amin(-1), tiles(qp, lo).amax(-1)
    c_min, c_max = tiles(cols, hi).amin(-1), tiles(cols, lo).amax(-1)
    some = c_min[:, None, :] <= q_max[:, :, None]  # [P, Q tiles, KV tiles]
    full = c_max[:, None, :] <= q_min[:, :, None]
    if Q % block:
        full[:, -1] = False
    if W % block:
        full[:, :, -1] = False
    partial = some & ~full

    def listed(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(m.to(torch.int8), dim=-1, descending=True, stable=True)
        return m.sum(-1, dtype=torch.int32)[:, None], order.to(torch.int32)[:, None]

    def allowed(b: Any, h: Any, q: Any, k: Any) -> Any:
        return cols[b, k] <= qp[b, q]

    block_mask = BlockMask.from_kv_blocks(
        *listed(partial), *listed(full), BLOCK_SIZE=block, mask_mod=allowed, seq_lengths=(Q, W)
    )
    return PositionMask(block_mask, cols, qp)


def key_bias_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    mask: PositionMask,
    *,
    scaling: float | None = None,
) -> torch.Tensor:
    """``softmax(scale · q kᵀ + bias[k]) v`` under ``mask``, the bias added in float32.

    Args:
        query: ``[P, H_kv, Q, d]`` (query heads grouped by KV head, as
            :func:`~compaction_gym.engine.attention.grouped_sdpa` lays them out).
        key / value: ``[P, H_kv, W, d]``.
        bias: ``[P, H_kv, W]`` float32, constant (no gradient flows to it).
        mask: from :func:`position_block_mask` (the inputs are padded to its sizes here).

    Returns:
        ``[P, H_kv, Q, d]`` in ``query``'s dtype.

    Raises:
        FlexUnavailable: the kernel failed to compile or run, or would recompile past dynamo's
            limit (logged once; :func:`flex_bias_supported` is False from then on).
    """
    global _compiled, _failure
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=True)
    P, Q, W = mask.colpos.shape[0], mask.qpos.shape[1], mask.colpos.shape[1]
    pieces, queries, width = query.shape[0], query.shape[2], key.shape[2]
    if (pieces, queries) != (P, Q):
        query = torch.nn.functional.pad(query, (0, 0, 0, Q - queries, 0, 0, 0, P - pieces))
    if (pieces, width) != (P, W):
        key, value = (torch.nn.functional.pad(x, (0, 0, 0, W - width, 0, 0, 0, P - pieces)) for x in (key, value))
        bias = torch.nn.functional.pad(bias, (0, W - width, 0, 0, 0, P - pieces))
    # every size varies from bucket to bucket: compiled once for all of them (the closures' tensors
    # and the block mask's tile tables too: pieces and both tile counts; their head dimension is 1)
    sized = [(query, (0, 2)), (key, (0, 2)), (value, (0, 2)), (bias, (0, 2)), (mask.colpos, (0, 1)),
             (mask.qpos, (0, 1))]  # fmt: skip
    sized += [(t, (0, *range(2, t.dim()))) for t in _tile_tables(mask.block_mask)]
    for x, dims in sized:
        for dim in dims:
            torch._dynamo.maybe_mark_dynamic(x, dim)

    def add_bias(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
        return score + bias[b, h, k]

    try:  # the inputs are already half precision: a trainer's autocast has nothing to cast
        with torch.autocast(query.device.type, enabled=False), _no_silent_fallback():
            out = _compiled(query, key, value, score_mod=add_bias, block_mask=mask.block_mask, scale=scaling)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compiler or Triton failure: not retried in this process
        _failure = f"{type(e).__name__}: {e}"
        logger.warning("FlexAttention failed (%s); β attention takes the SDPA paths from now on", _failure)
        raise FlexUnavailable(_failure) from e
    return out[:pieces, :, :queries]


#: a :class:`BlockMask`'s tile tables, ``[pieces, 1, tiles]`` or ``[pieces, 1, tiles, tiles]`` each
_TILE_TABLES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                "full_q_num_blocks", "full_q_indices")  # fmt: skip


def _tile_tables(block_mask: Any) -> list[torch.Tensor]:
    """The tile tables ``block_mask`` holds (the full-tile ones may be absent)."""
    tables = (getattr(block_mask, name, None) for name in _TILE_TABLES)
    return [t for t in tables if isinstance(t, torch.Tensor)]


def _no_silent_fallback() -> Any:
    """Past dynamo's recompile limit a compiled function runs eagerly — for FlexAttention an unfused
    kernel ~60× slower; raise instead (the caller then takes the SDPA paths)."""
    config = torch._dynamo.config
    if "fail_on_recompile_limit_hit" in getattr(config, "_config", {}):
        return config.patch(fail_on_recompile_limit_hit=True)
    return contextlib.nullcontext()
