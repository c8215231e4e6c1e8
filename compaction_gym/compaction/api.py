"""One entry point for every compaction mode: :func:`compact` → :class:`CompactionResult`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compaction_gym.compaction import _checks as C
from compaction_gym.compaction.baselines import (
    h2o_indices,
    knorm_indices,
    random_indices,
    snapkv_indices,
    streaming_indices,
    tova_indices,
)
from compaction_gym.compaction.beta import beta_from_logits, beta_where_it_helps
from compaction_gym.compaction.modes import COMPACTION_MODES, QUERY_MODES
from compaction_gym.compaction.scoring import attention_logits, importance, top_indices
from compaction_gym.compaction.values import check_query_mask, check_ridge, values_from_logits
from compaction_gym.errors import InvalidArgumentError

__all__ = ["COMPACTION_MODES", "CompactionResult", "compact"]


@dataclass
class CompactionResult:
    """The block that replaces a span, per row of the batch (layer × KV head).

    Attributes:
        keys: C1 ``[B, t, d]``, the kept keys unchanged (input dtype).
        values: C2 ``[B, t, d_v]`` (input dtype): refitted for ``attention_matching``, the
            original values at ``indices`` for selection baselines.
        beta: absolute logit bias of the kept rows ``[B, t]`` (float32, float64 for float64
            inputs), or ``None`` when no β was fitted and no ``key_bias`` was given.
        indices: kept absolute cache indices, int64 ``[B, t]``, ascending (``t = 0`` for markovian).
    """

    keys: torch.Tensor
    values: torch.Tensor
    beta: torch.Tensor | None
    indices: torch.Tensor

    @property
    def target(self) -> int:
        """Kept rows per head ``t``."""
        return self.indices.shape[1]


def _select(
    mode: str,
    logits: torch.Tensor | None,
    keys: torch.Tensor,
    span: tuple[int, int],
    target: int,
    seed: int | None,
    query_positions: torch.Tensor | None = None,
    n_kv_heads: int | None = None,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Kept indices ``[B, target]`` for a scoring mode (``logits`` are ``None`` without queries)."""
    batch = keys.shape[0]
    if mode == "attention_matching":
        return top_indices(importance(logits, span, query_mask), target, span[0])
    if mode == "h2o":
        return h2o_indices(logits, span, target, query_positions=query_positions)
    if mode == "snapkv":
        return snapkv_indices(logits, span, target, query_positions=query_positions)
    if mode == "tova":
        return tova_indices(logits, span, target, query_positions=query_positions, layer_rows=n_kv_heads)
    if mode == "knorm":
        return knorm_indices(keys, span, target)
    if mode == "streaming":
        return streaming_indices(batch, span, target, keys.device)
    return random_indices(batch, span, target, seed, keys.device)


def _check_query_positions(
    query_positions: object, queries: torch.Tensor | None, keys: torch.Tensor
) -> torch.Tensor | None:
    """``None`` or int64 ``[n]`` / ``[B, n]`` cache rows ``>= 0`` of the probes, on keys' device."""
    if query_positions is None:
        return None
    if queries is None:
        raise InvalidArgumentError("query_positions needs queries (they give each probe's cache row)")
    if (
        not isinstance(query_positions, torch.Tensor)
        or query_positions.is_floating_point()
        or query_positions.is_complex()
        or query_positions.dtype == torch.bool
    ):
        raise InvalidArgumentError(
            f"query_positions must be an integer torch.Tensor [n] or [B, n], got {query_positions!r}"
        )
    n = queries.shape[1]
    if query_positions.shape not in ((n,), (keys.shape[0], n)):
        raise InvalidArgumentError(
            f"query_positions must have shape [n={n}] or [B={keys.shape[0]}, n={n}], got {tuple(query_positions.shape)}"
        )
    if query_positions.device != keys.device:
        raise InvalidArgumentError(
            f"query_positions is on {query_positions.device} but keys is on {keys.device}"
        )
    if query_positions.numel() and int(query_positions.min()) < 0:
        raise InvalidArgumentError("query_positions must be >= 0 (cache rows)")
    return query_positions.long()


def _check_n_kv_heads(n_kv_heads: object, batch: int) -> int | None:
    if n_kv_heads is None:
        return None
    n_kv_heads = C.as_int(n_kv_heads, "n_kv_heads")
    if n_kv_heads <= 0 or batch % n_kv_heads:
        raise InvalidArgumentError(f"n_kv_heads must be a positive divisor of B={batch}, got {n_kv_heads}")
    return n_kv_heads


