"""Evaluation on top of the agents: statistics, summaries, tables, and the ``eval`` command.

Layer: imports ``agents`` (which plays the episodes, :func:`compaction_gym.agents.evaluate.play`);
the leaderboard (:mod:`compaction_gym.leaderboard`) builds on it. ``docs/eval.md``.
"""

from __future__ import annotations

from compaction_gym.evaluation.evaluate import evaluate
from compaction_gym.evaluation.stats import PairedComparison, mean, paired_comparison, pop_se, sample_se
from compaction_gym.evaluation.summary import SUMMARY_SCHEMA, episode_stats, summarize

__all__ = [
    "SUMMARY_SCHEMA",
    "PairedComparison",
    "episode_stats",
    "evaluate",
    "mean",
    "paired_comparison",
    "pop_se",
    "sample_se",
    "summarize",
]
