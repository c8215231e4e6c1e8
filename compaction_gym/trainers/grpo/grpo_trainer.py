"""``CompactionGRPOConfig`` + ``CompactionGRPOTrainer``: GRPO on env episodes with exact compaction replay.

Rollouts are whole env episodes played by a :class:`~compaction_gym.agents.CompactionAgent` whose
session is compacted as it grows, on the embedded engine running the policy's own weights
(:class:`~compaction_gym.trainers.rollouts.EnvRollouts`). Every log-probability pass TRL makes — old,
current (with gradient) and reference — *replays* each episode's compaction events on the trainer's
K/V (:func:`~compaction_gym.trainers.replay.replay_logprobs_batch`), so the scored distribution is
the one the rollout sampled from and importance ratios start at exactly 1.

One sample = one episode: ``prompt`` = its protected prompt (the env's instruction), ``completion``
= everything after (observations, the agent's outputs, budget messages); only the sampled tokens
carry loss (TRL's ``tool_mask``). A GRPO group = ``num_generations`` episodes of the same env seed
with different sampling seeds; the reward is the env's total episode reward (:func:`env_reward`).
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from trl import GRPOTrainer

from compaction_gym.agents import Trajectory
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.grpo.grpo_config import CompactionGRPOConfig
from compaction_gym.trainers.replay import ReplayOutput, replay_logprobs_batch
from compaction_gym.trainers.replay_attention import install_replay_attention, unwrap
from compaction_gym.trainers.replay_cache import ReplayPlanCache
from compaction_gym.trainers.rollouts import (
    EnvRollouts,
    EnvsLike,
    EpisodeSpec,
    budget_overshoot_reason,
    completion_start,
    derive_seed,
    resolve_envs,
    rollout_batch,
    rollout_metrics,
)
from compaction_gym.trainers.tensorboard import attach_rollout_histograms

logger = logging.getLogger(__name__)

#: Metrics reduced with ``max`` (not TRL's mean) over the micro-batches of a logging window.
MAX_METRICS = (
    "replay/max_abs_logprob_diff",
    "rollout/peak_kv_len_max",
    "rollout/kv_over_budget_max",
    "compaction/event_time_max_s",
)


def env_reward(completions: list, env_reward: list[float], **kwargs: Any) -> list[float]:
    """The GRPO reward: each episode's total env reward (the rollout passes it as ``env_reward``)."""
    return [float(r) for r in env_reward]


def episode_dataset(env_keys: Sequence[str], num_episodes: int, first_seed: int = 0):
    """A ``datasets.Dataset`` of episodes: ``prompt`` (a label), ``env`` (env key), ``env_seed``.

    Rows cycle through ``env_keys``; seeds are ``first_seed, first_seed + 1, ...``. TRL repeats each
    row ``num_generations`` times, so a GRPO group is one env seed played several times.
    """
    from datasets import Dataset

    keys = list(env_keys)
    envs = [keys[i % len(keys)] for i in range(num_episodes)]
    seeds = [first_seed + i for i in range(num_episodes)]
    return Dataset.from_dict(
        {"prompt": [f"{e} seed={s}" for e, s in zip(envs, seeds)], "env": envs, "env_seed": seeds}
    )


