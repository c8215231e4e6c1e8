"""``compaction-gym leaderboard run|show|check``: methods × suites × seeds with honest statistics.

``run SUITE`` plays a suite's (method, budget) cells, resumably, writing one record per cell;
``show`` ranks the records in tables and plots; ``check`` verifies every record's compliance and
lists the stale ones (``docs/leaderboard.md``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from compaction_gym.cli_args import check_output_dir
from compaction_gym.errors import CompactionGymError


def register(subparsers: Any) -> None:
    """Add ``leaderboard`` (with ``run``, ``show``, ``check``) to the ``compaction-gym`` command."""
    from compaction_gym.leaderboard.suite import DEFAULT_OUTPUT

    parser = subparsers.add_parser(
        "leaderboard",
        help="run, show and check the leaderboard: methods x suites x seeds",
        description=(__doc__ or "").split("\n\n")[0],
    )
    sub = parser.add_subparsers(dest="leaderboard_command", metavar="ACTION", required=True)
    run = sub.add_parser("run", help="play a suite's cells (resumable) and write their records")
    run.add_argument("suite", help="suite name (benchmarks/leaderboard/suites/NAME.toml) or a TOML path")
    run.add_argument("--methods", nargs="+", help="methods to run (default: all of the suite's)")
    run.add_argument("--budgets", nargs="+", help="budget labels to run, e.g. kv1024 r0.25 (default: all)")
    run.add_argument("--seeds", nargs="+", type=int, help="a subset of the suite's seeds (default: all)")
    run.add_argument(
        "--limit-episodes",
        type=int,
        help="smoke run: only the first N episodes per task and seed (records stay incomplete until a full run)",
    )
    run.add_argument("--output", default=str(DEFAULT_OUTPUT), help="records root (default: %(default)s)")
    run.add_argument("--device", help="cuda / cpu (default: cuda when available)")
    run.add_argument("--dtype", help="weights/cache dtype (default: float32 on CPU, checkpoint dtype on GPU)")
    run.add_argument("--capacity", type=int, help="KV rows per session slot (default: engine's)")
    run.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="worker processes sharing the device, one cell each at a time, 1 torch thread each "
        "(default: %(default)s: in this process)",
    )
    run.add_argument(
        "--time-limit",
        type=float,
        help="stop the workers after this many seconds, pair the finished records and exit 3 "
        "(re-run to resume; runs in worker processes even with --jobs 1)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.add_argument(
        "--no-tensorboard",
        action="store_true",
        help="write no TensorBoard event files (default: OUTPUT/tensorboard/SUITE/METHOD/BUDGET per cell)",
    )
    run.set_defaults(func=main_run)
    cells = sub.add_parser("cells", help="list a run's cells: episodes planned, on disk, to play, time left")
    cells.add_argument("suite", help="suite name or TOML path")
    cells.add_argument("--methods", nargs="+", help="methods (default: all)")
    cells.add_argument("--budgets", nargs="+", help="budget labels (default: all)")
    cells.add_argument("--seeds", nargs="+", type=int, help="a subset of the suite's seeds")
    cells.add_argument("--limit-episodes", type=int, help="as for run")
    cells.add_argument("--output", default=str(DEFAULT_OUTPUT), help="records root (default: %(default)s)")
    cells.add_argument("--jobs", type=int, default=1, help="workers the time estimate assumes")
    cells.set_defaults(func=main_cells)
    show = sub.add_parser("show", help="ranked tables and plots of the records")
    show.add_argument("--records", default=str(DEFAULT_OUTPUT), help="records root (default: %(default)s)")
    show.add_argument(
        "--format", choices=("md", "html"), default="md", help="page format (default: %(default)s)"
    )
    show.add_argument("--output", help="where the page and PNGs go (default: the records root)")
    show.add_argument(
        "--update-doc",
        metavar="DOC",
        help="rewrite the generated block of a markdown page (e.g. docs/leaderboard.md) with the tables, "
        "plots going to --output (default: DOC's folder/img/leaderboard)",
    )
    show.set_defaults(func=main_show)
    check = sub.add_parser(
        "check", help="verify every record's compliance (writes compliance.json); list stale records"
    )
    check.add_argument("--records", default=str(DEFAULT_OUTPUT), help="records root (default: %(default)s)")
    check.set_defaults(func=main_check)


def main_run(args: argparse.Namespace) -> int:
    from compaction_gym.leaderboard.lm_suite import LM_KIND, suite_kind
    from compaction_gym.leaderboard.parallel import RunIncomplete

    engine = {
        k: v for k, v in (("device", args.device), ("dtype", args.dtype), ("capacity", args.capacity)) if v
    }
    try:
        check_output_dir(args.output, "--output")
        run = _run_lm if suite_kind(args.suite) == LM_KIND else _run_env
        paths = run(args, engine)
    except RunIncomplete as exc:
        print(f"compaction-gym leaderboard run: {exc}", file=sys.stderr)
        return 3
    except CompactionGymError as exc:
        print(f"compaction-gym leaderboard run: {exc}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    return 0


def main_cells(args: argparse.Namespace) -> int:
    from compaction_gym.leaderboard.plan import cell_plan, format_plan
    from compaction_gym.leaderboard.runner import select_cells
    from compaction_gym.leaderboard.suite import load_suite

    try:
        suite = load_suite(args.suite)
        cells, run_seeds = select_cells(suite, args.methods, args.budgets, args.seeds)
    except CompactionGymError as exc:
        print(f"compaction-gym leaderboard cells: {exc}", file=sys.stderr)
        return 2
    print(format_plan(cell_plan(cells, run_seeds, args.output, args.limit_episodes), args.jobs))
    return 0


def _run_env(args: argparse.Namespace, engine: dict[str, Any]) -> list[Any]:
    """``leaderboard run`` of an env suite: in this process, or in workers with ``--jobs`` /
    ``--time-limit``."""
    from compaction_gym.leaderboard.parallel import run_suite_parallel
    from compaction_gym.leaderboard.runner import run_suite
    from compaction_gym.leaderboard.suite import load_suite

    suite = load_suite(args.suite)
    common: dict[str, Any] = {
        "methods": args.methods,
        "budgets": args.budgets,
        "seeds": args.seeds,
        "output": args.output,
        "engine_kwargs": engine,
        "progress": not args.no_progress,
        "limit_episodes": args.limit_episodes,
        "tensorboard": not args.no_tensorboard,
    }
    if args.jobs != 1 or args.time_limit is not None:
        return run_suite_parallel(suite, jobs=args.jobs, time_limit=args.time_limit, **common)
    return run_suite(suite, **common)


def _run_lm(args: argparse.Namespace, engine: dict[str, Any]) -> list[Any]:
    """``leaderboard run`` of a language-modelling suite (``kind = "lm"``)."""
    from compaction_gym.errors import InvalidArgumentError
    from compaction_gym.leaderboard.lm_runner import run_lm_suite
    from compaction_gym.leaderboard.lm_suite import load_lm_suite

    if args.limit_episodes is not None:
        raise InvalidArgumentError("--limit-episodes: an lm suite has no episodes (its text has max_tokens)")
    return run_lm_suite(
        load_lm_suite(args.suite),
        methods=args.methods,
        budgets=args.budgets,
        seeds=args.seeds,
        output=args.output,
        engine_kwargs=engine,
    )


def main_show(args: argparse.Namespace) -> int:
    from pathlib import Path

    from compaction_gym.leaderboard.report import doc_section, show, update_doc

    if args.update_doc:
        if args.format != "md":
            print("compaction-gym leaderboard show: --update-doc needs --format md", file=sys.stderr)
            return 2
        img = Path(args.output) if args.output else Path(args.update_doc).parent / "img" / "leaderboard"
        try:
            section, plots = doc_section(args.records, args.update_doc, img)
            update_doc(args.update_doc, section)
        except CompactionGymError as exc:
            print(f"compaction-gym leaderboard show: {exc}", file=sys.stderr)
            return 2
        print(section)
        for p in plots:
            print(f"wrote {p}", file=sys.stderr)
        print(f"updated {args.update_doc}", file=sys.stderr)
        return 0

    page, plots = show(args.records, args.output, args.format)
    print(page if args.format == "md" else f"wrote leaderboard.html ({len(page)} bytes)")
    for p in plots:
        print(f"wrote {p}", file=sys.stderr)
    return 0


def main_check(args: argparse.Namespace) -> int:
    from compaction_gym.leaderboard.compliance import check_all
    from compaction_gym.leaderboard.staleness import stale_records, stale_report

    results = check_all(args.records)
    for res in results:
        print(f"{'ok  ' if res.ok else 'FAIL'} {res.path}")
        for f in res.failures:
            print(f"     - {f}")
    failed = sum(not r.ok for r in results)
    print(f"{len(results)} records, {failed} failing")
    # stale records are reported, not failed: a record is what its run measured (docs/leaderboard.md)
    print(stale_report(stale_records(args.records), args.records))
    return 1 if failed else 0
