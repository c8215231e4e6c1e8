"""One compaction event applied to a cache's K/V/β: the engine's and replay's shared path.

:func:`apply_event` turns an event — scored now by the engine, or recorded and replayed by a
trainer — into the block ``[C1 | C2 | β]`` that replaces the span (see ``docs/compaction.md``).
The engine calls it with no ``indices`` (selection runs, through its ``compact_fn``); replay
passes the recorded kept indices and β, so only C1 (a gather) and C2 (the ridge solve) are
recomputed — differentiably with ``differentiable=True``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from compaction_gym.compaction import _checks as C
from compaction_gym.compaction.api import (
    CompactionResult,
    check_refit_values,
    compact,
    gather_values,
    kept_rows,
)
from compaction_gym.compaction.beta import fit_beta
from compaction_gym.compaction.modes import COMPACTION_MODES
from compaction_gym.compaction.values import check_beta, fit_values
from compaction_gym.errors import InvalidArgumentError


def apply_event(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    *,
    mode: str,
    span: tuple[int, int],
    target: int,
    compute_beta: bool = False,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
    ridge: float = 1e-4,
    seed: int | None = None,
    indices: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
    differentiable: bool = False,
    compact_fn: Callable[..., CompactionResult] = compact,
    query_positions: torch.Tensor | None = None,
    n_kv_heads: int | None = None,
    refit_values: bool = True,
    query_mask: torch.Tensor | None = None,
) -> CompactionResult:
    """The block replacing rows ``span`` of every (layer, KV head) for one event.

    Without ``indices`` the event is scored: ``compact_fn`` (``compact``'s signature and result,
    e.g. the engine's fused GPU path) selects and fits everything. With recorded ``indices``
    (``CompactionEvent.forced_indices()``):

    * selection modes gather C1/C2 at ``indices`` (no probes needed); the kept rows keep their
      old bias;
    * ``attention_matching`` gathers C1 and refits C2 from ``queries`` by the ridge solve with
      ``beta`` as a constant (the recorded β; refitted without gradient when ``compute_beta`` and
      no ``beta`` is given — old records). Equal to ``compact(forced_indices=indices)`` when
      ``beta`` is the β that call fits. With ``refit_values=False`` C2 is the kept rows'
      original values (no probes needed when ``beta`` is recorded).

    Keys and values of different dtypes (autocast) are compacted in the keys' dtype; C2 comes
    back in the values' dtype.

    Args:
        keys, values: cache rows ``[B, T, d]``, ``B`` = layers × KV heads.
        queries: probes ``[B, n, d]`` (``None`` where the mode does not read them).
        mode, span, target, compute_beta, scale, key_bias, ridge, seed: as :func:`compact`.
        indices: recorded kept indices ``[B, t]`` (``None``: score now).
        beta: recorded absolute β of the kept rows ``[B, t]`` (any float dtype), with ``compute_beta``.
        differentiable: keep the autograd graph through C1 and C2 (needs ``indices``).
        compact_fn: the scoring implementation (``compact`` or a drop-in such as ``compact_fast``).
        query_positions, n_kv_heads: as :func:`compact` (each probe's cache row, for the causal
            masks of h2o/snapkv; the layout for tova's head average); used only when scoring.
        refit_values: as :func:`compact` (``attention_matching``: refit C2, or keep the values).
        query_mask: bool ``[B, n]``, ``False`` on padding probes (events of different probe counts
            stacked in one call, as batched replay and the engine's batched events do): each row
            is scored (passed to ``compact_fn``) or, with recorded ``indices`` and a recorded (or
            no) β, has C2 fitted (:func:`fit_values`) from its real probes alone.

    Returns:
        :class:`~compaction_gym.compaction.CompactionResult` (``beta`` float32 for recorded β).

    Raises:
        InvalidArgumentError: an unknown mode, ``beta`` without ``compute_beta`` or of the wrong
            shape, ``differentiable`` without ``indices``, or what :func:`compact` refuses.
    """
    if mode not in COMPACTION_MODES:
        raise InvalidArgumentError(f"mode must be one of {COMPACTION_MODES}, got {mode!r}")
    if beta is not None and not compute_beta:
        raise InvalidArgumentError("beta (a recorded β) needs compute_beta=True")
    refit_values = check_refit_values(refit_values)
    if differentiable and indices is None:
        raise InvalidArgumentError("indices are required with differentiable=True (replay a recorded event)")
    if query_mask is not None and indices is not None and compute_beta and beta is None:
        raise InvalidArgumentError(
            "query_mask with recorded indices needs, with compute_beta, a recorded beta"
        )
    if _mixed_dtypes(keys, values, queries):
        # under autocast, post-RoPE keys/queries and the value projection can differ in dtype (the
        # engine never autocasts): compact in the keys' dtype, hand C2 back in the values' dtype
        res = apply_event(
            keys, values.to(keys.dtype), None if queries is None else queries.to(keys.dtype),
            mode=mode, span=span, target=target, compute_beta=compute_beta, scale=scale, key_bias=key_bias,
            ridge=ridge, seed=seed, indices=indices, beta=beta, differentiable=differentiable, compact_fn=compact_fn,
            query_positions=query_positions, n_kv_heads=n_kv_heads, refit_values=refit_values,
            query_mask=query_mask,
        )  # fmt: skip
        return CompactionResult(res.keys, res.values.to(values.dtype), res.beta, res.indices)
    if indices is None or (
        mode == "attention_matching"
        and refit_values
        and not differentiable
        and beta is None
        and query_mask is None
    ):
        extra: dict = {} if refit_values else {"refit_values": False}  # compact_fn drop-ins take it when used
        if query_mask is not None:
            extra["query_mask"] = query_mask
        return compact_fn(
            keys, values, queries, span, target, mode=mode, compute_beta=compute_beta, scale=scale,
            key_bias=key_bias, ridge=ridge, seed=seed, forced_indices=indices,
            query_positions=None if indices is not None else query_positions,
            n_kv_heads=None if indices is not None else n_kv_heads, **extra,
        )  # fmt: skip
    return _replayed(
        keys, values, queries, mode, span, target, compute_beta, scale, key_bias, ridge, indices, beta,
        refit_values, query_mask,
    )  # fmt: skip


def _mixed_dtypes(keys: object, values: object, queries: object) -> bool:
    if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
        return False  # compact's own checks name the bad argument
    return values.dtype != keys.dtype or (isinstance(queries, torch.Tensor) and queries.dtype != keys.dtype)


def _replayed(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    mode: str,
    span: tuple[int, int],
    target: int,
    compute_beta: bool,
    scale: float | None,
    key_bias: torch.Tensor | None,
    ridge: float,
    indices: torch.Tensor,
    beta: torch.Tensor | None,
    refit_values: bool = True,
    query_mask: torch.Tensor | None = None,
) -> CompactionResult:
    """A recorded event's block: the same operations as :func:`compact`, β a constant."""
    keys = C.check_keys(keys)
    values = C.check_values(values, keys)
    span = C.check_span(span, keys.shape[1])
    indices = C.check_indices(indices, "indices", keys, span)
    expected = 0 if mode == "markovian" else C.check_target(target, span[1] - span[0])
    if indices.shape[1] != expected:
        raise InvalidArgumentError(
            f"indices must have shape [B, t={expected}] for mode {mode!r}, got {tuple(indices.shape)}"
        )
    key_bias = C.check_key_bias(key_bias, keys)
    kept_keys, old_beta, selected = kept_rows(mode, keys, values, key_bias, indices)
    if selected is not None:
        return selected
    if queries is None and (refit_values or (compute_beta and beta is None)):
        raise InvalidArgumentError("queries are required to refit C2 (mode='attention_matching')")
    if compute_beta and beta is None:  # an old record: refit β, a constant (no gradient)
        with torch.no_grad():
            beta = fit_beta(
                keys.detach(), queries.detach(), span, indices, scale=scale,
                key_bias=None if key_bias is None else key_bias.detach(),
            )  # fmt: skip
    elif beta is not None:
        beta = check_beta(beta.detach().to(keys.device), indices, keys)
    if not refit_values:
        return CompactionResult(
            kept_keys, gather_values(values, indices), beta if compute_beta else old_beta, indices
        )
    fitted = fit_values(
        keys, values, queries, span, indices, beta=beta, scale=scale, key_bias=key_bias, ridge=ridge,
        query_mask=query_mask,
    )  # fmt: skip
    return CompactionResult(kept_keys, fitted, beta if compute_beta else old_beta, indices)
