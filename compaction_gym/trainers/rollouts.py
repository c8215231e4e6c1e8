"""Env episodes → training batches: groups of episodes on the embedded engine, on the policy's weights.

:class:`EnvRollouts` owns an :class:`~compaction_gym.engine.Engine` built *on the policy module
itself* (no copy: generation always reads the current weights, LoRA adapters included, so there
is nothing to sync after an optimizer step), a pool of env instances per env key, and plays
:class:`EpisodeSpec` s with :func:`~compaction_gym.agents.run_episodes` (each with its own sampling
seed; by default continuously batched: every episode advances on its own, docs/grpo.md).
:func:`rollout_batch` turns the resulting :class:`~compaction_gym.agents.Trajectory` s into TRL's ``rollout_func`` contract.

The policy is shared with a trainer, so every engine call runs inside :meth:`EnvRollouts.generating`:
eval mode (no dropout, no gradient checkpointing) and no autograd. The engine itself switches the
model to its attention implementation around its own forwards only (docs/engine.md), so the
trainer's forwards keep theirs.

Used by :class:`~compaction_gym.trainers.grpo.CompactionGRPOTrainer` and the GJS trainer; nothing
here depends on TRL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from compaction_gym.agents import CompactionAgent, Trajectory, run_episodes
from compaction_gym.agents.prompts import PromptFormat
from compaction_gym.backends import LocalBackend
from compaction_gym.engine import CompactionConfig, Engine, SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.replay_attention import unwrap

#: Makes one env instance.
EnvFactory = Callable[[], gym.Env]
#: What a trainer accepts as its environment(s): an id, a factory, or a name → id/factory mapping.
EnvsLike = str | EnvFactory | Mapping[str, "str | EnvFactory"]


@dataclass(frozen=True)
class EpisodeSpec:
    """One episode to play.

    Attributes:
        env: key of the env in :attr:`EnvRollouts.envs` (an env id unless factories were named).
        seed: the env's reset seed (also mixed into the session seed).
        sampling_seed: seeds the agent's sampling stream; episodes of one GRPO group share ``seed``
            and differ here.
    """

    env: str
    seed: int | None = None
    sampling_seed: int | None = None


def resolve_envs(
    envs: EnvsLike, env_kwargs: Mapping[str, Any] | None = None, *, prompt_format: str | None = None
) -> dict[str, EnvFactory]:
    """Env factories by key: ``"A-v0"`` / ``"A-v0,B-v0"`` (ids), a factory (key ``"env"``), or a mapping.

    With ``prompt_format``, BabyAI ids get that format's ``action_parsing`` (``reasoning`` → ``tag``)
    unless ``env_kwargs`` sets it, as ``compaction-gym eval`` does; factories are used as given.

    Raises:
        InvalidArgumentError: an unknown env id, or nothing given.
    """
    kwargs = dict(env_kwargs or {})

    def from_id(env_id: str) -> EnvFactory:
        from compaction_gym.agents.evaluate import is_babyai
        from compaction_gym.agents.prompts import PROMPT_FORMATS

        if env_id not in gym.registry:
            raise InvalidArgumentError(
                f"unknown env id {env_id!r}; registered AttnMatch ids: "
                f"{sorted(i for i in gym.registry if i.startswith('AttnMatch'))}"
            )
        made = dict(kwargs)
        if prompt_format in PROMPT_FORMATS and is_babyai(env_id):
            made.setdefault("action_parsing", PROMPT_FORMATS[prompt_format].action_parsing)
        return lambda: gym.make(env_id, **made)

    if isinstance(envs, str):
        ids = [e.strip() for e in envs.split(",") if e.strip()]
        out = {env_id: from_id(env_id) for env_id in ids}
    elif callable(envs):
        out = {"env": envs}
    elif isinstance(envs, Mapping):
        out = {str(k): from_id(v) if isinstance(v, str) else v for k, v in envs.items()}
    else:
        raise InvalidArgumentError(
            f"envs must be an env id, a factory or a mapping, got {type(envs).__name__}"
        )
    if not out:
        raise InvalidArgumentError("no environment given")
    return out


def derive_seed(*parts: int) -> int:
    """A well-mixed 62-bit seed from integer parts (e.g. run seed, process, generation round, index)."""
    state = np.random.SeedSequence([int(p) % (1 << 64) for p in parts]).generate_state(2, np.uint32)
    return (int(state[0]) << 30) ^ int(state[1])


def group_specs(
    episodes: Sequence[tuple[str, int | None]], num_generations: int, *, base_seed: int = 0
) -> list[EpisodeSpec]:
    """``num_generations`` consecutive specs per ``(env, seed)``: one GRPO group each, distinct sampling seeds."""
    return [
        EpisodeSpec(env, seed, derive_seed(base_seed, i, g))
        for i, (env, seed) in enumerate(episodes)
        for g in range(num_generations)
    ]


class EnvRollouts:
    """Plays env episodes with a :class:`CompactionAgent` on an engine that shares ``model``'s weights.

    Args:
        model: the policy (a Hugging Face causal LM, optionally PEFT-wrapped). The engine runs this
            very module: no copy, no weight sync.
        tokenizer: its tokenizer (chat template required).
        envs: env id(s), a factory, or a mapping (see :func:`resolve_envs`).
        compaction: the sessions' :class:`CompactionConfig` (default: no compaction).
        sampling: per-turn :class:`SamplingParams` (``seed`` is replaced per episode).
        prompt: the agent's prompt format (``balrog``, ``reasoning``, ``raw``, a ``PromptFormat``).
        system_prompt, chat_template_kwargs: passed to the agents.
        env_kwargs: keyword arguments of ``gym.make`` for env ids.
        max_slots: sessions played at once (larger batches are played in chunks).
        capacity: cache rows per session (engine default when ``None``).
        fast: the engine's GPU fast path (``False``: the generic path; ``None``: auto). The fast
            path re-points the model's q/k/v and gate/up parameters into packed matrices (shared
            storage, so weights stay in sync).
        continuous: each episode advances on its own (its next turn is submitted as soon as its
            env has stepped); ``False``: lock-step, one ``step_batch`` per turn across the
            episodes. The trajectories are the same up to float32 rounding of batches of other
            sizes (``run_episodes``; docs/agents.md, "Batching").
        model_name: recorded in trajectories.

    Example:
        >>> rollouts = EnvRollouts(model, tok, "AttnMatch-BabyAI-GoTo-v0",
        ...                        compaction=CompactionConfig(mode="attention_matching", max_kv_len=2048))  # doctest: +SKIP
        >>> trajs = rollouts.run(group_specs([("AttnMatch-BabyAI-GoTo-v0", 0)], num_generations=4))  # doctest: +SKIP
        >>> batch = rollout_batch(trajs)  # doctest: +SKIP
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        envs: EnvsLike,
        *,
        compaction: CompactionConfig | None = None,
        sampling: SamplingParams | None = None,
        prompt: str | PromptFormat = "balrog",
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        max_slots: int = 8,
        capacity: int | None = None,
        fast: bool | None = False,
        continuous: bool = True,
        model_name: str | None = None,
    ) -> None:
        if not isinstance(continuous, bool):
            raise InvalidArgumentError(f"continuous must be a bool, got {continuous!r}")
        self.continuous = continuous
        self.envs = resolve_envs(envs, env_kwargs, prompt_format=prompt if isinstance(prompt, str) else None)
        self.model = unwrap(model)
        self.tokenizer = tokenizer
        self.compaction = compaction if compaction is not None else CompactionConfig()
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.prompt = prompt
        self.system_prompt = system_prompt
        self.chat_template_kwargs = chat_template_kwargs
        config = self.model.config
        self.engine = Engine(self.model, tokenizer, max_slots=max_slots, capacity=capacity, fast=fast)
        name = model_name or str(getattr(config, "_name_or_path", "") or "")
        self.backend = LocalBackend(self.engine, name=name)
        self._pool: dict[str, list[gym.Env]] = {}
        #: called with each :meth:`run`'s trajectories (e.g. the TensorBoard histograms of
        #: :func:`compaction_gym.trainers.tensorboard.attach_rollout_histograms`)
        self.listeners: list[Callable[[list[Trajectory]], None]] = []

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Eval mode and no autograd, the mode restored afterwards (the engine switches its attention itself)."""
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.model.train(training)

    def run(self, specs: Sequence[EpisodeSpec]) -> list[Trajectory]:
        """Play ``specs`` (in chunks of ``max_slots``, see ``continuous``); trajectories in order.

        Episodes the engine cannot hold stop early with ``info["aborted"]`` (see ``run_episodes``).
        """
        for spec in specs:
            if spec.env not in self.envs:
                raise InvalidArgumentError(
                    f"unknown env key {spec.env!r}; this rollout has {sorted(self.envs)}"
                )
        out: list[Trajectory] = []
        size = self.engine.max_slots
        with self.generating():
            for start in range(0, len(specs), size):
                chunk = specs[start : start + size]
                envs = self._envs([s.env for s in chunk])
                agents = [self._agent(s) for s in chunk]
                out += run_episodes(envs, agents, [s.seed for s in chunk], continuous=self.continuous)
        for listener in self.listeners:
            listener(out)
        return out

    def close(self) -> None:
        """Close every pooled env."""
        for envs in self._pool.values():
            for env in envs:
                env.close()
        self._pool.clear()

    def _agent(self, spec: EpisodeSpec) -> CompactionAgent:
        return CompactionAgent(
            self.backend,
            self.tokenizer,
            compaction=self.compaction,
            sampling=self.sampling.replace(seed=spec.sampling_seed),
            prompt=self.prompt,
            system_prompt=self.system_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
        )

    def _envs(self, keys: list[str]) -> list[gym.Env]:
        """One env instance per key occurrence, reused across calls."""
        taken: dict[str, int] = {}
        out = []
        for key in keys:
            pool = self._pool.setdefault(key, [])
            i = taken.get(key, 0)
            if i == len(pool):
                pool.append(self.envs[key]())
            taken[key] = i + 1
            out.append(pool[i])
        return out


def completion_start(traj: Trajectory) -> int:
    """Where a trainer's "completion" starts: the end of the protected prompt (at least one token left)."""
    return max(1, min(traj.prompt_len, len(traj.token_ids) - 1))


