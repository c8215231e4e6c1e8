"""Per-key logit bias β by span-mass matching, with a batched box-constrained NNLS solver.

The fit is regularised so that β never hurts (docs/compaction.md, "β bounds and fallback"):
``w = exp(β − β⁰)`` lives in a box, a ridge pulls it toward ``w = 1`` (no change), and rows with
too few probes per kept key keep ``w = 1``.
"""

from __future__ import annotations

import math

import torch

from compaction_gym.compaction import _checks as C
from compaction_gym.compaction.scoring import attention_logits
from compaction_gym.errors import InvalidArgumentError

BETA_CLAMP = 30.0  # the absolute β is always clamped to [-30, 30]
#: Default box on the *relative* log-weight ``β − β⁰ = log w`` (the Attention Matching reference code
#: bounds ``w`` to ``[e⁻³, e³]``): a kept key is never silenced nor blown up by a fit.
BETA_BOUNDS = (-3.0, 3.0)
#: Default ridge toward ``w = 1``, relative to the mean diagonal of ``AᵀA``: makes the fit unique
#: and Lipschitz in its inputs (a rollout and its replay agree), and fixes unseen keys at ``w = 1``.
BETA_RIDGE = 1e-4
#: Default probe guard: rows with fewer than this many probes per kept key (``n < ratio · t``) keep
#: ``w = 1``: below it the span-mass fit is under-determined and hurt held-out attention.
BETA_MIN_PROBES_PER_KEY = 1.0
#: Folds of the cross-fitted check of β with kept values (:func:`beta_where_it_helps`).
CV_FOLDS = 4
_EPS_ACTIVE = 1e-3  # cap of the ε-active threshold (in Jacobi-scaled units)
_DAMPINGS = (1e-10, 1e-6, 1e-3, 1e-1)
_STEPS = 12  # backtracking step lengths 1, 1/2, ..., 2^-11 tried at once


