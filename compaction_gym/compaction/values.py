"""Refitted values C2 by block-local output matching, a batched ridge solve (DESIGN §3.3)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from compaction_gym.compaction import _checks as C
from compaction_gym.compaction.scoring import attention_logits
from compaction_gym.errors import InvalidArgumentError

#: The dtype of C2's normal equations (float64 whatever the cache's dtype).
SOLVE_DTYPE = C.SOLVE_DTYPE
#: Internal precision of scores for a cache dtype: float64 for float64, float32 otherwise.
compute_dtype = C.compute_dtype

#: C2's relative ridge at and below one probe per kept key, in multiples of ``ridge``: the square
#: least-squares fit (its interpolation peak) is ill-conditioned enough to turn a rollout's float32
#: rounding into replay gaps past 1e-4. It falls linearly to 1× at two probes per kept key
#: (docs/compaction.md, "C2's ridge at one probe per kept key").
PEAK_RIDGE_FACTOR = 100.0


def relative_ridge(x: torch.Tensor, ridge: float, probes: torch.Tensor | None = None) -> torch.Tensor:
    """Per problem ``ridge · (1 + (PEAK_RIDGE_FACTOR − 1) · clamp(2 − n/t, 0, 1))`` ``[B]`` for a
    design ``x`` ``[B, n, t]`` whose all-zero rows are padding (``n`` counts the others, unless
    given as ``probes`` ``[B]``)."""
    probes = (x != 0).any(-1).sum(-1).to(x.dtype) if probes is None else probes.to(x.dtype)
    peak = (2 - probes / x.shape[-1]).clamp(0, 1)
    return ridge * (1 + (PEAK_RIDGE_FACTOR - 1) * peak)


def ridge_system(
    x: torch.Tensor,
    y: torch.Tensor,
    prior: torch.Tensor,
    ridge: float,
    probes: torch.Tensor | None = None,
    products: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The normal equations of :func:`ridge_solve`: ``(xᵀx + λI, xᵀy + λ·prior, λ)``, batched.

    ``λ = relative_ridge(x, ridge, probes) · trace(xᵀx) / t`` (:func:`relative_ridge`), floored at
    ``10·eps·trace(xᵀx)`` so a singular ``xᵀx`` (``ridge=0`` with duplicate keys or fewer probes
    than keys) still factors. ``products``: ``(xᵀx, xᵀy)`` when the caller computed them (the GPU
    fast path's kernels); they become the returned buffers.
    """
    gram, xty = products if products is not None else (x.mT @ x, x.mT @ y)
    a, lam = _add_ridge(gram, x, ridge, probes)
    return a, xty.add_(lam[:, None, None] * prior), lam


