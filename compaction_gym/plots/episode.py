"""Figures of trajectories (docs/plots.md): one episode's KV length over time with its compaction
events, and the attention mass each event kept.

The data functions (:func:`kv_timeline`, :func:`event_points`, :func:`mass_series`) are pure; the
figures are drawn on a ``matplotlib.figure.Figure`` with an Agg canvas, so nothing here switches
the caller's pyplot backend (a notebook keeps its own).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compaction_gym.agents.tensorboard import final_kv_len
from compaction_gym.agents.trajectory import Trajectory
from compaction_gym.errors import InvalidArgumentError


def kv_timeline(traj: Trajectory) -> tuple[list[int], list[int]]:
    """KV rows against logical tokens fed, as the corners of a piecewise-linear line.

    Every fed token adds one cache row (``kv = fed − position_offset``), and an event at ``fed =
    logical_len`` drops the cache from ``kv_len_before`` to ``kv_len_after`` (a vertical step). The
    line starts at ``(0, 0)``, has two corners per event and ends at the session's last cache length
    (the last sampled token is never fed, docs/engine.md).

    Returns:
        ``(xs, ys)``: logical tokens fed, cache rows.
    """
    xs, ys = [0], [0]
    offset = 0
    for e in traj.events:
        xs += [e.logical_len, e.logical_len]
        ys += [e.kv_len_before, e.kv_len_after]
        offset = e.logical_len - e.kv_len_after
    end = final_kv_len(traj)
    xs.append(end + offset)
    ys.append(end)
    return xs, ys


def event_points(traj: Trajectory) -> tuple[list[int], list[int], list[int]]:
    """Each event's logical position, cache rows before and after (the markers of :func:`plot_episode`)."""
    return (
        [e.logical_len for e in traj.events],
        [e.kv_len_before for e in traj.events],
        [e.kv_len_after for e in traj.events],
    )


def mass_series(traj: Trajectory) -> tuple[list[int], list[float]]:
    """``(event index, mass_kept)`` of the events that recorded their mass (docs/compaction.md, "Mass kept")."""
    pairs = [(e.index, e.mass_kept) for e in traj.events if e.mass_kept is not None]
    return [i for i, _ in pairs], [float(m) for _, m in pairs]


def _figure(width: float = 7.0, height: float = 3.6) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _label(traj: Trajectory) -> str:
    task = traj.info.get("eval_task")
    parts = [traj.env_id or "episode", str(task) if task else "", f"seed {traj.seed}" if traj.seed is not None else ""]
    mode = traj.compaction.get("mode")
    if mode and mode != "none":
        parts.append(f"mode={mode}")
    return " · ".join(p for p in parts if p)


def plot_episode(traj: Trajectory) -> Any:
    """One episode's KV length over logical tokens, compaction events marked, ``max_kv_len`` dashed.

    Artists (tests read them): ``ax.lines[0]`` is the KV line (:func:`kv_timeline`);
    ``ax.collections[0]`` the event markers at ``(logical_len, kv_len_after)``, drawn only when
    the episode has events; the budget line (``max_kv_len`` from the trajectory's compaction
    config) is labelled ``max_kv_len``.

    Returns:
        The ``matplotlib.figure.Figure``.
    """
    fig, ax = _figure()
    xs, ys = kv_timeline(traj)
    ax.plot(xs, ys, color="tab:blue", linewidth=1.4, label="KV rows")
    ex, before, after = event_points(traj)
    if ex:
        ax.scatter(ex, after, color="tab:red", marker="v", zorder=3, label=f"compaction ({len(ex)} events)")
        ax.vlines(ex, after, before, color="tab:red", linewidth=0.8, alpha=0.6)
    budget = traj.compaction.get("max_kv_len")
    if budget:
        ax.axhline(budget, color="grey", linestyle="--", linewidth=1, label="max_kv_len")
    tokens = traj.num_tokens
    ax.plot([0, tokens], [0, tokens], color="grey", linewidth=0.8, alpha=0.5, label="no compaction")
    ax.set_xlabel("logical tokens fed")
    ax.set_ylabel("KV cache rows")
    ax.set_title(_label(traj), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


def plot_mass(trajectories: Sequence[Trajectory]) -> Any:
    """Attention mass kept per event: one line per episode (``ax.lines[i]`` is the i-th episode
    with recorded mass, :func:`mass_series`), 1.0 dotted.

    Raises:
        InvalidArgumentError: no event of ``trajectories`` recorded ``mass_kept``.
    """
    series = [(t, *mass_series(t)) for t in trajectories]
    series = [s for s in series if s[1]]
    if not series:
        raise InvalidArgumentError(
            "trajectories: no compaction event recorded mass_kept; run `compaction-gym eval --record-mass` "
            "(or Engine(record_mass=True))"
        )
    fig, ax = _figure()
    for traj, idx, mass in series:
        ax.plot(idx, mass, marker="o", markersize=3, linewidth=1, label=_label(traj))
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("compaction event")
    ax.set_ylabel("attention mass kept (block / span)")
    ax.set_title("attention mass kept per event", fontsize=9)
    ax.grid(alpha=0.3)
    if len(series) <= 10:
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def read_trajectory(path: str | Path, index: int = 0) -> Trajectory:
    """The ``index``-th trajectory of a JSONL file (0-based, blank lines skipped), decoding only that line.

    Raises:
        InvalidArgumentError: no such file, a negative index, an index past the end, or a line that
            is not a trajectory.
    """
    path = Path(path)
    if not path.is_file():
        raise InvalidArgumentError(f"trajectories: no file {path}")
    if index < 0:
        raise InvalidArgumentError(f"index must be >= 0, got {index}")
    seen = 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if seen == index:
                try:
                    return Trajectory.from_dict(json.loads(line))
                except (KeyError, ValueError, TypeError) as exc:
                    raise InvalidArgumentError(f"trajectories: {path}:{lineno} is not a trajectory ({exc})") from exc
            seen += 1
    raise InvalidArgumentError(f"index {index} is past the end of {path} ({seen} trajectories)")


def save(fig: Any, path: str | Path) -> Path:
    """Write ``fig`` as a PNG (folders created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path
