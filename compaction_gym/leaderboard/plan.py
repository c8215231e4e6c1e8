"""``leaderboard cells``: what a run would play, per cell, and how long it may take.

Read-only: counts the episodes already in each cell's ``trajectories.jsonl`` (a torn last line is
not counted, nothing is rewritten) and estimates the time left from the seconds per episode that
earlier invocations measured in this output (``cell.json``'s ``wall_time_s``;
``docs/leaderboard.md``, "Running in parallel").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from compaction_gym.leaderboard.record import RECORD_FILE, TRAJECTORIES_FILE
from compaction_gym.leaderboard.suite import Cell

CELL_FILE = "cell.json"


@dataclass(frozen=True)
class CellPlan:
    """One cell of a run: episodes planned, on disk, to play, and its measured pace."""

    cell: Cell
    planned: int
    on_disk: int
    has_record: bool
    wall_time_s: float
    episodes_timed: int

    @property
    def to_play(self) -> int:
        return self.planned - self.on_disk

    @property
    def seconds_per_episode(self) -> float | None:
        """Measured pace of this cell (``None`` before any episode)."""
        return self.wall_time_s / self.episodes_timed if self.episodes_timed else None


def episodes_on_disk(path: Path) -> set[tuple[str, int]]:
    """``(requested task, env seed)`` of every complete line of a trajectories file, read-only."""
    keys: set[tuple[str, int]] = set()
    if not path.exists():
        return keys
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
            keys.add((str(d["info"].get("eval_task_requested")), int(d["seed"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    return keys


def cell_plan(
    cells: Sequence[Cell], run_seeds: Sequence[int], output: str | Path, limit_episodes: int | None = None
) -> list[CellPlan]:
    """The plan of each cell under ``output`` for a run of ``run_seeds`` (first ``limit_episodes``
    per task and seed)."""
    out = []
    for cell in cells:
        directory = Path(output) / cell.suite / cell.method / cell.budget.label
        have = episodes_on_disk(directory / TRAJECTORIES_FILE)
        wanted = {
            (str(t), e) for t in cell.tasks for s in run_seeds for e in cell.env_seeds(s)[:limit_episodes]
        }
        state: dict[str, Any] = {}
        if (directory / CELL_FILE).exists():
            state = json.loads((directory / CELL_FILE).read_text())
        out.append(
            CellPlan(
                cell=cell,
                planned=len(wanted),
                on_disk=len(wanted & have),
                has_record=(directory / RECORD_FILE).exists(),
                wall_time_s=float(state.get("wall_time_s", 0.0)),
                episodes_timed=len(have),
            )
        )
    return out


def estimate_seconds(plans: Sequence[CellPlan], jobs: int = 1) -> float | None:
    """Wall seconds left with ``jobs`` workers: each cell's remaining episodes at its own pace (or
    the mean pace of the timed cells), spread over the workers (no faster than the longest cell);
    ``None`` when no cell has been timed yet."""
    paces = [p.seconds_per_episode for p in plans if p.seconds_per_episode]
    if not paces:
        return None
    default = sum(paces) / len(paces)
    per_cell = [p.to_play * (p.seconds_per_episode or default) for p in plans]
    return max(sum(per_cell) / max(jobs, 1), max(per_cell, default=0.0))


def format_plan(plans: Sequence[CellPlan], jobs: int = 1) -> str:
    """A table of the plan, one line per cell, and a summary line."""
    lines = [f"{'cell':<40} {'max_kv':>7} {'planned':>8} {'on disk':>8} {'to play':>8} {'s/ep':>7}  record"]
    for p in plans:
        pace = p.seconds_per_episode
        lines.append(
            f"{p.cell.key:<40} {p.cell.budget.max_kv_len or 'full':>7} {p.planned:>8} {p.on_disk:>8} "
            f"{p.to_play:>8} {'-' if pace is None else f'{pace:.1f}':>7}  {'yes' if p.has_record else 'no'}"
        )
    left = sum(p.to_play for p in plans)
    est = estimate_seconds(plans, jobs)
    when = "no timings yet" if est is None else f"about {math.ceil(est / 60)} min with {jobs} job(s)"
    lines.append(f"{len(plans)} cells, {left} of {sum(p.planned for p in plans)} episodes to play; {when}")
    return "\n".join(lines)
