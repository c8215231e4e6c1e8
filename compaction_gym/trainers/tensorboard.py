"""TensorBoard histograms of a trainer's rollouts, in the trainer's own TensorBoard run.

TRL's ``TensorBoardCallback`` writes the scalars a trainer logs (``train/rollout/*``,
``train/compaction/*``, ``train/replay/*``; :func:`~compaction_gym.trainers.rollouts.rollout_metrics`).
Scalars are means; :class:`RolloutHistogramCallback` adds the distributions behind them — per
compaction event ratio, latency, KV lengths, and per episode peak KV and tokens — through the same
:class:`~compaction_gym.agents.tensorboard.TrajectoryLogger` that ``eval`` and the leaderboard use
(docs/tensorboard.md).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback
from transformers.integrations import TensorBoardCallback

from compaction_gym.agents.tensorboard import TrajectoryLogger
from compaction_gym.agents.trajectory import Trajectory


class RolloutHistogramCallback(TrainerCallback):
    """Histograms of the rollouts played since the last log, written at each log step.

    Args:
        trainer: the trainer whose ``TensorBoardCallback`` writer receives the histograms
            (looked up at log time; nothing is written when the trainer has none).

    Tags: ``train/compaction/<key>`` (``kv_len_before``, ``kv_len_after``, ``kv_ratio``,
    ``span_ratio``, ``latency_s``, ``mass_kept`` when recorded) and ``train/episode/peak_kv_len``,
    ``train/episode/tokens``; ``eval/...`` for rollouts logged with evaluation metrics.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.pending: list[Trajectory] = []

    def add(self, trajectories: list[Trajectory]) -> None:
        """Queue one rollout batch (an :class:`EnvRollouts` listener)."""
        self.pending.extend(trajectories)

    def writer(self) -> Any:
        """The trainer's TensorBoard ``SummaryWriter`` (``None`` before training starts or without one)."""
        for cb in self.trainer.callback_handler.callbacks:
            if isinstance(cb, TensorBoardCallback):
                return cb.tb_writer
        return None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        pending, self.pending = self.pending, []
        writer = self.writer()
        if not state.is_world_process_zero or not pending or writer is None:
            return
        prefix = "eval/" if any(k.startswith("eval_") for k in logs or {}) else "train/"
        TrajectoryLogger(writer=writer).log_histograms(pending, state.global_step, prefix=prefix)
        writer.flush()


def attach_rollout_histograms(trainer: Any) -> RolloutHistogramCallback | None:
    """Add a :class:`RolloutHistogramCallback` to a trainer with ``trainer.rollouts``
    (:class:`~compaction_gym.trainers.rollouts.EnvRollouts`) when it reports to TensorBoard.

    Returns:
        The callback, or ``None`` when ``"tensorboard"`` is not in ``trainer.args.report_to``.
    """
    report_to = trainer.args.report_to or []
    if "tensorboard" not in ([report_to] if isinstance(report_to, str) else report_to):
        return None
    callback = RolloutHistogramCallback(trainer)
    trainer.add_callback(callback)
    trainer.rollouts.listeners.append(callback.add)
    return callback
