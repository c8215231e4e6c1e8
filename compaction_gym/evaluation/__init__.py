"""Evaluation on top of the agents: statistics, summaries, tables, and the ``eval`` command.

Layer: imports ``agents`` (which plays the episodes, :func:`compaction_gym.agents.evaluate.play`);
the leaderboard (:mod:`compaction_gym.leaderboard`) builds on it. ``docs/eval.md``.
"""

from __future__ import annotations

from compaction_gym.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "evaluate": "compaction_gym.evaluation.run",
    "PairedComparison": "compaction_gym.evaluation.stats",
    "mean": "compaction_gym.evaluation.stats",
    "paired_comparison": "compaction_gym.evaluation.stats",
    "pop_se": "compaction_gym.evaluation.stats",
    "sample_se": "compaction_gym.evaluation.stats",
    "SUMMARY_SCHEMA": "compaction_gym.evaluation.summary",
    "episode_stats": "compaction_gym.evaluation.summary",
    "summarize": "compaction_gym.evaluation.summary",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
