"""The leaderboard: suites of (method, budget) cells, resumable runs, records with provenance,
paired statistics against full KV, compliance checks, tables and plots (``docs/leaderboard.md``).

Layer: on top of :mod:`compaction_gym.evaluation` and :mod:`compaction_gym.agents`; only the CLI
imports it.
"""

from __future__ import annotations

from compaction_gym.leaderboard.compliance import CheckResult, check_all, check_record
from compaction_gym.leaderboard.record import RECORD_SCHEMA, schema_errors
from compaction_gym.leaderboard.runner import run_suite
from compaction_gym.leaderboard.suite import Budget, Cell, Suite, load_suite

__all__ = [
    "RECORD_SCHEMA",
    "Budget",
    "Cell",
    "CheckResult",
    "Suite",
    "check_all",
    "check_record",
    "load_suite",
    "run_suite",
    "schema_errors",
]
