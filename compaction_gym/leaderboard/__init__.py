"""The leaderboard: suites of (method, budget) cells, resumable runs, records with provenance,
paired statistics against full KV, compliance checks, tables and plots (``docs/leaderboard.md``).

Layer: on top of :mod:`compaction_gym.evaluation` and :mod:`compaction_gym.agents`; only the CLI
imports it.
"""

from __future__ import annotations

from compaction_gym.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CheckResult": "compaction_gym.leaderboard.compliance",
    "check_all": "compaction_gym.leaderboard.compliance",
    "check_record": "compaction_gym.leaderboard.compliance",
    "RECORD_SCHEMA": "compaction_gym.leaderboard.record",
    "schema_errors": "compaction_gym.leaderboard.record",
    "RunIncomplete": "compaction_gym.leaderboard.parallel",
    "run_suite_parallel": "compaction_gym.leaderboard.parallel",
    "CellPlan": "compaction_gym.leaderboard.plan",
    "cell_plan": "compaction_gym.leaderboard.plan",
    "run_suite": "compaction_gym.leaderboard.runner",
    "Budget": "compaction_gym.leaderboard.suite",
    "Cell": "compaction_gym.leaderboard.suite",
    "Suite": "compaction_gym.leaderboard.suite",
    "load_suite": "compaction_gym.leaderboard.suite",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