def rollout_batch(trajectories: Sequence[Trajectory]) -> dict[str, list]:
    """Trajectories as TRL's ``rollout_func`` output (one entry per trajectory, in order).

    ``prompt_ids`` = the protected prompt, ``completion_ids`` = everything after it (every turn's
    observation, the agent's outputs, injected budget messages), ``logprobs`` = the engine's exact
    sampling log-probs (0.0 on non-sampled tokens), ``env_mask`` = ``completion_mask`` (1 only on
    sampled tokens: the loss mask). Extra keys reach reward functions as keyword arguments:
    ``env_reward`` (the episode's total env reward), ``success``, ``trajectory``.
    """
    out: dict[str, list] = {
        k: []
        for k in (
            "prompt_ids",
            "completion_ids",
            "logprobs",
            "env_mask",
            "env_reward",
            "success",
            "trajectory",
        )
    }
    for t in trajectories:
        c = completion_start(t)
        out["prompt_ids"].append(list(t.token_ids[:c]))
        out["completion_ids"].append(list(t.token_ids[c:]))
        out["logprobs"].append([float(x) for x in t.logprobs[c:]])
        out["env_mask"].append([int(m) for m in t.completion_mask[c:]])
        out["env_reward"].append(float(t.total_reward))
        out["success"].append(bool(t.success))
        out["trajectory"].append(t)
    return out


