"""``summary.json`` of an evaluation: BALROG statistics per task and overall, config and provenance.

BabyAI statistics follow BALROG: per task, mean progression × 100 with SE = population std ×
100 / √n; overall, the mean over tasks with SE = √(Σ SE²) / n_tasks (``docs/eval.md``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import Any

from compaction_gym.agents.evaluate import EvalRun, episode_progression
from compaction_gym.agents.trajectory import Trajectory, jsonable
from compaction_gym.evaluation.stats import combined_se, mean, pop_se
from compaction_gym.provenance import provenance

SUMMARY_SCHEMA = "compaction-gym/eval-summary/v1"


def episode_stats(trajs: Sequence[Trajectory]) -> dict[str, Any]:
    """The per-group statistics of ``docs/eval.md`` (``STATS`` without ``wall_time_s``)."""
    prog = [100.0 * episode_progression(t) for t in trajs]
    return {
        "episodes": len(trajs),
        "progression": {"mean": mean(prog), "se": pop_se(prog)},
        "success_rate": mean([float(t.success) for t in trajs]),
        "reward_mean": mean([t.total_reward for t in trajs]),
        "turns_mean": mean([len(t.turns) for t in trajs]),
        "tokens_mean": mean([t.num_tokens for t in trajs]),
        "generated_tokens_mean": mean([t.num_generated for t in trajs]),
        "peak_kv_mean": mean([t.peak_kv_len for t in trajs]),
        "peak_kv_max": max((t.peak_kv_len for t in trajs), default=0),
        "compaction_events_mean": mean([len(t.events) for t in trajs]),
        "invalid_action_rate": mean([float(turn.invalid_action) for t in trajs for turn in t.turns]),
        "aborted": sum(1 for t in trajs if "aborted" in t.info),
        "episode_wall_time_mean_s": mean([float(t.metrics.get("wall_time_s", 0.0)) for t in trajs]),
    }


def summarize(
    by_task: dict[str, list[Trajectory]], wall_times: dict[str, float] | None = None
) -> dict[str, Any]:
    """Per-task statistics and BALROG's overall aggregate.

    Returns:
        ``{"tasks": {task: stats}, "overall": stats}`` where ``stats`` holds ``episodes``,
        ``progression`` (``{"mean", "se"}``, percent), ``success_rate``, ``reward_mean``,
        ``turns_mean``, ``tokens_mean``, ``generated_tokens_mean``, ``peak_kv_mean``,
        ``peak_kv_max``, ``compaction_events_mean``, ``invalid_action_rate``, ``aborted``,
        ``episode_wall_time_mean_s`` and ``wall_time_s``. Overall progression is the mean of
        the task means, its SE ``√(Σ SE²) / n_tasks``; the other overall fields pool episodes.
    """
    wall_times = wall_times or {}
    tasks = {
        task: {**episode_stats(trajs), "wall_time_s": float(wall_times.get(task, 0.0))}
        for task, trajs in by_task.items()
    }
    everything = [t for trajs in by_task.values() for t in trajs]
    overall = {**episode_stats(everything), "wall_time_s": float(sum(wall_times.values()))}
    if tasks:
        overall["progression"] = {
            "mean": mean([s["progression"]["mean"] for s in tasks.values()]),
            "se": combined_se([s["progression"]["se"] for s in tasks.values()]),
        }
    return {"tasks": tasks, "overall": overall}


def finite(value: Any) -> Any:
    """Strict JSON: non-finite floats (means of nothing) become ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def make_summary(run: EvalRun, *, seed: int, episodes: int, trajectories: str | None) -> dict[str, Any]:
    """The ``summary.json`` dict of a played evaluation (schema in ``docs/eval.md``)."""
    summary: dict[str, Any] = {
        "schema": SUMMARY_SCHEMA,
        "env": run.env,
        "env_kwargs": jsonable(run.env_kwargs),
        "tasks_requested": run.tasks,
        **summarize(run.by_task, run.wall),
        "config": {
            "compaction": run.compaction.to_dict(),
            "sampling": jsonable(run.sampling.to_dict()),
            "prompt": run.prompt,
            "policy": run.policy,
            "episodes_per_task": episodes,
            "batch": run.batch,
        },
        "model": {"spec": run.model_label, "resolved": run.resolved, "backend": run.backend_name},
        "seed": seed,
        "seeds": [seed + i for i in range(episodes)],
        "provenance": {
            "started_at": run.started_at,
            "wall_time_s": run.wall_time_s,
            **provenance(),
            "device": run.device,
            "argv": sys.argv,
        },
        "trajectories": trajectories,
    }
    return finite(jsonable(summary))
