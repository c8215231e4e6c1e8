"""Playing an evaluation: env/task defaults and :func:`play`, N episodes per task through batched sessions.

This module only plays episodes and returns their trajectories (:class:`EvalRun`). Statistics,
provenance, the summary file, the table and the ``eval`` command live one layer up in
:mod:`compaction_gym.evaluation` (``docs/eval.md``); the leaderboard (``docs/leaderboard.md``)
plays its cells through the same :func:`play`.
"""

from __future__ import annotations

import datetime as _dt
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import gymnasium as gym

from compaction_gym.agents.prompts import get_prompt_format
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.models.registry import model_defaults, resolve_model

if TYPE_CHECKING:  # torch-free at import: the CLI builds its parser from this module's defaults
    from compaction_gym.agents.trajectory import Trajectory

BABYAI_ENTRY = "compaction_gym.envs.babyai.env:BabyAITextEnv"
#: task label per episode, read from ``info`` when the env picks the task itself.
TASK_INFO_KEYS = ("task", "dataset")
#: who chooses the actions: the model, or the BabyAI expert bot (teacher-forced into the session).
POLICIES = ("model", "expert")
#: ``--model`` when none is given: the agent shipped in the package (``compaction_gym.models``).
DEFAULT_MODEL = "babyai-tiny"


# ---------------------------------------------------------------------------- env plumbing
def _entry_point(env_id: str) -> str:
    try:
        spec = gym.spec(env_id)
    except gym.error.Error as exc:
        raise InvalidArgumentError(f"unknown env id {env_id!r}: {exc}") from exc
    return spec.entry_point if isinstance(spec.entry_point, str) else ""


def is_babyai(env_id: str) -> bool:
    """Whether ``env_id`` is one of our BabyAI text envs."""
    return _entry_point(env_id) == BABYAI_ENTRY


def default_tasks(env_id: str) -> list[str | None]:
    """BALROG's five tasks for the mixed BabyAI id; one unnamed task (labels from ``info``) otherwise."""
    from compaction_gym.envs.registration import BABYAI_TASK_IDS

    if is_babyai(env_id) and "task" not in (gym.spec(env_id).kwargs or {}):
        return list(BABYAI_TASK_IDS)
    return [None]


def task_env_kwargs(env_id: str, task: str | None) -> dict[str, Any]:
    """The ``gym.make`` keyword arguments that pin ``task`` on ``env_id``."""
    if task is None:
        return {}
    entry = _entry_point(env_id)
    pinned = (gym.spec(env_id).kwargs or {}).get("task")
    if pinned is not None and pinned != task:
        raise InvalidArgumentError(
            f"--env {env_id} always runs task {pinned!r}; drop --task {task} or use AttnMatch-BabyAI-v0 --task {task}"
        )
    if entry == BABYAI_ENTRY:
        return {"task": task}
    if entry.endswith(":MathEnv"):
        return {"dataset": task}
    if entry.endswith(":RGMixEnv"):
        return {"weights": {task: 1.0}}
    if entry.endswith(":RecallEnv"):
        return {"preset": task}
    raise InvalidArgumentError(f"--task is not supported for {env_id!r}; drop it or use a BabyAI or math env")


def default_prompt(env_id: str, model: str | None = None) -> str:
    """The prompt format a BabyAI model declares (``compaction_gym.json``, e.g. the bundled
    ``babyai-tiny``: ``reasoning``), else ``balrog`` for BabyAI, ``raw`` otherwise (math questions
    carry their own answer format)."""
    if not is_babyai(env_id):
        return "raw"
    return model_defaults(model).get("prompt", "balrog")


def default_max_new_tokens(prompt: str, model: str | None) -> int:
    """The model's declared per-turn budget when it runs its own prompt format, else the format's."""
    declared = model_defaults(model)
    if declared.get("prompt") == prompt and "max_new_tokens" in declared:
        return int(declared["max_new_tokens"])
    return get_prompt_format(prompt).max_new_tokens


