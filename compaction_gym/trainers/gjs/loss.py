"""Top-K generalized Jensen–Shannon divergence between a teacher and a student, per token.

Three entry points share one core (:func:`_divergence_on_support`):

* :func:`topk_gjs` — both sides as full-vocabulary log-probs ``[..., V]``;
* :func:`topk_gjs_from_lists` — both sides as top-K lists (token ids + log-probs), as inference
  servers return them;
* :func:`topk_gjs_from_teacher_topk` — the trainer's case: the teacher as a cached top-K list, the
  student as full-vocabulary log-probs from the training forward pass.

Inside, a distribution over the support is a tensor of log-probs in which ``-inf`` means "no mass
in this bucket" (a padding slot, a duplicate in a union, or a token missing from a side's list).
See ``docs/gjs.md`` for the math and conventions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.gjs._inputs import (
    NEG_INF,
    as_list,
    check_full,
    check_support,
    compute_dtype,
    full_topk,
    list_topk,
    lookup,
    mask,
    support_from_tops,
)
from compaction_gym.trainers.gjs.loss_config import GJSLossConfig

# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------


def topk_gjs(
    student_logprobs: Tensor,
    teacher_logprobs: Tensor,
    *,
    k: int,
    alpha: float,
    support: str = "teacher",
    tail: bool = True,
    normalize: bool = False,
) -> Tensor:
    """Per-token top-K generalized Jensen–Shannon divergence GJS_α(T‖S) from full-vocabulary log-probs.

    GJS_α = α·KL(T‖M) + (1−α)·KL(S‖M) with M = α·T + (1−α)·S, evaluated on the buckets
    "each support token" plus, with ``tail=True``, one bucket holding the mass outside the support,
    ``log(1 − Σ_K p)``. With ``tail=False`` both sides are renormalised over the support instead.
    α = 0 gives KL(T‖S) and α = 1 gives KL(S‖T) (TRL's GKD convention); ``normalize`` divides by
    α(1−α) for 0 < α < 1. The result is differentiable w.r.t. both inputs; detach the teacher yourself.

    Args:
        student_logprobs: student log-probabilities ``[..., V]`` (normalised, e.g. ``log_softmax``).
        teacher_logprobs: teacher log-probabilities, same shape as ``student_logprobs``.
        k: top tokens per position taken from the side(s) that define the support; ``1 ≤ k ≤ V``.
        alpha: α ∈ [0, 1], the teacher's weight in the mixture.
        support: ``"teacher"``, ``"student"`` or ``"union"`` (both top-K sets, deduplicated).
        tail: add the tail bucket (``True``) or renormalise over the support (``False``).
        normalize: divide by α(1−α) when 0 < α < 1.

    Returns:
        The divergence per position, shape ``[...]`` (the inputs without their last dim), in float32
        (float64 if an input is float64). Always ≥ 0; ``+inf`` only for a KL endpoint whose second
        argument gives zero probability to a bucket that the first one fills.

    Raises:
        InvalidArgumentError: bad settings (message lists valid values), shapes that differ,
            ``k > V``, non-floating inputs, NaN/+inf on the support, or listed probabilities that sum
            to more than 1 (logits passed instead of log-probs).

    Example:
        >>> s = torch.randn(2, 7, 50).log_softmax(-1)
        >>> t = torch.randn(2, 7, 50).log_softmax(-1)
        >>> topk_gjs(s, t, k=8, alpha=0.5, support="union").shape
        torch.Size([2, 7])
    """
    cfg = GJSLossConfig(k=k, alpha=alpha, support=support, tail=tail, normalize=normalize)  # type: ignore[arg-type]
    check_full(student_logprobs, "student_logprobs")
    check_full(teacher_logprobs, "teacher_logprobs")
    if student_logprobs.shape != teacher_logprobs.shape:
        raise InvalidArgumentError(
            f"student_logprobs and teacher_logprobs must have the same shape, "
            f"got {tuple(student_logprobs.shape)} and {tuple(teacher_logprobs.shape)}"
        )
    if student_logprobs.device != teacher_logprobs.device:
        raise InvalidArgumentError(
            f"student_logprobs and teacher_logprobs must be on one device, "
            f"got {student_logprobs.device} and {teacher_logprobs.device}"
        )
    vocab = student_logprobs.shape[-1]
    if cfg.k > vocab:
        raise InvalidArgumentError(f"k must be <= the vocabulary size {vocab} (last dim), got k={cfg.k}")

    ids, valid = support_from_tops(
        cfg.support,
        teacher=lambda: full_topk(teacher_logprobs, cfg.k),
        student=lambda: full_topk(student_logprobs, cfg.k),
    )
    dtype = compute_dtype(student_logprobs.dtype, teacher_logprobs.dtype)
    safe = ids.clamp_min(0)
    t_sup = mask(teacher_logprobs.gather(-1, safe).to(dtype), valid)
    s_sup = mask(student_logprobs.gather(-1, safe).to(dtype), valid)
    return _divergence_on_support(t_sup, s_sup, cfg, names=("teacher_logprobs", "student_logprobs"))


def topk_gjs_from_lists(
    student_topk_ids: Tensor | Sequence[Sequence[int]],
    student_topk_logprobs: Tensor | Sequence[Sequence[float]],
    teacher_topk_ids: Tensor | Sequence[Sequence[int]],
    teacher_topk_logprobs: Tensor | Sequence[Sequence[float]],
    *,
    k: int,
    alpha: float,
    support: str = "teacher",
    tail: bool = True,
    normalize: bool = False,
) -> Tensor:
    """Per-token top-K GJS from top-K lists (token ids + log-probs per position), as servers return them.

    Same math as :func:`topk_gjs`. Each side's support contribution is its ``min(k, listed)``
    most likely listed tokens. A support token that is **missing from a side's list** gets zero
    probability on that side, and its (unknown) mass counts in that side's tail bucket, which is
    ``1 − Σ`` (that side's listed probabilities of the support tokens). With ``tail=False`` the side
    is renormalised over the support tokens it lists; a side that lists none of them is treated as
    having all its mass outside the support (disjoint from the other side). When every support
    token is listed by both sides, the result equals :func:`topk_gjs` on the full distributions.

    Args:
        student_topk_ids: student token ids, an int tensor ``[..., Ks]`` or a python list of
            per-position lists (ragged allowed). Ids ``< 0`` are padding.
        student_topk_logprobs: the matching log-probs, a float tensor of the same shape or lists.
        teacher_topk_ids: teacher token ids ``[..., Kt]`` (same leading dims as the student's).
        teacher_topk_logprobs: the matching teacher log-probs.
        k: tokens per position taken from each list that defines the support (≥ 1).
        alpha: α ∈ [0, 1]; see :func:`topk_gjs`.
        support: ``"teacher"``, ``"student"`` or ``"union"``.
        tail: tail bucket (``True``) or renormalised support (``False``).
        normalize: divide by α(1−α) when 0 < α < 1.

    Returns:
        The divergence per position, shape ``[...]`` (``[N]`` for python lists). Python lists are
        computed in float64; tensors as in :func:`topk_gjs`. Differentiable w.r.t. float tensors.

    Raises:
        InvalidArgumentError: bad settings, mismatched shapes or leading dims, non-integer ids,
            NaN/+inf log-probs, or listed probabilities summing to more than 1.

    Example:
        >>> topk_gjs_from_lists([[5, 2]], [[-0.1, -2.5]], [[2, 5]], [[-0.3, -1.5]], k=2, alpha=0.5)
        tensor([0.2649], dtype=torch.float64)
    """
    cfg = GJSLossConfig(k=k, alpha=alpha, support=support, tail=tail, normalize=normalize)  # type: ignore[arg-type]
    s_ids, s_lp = as_list(student_topk_ids, student_topk_logprobs, "student_topk")
    t_ids, t_lp = as_list(teacher_topk_ids, teacher_topk_logprobs, "teacher_topk")
    if s_ids.shape[:-1] != t_ids.shape[:-1]:
        raise InvalidArgumentError(
            f"student and teacher top-K lists must cover the same positions: leading dims "
            f"{tuple(s_ids.shape[:-1])} vs {tuple(t_ids.shape[:-1])}"
        )
    if s_lp.device != t_lp.device:
        raise InvalidArgumentError(
            f"student and teacher lists must be on one device, got {s_lp.device} and {t_lp.device}"
        )
    ids, valid = support_from_tops(
        cfg.support,
        teacher=lambda: list_topk(t_ids, t_lp, cfg.k),
        student=lambda: list_topk(s_ids, s_lp, cfg.k),
    )
    dtype = compute_dtype(s_lp.dtype, t_lp.dtype)
    t_sup = lookup(ids, valid, t_ids, t_lp).to(dtype)
    s_sup = lookup(ids, valid, s_ids, s_lp).to(dtype)
    return _divergence_on_support(t_sup, s_sup, cfg, names=("teacher_topk_logprobs", "student_topk_logprobs"))


def topk_gjs_from_teacher_topk(
    student_logprobs: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    *,
    k: int,
    alpha: float,
    support: str = "teacher",
    tail: bool = True,
    normalize: bool = False,
) -> Tensor:
    """Per-token top-K GJS with the teacher as a top-K list and the student as full log-probs.

    The trainer's path: teacher top-K lists are computed once per batch (no grad) and cached, the
    student's full-vocabulary log-probs come from the training forward. Equivalent to
    :func:`topk_gjs_from_lists` with the student's list being the whole vocabulary, so the student
    side is always exact and only the teacher can miss support tokens (``support="student"`` or
    ``"union"``): their teacher mass goes to the teacher's tail bucket.

    Args:
        student_logprobs: student log-probs ``[..., V]``.
        teacher_topk_ids: teacher token ids ``[..., Kt]`` (int, ``< V``; ``< 0`` is padding).
        teacher_topk_logprobs: teacher log-probs ``[..., Kt]``.
        k: tokens per position taken from each side that defines the support (``k ≤ V``).
        alpha: α ∈ [0, 1]; see :func:`topk_gjs`.
        support: ``"teacher"``, ``"student"`` or ``"union"``.
        tail: tail bucket (``True``) or renormalised support (``False``).
        normalize: divide by α(1−α) when 0 < α < 1.

    Returns:
        The divergence per position, shape ``[...]``.

    Raises:
        InvalidArgumentError: as :func:`topk_gjs_from_lists`, plus teacher ids ``>= V``.

    Example:
        >>> s = torch.randn(3, 50).log_softmax(-1)
        >>> top = torch.randn(3, 50).log_softmax(-1).topk(8)
        >>> topk_gjs_from_teacher_topk(s, top.indices, top.values, k=8, alpha=0.5).shape
        torch.Size([3])
    """
    cfg = GJSLossConfig(k=k, alpha=alpha, support=support, tail=tail, normalize=normalize)  # type: ignore[arg-type]
    check_full(student_logprobs, "student_logprobs")
    t_ids, t_lp = as_list(teacher_topk_ids, teacher_topk_logprobs, "teacher_topk")
    vocab = student_logprobs.shape[-1]
    if t_ids.shape[:-1] != student_logprobs.shape[:-1]:
        raise InvalidArgumentError(
            f"teacher_topk_ids must have the leading dims of student_logprobs "
            f"{tuple(student_logprobs.shape[:-1])}, got {tuple(t_ids.shape[:-1])}"
        )
    if t_ids.device != student_logprobs.device:
        raise InvalidArgumentError(
            f"teacher top-K and student_logprobs must be on one device, got {t_ids.device} and {student_logprobs.device}"
        )
    if cfg.k > vocab:
        raise InvalidArgumentError(f"k must be <= the vocabulary size {vocab} (last dim), got k={cfg.k}")
    if t_ids.numel() and bool((t_ids >= vocab).any()):
        raise InvalidArgumentError(
            f"teacher_topk_ids has ids >= the vocabulary size {vocab} of student_logprobs"
        )
    ids, valid = support_from_tops(
        cfg.support,
        teacher=lambda: list_topk(t_ids, t_lp, cfg.k),
        student=lambda: full_topk(student_logprobs, cfg.k),
    )
    dtype = compute_dtype(student_logprobs.dtype, t_lp.dtype)
    t_sup = lookup(ids, valid, t_ids, t_lp).to(dtype)
    s_sup = mask(student_logprobs.gather(-1, ids.clamp_min(0)).to(dtype), valid)
    return _divergence_on_support(t_sup, s_sup, cfg, names=("teacher_topk_logprobs", "student_logprobs"))


# ----------------------------------------------------------------------------------------------
# The math on a fixed support
# ----------------------------------------------------------------------------------------------


def _divergence_on_support(
    t_sup: Tensor, s_sup: Tensor, cfg: GJSLossConfig, *, names: tuple[str, str]
) -> Tensor:
    """GJS on support log-probs ``[..., M]`` (``-inf`` = no mass), plus the tail or renormalisation."""
    t_lse = _masked_logsumexp(t_sup)
    s_lse = _masked_logsumexp(s_sup)
    check_support(t_sup, t_lse, names[0])
    check_support(s_sup, s_lse, names[1])
    eps = torch.finfo(t_sup.dtype).eps
    t_buckets = _buckets(t_sup, t_lse, cfg.tail, eps)
    s_buckets = _buckets(s_sup, s_lse, cfg.tail, eps)
    # Rounding can leave a tiny negative value where the distributions agree; the divergence is >= 0.
    return _gjs(t_buckets, s_buckets, cfg.alpha, cfg.normalize).clamp_min(0.0)


def _buckets(sup: Tensor, lse: Tensor, tail: bool, eps: float) -> Tensor:
    """Append the last bucket: the tail mass, or (renormalised) the mass of a side absent from the support."""
    if tail:
        # log(1 - exp(lse)), stable via expm1; the tail is floored at eps (machine precision of the
        # dtype): below it, 1 - sum_K p is rounding noise, and the floor keeps the log finite.
        last = torch.log(-torch.expm1(lse.clamp(max=math.log1p(-eps))))
        return torch.cat([sup, last.unsqueeze(-1)], dim=-1)
    has_mass = lse > NEG_INF
    body = sup - torch.where(has_mass, lse, torch.zeros_like(lse)).unsqueeze(-1)
    # A side with no mass on the support has all of it elsewhere: one bucket the other side lacks.
    last = torch.where(has_mass, torch.full_like(lse, NEG_INF), torch.zeros_like(lse))
    return torch.cat([body, last.unsqueeze(-1)], dim=-1)


def _gjs(t: Tensor, s: Tensor, alpha: float, normalize: bool) -> Tensor:
    """GJS_α over the last dim of bucket log-probs; α = 0 / 1 are KL(T‖S) / KL(S‖T) (TRL's GKD)."""
    if alpha == 0.0:
        return _kl(t, s)
    if alpha == 1.0:
        return _kl(s, t)
    # Buckets empty on both sides are fed zeros so that logaddexp's backward stays finite.
    both_empty = (t == NEG_INF) & (s == NEG_INF)
    zero = torch.zeros_like(t)
    log_m = torch.logaddexp(
        torch.where(both_empty, zero, t) + math.log(alpha),
        torch.where(both_empty, zero, s) + math.log1p(-alpha),
    )
    div = alpha * _kl(t, log_m) + (1.0 - alpha) * _kl(s, log_m)
    return div / (alpha * (1.0 - alpha)) if normalize else div


def _kl(p: Tensor, q: Tensor) -> Tensor:
    """Σ exp(p)·(p − q) over the last dim with 0·log 0 = 0 (empty buckets of ``p`` contribute nothing)."""
    present = p > NEG_INF
    zero = torch.zeros_like(p)
    p_safe = torch.where(present, p, zero)
    q_safe = torch.where(present, q, zero)
    return torch.where(present, p_safe.exp() * (p_safe - q_safe), zero).sum(-1)


def _masked_logsumexp(x: Tensor) -> Tensor:
    """logsumexp over the last dim; ``-inf`` (with a finite gradient) for rows that are all ``-inf``."""
    has_any = (x > NEG_INF).any(-1)
    lse = torch.logsumexp(torch.where(has_any.unsqueeze(-1), x, torch.zeros_like(x)), dim=-1)
    return torch.where(has_any, lse, torch.full_like(lse, NEG_INF))