def _decrease(gram: torch.Tensor, grad: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """Change of ``½ wᵀGw − hᵀw`` for moves ``delta [B, K, t]`` from a point with gradient ``grad``.

    ``gᵀΔ + ½ ΔᵀGΔ`` avoids the cancellation of comparing two large objective values, so float32
    still ranks candidates correctly near the optimum.
    """
    g_delta = torch.einsum("bij,bkj->bki", gram, delta)
    return (delta * grad[:, None, :]).sum(-1) + 0.5 * (delta * g_delta).sum(-1)


def nnls(
    gram: torch.Tensor,
    rhs: torch.Tensor,
    *,
    max_iter: int = 100,
    rtol: float | None = None,
    damping: float | None = None,
    lower: float = 0.0,
    upper: float | None = None,
) -> torch.Tensor:
    """Solve ``min_w ½ wᵀGw − hᵀw`` s.t. ``lower ≤ w ≤ upper`` for PSD ``G [B, t, t]``, ``h [B, t]``.

    That is (box-constrained) non-negative least squares ``min ‖Aw − m‖²`` given its normal equations
    ``G = AᵀA``, ``h = Aᵀm``, for all ``B`` problems at once. Projected Newton (Bertsekas 1982)
    on Jacobi-scaled variables: variables near a bound whose gradient pushes them across it (the
    ε-active set) take a gradient step, the others a Newton step on their
    sub-block, solved by one batched Cholesky for several damping levels (Levenberg–Marquardt
    style, so singular ``G`` is handled); every damping × step length ``1, ½, …, 2⁻¹¹`` and a
    projected gradient step are projected onto the box and the one with the largest exact
    decrease is taken, so the objective never increases. Stops when the KKT gap
    ``‖w − clamp(w − ∇, lower, upper)‖∞`` is below ``rtol · max|h|`` for every problem, when no
    problem improves, or after ``max_iter``.

    Args:
        gram: ``G`` ``[B, t, t]``, symmetric positive semi-definite, floating.
        rhs: ``h`` ``[B, t]``, same dtype and device.
        max_iter: iteration cap (well-posed problems finish in a few iterations).
        rtol: relative tolerance of the KKT gap (default ``100·eps`` of the dtype).
        damping: use this single damping level instead of the default ladder
            ``(1e-10, 1e-6, 1e-3, 1e-1)`` (relative to the unit diagonal).
        lower, upper: the box (``0 ≤ lower ≤ upper``; ``upper=None`` is unbounded).

    Returns:
        ``w`` ``[B, t]`` inside the box.

    Raises:
        InvalidArgumentError: mismatched shapes, dtypes or devices, ``max_iter < 0`` or a bad box.

    Example:
        >>> a = torch.rand(2, 10, 3, dtype=torch.float64)
        >>> w = nnls(a.mT @ a, (a.mT @ a.sum(-1, keepdim=True)).squeeze(-1))
        >>> bool((w >= 0).all())
        True
    """
    gram = C.check_tensor(gram, "gram", 3, "[B, t, t]")
    rhs = C.check_tensor(rhs, "rhs", 2, "[B, t]")
    if gram.shape[1] != gram.shape[2] or gram.shape[:2] != rhs.shape:
        raise InvalidArgumentError(
            f"gram must be [B, t, t] matching rhs {tuple(rhs.shape)}, got {tuple(gram.shape)}"
        )
    C.check_same(rhs, "rhs", gram, "gram")
    if C.as_int(max_iter, "max_iter") < 0:
        raise InvalidArgumentError(f"max_iter must be >= 0, got {max_iter}")
    if not (isinstance(lower, int | float) and 0 <= lower < float("inf")):
        raise InvalidArgumentError(f"lower must be a finite float >= 0, got {lower!r}")
    if upper is not None and not (isinstance(upper, int | float) and lower <= upper < float("inf")):
        raise InvalidArgumentError(f"upper must be None or a finite float >= lower={lower}, got {upper!r}")
    batch, t = rhs.shape
    finfo = torch.finfo(gram.dtype)
    rtol = 100 * finfo.eps if rtol is None else rtol
    # Jacobi scaling w = D u keeps u ≥ 0 and gives G a unit diagonal (better conditioned).
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    d = torch.where(diag > 0, diag.clamp_min(finfo.tiny).rsqrt(), torch.ones_like(diag))
    gram = gram * d[:, :, None] * d[:, None, :]
    rhs = rhs * d
    lo = float(lower) / d  # the box in scaled units
    hi = torch.full_like(d, float("inf")) if upper is None else float(upper) / d
    eye = torch.eye(t, dtype=gram.dtype, device=gram.device)
    jitter = 10 * t * finfo.eps
    dampings = torch.tensor(_DAMPINGS if damping is None else [damping], dtype=gram.dtype, device=gram.device)
    dampings = dampings + jitter
    lipschitz = torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1).clamp_min(finfo.tiny)  # trace ≥ λ_max
    tol = rtol * rhs.abs().amax(-1).clamp_min(finfo.tiny)
    steps = 0.5 ** torch.arange(_STEPS, dtype=gram.dtype, device=gram.device)

    chol, info = torch.linalg.cholesky_ex(gram + jitter * eye)
    u = torch.cholesky_solve(rhs[:, :, None], chol)[:, :, 0]
    u = torch.where((info == 0)[:, None] & u.isfinite(), u, torch.zeros_like(u)).clamp(lo, hi)
    for _ in range(max_iter):
        grad = torch.einsum("bij,bj->bi", gram, u) - rhs
        gap = u - (u - grad).clamp(lo, hi)  # zero exactly at a KKT point
        if bool((gap.abs().amax(-1) <= tol).all()):
            break
        # Bertsekas' ε-active set: variables near a bound that want to cross it move by a
        # gradient step (and are projected); the others take a (damped) Newton step together.
        eps_k = gap.norm(dim=-1, keepdim=True).clamp(max=_EPS_ACTIVE)
        active = ((u - lo <= eps_k) & (grad > 0)) | ((hi - u <= eps_k) & (grad < 0))
        free = ~active
        reduced = torch.where(free[:, :, None] & free[:, None, :], gram, torch.zeros_like(gram))
        reduced = reduced + torch.diag_embed(active.to(gram.dtype))
        chol, info = torch.linalg.cholesky_ex(reduced[:, None] + dampings[None, :, None, None] * eye)
        rhs_free = torch.where(free, grad, 0.0)[:, None, :, None].expand(-1, len(dampings), -1, -1)
        newton = -torch.cholesky_solve(rhs_free, chol)[..., 0]
        direction = torch.where(free[:, None], newton, -grad[:, None])
        ok = (info == 0)[..., None] & direction.isfinite().all(-1, keepdim=True)
        direction = torch.where(ok, direction, -grad[:, None] / lipschitz[:, None, None])
        tries = (u[:, None, None, :] + steps[None, None, :, None] * direction[:, :, None, :]).clamp(
            lo[:, None, None, :], hi[:, None, None, :]
        )
        candidates = torch.cat(
            [
                u[:, None, :],
                tries.flatten(1, 2),
                (u - grad / lipschitz[:, None]).clamp(lo, hi)[:, None, :],
            ],
            dim=1,
        )
        best = _decrease(gram, grad, candidates - u[:, None, :]).argmin(dim=1)
        if bool((best == 0).all()):
            break  # no problem can improve further in this precision
        u = candidates[torch.arange(batch, device=u.device), best]
    return u * d