def rollout_metrics(trajectories: Sequence[Trajectory], max_kv_len: int | None = None) -> dict[str, float]:
    """One rollout batch's metrics (TensorBoard keys; means over episodes or events unless named max).

    ``rollout/*``: success, reward, turns, sampled tokens, tokens, compaction events, peak KV length
    (mean and ``rollout/peak_kv_len_max``), aborted episodes; with ``max_kv_len`` also
    ``rollout/kv_over_budget`` (mean of ``max(0, peak − max_kv_len)``) and
    ``rollout/kv_over_budget_max``.

    ``compaction/*`` (per event, only when the batch has events): ``kv_len_before``,
    ``kv_len_after``, ``kept_fraction`` (``kv_len_after / kv_len_before``), ``span_kept_fraction``
    (kept rows / span rows), ``event_time_s`` (the event's ``timings["total"]``) and
    ``event_time_max_s``.
    """
    n = max(1, len(trajectories))

    def mean(values: Sequence[float]) -> float:
        return float(sum(values)) / n

    peaks = [t.peak_kv_len for t in trajectories]
    out = {
        "rollout/success": mean([t.success for t in trajectories]),
        "rollout/env_reward": mean([t.total_reward for t in trajectories]),
        "rollout/turns": mean([len(t.turns) for t in trajectories]),
        "rollout/sampled_tokens": mean([t.num_generated for t in trajectories]),
        "rollout/tokens": mean([t.num_tokens for t in trajectories]),
        "rollout/compaction_events": mean([len(t.events) for t in trajectories]),
        "rollout/peak_kv_len": mean(peaks),
        "rollout/peak_kv_len_max": float(max(peaks, default=0)),
        "rollout/aborted": mean([bool(t.info.get("aborted")) for t in trajectories]),
    }
    if max_kv_len is not None:
        over = [max(0, p - max_kv_len) for p in peaks]
        out["rollout/kv_over_budget"] = mean(over)
        out["rollout/kv_over_budget_max"] = float(max(over, default=0))
    events = [e for t in trajectories for e in t.events]
    if events:
        m = len(events)
        times = [float(e.timings.get("total", sum(e.timings.values()))) for e in events]
        out.update(
            {
                "compaction/kv_len_before": sum(e.kv_len_before for e in events) / m,
                "compaction/kv_len_after": sum(e.kv_len_after for e in events) / m,
                "compaction/kept_fraction": sum(e.kv_len_after / max(1, e.kv_len_before) for e in events) / m,
                "compaction/span_kept_fraction": sum(e.target / max(1, e.span[1] - e.span[0]) for e in events)
                / m,
                "compaction/event_time_s": sum(times) / m,
                "compaction/event_time_max_s": max(times),
            }
        )
    return out