def normal_matrix(
    x: torch.Tensor, ridge: float, probes: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The left-hand side ``xᵀx + λI`` of :func:`ridge_system` and ``λ`` ``[B]`` (``probes``: the
    real probes per problem, when known, as :func:`relative_ridge` takes them)."""
    return _add_ridge(x.mT @ x, x, ridge, probes)


def _add_ridge(
    gram: torch.Tensor, x: torch.Tensor, ridge: float, probes: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    t = x.shape[-1]
    trace = torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1)
    lam = torch.maximum(relative_ridge(x, ridge, probes) * trace / t, 10 * torch.finfo(x.dtype).eps * trace)
    gram.diagonal(dim1=-2, dim2=-1).add_(lam[:, None])  # the product's own buffer
    return gram, lam


def cholesky_solve_ex(a: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``a c = rhs`` for symmetric positive definite ``a`` ``[B, t, t]``: a Cholesky factor
    and two triangular solves, with no host synchronisation (unlike ``torch.cholesky_solve``,
    which checks on the host). Returns ``c`` and which problems succeeded (factored, finite).

    In float64 with a right-hand side wider than the system (``w > t``, e.g. replay's value maps)
    the factor is inverted instead (one triangular solve with ``t`` columns rather than two with
    ``w``) and applied as two batched products: the explicit inverse costs ``cond · eps`` ≈ 1e-12
    at the ridge's floor, nothing measurable (in float32 it would not be, so float32 keeps the
    solves)."""
    chol, info = torch.linalg.cholesky_ex(a)
    sol, finite = factor_solve(chol, rhs)
    return sol, (info == 0) & finite


def factor_solve(chol: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``a c = rhs`` from ``a``'s lower Cholesky factor ``chol`` as :func:`cholesky_solve_ex`
    does (through the factor's inverse in float64 when ``w > t``). Returns ``c`` and which
    problems' results are finite."""
    t = chol.shape[-1]
    if chol.dtype == torch.float64 and rhs.shape[-1] > t:
        inv = _factor_inverse_lower(chol)
        # a finite inverse maps a finite right-hand side to a finite solution
        return inv.mT @ (inv @ rhs), inv.isfinite().all(-1).all(-1)
    half = torch.linalg.solve_triangular(chol, rhs, upper=False)
    sol = torch.linalg.solve_triangular(chol.mT, half, upper=True)
    return sol, sol.isfinite().all(-1).all(-1)


def factor_inverse(chol: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a⁻¹ = L⁻ᵀL⁻¹`` from ``a``'s lower Cholesky factor ``L`` (float64 callers: the explicit
    inverse costs ``cond · eps``, see :func:`cholesky_solve_ex`), and which problems' inverses are finite."""
    inv = _factor_inverse_lower(chol)
    return inv.mT @ inv, inv.isfinite().all(-1).all(-1)


def _factor_inverse_lower(chol: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(chol.shape[-1], dtype=chol.dtype, device=chol.device).expand_as(chol)
    return torch.linalg.solve_triangular(chol, eye, upper=False)


def ridge_solve_ex(
    x: torch.Tensor,
    y: torch.Tensor,
    prior: torch.Tensor,
    ridge: float,
    probes: torch.Tensor | None = None,
    *,
    products: tuple[torch.Tensor, torch.Tensor] | None = None,
    solve: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ridge_solve` without a host synchronisation (the GPU fast path's C2): a problem
    whose normal equations do not factor gets ``prior``. Returns ``(c, ok, λ)`` (``probes``: as
    :func:`relative_ridge` takes them, when the caller knows them; ``products``: as
    :func:`ridge_system` takes them; ``solve``: :func:`cholesky_solve_ex`'s contract, by default
    itself, and it may overwrite the system, which is this call's own buffer)."""
    a, rhs, lam = ridge_system(x, y, prior, ridge, probes, products)
    sol, ok = (solve or cholesky_solve_ex)(a, rhs)
    return torch.where(ok[:, None, None], sol, prior), ok, lam


def ridge_solve(x: torch.Tensor, y: torch.Tensor, prior: torch.Tensor, ridge: float) -> torch.Tensor:
    """``argmin_c ‖x c − y‖² + λ‖c − prior‖²``, ``λ`` from :func:`ridge_system`, batched.

    A Cholesky solve of the normal equations (:func:`ridge_system`). Problems where the
    factorisation fails anyway or yields non-finite values are re-solved from the augmented
    system ``[x; √λ I] c = [y; √λ prior]`` with a pseudo-inverse (SVD).

    Args:
        x: ``[B, n, t]``. y: ``[B, n, d]``. prior: ``[B, t, d]``, what ``c`` falls back to in
            the directions the rows of ``x`` do not determine. ridge: relative strength ``≥ 0``.

    Returns:
        ``c`` ``[B, t, d]``.
    """
    sol, ok, lam = ridge_solve_ex(x, y, prior, ridge)
    if not bool(ok.all()):
        rows = (~ok).nonzero()[:, 0]
        root = lam[rows].sqrt()[:, None, None]
        eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)
        xa = torch.cat([x[rows], root * eye], dim=1)
        ya = torch.cat([y[rows], root * prior[rows]], dim=1)
        sol = sol.index_put((rows,), torch.linalg.pinv(xa) @ ya)
    return sol


def values_from_logits(
    raw: torch.Tensor,
    logits: torch.Tensor,
    values: torch.Tensor,
    span: tuple[int, int],
    indices: torch.Tensor,
    beta: torch.Tensor | None,
    ridge: float,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """C2 ``[B, t, d]`` in the compute dtype for validated inputs.

    ``raw`` are the unbiased logits, ``logits`` include ``key_bias``; ``beta`` (absolute) replaces
    the kept rows' bias when given, otherwise the kept rows keep their old bias. ``query_mask``
    (bool ``[B, n]``): probes that are padding; their rows of the design and the target are zeroed,
    which leaves ``xᵀx``, ``xᵀy`` and λ exactly those of the real probes alone.
    """
    start, end = span
    span_values = values[:, start:end].to(logits.dtype)
    target = torch.softmax(logits[:, :, start:end], dim=-1) @ span_values
    gather = indices[:, None, :].expand(-1, logits.shape[1], -1)
    if beta is None:
        kept = torch.gather(logits, 2, gather)
    else:
        kept = torch.gather(raw, 2, gather) + beta.to(logits.dtype)[:, None, :]
    x = torch.softmax(kept, dim=-1).to(C.SOLVE_DTYPE)
    target = target.to(C.SOLVE_DTYPE)
    if query_mask is not None:
        keep = query_mask[:, :, None].to(C.SOLVE_DTYPE)
        x, target = x * keep, target * keep
    prior = torch.gather(values, 1, indices[:, :, None].expand(-1, -1, values.shape[2])).to(C.SOLVE_DTYPE)
    return ridge_solve(x, target, prior, ridge).to(logits.dtype)


def check_ridge(ridge: object) -> float:
    if isinstance(ridge, bool) or not isinstance(ridge, int | float) or not math.isfinite(ridge) or ridge < 0:
        raise InvalidArgumentError(f"ridge must be a finite float >= 0, got {ridge!r}")
    return float(ridge)


def check_beta(beta: object, indices: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    if beta is None:
        return None
    beta = C.check_tensor(beta, "beta", 2, "[B, t]")
    if beta.shape != indices.shape:
        raise InvalidArgumentError(
            f"beta must match indices' shape {tuple(indices.shape)}, got {tuple(beta.shape)}"
        )
    C.check_same(beta, "beta", keys, "keys", dtype=False)
    return beta


def fit_values(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor,
    span: tuple[int, int],
    indices: torch.Tensor,
    *,
    beta: torch.Tensor | None = None,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
    ridge: float = 1e-4,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Refit the kept keys' values so attention over them reproduces the span's own output.

    Target ``Y_i = Σ_{j∈W} softmax_W(S_i)_j V_j`` (softmax over the span only); design
    ``X_i = softmax_sel(S_i,sel + β)``; ``C2 = argmin ‖X C2 − Y‖² + λ‖C2 − V_sel‖²``: a ridge
    toward the kept rows' original values, so directions the probes do not determine keep them.
    ``λ = ρ · trace(XᵀX) / t`` with ``ρ = ridge`` from two probes per kept key up and
    ``PEAK_RIDGE_FACTOR · ridge`` at one and below (:func:`relative_ridge`; batched Cholesky, λ
    floored at ``10·eps·trace`` and a pseudo-inverse fallback keep singular systems solvable).
    With every span key kept and no β, ``C2 = V_W`` reproduces the span's block output up to
    rounding for any ridge.

    Args:
        keys: cache keys ``[B, T, d]``.
        values: cache values ``[B, T, d_v]``, same dtype and device as ``keys``.
        queries: probe queries ``[B, n, d]``.
        span: ``(start, end)`` cache rows being compacted.
        indices: kept cache indices ``[B, t]`` inside ``span``, strictly ascending.
        beta: absolute logit bias of the kept keys ``[B, t]`` (from :func:`fit_beta`); ``None``
            keeps their current bias (``key_bias`` at the kept rows, or 0).
        scale: logit scale (``1/sqrt(d)`` when ``None``).
        key_bias: β already on cache rows ``[B, T]``, part of ``S``.
        ridge: relative ridge strength ``≥ 0`` (``0``: plain least squares).
        query_mask: bool ``[B, n]``, ``False`` on padding probes (several problems with different
            probe counts stacked in one batch): the fit equals that of the real probes alone.

    Returns:
        C2 ``[B, t, d_v]`` in ``values``' dtype.

    Raises:
        InvalidArgumentError: bad shapes, dtypes, devices, span, indices, beta or ridge.

    Example:
        >>> k, v, q = torch.randn(2, 32, 16), torch.randn(2, 32, 16), torch.randn(2, 24, 16)
        >>> fit_values(k, v, q, (0, 16), torch.arange(0, 16, 2).expand(2, -1)).shape
        torch.Size([2, 8, 16])
    """
    keys = C.check_keys(keys)
    values = C.check_values(values, keys)
    queries = C.check_queries(queries, keys)
    span = C.check_span(span, keys.shape[1])
    indices = C.check_indices(indices, "indices", keys, span)
    if indices.shape[1] == 0:
        raise InvalidArgumentError("indices must keep at least one key (t >= 1) to fit values")
    beta = check_beta(beta, indices, keys)
    scale = C.check_scale(scale, keys.shape[2])
    key_bias = C.check_key_bias(key_bias, keys)
    ridge = check_ridge(ridge)
    query_mask = check_query_mask(query_mask, queries)
    raw, logits = attention_logits(keys, queries, scale, key_bias)
    return values_from_logits(raw, logits, values, span, indices, beta, ridge, query_mask).to(values.dtype)


def check_query_mask(query_mask: object, queries: torch.Tensor) -> torch.Tensor | None:
    """``query_mask`` checked against ``queries`` ``[B, n, d]`` (a bool ``[B, n]`` on their device) or ``None``."""
    if query_mask is None:
        return None
    if (
        not isinstance(query_mask, torch.Tensor)
        or query_mask.dtype != torch.bool
        or query_mask.shape != queries.shape[:2]
    ):
        raise InvalidArgumentError(
            f"query_mask must be a bool tensor of shape {tuple(queries.shape[:2])} (queries' [B, n]), "
            f"got {getattr(query_mask, 'dtype', type(query_mask).__name__)} {tuple(getattr(query_mask, 'shape', ()))}"
        )
    C.check_same(query_mask, "query_mask", queries, "queries", dtype=False)
    return query_mask
