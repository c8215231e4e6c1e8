"""Attention scores and RMS-attention key selection (DESIGN §3.1)."""

from __future__ import annotations

import torch

from compaction_gym.compaction import _checks as C


def attention_logits(
    keys: torch.Tensor, queries: torch.Tensor, scale: float, key_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw logits ``scale * Q Kᵀ`` and the biased logits attention sees, both ``[B, n, T]``.

    Computed in float32 (float64 for float64 inputs). Inputs are assumed validated.
    """
    dtype = C.compute_dtype(keys.dtype)
    raw = torch.matmul(queries.to(dtype), keys.to(dtype).transpose(1, 2)) * scale
    if key_bias is None:
        return raw, raw
    return raw, raw + key_bias.to(dtype)[:, None, :]


def half_product(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """``Q Kᵀ`` ``[B, n, T]`` in float32 from half-precision CUDA ``queries`` ``[B, n, d]`` and
    ``keys`` ``[B, T, d]`` without float32 copies of them: the products of half-precision values
    are exact in the float32 accumulator, so this is the float32 product of the copies up to the
    order of accumulation. ``None``
    where it does not apply (CPU, other dtypes, gradients: the product has no autograd formula).

    The reference :func:`attention_logits` keeps its float32 copies: a different accumulation
    order there moves near-tied selections between the reference and the fused path."""
    if not (keys.is_cuda and keys.dtype in (torch.bfloat16, torch.float16) and queries.dtype == keys.dtype):
        return None
    if torch.is_grad_enabled() and (keys.requires_grad or queries.requires_grad):
        return None
    try:
        return torch.bmm(queries, keys.transpose(1, 2), out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # a torch without the mixed-dtype product
        return None


def importance(
    logits: torch.Tensor, span: tuple[int, int], query_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """RMS attention ``I_j = sqrt(mean_i A_ij²)`` of the span's keys, ``[B, e - s]``.

    ``A`` is the row softmax of ``logits`` over the whole cache, not only the span. ``query_mask``
    (bool ``[B, n]``, ``False`` on padding probes): the mean runs over each row's real probes.
    """
    start, end = span
    log_attn = logits[:, :, start:end] - torch.logsumexp(logits, dim=-1, keepdim=True)
    if query_mask is None:
        return torch.exp(2.0 * log_attn).mean(dim=1).sqrt()
    keep = query_mask[:, :, None].to(log_attn.dtype)
    return ((torch.exp(2.0 * log_attn) * keep).sum(dim=1) / keep.sum(dim=1)).sqrt()


def top_indices(scores: torch.Tensor, target: int, start: int) -> torch.Tensor:
    """The ``target`` best span positions per row as absolute, ascending cache indices ``[B, target]``."""
    local = torch.topk(scores, target, dim=-1, sorted=False).indices
    return torch.sort(local, dim=-1).values + start


def select_keys(
    keys: torch.Tensor,
    queries: torch.Tensor,
    span: tuple[int, int],
    target: int,
    *,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pick the ``target`` span keys with the largest RMS attention from the probe queries.

    Args:
        keys: cache keys ``[B, T, d]`` (post-RoPE), ``B`` = layers × KV heads.
        queries: probe queries ``[B, n, d]``.
        span: ``(start, end)`` cache rows to choose from.
        target: how many keys to keep, ``1 <= target <= end - start``.
        scale: logit scale (``1/sqrt(d)`` when ``None``).
        key_bias: β already stored on cache rows ``[B, T]`` (0 elsewhere), added to the logits.

    Returns:
        Absolute cache indices, int64 ``[B, target]``, inside ``span`` and ascending per row.

    Raises:
        InvalidArgumentError: bad shapes, dtypes, devices, span or target (the message names it).

    Example:
        >>> k, q = torch.randn(4, 32, 16), torch.randn(4, 8, 16)
        >>> select_keys(k, q, (8, 24), 4).shape
        torch.Size([4, 4])
    """
    keys = C.check_keys(keys)
    queries = C.check_queries(queries, keys)
    start, end = C.check_span(span, keys.shape[1])
    target = C.check_target(target, end - start)
    scale = C.check_scale(scale, keys.shape[2])
    key_bias = C.check_key_bias(key_bias, keys)
    _, logits = attention_logits(keys, queries, scale, key_bias)
    return top_indices(importance(logits, (start, end)), target, start)