def episode_progression(traj: Trajectory) -> float:
    """BabyAI: BALROG's progression (0 or 1); math and recall: the scorer's score; else ``success``."""
    for key in ("progression", "score"):
        if key in traj.info and traj.info[key] is not None:
            return float(traj.info[key])
    return float(traj.success)


@dataclass
class EvalRun:
    """What :func:`play` played: the resolved settings and the trajectories by task label.

    ``by_task`` lists each task's trajectories in seed order; ``wall`` is each task's wall time
    (seconds; with ``batch > 1`` episodes overlap).
    """

    env: str
    tasks: list[str | None]
    env_kwargs: dict[str, Any]
    compaction: CompactionConfig
    sampling: SamplingParams
    prompt: str
    policy: str
    batch: int
    model_label: str
    resolved: str | None
    backend_name: str
    device: str
    started_at: str
    by_task: dict[str, list[Trajectory]] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    wall_time_s: float = 0.0


def resolve_sampling(sampling: SamplingParams | None, prompt: str, model: str | None) -> SamplingParams:
    """``sampling``, or greedy with the model's / prompt format's per-turn token budget."""
    if sampling is not None:
        return sampling
    return SamplingParams(temperature=0.0, max_new_tokens=default_max_new_tokens(prompt, model))


def load_backend(
    model: str | None, batch: int, engine_kwargs: Mapping[str, Any] | None = None
) -> tuple[Any, str]:
    """A :class:`~compaction_gym.backends.LocalBackend` for ``model`` with ``batch`` slots, and the
    resolved model path."""
    from compaction_gym.backends import LocalBackend

    if model is None:
        raise InvalidArgumentError("pass --model (a directory, registered name or hub id) or a backend")
    resolved = resolve_model(model)
    kwargs = dict(engine_kwargs or {})
    kwargs.setdefault("max_slots", batch)
    backend = LocalBackend.from_pretrained(resolved, **kwargs)
    if backend.tokenizer is None:
        raise InvalidArgumentError(
            f"{model}: no tokenizer files (tokenizer.json / tokenizer_config.json) beside the weights at "
            f"{resolved}; save the tokenizer there too (tokenizer.save_pretrained)"
        )
    return backend, resolved


