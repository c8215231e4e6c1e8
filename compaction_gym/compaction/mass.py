"""How much of the probes' attention mass a compacted block keeps (docs/compaction.md, "Mass kept").

For a probe ``q`` and the span's rows ``j`` (keys ``k_j``, logit bias ``b_j``), the span's mass is
``M(q) = Σ_j exp(scale · q·k_j + b_j)``; the block's is ``C(q) = Σ_m exp(scale · q·c1_m + β_m)``
over its kept rows. :func:`attention_mass_kept` is the mean of ``C(q) / M(q)`` over probes and
(layer, KV head) rows: at most 1 for a selection without β (the mass of the kept keys), close to 1
when Attention Matching's β restores the span's mass, 0 for a deletion.
"""

from __future__ import annotations

import torch

from compaction_gym.compaction import _checks as C
from compaction_gym.errors import InvalidArgumentError

#: float32 logits computed at once (per chunk of rows): 2**24 elements = 64 MiB for the span's.
CHUNK_ELEMENTS = 1 << 24


@torch.no_grad()
def attention_mass_kept(
    keys: torch.Tensor,
    queries: torch.Tensor,
    span: tuple[int, int],
    indices: torch.Tensor,
    *,
    scale: float,
    key_bias: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> float:
    """Mean over probes and rows of (block mass / span mass), in float32 log-space, a chunk of rows
    at a time (memory stays bounded for long spans and many probes).

    Args:
        keys: the cache's keys before the event ``[B, T, d]``.
        queries: probes ``[B, n, d]``.
        span: ``(start, end)`` rows the block replaces.
        indices: kept absolute rows ``[B, t]`` inside ``span`` (``t = 0``: nothing kept, returns 0).
        scale: the attention scale (``1/√d`` usually).
        key_bias: logit bias already on the cache rows ``[B, T]`` (earlier events' β), or ``None``.
        beta: the block's absolute bias ``[B, t]`` (``None``: the kept rows keep ``key_bias``).

    Raises:
        InvalidArgumentError: shapes that do not agree, or ``span`` outside ``keys``.
    """
    keys = C.check_tensor(keys, "keys", 3, "[B, T, d]")
    queries = C.check_tensor(queries, "queries", 3, "[B, n, d]")
    b, total, d = keys.shape
    start, end = int(span[0]), int(span[1])
    if not 0 <= start < end <= total:
        raise InvalidArgumentError(f"span must satisfy 0 <= start < end <= {total}, got {span}")
    if queries.shape[0] != b or queries.shape[2] != d:
        raise InvalidArgumentError(f"queries must be [{b}, n, {d}], got {list(queries.shape)}")
    if indices.dim() != 2 or indices.shape[0] != b:
        raise InvalidArgumentError(f"indices must be [{b}, t], got {list(indices.shape)}")
    if indices.shape[1] == 0 or queries.shape[1] == 0:
        return 0.0 if indices.shape[1] == 0 else float("nan")
    if beta is not None and tuple(beta.shape) != tuple(indices.shape):
        raise InvalidArgumentError(f"beta must match indices' shape {list(indices.shape)}, got {list(beta.shape)}")
    n, span_len = queries.shape[1], end - start
    rows = max(1, CHUNK_ELEMENTS // (n * max(span_len, indices.shape[1])))  # bounded memory per chunk
    total_ratio = 0.0
    for lo in range(0, b, rows):
        hi = min(b, lo + rows)
        k = keys[lo:hi].float()
        q = queries[lo:hi].to(k.device, torch.float32)
        idx = indices[lo:hi].to(k.device).long()
        span_logits = scale * torch.einsum("bnd,btd->bnt", q, k[:, start:end])
        block_logits = scale * torch.einsum("bnd,btd->bnt", q, k.gather(1, idx[..., None].expand(-1, -1, d)))
        if key_bias is not None:
            bias = key_bias[lo:hi].to(k.device, torch.float32)
            span_logits = span_logits + bias[:, None, start:end]
            if beta is None:
                block_logits = block_logits + bias.gather(1, idx)[:, None, :]
        if beta is not None:
            block_logits = block_logits + beta[lo:hi].to(k.device, torch.float32)[:, None, :]
        log_ratio = torch.logsumexp(block_logits, -1) - torch.logsumexp(span_logits, -1)
        total_ratio += float(log_ratio.double().exp().sum())
    return total_ratio / (b * n)
