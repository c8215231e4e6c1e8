"""The registry of compaction revisions: consistent, dated, and its predicates name exactly the
methods each revision changed (docs/design-notes.md, "Compaction revisions")."""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import subprocess
from pathlib import Path

import pytest

from compaction_gym.compaction.modes import COMPACTION_MODES, PROBE_SOURCES
from compaction_gym.compaction.revisions import (
    COMPACTION_REVISION,
    REVISIONS,
    revision,
    revision_at,
    stale_since,
)
from compaction_gym.engine.config import CompactionConfig
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard.suite import hashed_compaction

ROOT = Path(__file__).resolve().parents[2]


def test_registry_is_numbered_dated_and_current():
    assert [r.number for r in REVISIONS] == list(range(1, len(REVISIONS) + 1))
    assert COMPACTION_REVISION == REVISIONS[-1].number == 2
    assert REVISIONS[0].date is None and REVISIONS[0].commit is None
    dates = [dt.datetime.fromisoformat(r.date) for r in REVISIONS[1:]]
    assert all(d.tzinfo is not None for d in dates) and dates == sorted(set(dates))
    assert all(r.commit and r.description for r in REVISIONS[1:])
    assert revision(2) is REVISIONS[1]


def test_revision_dates_are_their_commits():
    """Each revision's date is its commit's committer date (where the git history is at hand)."""
    for r in REVISIONS[1:]:
        try:
            out = subprocess.run(
                ["git", "show", "-s", "--format=%cI", r.commit], cwd=ROOT, capture_output=True, text=True
            )
        except OSError:
            pytest.skip("no git")
        if out.returncode:
            pytest.skip(f"commit {r.commit} not in this checkout's history")
        assert dt.datetime.fromisoformat(out.stdout.strip()) == dt.datetime.fromisoformat(r.date)


def test_revision_at_a_time():
    c2 = dt.datetime.fromisoformat(revision(2).date)
    assert revision_at(None) == 1
    assert revision_at((c2 - dt.timedelta(seconds=1)).isoformat()) == 1
    assert revision_at(c2.isoformat()) == 2
    assert revision_at(c2.astimezone(dt.timezone(dt.timedelta(hours=1))).isoformat()) == 2  # same instant
    assert revision_at("2026-11-24T07:27:11+00:00") == 1  # the first committed records


def _affected_by_c2(mode: str, refit: bool) -> bool:
    """Revision 2 (the C2 ridge) changed every mode that fits C2: Attention Matching with the refit on."""
    return mode == "attention_matching" and refit


def _session_configs() -> list[CompactionConfig]:
    """Every valid (mode, refit_values, queries, compute_beta) session config."""
    out = []
    for mode, refit, queries, beta in itertools.product(
        [*COMPACTION_MODES, "none"], (True, False), PROBE_SOURCES, (True, False)
    ):
        with contextlib.suppress(InvalidArgumentError):  # refit_values / compute_beta are AM's
            out.append(
                CompactionConfig(
                    mode=mode,
                    max_kv_len=None if mode == "none" else 256,
                    queries=queries,
                    compute_beta=beta,
                    refit_values=refit,
                )
            )
    return out


def test_revision_2_changed_exactly_the_c2_refit():
    configs = _session_configs()
    assert {c.mode for c in configs} == {*COMPACTION_MODES, "none"}
    assert {(c.refit_values, c.compute_beta) for c in configs if c.mode == "attention_matching"} == set(
        itertools.product((True, False), (True, False))
    )
    for config in configs:
        for form in (config.to_dict(), hashed_compaction(config)):  # the session's and a record's
            since = stale_since(form, 1)
            assert (since is not None) == _affected_by_c2(config.mode, config.refit_values), config
            assert since is None or since.number == 2
            assert stale_since(form, COMPACTION_REVISION) is None  # made now: never stale