def play(
    model: str | None = None,
    env: str = "AttnMatch-BabyAI-v0",
    *,
    tasks: Sequence[str | None] | None = None,
    compaction: CompactionConfig | None = None,
    sampling: SamplingParams | None = None,
    prompt: str | None = None,
    seeds: Sequence[int] | Mapping[str | None, Sequence[int]] = (0,),
    batch: int = 1,
    env_kwargs: Mapping[str, Any] | None = None,
    backend: Any = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    progress: bool = True,
    policy: str = "model",
    on_episode: Callable[[str, Trajectory], None] | None = None,
    desc: str = "eval",
) -> EvalRun:
    """Play the episodes of an evaluation and return them (no statistics, nothing written).

    Args:
        model: model directory, registered name or hub id; loaded into a ``LocalBackend`` unless
            ``backend`` is given (then it only labels the run).
        env: env id; ``tasks`` (default :func:`default_tasks`) pins one task per group of episodes.
        compaction, sampling, prompt: the agent's configs (defaults: no compaction; greedy with the
            prompt format's ``max_new_tokens``; :func:`default_prompt`).
        seeds: env seeds played in every task, or ``{task: seeds}`` (a resumed leaderboard cell
            plays only the missing ones). Episode ``i`` of a task is ``seeds[i]``.
        batch: episodes in flight (one ``step_batch`` per turn across them).
        env_kwargs: extra ``gym.make`` arguments (e.g. ``{"max_steps": 16}``).
        engine_kwargs: ``Engine.from_pretrained`` arguments (``device``, ``dtype``, ``capacity``).
        progress: show a progress bar labelled ``desc``.
        policy: ``model`` or ``expert`` (BabyAI: the expert bot, teacher-forced).
        on_episode: called as ``on_episode(task_label, trajectory)`` as each episode ends;
            ``trajectory.info`` holds ``eval_task`` (the task label), ``eval_task_requested`` (the
            task asked for, ``None`` when the env picks) and ``eval_episode``.
    """
    from tqdm.auto import tqdm

    from compaction_gym.agents.agent import CompactionAgent
    from compaction_gym.agents.rollout import run_episodes

    if batch < 1:
        raise InvalidArgumentError(f"batch must be >= 1, got {batch}")
    if policy not in POLICIES:
        raise InvalidArgumentError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy == "expert" and not is_babyai(env):
        raise InvalidArgumentError(f"policy='expert' needs a BabyAI env, got {env!r}")
    if model is None and backend is None:
        raise InvalidArgumentError("pass --model (a directory, registered name or hub id) or a backend")
    task_list = list(tasks) if tasks else default_tasks(env)
    plan = (
        {t: list(seeds.get(t, ())) for t in task_list}
        if isinstance(seeds, Mapping)
        else {t: list(seeds) for t in task_list}
    )
    total = sum(len(v) for v in plan.values())
    teacher = None
    if policy == "expert":
        from compaction_gym.envs.babyai.expert import expert_action as teacher
    prompt_name = prompt or default_prompt(env, None if backend is not None else model)
    fmt = get_prompt_format(prompt_name)
    compaction = compaction if compaction is not None else CompactionConfig()
    sampling = resolve_sampling(sampling, fmt.name, model)
    base_kwargs = dict(env_kwargs or {})
    if is_babyai(env):
        base_kwargs.setdefault("action_parsing", fmt.action_parsing)
    resolved = None
    if backend is None:
        backend, resolved = load_backend(model, batch, engine_kwargs)
    run = EvalRun(
        env=env,
        tasks=task_list,
        env_kwargs=base_kwargs,
        compaction=compaction,
        sampling=sampling,
        prompt=fmt.name,
        policy=policy,
        batch=batch,
        model_label=str(model) if model is not None else str(getattr(backend, "name", "")),
        resolved=resolved,
        backend_name=type(backend).__name__,
        device=str(getattr(getattr(backend, "engine", None), "device", "")),
        started_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    )
    t_start = time.perf_counter()
    bar = tqdm(total=total, desc=desc, unit="ep", disable=not progress, file=sys.stderr)
    agents = [
        CompactionAgent(
            backend, compaction=compaction, sampling=sampling, prompt=fmt, model_name=run.model_label
        )
        for _ in range(max(1, min(batch, max((len(v) for v in plan.values()), default=1))))
    ]
    by_task, wall = run.by_task, run.wall
    try:
        for task in task_list:
            task_seeds = plan[task]
            if not task_seeds:
                continue
            kwargs = {**base_kwargs, **task_env_kwargs(env, task)}
            envs = [gym.make(env, **kwargs) for _ in agents]

            def done(index: int, traj: Trajectory, task: str | None = task) -> None:
                label = task or next((str(traj.info[k]) for k in TASK_INFO_KEYS if k in traj.info), "all")
                traj.info["eval_task"], traj.info["eval_episode"] = label, index
                traj.info["eval_task_requested"] = task
                by_task.setdefault(label, []).append(traj)
                if on_episode is not None:
                    on_episode(label, traj)
                bar.update(1)
                scores = [100 * episode_progression(t) for t in by_task[label]]
                bar.set_postfix(task=label, progression=f"{sum(scores) / len(scores):.1f}")

            t0 = time.perf_counter()
            try:
                run_episodes(envs, agents, task_seeds, teacher=teacher, on_episode=done)
            finally:
                for e in envs:
                    e.close()
            elapsed = time.perf_counter() - t0
            if task is not None:
                wall[task] = wall.get(task, 0.0) + elapsed
            else:  # labels come from info: share the time by episode count
                n = sum(len(v) for k, v in by_task.items() if k not in wall)
                for k, v in by_task.items():
                    if k not in wall:
                        wall[k] = elapsed * len(v) / max(n, 1)
    finally:
        bar.close()
        for agent in agents:
            agent.close()
    for trajs in by_task.values():
        trajs.sort(key=lambda t: t.info["eval_episode"])
    run.wall_time_s = time.perf_counter() - t_start
    return run