def _check_scoring_mask(
    query_mask: object, queries: torch.Tensor | None, mode: str, refit_values: bool
) -> torch.Tensor | None:
    """``query_mask`` for :func:`compact`: only ``attention_matching`` with refitted values reads it."""
    if query_mask is None:
        return None
    if mode != "attention_matching" or not refit_values:
        raise InvalidArgumentError(
            f"query_mask needs mode='attention_matching' with refit_values=True, got mode={mode!r}, "
            f"refit_values={refit_values}"
        )
    query_mask = check_query_mask(query_mask, queries)
    if not bool(query_mask.any(dim=1).all()):
        raise InvalidArgumentError("query_mask must keep at least one probe in every row")
    return query_mask


def check_refit_values(refit_values: object) -> bool:
    """``refit_values`` as a bool; anything else is refused naming the argument."""
    if not isinstance(refit_values, bool):
        raise InvalidArgumentError(f"refit_values must be a bool, got {refit_values!r}")
    return refit_values


def gather_values(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The original values of the kept rows ``[B, t, d_v]``."""
    return torch.gather(values, 1, indices[..., None].expand(-1, -1, values.shape[-1]))


def kept_rows(
    mode: str,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_bias: torch.Tensor | None,
    indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor | None, CompactionResult | None]:
    """C1 (the kept keys) and the kept rows' old bias; for the selection modes, also the whole
    result (C2 = the kept values). Shared by :func:`compact` and a replayed event's block."""
    kept_keys = torch.gather(keys, 1, indices[:, :, None].expand(-1, -1, keys.shape[2]))
    old_beta = None
    if key_bias is not None:
        old_beta = torch.gather(key_bias.to(C.compute_dtype(keys.dtype)), 1, indices)
    if mode == "attention_matching":
        return kept_keys, old_beta, None
    kept_values = torch.gather(values, 1, indices[:, :, None].expand(-1, -1, values.shape[2]))
    return kept_keys, old_beta, CompactionResult(kept_keys, kept_values, old_beta, indices)


def compact(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    span: tuple[int, int],
    target: int,
    *,
    mode: str = "attention_matching",
    compute_beta: bool = False,
    forced_indices: torch.Tensor | None = None,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
    ridge: float = 1e-4,
    seed: int | None = None,
    query_positions: torch.Tensor | None = None,
    n_kv_heads: int | None = None,
    refit_values: bool = True,
    query_mask: torch.Tensor | None = None,
) -> CompactionResult:
    """Compact cache rows ``span`` of every (layer, KV head) down to ``target`` rows.

    Modes: ``attention_matching`` (C1 = top-t keys by RMS attention, C2 refitted, β if
    ``compute_beta``), ``markovian`` (the span is deleted: ``t = 0``), and the selection-only
    baselines ``h2o``, ``snapkv``, ``tova``, ``streaming``, ``knorm`` and ``random`` (C2 =
    original values), defined as their papers and kvpress define them (docs/compaction.md).
    The caller writes ``[prefix | result | suffix]`` back into its cache.

    Args:
        keys: cache keys ``[B, T, d]`` (post-RoPE), ``B`` = layers × KV heads.
        values: cache values ``[B, T, d_v]``, same dtype and device.
        queries: probe queries ``[B, n, d]``; may be ``None`` for ``markovian``, ``streaming``,
            ``knorm`` and ``random``, which do not look at attention.
        span: ``(start, end)`` cache rows to compact, non-empty, inside the cache.
        target: rows to keep per head, ``1 <= target <= end - start`` (ignored by markovian,
            which accepts ``0`` too).
        mode: one of :data:`COMPACTION_MODES`.
        compute_beta: fit β (``attention_matching`` only).
        forced_indices: kept cache indices ``[B, target]`` (strictly ascending, inside the span)
            that replace scoring, e.g. when a trainer replays a recorded event; the result is
            bit-identical to the scored call that chose the same indices.
        scale: logit scale (``1/sqrt(d)`` when ``None``).
        key_bias: β already stored on cache rows ``[B, T]`` (0 elsewhere), added to the logits.
            Kept rows keep their old bias (returned as ``beta``) unless β is refitted.
        ridge: relative ridge strength of the C2 solve, toward the kept rows' original values
            (:func:`~compaction_gym.compaction.values.relative_ridge`).
        seed: seed of the ``random`` baseline.
        query_positions: cache row of each probe, int ``[n]`` or ``[B, n]`` (``>= 0``; a probe not
            in the cache yet may be past ``T``). The attention baselines (``h2o``, ``snapkv``,
            ``tova``) then mask keys after each probe (a causal observation window, as kvpress)
            and ``tova`` takes the probes at the largest position as the last query. ``None``:
            every probe sees the whole cache, and ``tova`` uses the last probe row.
        n_kv_heads: ``H_kv`` when ``B = L × H_kv``: ``tova`` then averages the last query's
            attention over all heads of a layer (one kept set per layer, as TOVA and kvpress).
            ``None``: per KV head (its query group) only.
        refit_values: ``attention_matching`` refits C2 by the ridge solve; ``False`` keeps the
            selected rows' original values (selection by RMS attention, β still fitted if asked).
        query_mask: bool ``[B, n]``, ``False`` on padding probes (``attention_matching`` with
            ``refit_values``): each row is scored and fitted from its real probes alone, as when
            called with those probes only (events of different probe counts stacked in one call,
            docs/engine.md "Batched events").

    Returns:
        :class:`CompactionResult` with ``keys``/``values`` in the input dtype.

    Raises:
        InvalidArgumentError: a bad mode, shape, dtype, device, span, target, forced_indices,
            ridge, seed or query_mask, or ``compute_beta`` with a mode other than attention_matching.

    Example:
        >>> k, v, q = torch.randn(8, 64, 16), torch.randn(8, 64, 16), torch.randn(8, 32, 16)
        >>> r = compact(k, v, q, (16, 48), 8, compute_beta=True)
        >>> r.keys.shape, r.values.shape, r.beta.shape, r.indices.shape
        (torch.Size([8, 8, 16]), torch.Size([8, 8, 16]), torch.Size([8, 8]), torch.Size([8, 8]))
    """
    if mode not in COMPACTION_MODES:
        raise InvalidArgumentError(f"mode must be one of {COMPACTION_MODES}, got {mode!r}")
    if compute_beta and mode != "attention_matching":
        raise InvalidArgumentError(f"compute_beta needs mode='attention_matching', got mode={mode!r}")
    keys = C.check_keys(keys)
    values = C.check_values(values, keys)
    if queries is not None or mode in QUERY_MODES:
        queries = C.check_queries(queries, keys)
    span = C.check_span(span, keys.shape[1])
    target = C.check_target(target, span[1] - span[0], allow_zero=mode == "markovian")
    scale = C.check_scale(scale, keys.shape[2])
    key_bias = C.check_key_bias(key_bias, keys)
    ridge = check_ridge(ridge)
    if seed is not None:
        seed = C.as_int(seed, "seed")
    refit_values = check_refit_values(refit_values)
    query_positions = _check_query_positions(query_positions, queries, keys)
    n_kv_heads = _check_n_kv_heads(n_kv_heads, keys.shape[0])
    query_mask = _check_scoring_mask(query_mask, queries, mode, refit_values)
    if forced_indices is not None:
        forced_indices = C.check_indices(forced_indices, "forced_indices", keys, span)
        expected = 0 if mode == "markovian" else target
        if forced_indices.shape[1] != expected:
            raise InvalidArgumentError(
                f"forced_indices must have shape [B, t={expected}] for mode {mode!r}, got {tuple(forced_indices.shape)}"
            )

    batch = keys.shape[0]
    if mode == "markovian":
        empty = torch.empty(batch, 0, dtype=torch.long, device=keys.device)
        return CompactionResult(
            keys.new_empty(batch, 0, keys.shape[2]), values.new_empty(batch, 0, values.shape[2]), None, empty
        )

    raw = logits = None
    if mode == "attention_matching" or (forced_indices is None and mode in QUERY_MODES):
        raw, logits = attention_logits(keys, queries, scale, key_bias)
    indices = (
        forced_indices
        if forced_indices is not None
        else _select(mode, logits, keys, span, target, seed, query_positions, n_kv_heads, query_mask)
    )
    kept_keys, old_beta, selected = kept_rows(mode, keys, values, key_bias, indices)
    if selected is not None:
        return selected
    beta = beta_from_logits(logits, span, indices, key_bias, query_mask=query_mask) if compute_beta else None
    if not refit_values:
        if compute_beta:  # kept values: β only where it lowers the probes' output error
            beta = beta_where_it_helps(raw, logits, values, span, indices, beta, old_beta, key_bias)
        return CompactionResult(
            kept_keys, gather_values(values, indices), beta if compute_beta else old_beta, indices
        )
    fitted = values_from_logits(raw, logits, values, span, indices, beta, ridge, query_mask).to(values.dtype)
    return CompactionResult(kept_keys, fitted, beta if compute_beta else old_beta, indices)
