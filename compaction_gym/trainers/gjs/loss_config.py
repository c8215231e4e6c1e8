"""Settings of the top-K generalized Jensen–Shannon loss, and the name of what they compute."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

from compaction_gym.errors import InvalidArgumentError

Support = Literal["teacher", "student", "union"]

#: Valid values of ``support``: whose top-K tokens form the support at each position.
SUPPORTS: tuple[str, ...] = ("teacher", "student", "union")

#: Every value :func:`divergence_mode` can return.
DIVERGENCE_MODES: tuple[str, ...] = (
    "topk_gjs",
    "topk_gjs_normalized",
    "kl_teacher_student",
    "kl_student_teacher",
)


@dataclass(frozen=True)
class GJSLossConfig:
    """Settings of :func:`~compaction_gym.trainers.gjs.topk_gjs` and its list forms.

    Args:
        k: number of top tokens per position taken from each side that defines the support (≥ 1).
        alpha: GJS weight α ∈ [0, 1]; the mixture is ``M = α·T + (1−α)·S`` (TRL's GKD ``beta``).
            ``0`` computes KL(T‖S) (forward KL) and ``1`` computes KL(S‖T) (reverse KL).
        support: ``"teacher"``, ``"student"`` or ``"union"`` (both top-K sets, deduplicated).
        tail: add one bucket holding the mass outside the support (``True``), or renormalise both
            distributions over the support (``False``).
        normalize: divide the divergence by α(1−α) for 0 < α < 1 (continuous in α; tends to the
            endpoint KLs). Endpoints are unaffected.

    Raises:
        InvalidArgumentError: a field is out of range or of the wrong type; the message lists the
            valid values.

    Example:
        >>> cfg = GJSLossConfig(k=20, alpha=0.5, support="union")
        >>> divergence_mode(cfg)
        'topk_gjs'
    """

    k: int = 20
    alpha: float = 0.5
    support: Support = "teacher"
    tail: bool = True
    normalize: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise InvalidArgumentError(f"k must be an int >= 1 (tokens per position), got {self.k!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, int | float):
            raise InvalidArgumentError(f"alpha must be a float in [0, 1], got {self.alpha!r}")
        if not (math.isfinite(self.alpha) and 0.0 <= self.alpha <= 1.0):
            raise InvalidArgumentError(
                f"alpha must be in [0, 1] (0: KL(teacher||student), 1: KL(student||teacher)), got {self.alpha!r}"
            )
        object.__setattr__(self, "alpha", float(self.alpha))
        if self.support not in SUPPORTS:
            raise InvalidArgumentError(f"support must be one of {list(SUPPORTS)}, got {self.support!r}")
        for name in ("tail", "normalize"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(f"{name} must be True or False, got {getattr(self, name)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The fields as keyword arguments of :func:`~compaction_gym.trainers.gjs.topk_gjs`."""
        return asdict(self)


def divergence_mode(config: GJSLossConfig) -> str:
    """Name what :func:`~compaction_gym.trainers.gjs.topk_gjs` really computes under ``config``.

    Log this string next to the loss: it is derived from the same fields that select the
    computation, so it cannot claim GJS while something else ran.

    Args:
        config: the loss settings.

    Returns:
        ``"kl_teacher_student"`` (α = 0), ``"kl_student_teacher"`` (α = 1), ``"topk_gjs_normalized"``
        (0 < α < 1 with ``normalize``) or ``"topk_gjs"``; one of :data:`DIVERGENCE_MODES`.

    Raises:
        InvalidArgumentError: ``config`` is not a :class:`GJSLossConfig`.

    Example:
        >>> divergence_mode(GJSLossConfig(alpha=0.0))
        'kl_teacher_student'
    """
    if not isinstance(config, GJSLossConfig):
        raise InvalidArgumentError(f"config must be a GJSLossConfig, got {type(config).__name__}")
    if config.alpha == 0.0:
        return "kl_teacher_student"
    if config.alpha == 1.0:
        return "kl_student_teacher"
    return "topk_gjs_normalized" if config.normalize else "topk_gjs"
