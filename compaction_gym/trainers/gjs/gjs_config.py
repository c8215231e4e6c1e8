"""``GJSDistillationConfig``: :class:`CompactionGRPOConfig` plus the top-K GJS self-distillation settings.

Kept apart from :mod:`compaction_gym.trainers.gjs.loss_config` so that the loss stays importable without trl.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.gjs.loss_config import SUPPORTS, GJSLossConfig
from compaction_gym.trainers.grpo.grpo_config import CompactionGRPOConfig

logger = logging.getLogger(__name__)

TEACHER_KINDS = ("policy", "ema")
TEACHER_SCORINGS = ("generation", "loss")
TEACHER_CONTEXTS = ("success_or_feedback", "success", "feedback", "success_and_feedback")
IS_LEVELS = ("token", "sequence")
IS_BEHAVIORS = ("trainer", "sampler")

# SDPO's reprompt texts (trl.experimental.sdpo.SDPOConfig, TRL 1.16; placeholders renamed), so results compare.
REPROMPT_TEMPLATE = "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n"
SOLUTION_TEMPLATE = "\nCorrect solution:\n\n{solution}\n\n"
FEEDBACK_TEMPLATE = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback}\n\n"


@dataclass
class GJSDistillationConfig(CompactionGRPOConfig):
    """:class:`~compaction_gym.trainers.grpo.CompactionGRPOConfig` for the GJS distillation trainer.

    Environment, agent, compaction, replay and engine options are the GRPO trainer's (``env_id``,
    ``prompt_format``, ``max_turn_tokens``, ``compaction``, ``grad_through_compaction``, ...).

    The divergence (``gjs_*``) and its weight (``distillation_coef``) are separate settings;
    :attr:`gjs_loss_config` is the one :class:`GJSLossConfig` that both the loss and the logged
    ``distill/{divergence_mode}`` key are derived from. GRPO's ``beta`` stays the KL-to-reference
    coefficient of the (optional) policy term, unrelated to the GJS α.

    Example:
        >>> args = GJSDistillationConfig("runs/gjs", env_id="AttnMatch-Math-v0", prompt_format="raw",
        ...                              gjs_k=20, gjs_alpha=0.5, distillation_coef=1.0, num_generations=4)  # doctest: +SKIP
    """

    # -- the divergence ----------------------------------------------------------------------------
    gjs_k: int = field(default=20, metadata={"help": "Top tokens per position that define the GJS support."})
    gjs_alpha: float = field(
        default=0.5,
        metadata={
            "help": "GJS weight α in [0, 1] (mixture α·T + (1−α)·S; 0: KL(teacher||student), 1: KL(student||teacher))."
        },
    )
    gjs_support: str = field(
        default="teacher",
        metadata={"help": "Whose top-k forms the support.", "choices": list(SUPPORTS)},
    )
    gjs_tail: bool = field(
        default=True,
        metadata={"help": "Add a tail bucket for the mass outside the support (else renormalise)."},
    )
    gjs_normalize: bool = field(default=False, metadata={"help": "Divide the GJS by α(1−α) for 0 < α < 1."})

    # -- loss weights ------------------------------------------------------------------------------
    distillation_coef: float = field(default=1.0, metadata={"help": "Weight of the distillation term."})
    policy_loss_coef: float = field(
        default=0.0,
        metadata={"help": "Weight of TRL's GRPO surrogate on the same batch (0: pure self-distillation)."},
    )

    # -- the teacher -------------------------------------------------------------------------------
    teacher_kind: str = field(
        default="policy",
        metadata={
            "help": "'policy': the current weights; 'ema': an EMA copy of them.",
            "choices": list(TEACHER_KINDS),
        },
    )
    teacher_ema_rate: float = field(
        default=0.05,
        metadata={"help": "EMA teacher: fraction of the policy mixed in after each optimizer step."},
    )
    teacher_scoring: str = field(
        default="generation",
        metadata={
            "help": "'generation': cache the teacher's top-k per token when the batch is generated; 'loss': run "
            "the teacher at loss time with full logits (exact for every support, one more forward).",
            "choices": list(TEACHER_SCORINGS),
        },
    )
    teacher_cache_k: int | None = field(
        default=None,
        metadata={
            "help": "Width of the cached teacher lists (>= gjs_k; None: gjs_k). Larger: fewer misses for "
            "student/union supports."
        },
    )

    # -- the teacher's extra context -----------------------------------------------------------------
    teacher_context: str = field(
        default="success_or_feedback",
        metadata={
            "help": "What the teacher sees: a successful sibling's solution, env feedback, the solution else the "
            "feedback, or both.",
            "choices": list(TEACHER_CONTEXTS),
        },
    )
    success_reward_threshold: float | None = field(
        default=None,
        metadata={
            "help": "A rollout is a success when its total reward >= this (None: the trajectory's success)."
        },
    )
    exclude_self_demo: bool = field(
        default=True, metadata={"help": "Never show a rollout its own success as the demonstration."}
    )
    reprompt_template: str = field(
        default=REPROMPT_TEMPLATE,
        metadata={
            "help": "Teacher's message: {prompt} (the original), {solution} and {feedback} (rendered below)."
        },
    )
    solution_template: str = field(
        default=SOLUTION_TEMPLATE, metadata={"help": "How a successful sibling's text is shown ({solution})."}
    )
    feedback_template: str = field(
        default=FEEDBACK_TEMPLATE, metadata={"help": "How env feedback is shown ({feedback})."}
    )
    remove_thinking_from_demonstration: bool = field(
        default=False, metadata={"help": "Strip <think>…</think> blocks from the demonstration."}
    )
    max_teacher_context_tokens: int = field(
        default=2048,
        metadata={
            "help": "Cap on the tokens the solution/feedback add (their ends are kept); never truncates "
            "the completion."
        },
    )

    # -- importance sampling -----------------------------------------------------------------------
    distill_is_clip: float | None = field(
        default=2.0,
        metadata={"help": "Upper clip of the (detached) IS weight of the distillation term; None: off."},
    )
    distill_is_level: str = field(
        default="token",
        metadata={
            "help": "IS weight per token, or exp of the masked mean log-ratio per sequence.",
            "choices": list(IS_LEVELS),
        },
    )
    distill_is_behavior: str = field(
        default="trainer",
        metadata={
            "help": "Behaviour log-probs of the IS ratio: 'trainer' (exact full-vocabulary recompute when the batch "
            "was generated; ratio 1 when on-policy) or 'sampler' (the engine's exact sampled-token log-probs).",
            "choices": list(IS_BEHAVIORS),
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, valid in (
            ("gjs_support", SUPPORTS),
            ("teacher_kind", TEACHER_KINDS),
            ("teacher_scoring", TEACHER_SCORINGS),
            ("teacher_context", TEACHER_CONTEXTS),
            ("distill_is_level", IS_LEVELS),
            ("distill_is_behavior", IS_BEHAVIORS),
        ):
            if getattr(self, name) not in valid:
                raise InvalidArgumentError(
                    f"{name} must be one of {list(valid)}, got {getattr(self, name)!r}"
                )
        self.gjs_loss_config  # noqa: B018  (validates the gjs_* fields, with their names in the message)
        if self.teacher_cache_k is None:
            self.teacher_cache_k = self.gjs_k
        if self.teacher_cache_k < self.gjs_k:
            raise InvalidArgumentError(
                f"teacher_cache_k must be >= gjs_k ({self.gjs_k}), got {self.teacher_cache_k}"
            )
        for name in ("distillation_coef", "policy_loss_coef"):
            if getattr(self, name) < 0:
                raise InvalidArgumentError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.distillation_coef == 0 and self.policy_loss_coef == 0:
            raise InvalidArgumentError("distillation_coef and policy_loss_coef are both 0: nothing to train")
        if not 0 < self.teacher_ema_rate <= 1:
            raise InvalidArgumentError(f"teacher_ema_rate must be in (0, 1], got {self.teacher_ema_rate}")
        if self.distill_is_clip is not None and self.distill_is_clip <= 0:
            raise InvalidArgumentError(f"distill_is_clip must be > 0 or None, got {self.distill_is_clip}")
        if self.max_teacher_context_tokens < 1:
            raise InvalidArgumentError(
                f"max_teacher_context_tokens must be >= 1, got {self.max_teacher_context_tokens}"
            )
        for name in ("{prompt}", "{solution}", "{feedback}"):
            if name not in self.reprompt_template:
                raise InvalidArgumentError(
                    f"reprompt_template must contain {name}, got {self.reprompt_template!r}"
                )
        if self.gjs_alpha == 1.0 and self.gjs_support != "teacher" and self.teacher_scoring == "generation":
            logger.warning(
                "gjs_alpha=1 (KL(student||teacher)) with support=%r and cached teacher lists is +inf wherever the "
                "student's top-k token is missing from the teacher's list; use teacher_scoring='loss' or raise "
                "teacher_cache_k",
                self.gjs_support,
            )

    @property
    def gjs_loss_config(self) -> GJSLossConfig:
        """The :class:`GJSLossConfig` of the ``gjs_*`` fields (what the loss computes and the log key names)."""
        try:
            return GJSLossConfig(
                k=self.gjs_k,
                alpha=self.gjs_alpha,
                support=self.gjs_support,  # type: ignore[arg-type]
                tail=self.gjs_tail,
                normalize=self.gjs_normalize,
            )
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"gjs_{exc}") from exc
