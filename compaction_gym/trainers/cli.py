"""``compaction-gym train TRAINER ...``: a small dispatcher. Each trainer's CLI module exposes
``register_train(subparsers)``, which adds its sub-command and sets ``func``; list it in
:data:`TRAINER_MODULES`. Modules are imported when the parser is built, so keep them light (import
trl and torch inside the command's ``main``)."""

from __future__ import annotations

import argparse
import importlib

#: Modules contributing ``register_train(subparsers)``, in help order.
TRAINER_MODULES: tuple[str, ...] = (
    "compaction_gym.trainers.grpo.cli",
    "compaction_gym.trainers.tree_sft.cli",
    "compaction_gym.trainers.gjs.cli",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``train`` command and every available trainer's sub-command."""
    train = subparsers.add_parser(
        "train",
        help="train with GRPO replay, tree SFT or GJS distillation",
        description="Train a model with one of the compaction-gym trainers.",
    )
    sub = train.add_subparsers(dest="trainer", metavar="TRAINER")
    for name in TRAINER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # that trainer's module is not part of this install
            if exc.name is None or not name.startswith(exc.name):
                raise
            continue
        module.register_train(sub)

    def run(args: argparse.Namespace) -> int:
        train.print_help()
        return 0

    train.set_defaults(func=run)