class CompactionGRPOTrainer(GRPOTrainer):
    """GRPO on env episodes with compacted KV sessions; log-probs replay each episode's compaction.

    Args:
        model: model path/id or a loaded causal LM (PEFT models welcome).
        args: :class:`CompactionGRPOConfig`.
        env: env id(s), an env factory, or a name → id/factory mapping (default: ``args.env_id``).
        reward_funcs: TRL reward functions (default: ``[env_reward]``, the episode's env reward);
            they receive ``env_reward``, ``success`` and ``trajectory`` keyword arguments.
        train_dataset: rows with ``prompt`` and optional ``env`` (env key) and ``env_seed``
            (default: :func:`episode_dataset`).
        eval_dataset, processing_class, callbacks, optimizers, peft_config: as :class:`trl.GRPOTrainer`.

    The batch carries ``inputs["trajectories"]`` (one :class:`Trajectory` per sample); subclasses
    needing logits use :meth:`_completion_logits`.

    Example:
        >>> trainer = CompactionGRPOTrainer("Qwen/Qwen3-0.6B", CompactionGRPOConfig("runs/grpo",
        ...     compaction={"mode": "attention_matching", "max_kv_len": 2048}))  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    _tag_names = ["trl", "grpo", "compaction-gym"]

    def __init__(
        self,
        model: Any,
        args: CompactionGRPOConfig | None = None,
        *,
        env: EnvsLike | None = None,
        reward_funcs: Callable | Sequence[Callable] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
    ) -> None:
        if args is None:
            args = CompactionGRPOConfig("compaction-grpo")
        if not isinstance(args, CompactionGRPOConfig):
            raise InvalidArgumentError(f"args must be a CompactionGRPOConfig, got {type(args).__name__}")
        self._env_factories = resolve_envs(
            env if env is not None else args.env_id, args.env_kwargs, prompt_format=args.prompt_format
        )
        if train_dataset is None:
            train_dataset = episode_dataset(list(self._env_factories), args.num_episodes, args.episode_seed)
        self._active: list[Trajectory] | None = None  # trajectories of the log-prob pass in progress
        self._mismatch_reference: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rollout_rows: list[dict] | None = None
        self._rollout_trajectories: list[Trajectory] = []
        # rollouts so far in the current (mode, global step): with the step, the seed key of a round
        self._round_key: tuple[str, int] = ("", -1)
        self._round_in_step = 0
        self._warned_overshoot = False
        self._generation_step = -1
        self._plan_cache: ReplayPlanCache | None = None  # made below, once TRL's batch sizes are known
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*rollout_func.*experimental", category=UserWarning)
            super().__init__(
                model,
                reward_funcs=list(reward_funcs)
                if isinstance(reward_funcs, Sequence)
                else reward_funcs or [env_reward],
                args=args,
                train_dataset=train_dataset,
                eval_dataset=eval_dataset,
                processing_class=processing_class,
                callbacks=callbacks,
                optimizers=optimizers,
                peft_config=peft_config,
                rollout_func=self._rollout,
            )
        # Every log-prob pass replays; gradient checkpointing re-runs layers during backward, so the
        # policy (and reference) stay on the replay attention (plain SDPA outside a replay).
        install_replay_attention(self.model)
        if self.ref_model is not None:
            install_replay_attention(self.ref_model)
        generation_batch = args.per_device_train_batch_size * args.steps_per_generation
        if args.replay_plan_cache:
            # one device plan per chunk a generation batch is replayed in: the passes without gradient
            # (old, reference) and the micro-batches (again at every iteration when num_iterations > 1)
            chunk = args.replay_inference_batch_size or args.per_device_train_batch_size
            self._plan_cache = ReplayPlanCache(
                max_device_plans=-(-generation_batch // chunk) + args.steps_per_generation
            )
        self.rollouts = EnvRollouts(
            self.model,
            self._tokenizer,
            self._env_factories,
            compaction=args.compaction_config,
            sampling=args.sampling_params,
            prompt=args.prompt_format,
            system_prompt=args.system_prompt,
            chat_template_kwargs=args.chat_template_kwargs,
            max_slots=args.engine_max_slots or generation_batch,
            capacity=args.engine_capacity,
            fast=args.engine_fast,
            continuous=args.engine_continuous,
        )
        # per-event/episode distributions beside TRL's scalars (docs/tensorboard.md)
        attach_rollout_histograms(self)

    # ------------------------------------------------------------------------------ rollouts
    def _rollout(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        """TRL's ``rollout_func``: play one episode per row (the rows TRL expanded into groups)."""
        rows = self._rollout_rows
        if rows is None or len(rows) != len(prompts):
            raise RuntimeError(
                "CompactionGRPOTrainer's rollout function runs only inside _generate_and_score_completions"
            )
        default_env = next(iter(self._env_factories))
        mode = "train" if self.model.training else "eval"
        round_key = self._rollout_round_key(mode)
        specs = []
        for i, row in enumerate(rows):
            seed = row.get("env_seed")
            sampling_seed = derive_seed(self.args.seed, self.accelerator.process_index, *round_key, i)
            specs.append(
                EpisodeSpec(
                    str(row.get("env") or default_env), None if seed is None else int(seed), sampling_seed
                )
            )
        trajectories = self.rollouts.run(specs)
        if self._plan_cache is not None:
            self._plan_cache.clear()  # the previous batch's plans are never replayed again
        self._rollout_trajectories = trajectories
        self._active = trajectories  # the old/reference log-prob passes inside super() replay these
        compaction = self.rollouts.compaction
        for key, value in rollout_metrics(trajectories, compaction.max_kv_len).items():
            self._metrics[mode][key].append(value)
        reason = budget_overshoot_reason(trajectories, compaction)
        if reason is not None and not self._warned_overshoot:
            logger.warning("%s (logged once; rollout/kv_over_budget tracks it)", reason)
            self._warned_overshoot = True
        return rollout_batch(trajectories)

    def _rollout_round_key(self, mode: str) -> tuple[int, int, int]:
        """``(mode, global step, rollout index within that step)`` as integers: the sampling seeds'
        key. It is a function of the trainer state a checkpoint restores, so a resumed run samples
        exactly what the uninterrupted one did (docs/grpo.md, "Checkpoints and resume")."""
        key = (mode, self.state.global_step)
        if key != self._round_key:
            self._round_key, self._round_in_step = key, 0
        self._round_in_step += 1
        return (0 if mode == "train" else 1, self.state.global_step, self._round_in_step)

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        # Override: the rollout function only receives prompts, so the rows (env, env_seed) are stashed
        # for it; the episodes' trajectories are added to the batch so every later log-prob pass can
        # replay their compaction; and the sampling-vs-replay mismatch is logged when old log-probs exist.
        self._rollout_rows = inputs
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._rollout_rows = None
            self._active = None
        output["trajectories"] = list(self._rollout_trajectories)
        self._generation_step = self.state.global_step
        if "old_per_token_logps" in output and "sampling_per_token_logps" in output:
            self._log_mismatch(
                output["old_per_token_logps"], output["sampling_per_token_logps"], _loss_mask(output)
            )
            self._generation_step = -1  # measured already
        return output

    # ------------------------------------------------------------------------------ log-probs
    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        # Override: a plain forward over prompt + completion scores the uncompacted history, not what the
        # compacted session sampled from; replay each sample's compaction events instead.
        trajectories = self._active
        if trajectories is None:
            raise RuntimeError(
                "log-probs were requested outside a replay context (no trajectories for the batch)"
            )
        if compute_aux_loss:
            raise InvalidArgumentError("MoE auxiliary losses are not supported by compaction replay")
        if any(v is not None for v in multimodal.values()):
            raise InvalidArgumentError("multimodal inputs are not supported by compaction replay")
        batch = input_ids.size(0)
        if len(trajectories) != batch:
            raise RuntimeError(f"{len(trajectories)} trajectories for a batch of {batch} samples")
        _check_completions(input_ids[:, -logits_to_keep:], trajectories)
        batch_size = batch_size or batch
        if not torch.is_grad_enabled() and self.args.replay_inference_batch_size:
            batch_size = self.args.replay_inference_batch_size  # no graph to hold: fewer, wider rounds
        logps, entropies = [], []
        chunks = [trajectories[lo : lo + batch_size] for lo in range(0, batch, batch_size)]
        for k, chunk in enumerate(chunks):
            # the next chunk's plan is built while this one runs on the device (docs/grpo.md,
            # "Building the next chunk's plan during this one")
            ahead = chunks[k + 1] if k + 1 < len(chunks) and self._plan_cache is not None else None
            out = self._replay(
                model,
                chunk,
                compute_entropy=compute_entropy,
                fused_lm_head=_has_fused_head(model),
                prefetch=ahead,
            )
            logps += [_completion_slice(t, lp, logits_to_keep) for t, lp in zip(chunk, out.logprobs)]
            if compute_entropy:
                entropies += [_completion_slice(t, e, logits_to_keep) for t, e in zip(chunk, out.entropies)]
        logps_t = torch.stack(logps)
        if self._mismatch_reference is not None:
            sampling, mask = self._mismatch_reference
            self._log_mismatch(logps_t.detach(), sampling, mask)
        return logps_t, torch.stack(entropies) if compute_entropy else None, None

    def _replay(self, model: torch.nn.Module, trajectories: list[Trajectory], **kwargs: Any) -> ReplayOutput:
        """:func:`replay_logprobs_batch` with this trainer's settings, under the accelerator's autocast;
        ``kwargs`` are the call's own (``positions``, ``compute_entropy``, ...)."""
        with self.accelerator.autocast():
            return replay_logprobs_batch(
                model,
                trajectories,
                grad=torch.is_grad_enabled(),
                grad_through_compaction=self.args.grad_through_compaction,
                temperature=self.temperature,
                max_tokens_per_forward=self.args.replay_max_tokens_per_forward,
                method=self.args.replay_method,
                plan_cache=self._plan_cache,
                **kwargs,
            )

    def _completion_logits(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        *,
        batch: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """Replayed logits ``[B, C, V]`` of every completion position (divided by the temperature).

        The hook for subclasses that need whole distributions (distillation): the trajectories come
        from ``batch["trajectories"]`` (or the log-prob pass in progress); row ``b`` position ``j``
        holds the logits predicting completion token ``j`` (zeros past the sample's end).
        """
        trajectories = batch["trajectories"] if batch is not None else self._active
        if trajectories is None or len(trajectories) != input_ids.size(0):
            raise RuntimeError("_completion_logits needs the batch's trajectories")
        positions = [
            range(completion_start(t), min(len(t.token_ids), completion_start(t) + logits_to_keep))
            for t in trajectories
        ]
        out = self._replay(model, trajectories, positions=positions, return_logits=True)
        vocab = out.logits[0].shape[-1]
        rows = [torch.cat([x, x.new_zeros(logits_to_keep - x.shape[0], vocab)]) for x in out.logits]
        return torch.stack(rows)

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        # Override: make the micro-batch's trajectories visible to the replaying log-prob hook, and compare
        # the replay with the sampling log-probs while the policy is still the one that sampled them.
        self._active = inputs["trajectories"]
        if (
            self.args.log_replay_mismatch
            and self.model.training
            and self.state.global_step == self._generation_step
            and "sampling_per_token_logps" in inputs
        ):
            self._mismatch_reference = (inputs["sampling_per_token_logps"], _loss_mask(inputs))
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._active = None
            self._mismatch_reference = None

    @contextmanager
    def replaying(self, trajectories: list[Trajectory]):
        """Run TRL's log-prob hooks on ``trajectories`` (for custom passes outside the training loop)."""
        before, self._active = self._active, trajectories
        try:
            yield
        finally:
            self._active = before

    # ------------------------------------------------------------------------------ logging
    def _log_mismatch(self, replayed: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor) -> None:
        """Sampling-vs-replay log-prob gap over loss tokens: max |Δ|, mean |Δ| and a KL(sampler‖replay) estimate."""
        if not self.args.log_replay_mismatch:
            return
        mask = mask.bool() & ~torch.isnan(sampling)
        delta = (replayed.float() - sampling.float())[mask]  # log(π_replay / π_sampler) on sampled tokens
        stats = torch.stack(
            [
                delta.abs().max() if delta.numel() else delta.new_zeros(()),
                delta.abs().sum(),
                (torch.exp(delta) - delta - 1).sum(),  # k3: unbiased, >= 0 estimate of KL(sampler‖replay)
                delta.new_tensor(float(delta.numel())),
            ]
        )
        gathered = self.accelerator.gather(stats[None]).view(-1, 4)
        count = gathered[:, 3].sum().clamp(min=1.0)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["replay/max_abs_logprob_diff"].append(gathered[:, 0].max().item())
        self._metrics[mode]["replay/mean_abs_logprob_diff"].append((gathered[:, 1].sum() / count).item())
        self._metrics[mode]["replay/mean_kl"].append((gathered[:, 2].sum() / count).item())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # Override: the window's maximum of a max metric is its max, not the mean TRL takes.
        mode = "train" if self.model.training else "eval"
        for key in MAX_METRICS:
            values = [v for v in self._metrics[mode].get(key, []) if not math.isnan(v)]
            if values:
                self._metrics[mode][key] = [max(values)]
        super().log(logs, start_time)


# ------------------------------------------------------------------------------------ helpers
def _loss_mask(batch: Mapping[str, Any]) -> torch.Tensor:
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if batch.get("tool_mask") is not None else mask


def _completion_slice(traj: Trajectory, values: torch.Tensor, width: int) -> torch.Tensor:
    """``values[start : start + width]`` (aligned to the completion), zero-padded to ``width``."""
    start = completion_start(traj)
    part = values[start : start + width]
    return torch.cat([part, part.new_zeros(width - part.shape[0])])


def _check_completions(completion_ids: torch.Tensor, trajectories: Sequence[Trajectory]) -> None:
    """The batch's completion tokens are the trajectories' (guards against misaligned shuffles)."""
    width = completion_ids.shape[1]
    rows = completion_ids.tolist()  # one host transfer
    for b, t in enumerate(trajectories):
        expected = list(t.token_ids[completion_start(t) : completion_start(t) + width])
        if rows[b][: len(expected)] != expected:
            raise RuntimeError(f"sample {b}: the batch's completion tokens are not its trajectory's")


def _has_fused_head(model: torch.nn.Module) -> bool:
    """Whether TRL's fused LM head (``add_fused_lm_head``) is installed on ``model``."""
    base = unwrap(model)
    if hasattr(base, "get_base_model"):
        base = base.get_base_model()
    code = getattr(getattr(base.forward, "__func__", base.forward), "__code__", None)
    return code is not None and "fused_lm_head" in code.co_varnames
