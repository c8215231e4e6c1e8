""":func:`evaluate`: play an evaluation (:func:`compaction_gym.agents.evaluate.play`), write
``trajectories.jsonl`` and ``summary.json``, return the summary (``docs/eval.md``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compaction_gym.agents.evaluate import play
from compaction_gym.agents.trajectory import Trajectory, write_jsonl
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.evaluation.summary import make_summary


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
) -> dict[str, Any]:
    """Run ``episodes`` episodes per task and return (and write) the summary.

    Episode ``i`` uses env seed ``seed + i`` in every task and method, so runs pair up across
    methods. ``output``: directory for ``trajectories.jsonl`` (streamed in completion order) and
    ``summary.json`` (nothing written if ``None``). The other arguments are
    :func:`~compaction_gym.agents.evaluate.play`'s.

    Returns:
        The summary dict (see ``docs/eval.md``).
    """
    if episodes < 1:
        raise InvalidArgumentError(f"episodes must be >= 1, got {episodes}")
    out_dir = Path(output) if output is not None else None
    traj_path = None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        traj_path = out_dir / "trajectories.jsonl"
        traj_path.write_text("")

    def stream(_task: str, traj: Trajectory) -> None:
        if traj_path is not None:
            write_jsonl(traj_path, [traj], append=True)

    run = play(
        model,
        env,
        tasks=tasks,
        compaction=compaction,
        sampling=sampling,
        prompt=prompt,
        seeds=[seed + i for i in range(episodes)],
        batch=batch,
        env_kwargs=env_kwargs,
        backend=backend,
        engine_kwargs=engine_kwargs,
        progress=progress,
        policy=policy,
        on_episode=stream,
    )
    summary = make_summary(
        run, seed=seed, episodes=episodes, trajectories="trajectories.jsonl" if out_dir is not None else None
    )
    if out_dir is not None:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    return summary