def budget_overshoot_reason(trajectories: Sequence[Trajectory], compaction: CompactionConfig) -> str | None:
    """Why a batch's peak KV length exceeded ``max_kv_len``, or ``None`` when it did not.

    The engine compacts rows ``[P, P + compact_window)`` after the protected prompt (``P`` rows) and
    skips an event while fewer than ``compact_window`` rows follow the prompt (docs/engine.md,
    "Triggers"). So when ``P + compact_window > max_kv_len`` the budget cannot hold: after an event
    the cache is ``P + ⌊window·ratio⌋ + …`` rows, and it grows past ``max_kv_len`` until ``window``
    rows follow the prompt again. Otherwise only a step input that does not fit even after
    compaction is fed whole (at most that input over the budget).
    """
    limit = compaction.max_kv_len
    if limit is None or compaction.turn_based or not trajectories:
        return None
    worst = max(trajectories, key=lambda t: t.peak_kv_len)
    if worst.peak_kv_len <= limit:
        return None
    window = compaction.compact_window or limit // 2
    prompt = worst.prompt_len if compaction.protect_prompt else 0
    if prompt + window > limit:
        return (
            f"peak KV length {worst.peak_kv_len} > max_kv_len {limit}: the protected prompt ({prompt} tokens) plus "
            f"compact_window ({window}) exceeds max_kv_len, so events wait until {window} rows follow the prompt "
            f"(the cache reaches {prompt + window} rows and more); raise max_kv_len to at least prompt + window + "
            "a turn's tokens, or lower compact_window"
        )
    return (
        f"peak KV length {worst.peak_kv_len} > max_kv_len {limit}: a step input that does not fit even after "
        "compaction is fed whole (docs/engine.md, 'Triggers'); the overshoot is at most that input"
    )
