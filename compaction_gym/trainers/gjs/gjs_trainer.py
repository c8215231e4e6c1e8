"""``GJSDistillationTrainer``: on-policy top-K GJS self-distillation from env rollouts (SDPO-style).

The student is the policy on its own rollout; the teacher is the same policy (or an EMA of it) reading
the same tokens with extra context in its prompt — a successful sibling rollout of the same episode
and/or the env's feedback (:mod:`compaction_gym.trainers.gjs.teacher`). Per completion token the loss
is ``w · GJS_α(teacher ‖ student)`` over a top-K support (:func:`topk_gjs_from_teacher_topk`), with
``w`` the detached importance weight ``exp(new − behaviour)`` of *exact* sampled-token log-probs.

Rollouts, compaction replay and the GRPO surrogate come from
:class:`~compaction_gym.trainers.grpo.CompactionGRPOTrainer`: episodes are played by compacted agent
sessions on the policy's own weights, and every student log-prob (old, new, reference) replays each
episode's compaction events, so the student is scored on the cache it acted under.

Rules this file keeps (the seed broke each one, see ``docs/gjs.md``):

* there is no scalar-KL path: the top-K GJS runs from the first optimisation step on;
* sampled-token log-probs come from a full-vocabulary ``log_softmax`` gather (or the engine's exact
  sampling log-probs); top-K lists are used only inside the divergence;
* the metric key ``distill/{divergence_mode(cfg)}`` comes from the same ``cfg`` the loss receives;
* ``distillation_coef`` (weight) and ``gjs_alpha`` (shape) are separate settings.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import Tensor
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import pad

from compaction_gym.agents.chat import ChatFormat
from compaction_gym.agents.trajectory import Trajectory
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.gjs.gjs_config import GJSDistillationConfig
from compaction_gym.trainers.gjs.loss import topk_gjs, topk_gjs_from_teacher_topk
from compaction_gym.trainers.gjs.loss_config import GJSLossConfig, divergence_mode
from compaction_gym.trainers.gjs.teacher import (
    FeedbackFunc,
    choose_contexts,
    clone_model,
    default_feedback,
    demonstration_text,
    is_success,
    strip_thinking,
    teacher_prompt_ids,
)
from compaction_gym.trainers.grpo.grpo_trainer import CompactionGRPOTrainer
from compaction_gym.trainers.rollouts import completion_start

logger = logging.getLogger(__name__)

#: The EMA teacher's weights inside a checkpoint folder (restored by ``resume_from_checkpoint``).
TEACHER_CHECKPOINT_NAME = "ema_teacher.safetensors"


@dataclass
class DistillationStats:
    """The last micro-batch's distillation tensors (detached), for diagnostics and tests; all ``[B, C]``."""

    new_logps: Tensor
    behavior_logps: Tensor
    is_ratio: Tensor
    divergence: Tensor
    mask: Tensor
    divergence_mode: str


class TeacherEMACallback(SyncRefModelCallback):
    """After each optimizer step: ``teacher ← (1 − rate)·teacher + rate·policy``."""

    def __init__(self, teacher: torch.nn.Module, rate: float, accelerator: Any) -> None:
        super().__init__(teacher, accelerator)
        self.rate = rate

    def on_step_end(self, args, state, control, **kwargs):
        # Override: the base class mixes on ref_model_sync_steps with ref_model_mixup_alpha (the reference
        # model's settings); the teacher has its own rate and moves every step.
        model = kwargs["model"]
        if self.accelerator is not None:
            model = self.accelerator.unwrap_model(model)
        self.sync_target_model(model, self.ref_model, self.rate)


