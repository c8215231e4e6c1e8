"""``compaction-gym plot episode|mass|leaderboard``: PNG figures of trajectories and leaderboard records
(docs/plots.md). matplotlib is imported only when a plot is drawn (``pip install compaction-gym[plot]``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    """Add ``plot`` (with ``episode``, ``mass``, ``leaderboard``) to the ``compaction-gym`` command."""
    parser = subparsers.add_parser(
        "plot",
        help="draw PNGs: one episode's KV length, attention mass kept per event, leaderboard curves",
        description="Figures people would rather see than read (docs/plots.md).",
    )
    sub = parser.add_subparsers(dest="plot_command", metavar="FIGURE", required=True)
    episode = sub.add_parser(
        "episode", help="one episode's KV length over logical tokens, compaction events marked"
    )
    episode.add_argument("trajectories", help="a trajectories.jsonl file (eval, leaderboard, write_jsonl)")
    episode.add_argument("--index", type=int, default=0, help="which episode: 0-based line (default: %(default)s)")
    episode.add_argument("--output", help="PNG path (default: TRAJECTORIES_episodeINDEX.png beside the file)")
    episode.set_defaults(func=main_episode)
    mass = sub.add_parser(
        "mass", help="attention mass kept per compaction event (events recorded with eval --record-mass)"
    )
    mass.add_argument("trajectories", help="a trajectories.jsonl file")
    mass.add_argument("--index", type=int, nargs="+", help="episodes to draw, 0-based lines (default: all)")
    mass.add_argument("--output", help="PNG path (default: TRAJECTORIES_mass.png beside the file)")
    mass.set_defaults(func=main_mass)
    board = sub.add_parser(
        "leaderboard", help="score vs KV budget and vs compression ratio per suite (as `leaderboard show` draws)"
    )
    board.add_argument("records", help="leaderboard records root (leaderboard run --output)")
    board.add_argument("--output", help="folder for SUITE_budget.png and SUITE_compression.png (default: RECORDS)")
    board.set_defaults(func=main_leaderboard)


def _beside(path: str, suffix: str) -> Path:
    p = Path(path)
    return p.with_name(f"{p.stem}_{suffix}.png")


def main_episode(args: argparse.Namespace) -> int:
    from compaction_gym.plots.episode import plot_episode, read_trajectory, save

    traj = read_trajectory(args.trajectories, args.index)
    path = save(plot_episode(traj), args.output or _beside(args.trajectories, f"episode{args.index}"))
    print(f"wrote {path}")
    return 0


def main_mass(args: argparse.Namespace) -> int:
    from compaction_gym.agents.trajectory import read_jsonl
    from compaction_gym.errors import InvalidArgumentError
    from compaction_gym.plots.episode import plot_mass, read_trajectory, save

    if args.index:
        trajs = [read_trajectory(args.trajectories, i) for i in args.index]
    else:
        if not Path(args.trajectories).is_file():
            raise InvalidArgumentError(f"trajectories: no file {args.trajectories}")
        trajs = read_jsonl(args.trajectories)
    path = save(plot_mass(trajs), args.output or _beside(args.trajectories, "mass"))
    print(f"wrote {path}")
    return 0


def main_leaderboard(args: argparse.Namespace) -> int:
    from compaction_gym.errors import InvalidArgumentError
    from compaction_gym.leaderboard.report import load_records, plot

    records = load_records(args.records)
    if not records:
        raise InvalidArgumentError(f"records: no leaderboard record under {args.records}")
    out = Path(args.output or args.records)
    out.mkdir(parents=True, exist_ok=True)
    for suite, entries in sorted(records.items()):
        for path in plot(suite, entries, out):
            print(f"wrote {path}", file=sys.stdout)
    return 0
