""":func:`evaluate`: play an evaluation (:func:`compaction_gym.agents.evaluate.play`), write
``trajectories.jsonl`` and ``summary.json``, return the summary (``docs/eval.md``)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compaction_gym.agents.evaluate import default_tasks, play
from compaction_gym.agents.trajectory import Trajectory, jsonable, jsonl_line, write_jsonl
from compaction_gym.atomic import write_atomic
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation.summary import make_summary

#: TensorBoard folder inside an eval ``--output`` (``tensorboard --logdir OUTPUT/tensorboard``).
TENSORBOARD_DIR = "tensorboard"
#: Summary statistics logged as ``summary/<task>/<stat>`` (besides ``progression``).
SUMMARY_STATS = (
    "success_rate", "reward_mean", "turns_mean", "tokens_mean", "generated_tokens_mean",
    "peak_kv_mean", "peak_kv_max", "compaction_events_mean", "invalid_action_rate",
)  # fmt: skip


def evaluate(
    model: str | None = None,
    env: str = "AttnMatch-BabyAI-v0",
    *,
    tasks: Sequence[str] | None = None,
    compaction: CompactionConfig | None = None,
    sampling: SamplingParams | None = None,
    prompt: str | None = None,
    episodes: int = 10,
    seed: int = 0,
    output: str | Path | None = None,
    batch: int = 1,
    env_kwargs: dict[str, Any] | None = None,
    backend: Any = None,
    engine_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    policy: str = "model",
    overwrite: bool = False,
    tensorboard: bool = True,
) -> dict[str, Any]:
    """Run ``episodes`` episodes per task and return (and write) the summary.

    Episode ``i`` uses env seed ``seed + i`` in every task and method, so runs pair up across
    methods. ``output``: directory for ``trajectories.jsonl`` (streamed in completion order),
    ``run.json`` (the run's settings, written first) and ``summary.json`` (written last,
    atomically); nothing is written if ``None``. Re-running into a folder that holds an interrupted
    run with the same settings **resumes** it: finished episodes are kept and only the missing ones
    play. A folder holding a run with other settings is refused unless ``overwrite``. With
    ``tensorboard`` (and an ``output``), TensorBoard event files go to ``output/tensorboard``
    (:data:`TENSORBOARD_DIR`; docs/tensorboard.md). The other arguments are
    :func:`~compaction_gym.agents.evaluate.play`'s.

    Returns:
        The summary dict (see ``docs/eval.md``).
    """
    if episodes < 1:
        raise InvalidArgumentError(f"episodes must be >= 1, got {episodes}")
    out_dir = Path(output) if output is not None else None
    traj_path = None
    seeds = [seed + i for i in range(episodes)]
    task_list = list(tasks) if tasks else default_tasks(env)
    plan: dict[Any, list[int]] = {t: list(seeds) for t in task_list}
    kept: list[Trajectory] = []
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        traj_path = out_dir / "trajectories.jsonl"
        settings = jsonable({
            "model": None if model is None else str(model), "env": env, "tasks": task_list,
            "compaction": None if compaction is None else compaction.to_dict(),
            "sampling": None if sampling is None else sampling.to_dict(), "prompt": prompt,
            "episodes": episodes, "seed": seed, "env_kwargs": env_kwargs or {}, "policy": policy,
        })  # fmt: skip
        kept = _resumable(out_dir, traj_path, settings, overwrite)
        done = {(t.info.get("eval_task_requested"), t.seed) for t in kept}
        plan = {t: [s for s in seeds if (t, s) not in done] for t in task_list}
        write_atomic(out_dir / "run.json", json.dumps(settings, indent=2) + "\n")
        # the kept episodes only: a line torn by the interruption is dropped
        write_atomic(traj_path, "".join(jsonl_line(t) for t in kept))
        (out_dir / "summary.json").unlink(missing_ok=True)  # written again when the run completes
    # nothing to play (a finished run re-run): its event files already hold everything
    tb = _tensorboard(out_dir, kept) if tensorboard and out_dir is not None and any(plan.values()) else None

    def stream(_task: str, traj: Trajectory) -> None:
        if traj_path is not None:
            write_jsonl(traj_path, [traj], append=True)
        if tb is not None:
            tb.log_episode(traj)

    try:
        run = play(
            model,
            env,
            tasks=tasks,
            compaction=compaction,
            sampling=sampling,
            prompt=prompt,
            seeds=plan,
            batch=batch,
            env_kwargs=env_kwargs,
            backend=backend,
            engine_kwargs=engine_kwargs,
            progress=progress,
            policy=policy,
            on_episode=stream,
        )
        for traj in kept:  # the finished episodes of an interrupted run, in seed order with the new ones
            run.by_task.setdefault(traj.info.get("eval_task") or "all", []).append(traj)
        for label in run.by_task:
            run.by_task[label].sort(key=lambda t: (t.seed is None, t.seed))
        summary = make_summary(
            run, seed=seed, episodes=episodes, trajectories="trajectories.jsonl" if out_dir is not None else None
        )
        if out_dir is not None:
            write_atomic(out_dir / "summary.json", json.dumps(summary, indent=2, allow_nan=False) + "\n")
        if tb is not None:
            tb.log_histograms([t for trajs in run.by_task.values() for t in trajs], step=0)
            tb.log_scalars(summary_scalars(summary), step=0, prefix="summary/")
    finally:
        if tb is not None:
            tb.close()
    return summary


def _tensorboard(out_dir: Path, kept: list[Trajectory]) -> Any:
    """The run's :class:`TrajectoryLogger`; a fresh run (nothing kept) clears older event files."""
    from compaction_gym.agents.tensorboard import TrajectoryLogger

    log_dir = out_dir / TENSORBOARD_DIR
    if not kept and log_dir.is_dir():
        shutil.rmtree(log_dir)
    return TrajectoryLogger(log_dir, episode_step=len(kept), event_step=sum(len(t.events) for t in kept))


def summary_scalars(summary: dict[str, Any]) -> dict[str, float | None]:
    """``<task>/<stat>`` for each task and ``overall``: the summary's numbers (progression in percent)."""
    out: dict[str, float | None] = {}
    for label, stats in {**summary["tasks"], "overall": summary["overall"]}.items():
        out[f"{label}/progression"] = stats["progression"]["mean"]
        for key in SUMMARY_STATS:
            out[f"{label}/{key}"] = stats[key]
    return out


def _resumable(out_dir: Path, traj_path: Path, settings: dict[str, Any], overwrite: bool) -> list[Trajectory]:
    """The finished episodes an output folder holds for a run with these ``settings`` ([] if none).

    Raises:
        InvalidArgumentError: the folder holds episodes of a run with other settings (without
            ``overwrite``), naming the settings that differ.
    """
    if overwrite or not traj_path.exists() or not traj_path.read_text().strip():
        return []
    run_file = out_dir / "run.json"
    previous = json.loads(run_file.read_text()) if run_file.is_file() else None
    if previous != settings:
        differ = sorted(k for k in settings if previous is None or previous.get(k) != settings[k])
        raise InvalidArgumentError(
            f"--output {out_dir} holds episodes of another run (settings that differ: {differ or ['run.json missing']}); "
            "use another --output, or --overwrite to replace them"
        )
    kept: dict[tuple[Any, Any], Trajectory] = {}
    for line in traj_path.read_text().splitlines():
        try:
            traj = Trajectory.from_dict(json.loads(line))
        except (ValueError, KeyError, TypeError, InvalidArgumentError):
            continue  # a line torn by the interruption
        kept[(traj.info.get("eval_task_requested"), traj.seed)] = traj
    return list(kept.values())
