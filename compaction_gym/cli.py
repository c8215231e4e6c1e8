"""The ``compaction-gym`` command. Each subcommand lives next to the code it drives and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed args)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

import compaction_gym
from compaction_gym.errors import CompactionGymError

#: subcommand -> (module that registers it, one-line help used if the module cannot be imported)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("compaction_gym.evaluation.cli", "run an agent on an env for N episodes and summarise"),
    "leaderboard": (
        "compaction_gym.leaderboard.cli",
        "run, show and check the leaderboard: methods x suites x seeds",
    ),
    "rsa": (
        "compaction_gym.evaluation.rsa_cli",
        "Recursive Self-Aggregation vs plain sampling on a math env (accuracy vs tokens)",
    ),
    "eval-lm": ("compaction_gym.lmeval.cli", "perplexity / bits per byte of a text under compacted KV caches"),
    "serve": ("compaction_gym.servers.cli", "serve the session API over HTTP"),
    "train": ("compaction_gym.trainers.cli", "train with GRPO replay, tree SFT or GJS distillation"),
    "demos": ("compaction_gym.demos.cli", "record expert-bot BabyAI demonstrations through compacted sessions"),
    "plot": (
        "compaction_gym.plots.cli",
        "draw PNGs: one episode's KV length, attention mass kept per event, leaderboard curves",
    ),
    "bench": ("compaction_gym.bench", "run a performance benchmark from benchmarks/"),
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compaction-gym",
        description="LLM agents in Gymnasium envs with compacted KV-cache sessions, and their trainers.",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="CPU threads for torch (default: $COMPACTION_GYM_THREADS, else 1 on machines with <= 2 "
        "cores, where a second thread competing with other work makes runs up to 10x slower; "
        "else torch's own default)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    version = sub.add_parser("version", help="print the package version")
    version.set_defaults(func=lambda args: print(compaction_gym.__version__))
    for name, (module, help_text) in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise
            unavailable = sub.add_parser(name, help=f"{help_text} (not available: {exc.name} missing)")
            unavailable.set_defaults(func=_unavailable(name, str(exc)))
            continue
        mod.register(sub)
    return parser


def _unavailable(name: str, reason: str):
    def run(args: argparse.Namespace) -> int:
        print(f"compaction-gym {name}: not available in this install ({reason})", file=sys.stderr)
        return 2

    return run


def cpu_threads(requested: int | None) -> int | None:
    """The torch CPU thread count a command runs with (``None``: torch's default); see ``--threads``."""
    if requested is None and os.environ.get("COMPACTION_GYM_THREADS"):
        requested = int(os.environ["COMPACTION_GYM_THREADS"])
    if requested is None and (os.cpu_count() or 1) <= 2:
        requested = 1
    return requested


def _apply_threads(threads: int | None) -> None:
    """Before torch is imported, its thread pools read these; after, set them directly."""
    if threads is None:
        return
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(threads)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    try:
        threads = cpu_threads(args.threads)
    except ValueError:
        parser.error(f"COMPACTION_GYM_THREADS must be an integer, got {os.environ['COMPACTION_GYM_THREADS']!r}")
    if threads is not None and threads < 1:
        parser.error(f"--threads must be >= 1, got {threads}")
    if args.threads is not None or "OMP_NUM_THREADS" not in os.environ:
        _apply_threads(threads)
    try:
        result = args.func(args)
    except KeyboardInterrupt:  # what finished is kept by the commands (records and JSONL are appended as they go)
        print(f"compaction-gym {args.command}: interrupted", file=sys.stderr)
        return 130
    except CompactionGymError as exc:
        print(f"compaction-gym {args.command}: {exc}", file=sys.stderr)
        return 2
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
