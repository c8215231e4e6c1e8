"""The ``compaction-gym`` command. Each subcommand lives next to the code it drives and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed args)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import compaction_gym

#: subcommand -> (module that registers it, one-line help used if the module cannot be imported)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "eval": ("compaction_gym.agents.evaluate", "run an agent on an env for N episodes and summarise"),
    "eval-lm": ("compaction_gym.lmeval.cli", "perplexity / bits per byte of a text under compacted KV caches"),
    "serve": ("compaction_gym.servers.cli", "serve the session API over HTTP"),
    "train": ("compaction_gym.trainers.cli", "train with GRPO replay, tree SFT or GJS distillation"),
    "demos": ("compaction_gym.demos.cli", "record expert-bot BabyAI demonstrations through compacted sessions"),
    "bench": ("compaction_gym.bench", "run a performance benchmark from benchmarks/"),
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="compaction-gym",
        description="LLM agents in Gymnasium envs with compacted KV-cache sessions, and their trainers.",
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
