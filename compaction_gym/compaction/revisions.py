"""Revisions of the compaction math: which results a change of it made stale (docs/design-notes.md,
"Compaction revisions").

A change that alters what compaction outputs beyond float rounding gets a new :class:`Revision`
in :data:`REVISIONS`, with a predicate over a method's compaction config (a
``CompactionConfig.to_dict()``, or a leaderboard record's ``config["compaction"]``) saying which
methods it changed. Results made under an earlier revision of a method a later one changed are
stale (``docs/leaderboard.md``, "Stale records").

>>> COMPACTION_REVISION
2
>>> stale_since({"mode": "attention_matching"}, 1).number
2
>>> stale_since({"mode": "attention_matching", "refit_values": False}, 1) is None
True
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Revision:
    """One revision of the compaction math.

    Attributes:
        number: 1, 2, ... in order.
        date: when it landed (ISO 8601 with its UTC offset, the commit's time); ``None`` for 1.
        commit: the commit that made it (``None`` for 1: everything before revision 2).
        description: what changed, in one line.
        changed: whether it changed a method's results, given its compaction config.
    """

    number: int
    date: str | None
    commit: str | None
    description: str
    changed: Callable[[Mapping[str, Any]], bool]

    def name(self) -> str:
        """``revision 2 (2026-11-25, 3e2e58d)``."""
        return f"revision {self.number}" + (f" ({self.date[:10]}, {self.commit})" if self.date else "")

    def label(self) -> str:
        """``revision 2 (2026-11-25, 3e2e58d): <description>``."""
        return f"{self.name()}: {self.description}"


def refits_c2(compaction: Mapping[str, Any]) -> bool:
    """Attention Matching with the C2 value refit on (``refit_values`` defaults to true)."""
    return (
        compaction.get("mode") == "attention_matching" and compaction.get("refit_values", True) is not False
    )


REVISIONS: tuple[Revision, ...] = (
    Revision(1, None, None, "Attention Matching as first released (C2 ridge toward 0)", lambda c: True),
    Revision(
        2,
        "2026-11-25T20:07:46+00:00",
        "3e2e58d",
        "C2's ridge pulls toward the kept rows' own values, up to 100x at <= 1 probe per kept key",
        refits_c2,
    ),
)

#: The revision of the compaction math this code runs (the last of :data:`REVISIONS`).
COMPACTION_REVISION: int = REVISIONS[-1].number


def revision(number: int) -> Revision:
    """The revision numbered ``number``."""
    return REVISIONS[number - 1]


def revision_at(timestamp: str | None) -> int:
    """The revision in force at ``timestamp`` (ISO 8601 with offset): the last one that landed at or
    before it; ``1`` without a timestamp."""
    if timestamp is None:
        return 1
    t = _dt.datetime.fromisoformat(timestamp)
    return max(r.number for r in REVISIONS if r.date is None or _dt.datetime.fromisoformat(r.date) <= t)


def stale_since(compaction: Mapping[str, Any], made_at: int) -> Revision | None:
    """The first revision after ``made_at`` that changed the method of ``compaction``; ``None``
    when results made at ``made_at`` still hold."""
    return next((r for r in REVISIONS[made_at:] if r.changed(compaction)), None)