class GJSDistillationTrainer(CompactionGRPOTrainer):
    """On-policy top-K GJS self-distillation (a :class:`~compaction_gym.trainers.grpo.CompactionGRPOTrainer`).

    Args:
        model: model id/path or ``PreTrainedModel`` (the policy; also the teacher unless ``teacher_kind="ema"``).
        args: a :class:`GJSDistillationConfig`.
        feedback_func: ``feedback(trajectory) -> str | None``, the env feedback shown to the teacher
            (default :func:`~compaction_gym.trainers.gjs.teacher.default_feedback`).
        **kwargs: as :class:`~compaction_gym.trainers.grpo.CompactionGRPOTrainer` (``env``, ``reward_funcs``,
            ``train_dataset``, ``processing_class``, ``callbacks``, ...). Rewards feed the optional GRPO term,
            the logs and, with ``success_reward_threshold``, the choice of demonstrations.

    Attributes:
        gjs_config: the :class:`GJSLossConfig` the loss is computed with.
        divergence_mode: ``divergence_mode(gjs_config)``; metrics are logged under ``distill/{divergence_mode}``.
        teacher_model: the EMA teacher (``None``: the policy itself is the teacher).
        last_distillation: :class:`DistillationStats` of the last micro-batch.

    Example:
        >>> args = GJSDistillationConfig("runs/gjs", env_id="AttnMatch-Math-v0", prompt_format="raw",
        ...                              num_generations=4, max_turn_tokens=256)  # doctest: +SKIP
        >>> GJSDistillationTrainer("path/to/model", args).train()  # doctest: +SKIP
    """

    _tag_names = ["trl", "gjs", "self-distillation", "compaction-gym"]

    def __init__(
        self,
        model: Any,
        args: GJSDistillationConfig | None = None,
        *,
        feedback_func: FeedbackFunc | None = None,
        **kwargs: Any,
    ) -> None:
        if args is None:
            args = GJSDistillationConfig("gjs-distillation")
        if not isinstance(args, GJSDistillationConfig):
            raise InvalidArgumentError(f"args must be a GJSDistillationConfig, got {type(args).__name__}")
        self.feedback_func = feedback_func or default_feedback
        self._reuse: tuple[Tensor, Tensor] | None = None
        self._accepts_logits_to_keep: dict[type, bool] = {}
        super().__init__(model, args, **kwargs)
        self.gjs_config: GJSLossConfig = args.gjs_loss_config
        self.divergence_mode: str = divergence_mode(self.gjs_config)
        self.chat = ChatFormat(
            self._tokenizer, system_prompt=args.system_prompt, template_kwargs=args.chat_template_kwargs
        )
        self.teacher_model: torch.nn.Module | None = None
        if args.teacher_kind == "ema":
            self.teacher_model = clone_model(self.accelerator.unwrap_model(self.model))
            self.add_callback(TeacherEMACallback(self.teacher_model, args.teacher_ema_rate, self.accelerator))
        self.last_distillation: DistillationStats | None = None

    # ------------------------------------------------------------------ checkpoints
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Override: the EMA teacher is training state (not the model): save it beside the optimizer, so
        # that resume_from_checkpoint restores it rather than restarting it from the policy.
        super()._save_optimizer_and_scheduler(output_dir)
        if self.teacher_model is not None and self.args.should_save:
            from safetensors.torch import save_file

            state = {k: v.detach().contiguous().cpu() for k, v in self.teacher_model.state_dict().items()}
            save_file(state, os.path.join(output_dir, TEACHER_CHECKPOINT_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # Override: restore the EMA teacher saved by _save_optimizer_and_scheduler.
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.teacher_model is None:
            return
        path = os.path.join(checkpoint, TEACHER_CHECKPOINT_NAME)
        if not os.path.isfile(path):
            logger.warning(
                "%s has no %s: the EMA teacher restarts from the resumed policy's weights",
                checkpoint,
                TEACHER_CHECKPOINT_NAME,
            )
            self.teacher_model.load_state_dict(self.accelerator.unwrap_model(self.model).state_dict())
            return
        from safetensors.torch import load_file

        self.teacher_model.load_state_dict(load_file(path, device=str(next(self.teacher_model.parameters()).device)))

    # ------------------------------------------------------------------ the teacher's batch
    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        # Override: after the rollouts are scored, build each sample's teacher context and score the teacher
        # once for the whole generation batch (cached top-K lists, or its inputs for loss-time scoring).
        output = super()._generate_and_score_completions(inputs)
        output.update(self._teacher_batch(output, output["trajectories"]))
        return output

    def _teacher_batch(self, output: dict[str, Any], trajectories: list[Trajectory]) -> dict[str, Tensor]:
        """Teacher contexts (mined over all processes), teacher inputs and — scoring at generation — top-K lists."""
        args, device = self.args, self.accelerator.device
        mode = "train" if self.model.training else "eval"
        group = self.num_generations if mode == "train" else self.num_generations_eval
        local_success = [is_success(t, args.success_reward_threshold) for t in trajectories]
        local_demo = [self._demonstration(t) if ok else "" for t, ok in zip(trajectories, local_success)]
        local_feedback = [self.feedback_func(t) for t in trajectories]
        all_success, all_demo = gather_object(local_success), gather_object(local_demo)
        start = self.accelerator.process_index * len(trajectories)
        choices = choose_contexts(
            all_success,
            gather_object(local_feedback),
            num_generations=group,
            mode=args.teacher_context,
            exclude_self=args.exclude_self_demo,
            indices=range(start, start + len(trajectories)),
        )
        active = []
        teacher_prompts = []
        for b, (traj, choice) in enumerate(zip(trajectories, choices)):
            # An episode with no token after its prompt has its last prompt token as "completion": skip it.
            use = choice.active and completion_start(traj) == traj.prompt_len
            if use:
                demo = all_demo[choice.demo] if choice.demo is not None else None
                ids = teacher_prompt_ids(traj, self.chat, solution=demo, feedback=choice.feedback, args=args)
            else:  # no context: the student's own prompt (the row is masked out of the loss)
                ids = output["prompt_ids"][b][output["prompt_mask"][b].bool()].tolist()
            active.append(float(use))
            teacher_prompts.append(torch.tensor(ids, dtype=torch.long))
        t_prompt = pad(teacher_prompts, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(
            device
        )
        t_mask = pad([torch.ones_like(t) for t in teacher_prompts], padding_value=0, padding_side="left").to(
            device
        )
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        batch = {
            "teacher_input_ids": torch.cat([t_prompt, completion_ids], dim=1),
            "teacher_attention_mask": torch.cat([t_mask, completion_mask], dim=1),
            "distill_mask": torch.tensor(active, device=device),
        }
        stats = [
            sum(active),
            sum(c.demo is not None for c in choices),
            sum(c.feedback is not None for c in choices),
        ]
        if args.teacher_scoring == "generation":
            ids, lps = self._teacher_topk(batch, completion_ids.size(1))
            batch["teacher_topk_ids"], batch["teacher_topk_logprobs"] = ids, lps
            token_mask = completion_mask * output.get("tool_mask", 1) * batch["distill_mask"][:, None]
            tail = (-torch.expm1(torch.logsumexp(lps, dim=-1))).clamp(min=0).nan_to_num(0.0)
            stats += [(tail * token_mask).sum().item(), token_mask.sum().item()]
        totals = self.accelerator.reduce(
            torch.tensor(stats, dtype=torch.float32, device=device), reduction="sum"
        )
        n = len(all_success)
        m = self._metrics[mode]
        m["distill/context_fraction"].append(totals[0].item() / n)
        m["distill/success_fraction"].append(totals[1].item() / n)
        m["distill/feedback_fraction"].append(totals[2].item() / n)
        if args.teacher_scoring == "generation" and totals[4] > 0:
            m["distill/teacher_tail_mass"].append((totals[3] / totals[4]).item())
        return batch

    def _demonstration(self, traj: Trajectory) -> str:
        text = demonstration_text(traj)
        return strip_thinking(text) if self.args.remove_thinking_from_demonstration else text

    def _teacher_topk(self, batch: dict[str, Tensor], completion_len: int) -> tuple[Tensor, Tensor]:
        """The teacher's top-``teacher_cache_k`` log-probs per completion token, ``[B, C, Kc]`` (no grad).

        Rows without a context are not scored (ids ``-1``, log-probs ``-inf``: empty list slots).
        """
        ids_in, mask_in = batch["teacher_input_ids"], batch["teacher_attention_mask"]
        kc = int(self.args.teacher_cache_k)
        shape = (ids_in.size(0), completion_len, kc)
        out_ids = torch.full(shape, -1, dtype=torch.long, device=ids_in.device)
        out_lps = torch.full(shape, float("-inf"), device=ids_in.device)
        rows = batch["distill_mask"].nonzero().flatten()
        for chunk in rows.split(self.args.per_device_train_batch_size):
            top = self._teacher_logprobs(ids_in[chunk], mask_in[chunk], completion_len).topk(kc, dim=-1)
            out_ids[chunk], out_lps[chunk] = top.indices, top.values
        return out_ids, out_lps

    @torch.no_grad()
    def _teacher_logprobs(self, input_ids: Tensor, attention_mask: Tensor, completion_len: int) -> Tensor:
        """Full teacher log-probs ``[b, C, V]`` (float32) at the completion positions.

        The teacher reads the *uncompacted* history with its privileged context: the better-informed
        distribution the student should match (one plain forward; no replay).
        """
        teacher = self.teacher_model if self.teacher_model is not None else self.model
        with disable_gradient_checkpointing(
            self.accelerator.unwrap_model(self.model), self.args.gradient_checkpointing_kwargs
        ):
            logits = self._plain_logits(teacher, input_ids, attention_mask, completion_len)
        return logits.float().log_softmax(-1)

    def _plain_logits(
        self, model: Any, input_ids: Tensor, attention_mask: Tensor, logits_to_keep: int
    ) -> Tensor:
        """One forward over full sequences; logits / temperature predicting the last ``C`` tokens."""
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "use_cache": False,
        }
        if self._takes_logits_to_keep(model):
            kwargs["logits_to_keep"] = logits_to_keep + 1
        with self.accelerator.autocast():
            logits = model(**kwargs).logits
        return logits[:, -(logits_to_keep + 1) : -1, :] / self.temperature

    def _takes_logits_to_keep(self, model: Any) -> bool:
        base = self.accelerator.unwrap_model(model)
        cls = type(base.get_base_model() if hasattr(base, "get_base_model") else base)
        if cls not in self._accepts_logits_to_keep:
            self._accepts_logits_to_keep[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
        return self._accepts_logits_to_keep[cls]

    # ------------------------------------------------------------------ the loss
    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
    ):
        # Override: inside _compute_loss the GRPO term reuses the student's replayed forward (exact
        # log_softmax gathers of the distillation logits) instead of replaying a second time.
        if self._reuse is not None:
            logps, entropies = self._reuse
            return logps, entropies if kwargs.get("compute_entropy") else None, None
        return super()._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, logits_to_keep, *args, **kwargs
        )

    def _compute_loss(self, model, inputs):
        # Override: the distillation term needs the student's full distribution at every completion token
        # (the parent scores sampled tokens only, through TRL's fused head); the GRPO surrogate is added
        # on the same forward when policy_loss_coef > 0.
        args, cfg = self.args, self.gjs_config
        mode = "train" if self.model.training else "eval"
        completion_ids = inputs["completion_ids"]
        c = completion_ids.size(1)
        input_ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logits = self._completion_logits(model, input_ids, attention_mask, c, batch=inputs)  # replayed
        logprobs = logits.float().log_softmax(-1)
        new = logprobs.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
        token_mask = inputs["completion_mask"] * inputs.get("tool_mask", 1)
        has_context = inputs["distill_mask"] > 0
        mask = token_mask * has_context[:, None]

        div = self._divergence(logprobs, inputs, has_context, cfg)
        behavior, ratio = self._importance_weights(new.detach(), inputs, token_mask)
        per_token = torch.where(mask.bool(), ratio * div, torch.zeros_like(div))
        distill, distill_scaled = self._normalize(per_token, mask, inputs, mode)
        loss = args.distillation_coef * distill_scaled
        if (
            self.model.training
            and self.state.global_step == self._generation_step
            and "sampling_per_token_logps" in inputs
        ):
            self._log_mismatch(
                new.detach(), inputs["sampling_per_token_logps"], token_mask
            )  # replay vs engine
        if args.policy_loss_coef > 0:
            self._reuse = (new, -(logprobs.exp() * logprobs).sum(-1))
            try:
                loss = loss + args.policy_loss_coef * super()._compute_loss(model, inputs)
            finally:
                self._reuse = None

        key = divergence_mode(cfg)  # the cfg the loss just used: the name cannot disagree with the math
        self.last_distillation = DistillationStats(new.detach(), behavior, ratio, div.detach(), mask, key)
        totals = self.accelerator.reduce(
            torch.stack([(div.detach() * mask).sum(), mask.sum().float(), distill.detach()]), reduction="sum"
        )
        m = self._metrics[mode]
        m[f"distill/{key}"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        m["distill/loss"].append(totals[2].item() / self.accelerator.num_processes)
        valid = ratio[token_mask.bool()]
        if valid.numel():
            m["distill/is_ratio/mean"].append(valid.mean().item())
            m["distill/is_ratio/min"].append(valid.min().item())
            m["distill/is_ratio/max"].append(valid.max().item())
        if args.teacher_scoring == "generation" and cfg.support != "teacher" and mask.sum() > 0:
            student_top = logprobs.detach().topk(cfg.k, dim=-1).indices
            found = (
                (student_top[..., :, None] == inputs["teacher_topk_ids"][..., None, :])
                .any(-1)
                .float()
                .mean(-1)
            )
            m["distill/support_coverage"].append(((found * mask).sum() / mask.sum()).item())
        return loss

    def _divergence(
        self, logprobs: Tensor, inputs: dict[str, Any], has_context: Tensor, cfg: GJSLossConfig
    ) -> Tensor:
        """Per-token top-K GJS ``[B, C]``; rows without a teacher context get the student itself as teacher (0)."""
        if self.args.teacher_scoring == "generation":
            t_ids, t_lps = inputs["teacher_topk_ids"], inputs["teacher_topk_logprobs"]
            own = logprobs.detach().topk(t_ids.size(-1), dim=-1)
            keep = has_context[:, None, None]
            t_ids = torch.where(keep, t_ids, own.indices)
            t_lps = torch.where(keep, t_lps, own.values)
            return topk_gjs_from_teacher_topk(logprobs, t_ids, t_lps, **cfg.to_dict())
        teacher = logprobs.detach().clone()
        rows = has_context.nonzero().flatten()
        for chunk in rows.split(self.args.per_device_train_batch_size):
            teacher[chunk] = self._teacher_logprobs(
                inputs["teacher_input_ids"][chunk], inputs["teacher_attention_mask"][chunk], logprobs.size(1)
            )
        return topk_gjs(logprobs, teacher, **cfg.to_dict())

    def _importance_weights(
        self, new: Tensor, inputs: dict[str, Any], token_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Behaviour log-probs and the detached IS weight ``exp(new − behaviour)`` (clipped), both ``[B, C]``.

        Behaviour: ``trainer`` — TRL's ``old_per_token_logps`` (the exact replayed log-probs computed when the
        batch was generated) or, on-policy, ``new`` itself (weight exactly 1); ``sampler`` — the engine's exact
        sampled-token log-probs of the rollout. Never a top-K reconstruction.
        """
        args = self.args
        if args.distill_is_behavior == "sampler":
            behavior = inputs.get("sampling_per_token_logps")
            if behavior is None:
                raise InvalidArgumentError(
                    "distill_is_behavior='sampler' needs the rollout's sampling log-probs"
                )
            behavior = torch.where(torch.isnan(behavior), new, behavior)
        else:
            behavior = inputs.get("old_per_token_logps")
            behavior = new if behavior is None else behavior
        log_ratio = torch.where(token_mask.bool(), new - behavior, torch.zeros_like(new))
        if args.distill_is_level == "sequence":
            seq = log_ratio.sum(-1, keepdim=True) / token_mask.sum(-1, keepdim=True).clamp(min=1)
            log_ratio = seq.expand_as(new)
        ratio = torch.exp(log_ratio)
        if args.distill_is_clip is not None:
            ratio = ratio.clamp(max=args.distill_is_clip)
        if "importance_sampling_ratio" in inputs:  # TRL's vLLM behaviour correction, when on
            ratio = ratio * inputs["importance_sampling_ratio"]
        return behavior.detach(), ratio.detach()

    def _normalize(
        self, per_token: Tensor, mask: Tensor, inputs: dict[str, Any], mode: str
    ) -> tuple[Tensor, Tensor]:
        """``(loss, loss scaled for accumulation)`` with TRL's normaliser for ``loss_type`` (as its policy term)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        total = (per_token * mask).sum()
        if self.loss_type in ("grpo", "sapo"):
            loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif self.loss_type == "bnpo":
            loss = total / mask.sum().clamp(min=1.0)
        elif self.loss_type == "dr_grpo":
            loss = total / (per_token.size(0) * self.max_completion_length)
        elif self.loss_type == "luspo":
            loss = (per_token * mask).sum(-1).mean()
        else:  # dapo, cispo, vespo: tokens of the whole generation batch, rescaled to one accumulation window
            normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                normalizer = (
                    normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
                )
            return total / normalizer, total / normalizer
        return loss, loss / accumulation
