"""TensorBoard from trajectories: the one place that turns episodes into scalars and histograms.

``compaction-gym eval``, leaderboard runs and the trainers (GRPO, GJS) all log through
:class:`TrajectoryLogger`, so a tag means the same number everywhere (``docs/tensorboard.md``):

* ``episode/*`` — one point per episode (step: episodes logged so far): :func:`episode_scalars`.
* ``compaction/*`` — one point per compaction event (step: events logged so far):
  :func:`event_scalars`; and, per :meth:`TrajectoryLogger.log_histograms` call, histograms of the
  same per-event values (:func:`event_values`) over a batch of episodes.

The functions are pure (trajectory → numbers), so callers that log elsewhere reuse them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compaction_gym.agents.evaluate import episode_progression
from compaction_gym.agents.trajectory import Trajectory
from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.errors import InvalidArgumentError

#: Per-event values (:func:`event_scalars` keys), also the histogram tags.
EVENT_KEYS = ("kv_len_before", "kv_len_after", "kv_ratio", "span_ratio", "latency_s", "mass_kept")


def final_kv_len(traj: Trajectory) -> int:
    """Cache rows when the episode ended (the last turn's ``kv_len``; the prompt if no turn)."""
    return traj.turns[-1].kv_len if traj.turns else traj.prompt_len


def event_latency(event: CompactionEvent) -> float:
    """Seconds the event took: its ``timings["total"]`` (the sum of its phases for older records)."""
    return float(event.timings.get("total", sum(event.timings.values())))


def episode_scalars(traj: Trajectory) -> dict[str, float]:
    """One episode's numbers, keyed by tag suffix (``episode/<key>``).

    ``progression`` (0–1: BabyAI's progression, the math score, else success), ``reward``,
    ``success``, ``turns``, ``tokens`` (logical), ``generated_tokens``, ``peak_kv_len``,
    ``final_kv_len``, ``compaction_events``, ``compaction_time_s`` (sum of event latencies),
    ``invalid_actions`` and ``aborted``.
    """
    return {
        "progression": episode_progression(traj),
        "reward": float(traj.total_reward),
        "success": float(traj.success),
        "turns": float(len(traj.turns)),
        "tokens": float(traj.num_tokens),
        "generated_tokens": float(traj.num_generated),
        "peak_kv_len": float(traj.peak_kv_len),
        "final_kv_len": float(final_kv_len(traj)),
        "compaction_events": float(len(traj.events)),
        "compaction_time_s": float(sum(event_latency(e) for e in traj.events)),
        "invalid_actions": float(sum(t.invalid_action for t in traj.turns)),
        "aborted": float(bool(traj.info.get("aborted"))),
    }


def event_scalars(event: CompactionEvent) -> dict[str, float]:
    """One event's numbers, keyed by tag suffix (``compaction/<key>``).

    ``kv_len_before`` / ``kv_len_after``, ``kv_ratio`` (after / before), ``span_ratio`` (kept rows
    / span rows: the compaction ratio), ``latency_s`` and, when the event recorded it,
    ``mass_kept`` (the probes' attention mass the compacted block keeps; docs/compaction.md).
    """
    out = {
        "kv_len_before": float(event.kv_len_before),
        "kv_len_after": float(event.kv_len_after),
        "kv_ratio": event.kv_len_after / max(1, event.kv_len_before),
        "span_ratio": event.target / max(1, event.span[1] - event.span[0]),
        "latency_s": event_latency(event),
    }
    if event.mass_kept is not None:
        out["mass_kept"] = float(event.mass_kept)
    return out


def event_values(trajectories: Iterable[Trajectory]) -> dict[str, np.ndarray]:
    """Every event's :func:`event_scalars`, gathered per key (float64 arrays; keys without a value omitted)."""
    values: dict[str, list[float]] = {k: [] for k in EVENT_KEYS}
    for traj in trajectories:
        for event in traj.events:
            for key, value in event_scalars(event).items():
                values[key].append(value)
    return {k: np.asarray(v, dtype=np.float64) for k, v in values.items() if v}


class TrajectoryLogger:
    """Writes trajectories to TensorBoard (``torch.utils.tensorboard.SummaryWriter``).

    Args:
        log_dir: the run's TensorBoard folder (created); ignored when ``writer`` is given.
        writer: an open ``SummaryWriter`` to write into (e.g. the trainer's), not closed by :meth:`close`.
        episode_step, event_step: the first ``episode/*`` and ``compaction/*`` steps (a resumed run
            continues its counts).

    Example:
        >>> with TrajectoryLogger("runs/x/tensorboard") as tb:  # doctest: +SKIP
        ...     for traj in trajectories:
        ...         tb.log_episode(traj)
        ...     tb.log_histograms(trajectories, step=0)
    """

    def __init__(
        self,
        log_dir: str | Path | None = None,
        *,
        writer: Any = None,
        episode_step: int = 0,
        event_step: int = 0,
    ) -> None:
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            if log_dir is None:
                raise InvalidArgumentError("log_dir: TrajectoryLogger needs a log_dir or a writer")
            writer = SummaryWriter(log_dir=str(log_dir))
            self._owned = True
        else:
            self._owned = False
        self.writer = writer
        self.episode_step = episode_step
        self.event_step = event_step

    def log_episode(self, traj: Trajectory, prefix: str = "") -> None:
        """``{prefix}episode/*`` at the next episode step and ``{prefix}compaction/*`` per event."""
        for key, value in episode_scalars(traj).items():
            self.writer.add_scalar(f"{prefix}episode/{key}", value, self.episode_step)
        self.episode_step += 1
        for event in traj.events:
            for key, value in event_scalars(event).items():
                self.writer.add_scalar(f"{prefix}compaction/{key}", value, self.event_step)
            self.event_step += 1

    def log_histograms(self, trajectories: Sequence[Trajectory], step: int, prefix: str = "") -> None:
        """Histograms ``{prefix}compaction/<key>`` of the batch's per-event values, and
        ``{prefix}episode/peak_kv_len`` / ``{prefix}episode/tokens`` across its episodes."""
        for key, values in event_values(trajectories).items():
            self.writer.add_histogram(f"{prefix}compaction/{key}", values, step)
        if trajectories:
            peaks = np.asarray([t.peak_kv_len for t in trajectories], dtype=np.float64)
            tokens = np.asarray([t.num_tokens for t in trajectories], dtype=np.float64)
            self.writer.add_histogram(f"{prefix}episode/peak_kv_len", peaks, step)
            self.writer.add_histogram(f"{prefix}episode/tokens", tokens, step)

    def log_scalars(self, scalars: Mapping[str, float | None], step: int, prefix: str = "") -> None:
        """Plain ``{prefix}<key>`` scalars (``None`` and NaN values skipped)."""
        for key, value in scalars.items():
            if value is None or value != value:
                continue
            self.writer.add_scalar(f"{prefix}{key}", float(value), step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this logger opened it."""
        self.writer.flush()
        if self._owned:
            self.writer.close()

    def __enter__(self) -> TrajectoryLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
