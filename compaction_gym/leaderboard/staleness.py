"""Stale records: made under an earlier revision of the compaction math that a later revision changed
for their method (:mod:`compaction_gym.compaction.revisions`; docs/leaderboard.md, "Stale records").

A record (or a cell's ``cell.json``) names the revision it was made under in
``compaction_revision``; one from before that field by the revision in force at its
``started_at``. ``check`` lists stale records with the commands that re-run them (staleness is no
compliance failure), ``show`` marks them with :data:`STALE_MARK`, and the runner refuses to resume
a cell whose episodes on disk are stale (:func:`refuse_stale_cell`).
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compaction_gym.compaction.revisions import COMPACTION_REVISION, Revision, revision_at, stale_since
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard.compliance import find_records
from compaction_gym.leaderboard.suite import SUITES_DIR

#: what ``show`` puts after a stale record's score.
STALE_MARK = "†"


def made_at(provenance: Mapping[str, Any]) -> int:
    """The compaction revision a record's ``provenance`` (or a ``cell.json``) was made under: its
    ``compaction_revision``, else the revision in force at its ``started_at`` (1 without one)."""
    rev = provenance.get("compaction_revision")
    return int(rev) if rev is not None else revision_at(provenance.get("started_at"))


def record_stale(record: Mapping[str, Any]) -> Revision | None:
    """The revision that made ``record`` stale (the first after its own that changed its method);
    ``None`` when it holds."""
    return stale_since(record["config"]["compaction"], made_at(record["provenance"]))


@dataclass(frozen=True)
class StaleRecord:
    """One stale record: where it is, its cell, the revision it was made under and the one it predates."""

    path: Path
    suite: str
    suite_arg: str
    method: str
    budget: str
    made_at: int
    since: Revision

    @property
    def cell(self) -> str:
        return f"{self.suite} {self.method}/{self.budget}"


def suite_arg(record: Mapping[str, Any]) -> str:
    """What ``leaderboard run`` takes for the record's suite: its name when the file is the bundled
    suite of that name, else the file's path."""
    name, file = record["suite"]["name"], record["suite"]["file"]
    bundled = SUITES_DIR / f"{name}.toml"
    return name if bundled.exists() and str(bundled).endswith(file) else file


def stale_records(root: str | Path) -> list[StaleRecord]:
    """Every stale record under ``root`` (unreadable records are ``check``'s business, skipped here)."""
    out = []
    for path in find_records(root):
        try:
            record = json.loads(path.read_text())
            since = record_stale(record)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if since is not None:
            out.append(
                StaleRecord(
                    path.parent,
                    record["suite"]["name"],
                    suite_arg(record),
                    record["method"],
                    record["budget"]["label"],
                    made_at(record["provenance"]),
                    since,
                )
            )
    return out


def rerun_commands(stale: Sequence[StaleRecord], root: str | Path) -> list[str]:
    """Per suite, the shell command that re-runs its stale cells: delete their folders (the runner
    does not resume a stale cell), then ``leaderboard run`` them into ``root``."""
    by_suite: dict[str, list[StaleRecord]] = {}
    for s in stale:
        by_suite.setdefault(s.suite_arg, []).append(s)
    out = []
    for arg, cells in by_suite.items():
        methods = list(dict.fromkeys(s.method for s in cells))
        budgets = list(dict.fromkeys(s.budget for s in cells))
        out.append(
            f"rm -r {' '.join(shlex.quote(str(s.path)) for s in cells)} && compaction-gym leaderboard run "
            f"{shlex.quote(arg)} --methods {' '.join(methods)} --budgets {' '.join(budgets)} "
            f"--output {shlex.quote(str(root))}"
        )
    return out


def stale_report(stale: Sequence[StaleRecord], root: str | Path) -> str:
    """``check``'s section on stale records: how many, which (per revision they predate and suite,
    with the revision each was made under), and the commands that re-run them."""
    if not stale:
        return f"0 stale records (compaction revision {COMPACTION_REVISION})"
    lines = [
        f"{len(stale)} stale records (not a compliance failure; (rN): the compaction revision it was "
        "made under; docs/leaderboard.md, 'Stale records'):"
    ]
    for number in sorted({s.since.number for s in stale}):
        group = [s for s in stale if s.since.number == number]
        lines.append(f"  made before {group[0].since.label()}:")
        for suite in dict.fromkeys(s.suite for s in group):
            cells = [f"{s.method}/{s.budget} (r{s.made_at})" for s in group if s.suite == suite]
            lines.append(f"    {suite}: {', '.join(cells)}")
    lines.append("re-run them with:")
    lines += [f"  {c}" for c in rerun_commands(stale, root)]
    return "\n".join(lines)


def stale_note(records: Sequence[Mapping[str, Any]]) -> str | None:
    """The footnote of a table whose rows include stale ``records`` (``None`` when none is)."""
    since = {r.number: r for r in (record_stale(rec) for rec in records) if r is not None}
    if not since:
        return None
    revs = "; ".join(r.label() for _, r in sorted(since.items()))
    return (
        f"{STALE_MARK} stale: made before compaction {revs}. `compaction-gym leaderboard check` "
        "lists the commands that re-run them."
    )


def refuse_stale_cell(directory: Path, compaction: Mapping[str, Any], played_at: int) -> None:
    """Refuse to resume a cell whose episodes on disk were played under compaction revision
    ``played_at`` when a later revision changed the cell's method (``compaction``): resuming would
    mix episodes of two revisions in one record.

    Raises:
        InvalidArgumentError: the cell's episodes are stale; names the folder and the fix.
    """
    since = stale_since(compaction, played_at)
    if since is not None:
        raise InvalidArgumentError(
            f"{directory}: its episodes were played under compaction revision {played_at}, and "
            f"{since.name()} changed this method's results ({since.description}): resuming would "
            "mix the two. Delete that directory (or use another --output) to re-run the cell afresh"
        )