def mass_matching_system(
    logits: torch.Tensor, span: tuple[int, int], indices: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Design ``A [B, n, t]`` and target ``m [B, n]`` of the span-mass NNLS.

    Each probe's row is shifted by its span log-sum-exp, ``A_ij = exp(S_ij − lse_{j∈W} S_ij)``
    for kept ``j`` (the span softmax, in ``[0, 1]`` whatever the logit range) and ``m_i = 1``: the
    least squares then weighs every probe's *relative* mass error equally.
    """
    start, end = span
    span_logits = logits[:, :, start:end]
    probs = torch.exp(span_logits - torch.logsumexp(span_logits, dim=-1, keepdim=True))
    local = (indices - start)[:, None, :].expand(-1, logits.shape[1], -1)
    return torch.gather(probs, 2, local), torch.ones_like(probs[:, :, 0])


def _check_regularisation(
    bounds: tuple[float, float] | None, ridge: float, min_probes_per_key: float
) -> tuple[tuple[float, float] | None, float, float]:
    if bounds is not None:
        if not (isinstance(bounds, tuple | list) and len(bounds) == 2):
            raise InvalidArgumentError(f"bounds must be None or a (low, high) pair of floats, got {bounds!r}")
        low, high = (
            float(x) if isinstance(x, int | float) and not isinstance(x, bool) else math.nan for x in bounds
        )
        if not (math.isfinite(low) and math.isfinite(high) and low <= 0 <= high):
            raise InvalidArgumentError(f"bounds must be finite with low <= 0 <= high, got {bounds!r}")
        bounds = (low, high)
    for name, value in (("ridge", ridge), ("min_probes_per_key", min_probes_per_key)):
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise InvalidArgumentError(f"{name} must be a finite float >= 0, got {value!r}")
    return bounds, float(ridge), float(min_probes_per_key)


def beta_weights(
    design: torch.Tensor,
    *,
    bounds: tuple[float, float] | None = BETA_BOUNDS,
    ridge: float = BETA_RIDGE,
    min_probes_per_key: float = BETA_MIN_PROBES_PER_KEY,
    probes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Relative weights ``w = exp(β − β⁰)`` ``[B, t]`` from the span-mass design ``A [B, n, t]``.

    ``min_{w ∈ [e^lo, e^hi]} ‖A w − 1‖² + ρ ‖w − 1‖²`` with ``ρ = ridge · trace(AᵀA) / t``
    (float64). ``w = 1`` (no change) is returned for every row when ``n < min_probes_per_key · t``,
    and for rows whose solution does not beat ``w = 1`` on that objective (a solver safeguard:
    the exact minimiser always does) or is not finite. ``probes`` ``[B]``: each row's real probe
    count when the design's other rows are zero padding (the guard then applies per row).
    """
    batch, n, t = design.shape
    if n < min_probes_per_key * t:
        return torch.ones(batch, t, dtype=design.dtype, device=design.device)
    gram, rhs = regularised_system(design.mT @ design, design.sum(1), ridge)
    if bounds is None:
        w = nnls(gram, rhs)
    else:
        w = nnls(gram, rhs, lower=math.exp(bounds[0]), upper=math.exp(bounds[1]))
    return probe_guard(keep_if_better(w, gram, rhs), probes, min_probes_per_key)


def probe_guard(
    w: torch.Tensor, probes: torch.Tensor | None, min_probes_per_key: float = BETA_MIN_PROBES_PER_KEY
) -> torch.Tensor:
    """``w`` ``[B, t]`` with ``1`` (no change) in the rows with fewer than ``min_probes_per_key · t``
    real probes ``probes`` ``[B]`` (rows of a design padded with zero rows); ``w`` when ``None``."""
    if probes is None:
        return w
    return torch.where((probes < min_probes_per_key * w.shape[-1])[:, None], torch.ones_like(w), w)


def regularised_system(
    gram: torch.Tensor, rhs: torch.Tensor, ridge: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(AᵀA + ρI, Aᵀ1 + ρ1)``, ``ρ = ridge · trace(AᵀA) / t``: the normal equations of
    ``‖Aw − 1‖² + ρ‖w − 1‖²`` (shared with the GPU fast path). ``ρ`` is added to ``gram``'s
    diagonal in place: callers pass a product of their own."""
    t = gram.shape[-1]
    rho = ridge * torch.diagonal(gram, dim1=-2, dim2=-1).sum(-1) / t
    gram.diagonal(dim1=-2, dim2=-1).add_(rho[:, None])
    return gram, rhs + rho[:, None]


def keep_if_better(w: torch.Tensor, gram: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``w`` where it is finite and ``½wᵀGw − hᵀw`` is no larger than at ``w = 1``, else ``1``
    (no host synchronisation; shared with the GPU fast path)."""
    ones = torch.ones_like(w)

    def objective(x: torch.Tensor) -> torch.Tensor:  # a product, not einsum: its path search costs ~0.6 ms
        return 0.5 * (x * torch.bmm(gram, x[:, :, None])[..., 0]).sum(-1) - (rhs * x).sum(-1)

    good = w.isfinite().all(-1) & (objective(torch.nan_to_num(w)) <= objective(ones))
    return torch.where(good[:, None], w, ones)


def beta_from_logits(
    logits: torch.Tensor,
    span: tuple[int, int],
    indices: torch.Tensor,
    key_bias: torch.Tensor | None,
    *,
    bounds: tuple[float, float] | None = BETA_BOUNDS,
    ridge: float = BETA_RIDGE,
    min_probes_per_key: float = BETA_MIN_PROBES_PER_KEY,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absolute β ``[B, t]`` for already validated inputs; ``logits`` include ``key_bias``.

    ``query_mask`` (bool ``[B, n]``, ``False`` on padding probes): each row is fitted to its real
    probes alone (padding rows of the design are zeroed: ``AᵀA`` and ``Aᵀ1`` are the real ones).
    """
    design, _ = mass_matching_system(logits.to(C.SOLVE_DTYPE), span, indices)
    probes = None
    if query_mask is not None:
        design = design * query_mask[:, :, None].to(design.dtype)
        probes = query_mask.sum(1)
    w = beta_weights(
        design, bounds=bounds, ridge=ridge, min_probes_per_key=min_probes_per_key, probes=probes
    ).to(logits.dtype)
    beta = torch.log(w.clamp_min(torch.finfo(w.dtype).tiny))
    if key_bias is not None:  # the design already carries the old bias: β is relative to it
        beta = beta + torch.gather(key_bias.to(beta.dtype), 1, indices)
    return beta.clamp(-BETA_CLAMP, BETA_CLAMP)


def fit_beta(
    keys: torch.Tensor,
    queries: torch.Tensor,
    span: tuple[int, int],
    indices: torch.Tensor,
    *,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
    bounds: tuple[float, float] | None = BETA_BOUNDS,
    ridge: float = BETA_RIDGE,
    min_probes_per_key: float = BETA_MIN_PROBES_PER_KEY,
) -> torch.Tensor:
    """Fit the per-key logit bias β that preserves the span's attention mass for every probe.

    Solves ``Σ_{j∈sel} exp(S_ij + β_j) ≈ Σ_{j∈W} exp(S_ij)`` for ``w = exp(β − β⁰)`` by batched
    box-constrained least squares (each probe's row shifted by its span log-sum-exp, so every
    probe's relative mass error counts alike) with a ridge toward ``w = 1``, then
    ``β = clamp(β⁰ + log(max(w, tiny)), -30, 30)``. Only the span's mass is matched: keys outside
    the span stay in the cache and keep their own mass. Rows with fewer than
    ``min_probes_per_key · t`` probes keep ``β = β⁰`` (docs/compaction.md, "β bounds and fallback").

    Args:
        keys: cache keys ``[B, T, d]``.
        queries: probe queries ``[B, n, d]``.
        span: ``(start, end)`` cache rows being compacted.
        indices: kept cache indices ``[B, t]`` inside ``span``, strictly ascending.
        scale: logit scale (``1/sqrt(d)`` when ``None``).
        key_bias: β already on cache rows ``[B, T]``; ``S`` includes it and the returned β is
            absolute (it replaces the old bias on the kept rows).
        bounds: box on ``β − β⁰`` (``None``: only ``w ≥ 0``, the unregularised NNLS).
        ridge: ridge toward ``w = 1``, relative to the mean diagonal of ``AᵀA`` (``0``: none).
        min_probes_per_key: probe guard (``0``: always fit).

    Returns:
        β ``[B, t]`` in float32 (float64 for float64 inputs).

    Raises:
        InvalidArgumentError: bad shapes, dtypes, devices, span or indices (the message names it).

    Example:
        >>> k, q = torch.randn(2, 32, 16), torch.randn(2, 24, 16)
        >>> fit_beta(k, q, (0, 16), torch.arange(0, 16, 2).expand(2, -1)).shape
        torch.Size([2, 8])
    """
    keys = C.check_keys(keys)
    queries = C.check_queries(queries, keys)
    span = C.check_span(span, keys.shape[1])
    indices = C.check_indices(indices, "indices", keys, span)
    if indices.shape[1] == 0:
        raise InvalidArgumentError("indices must keep at least one key (t >= 1) to fit beta")
    scale = C.check_scale(scale, keys.shape[2])
    key_bias = C.check_key_bias(key_bias, keys)
    bounds, ridge, min_probes_per_key = _check_regularisation(bounds, ridge, min_probes_per_key)
    _, logits = attention_logits(keys, queries, scale, key_bias)
    return beta_from_logits(
        logits, span, indices, key_bias, bounds=bounds, ridge=ridge, min_probes_per_key=min_probes_per_key
    )


def beta_where_it_helps(
    raw: torch.Tensor,
    logits: torch.Tensor,
    values: torch.Tensor,
    span: tuple[int, int],
    indices: torch.Tensor,
    beta: torch.Tensor,
    old_beta: torch.Tensor | None,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per row, the fitted ``beta`` where it lowers the probes' attention-output error, else the old bias.

    For kept (not refitted) values: the probes' full-cache attention output ``softmax(S) V`` is
    compared with the compacted cache's (``[prefix | kept rows with bias b | suffix]``, original
    values) for ``b = beta`` and ``b = old_beta`` (``0`` without one). A row keeps ``beta`` only
    if its squared error is lower on the probes ``beta`` was fitted to and, **cross-fitted**, on
    every one of ``CV_FOLDS`` folds (probes ``i ≡ k mod CV_FOLDS``) with β fitted on the other
    folds' probes (the same regularised fit, probe guard included): a fit that only matches its
    own probes does not pass (docs/compaction.md, "Kept values").

    Args:
        raw, logits: ``[B, n, T]`` unbiased and biased logits (:func:`~compaction_gym.compaction.scoring.attention_logits`).
        values: ``[B, T, d_v]``. span: ``(s, e)``. indices: kept rows ``[B, t]``.
        beta: fitted absolute β ``[B, t]``. old_beta: the kept rows' stored bias ``[B, t]`` or ``None``.
        key_bias: the cache's bias ``[B, T]`` (what ``logits`` include) or ``None``, for the folds' fits.

    Returns:
        ``[B, t]`` in ``beta``'s dtype.
    """
    start, end = span
    dtype = logits.dtype
    v = values.to(dtype)
    ref = torch.softmax(logits, dim=-1) @ v  # [B, n, d_v]
    kept_raw = torch.gather(raw, 2, indices[:, None, :].expand(-1, raw.shape[1], -1))
    kept_v = torch.gather(v, 1, indices[..., None].expand(-1, -1, v.shape[-1]))
    v_c = torch.cat([v[:, :start], kept_v, v[:, end:]], dim=1)
    old = torch.zeros_like(beta) if old_beta is None else old_beta.to(beta.dtype)

    def error(bias: torch.Tensor, probes: torch.Tensor | slice = slice(None)) -> torch.Tensor:
        """Squared output error ``[B, n]`` of each of ``probes`` with ``bias`` on the kept rows."""
        s_c = torch.cat(
            [
                logits[:, probes, :start],
                kept_raw[:, probes] + bias.to(dtype)[:, None, :],
                logits[:, probes, end:],
            ],
            dim=2,
        )
        return ((torch.softmax(s_c, dim=-1) @ v_c - ref[:, probes]) ** 2).sum(-1)

    old_error = error(old)  # per probe: every fold is judged against its share of it
    ok = error(beta).sum(-1) < old_error.sum(-1)
    probe = torch.arange(logits.shape[1], device=logits.device)
    for k in range(min(CV_FOLDS, len(probe))):
        judge_on, fit_on = probe[probe % CV_FOLDS == k], probe[probe % CV_FOLDS != k]
        fold_beta = beta_from_logits(logits[:, fit_on], span, indices, key_bias).to(beta.dtype)
        ok = ok & (error(fold_beta, judge_on).sum(-1) < old_error[:, judge_on].sum(-1))
    return torch.where(ok[:, None], beta, old)
