"""Script-argument dataclasses as command lines: one flag per field, defaults < ``--config`` TOML < flags.

Every ``compaction-gym train ...`` command is a dataclass of script arguments (TRL's pattern): each
field's ``metadata`` carries its ``help`` text and, optionally, its ``choices``. This module turns
such a dataclass into argparse flags and merges the three sources back into an instance::

    @dataclass
    class MyScriptArguments:
        model: str | None = field(default=None, metadata={"help": "model path (required)"})
        steps: int = field(default=10, metadata={"help": "optimizer steps"})
        training: dict[str, Any] = field(default_factory=dict, metadata={"help": "TOML only"})

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, MyScriptArguments, skip=("training",))
    script = load_script_arguments(MyScriptArguments, parser.parse_args(argv), required=("model",))

Flags are built from the field's annotation: ``bool`` becomes ``--x/--no-x``, ``int`` and ``float``
convert, ``list[...]`` takes one or more values (a repeated flag adds more), ``dict[...]`` takes a JSON object, anything else a
string. Flags default to ``argparse.SUPPRESS``, so only the flags actually given override the file.

:func:`add_script_command`, :func:`script_parser` and :func:`run_script` are the rest of a trainer
command's plumbing: its ``compaction-gym train NAME`` sub-command, its standalone parser
(``python -m ...``) and its entry point (a bad argument prints ``PROG: message`` and exits 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from compaction_gym.errors import InvalidArgumentError

T = TypeVar("T")

_SCALARS: dict[str, Any] = {"int": int, "float": float}


def flag(name: str) -> str:
    """The command-line flag of a field: ``max_kv_len`` -> ``--max-kv-len``."""
    return "--" + name.replace("_", "-")


def _kind(field: dataclasses.Field) -> str:
    """The field's annotation without ``| None`` and type parameters: ``"int"``, ``"dict"``, ..."""
    kind = field.type.__name__ if isinstance(field.type, type) else str(field.type)
    return kind.split(" | ")[0].split("[")[0]


def _item_type(field: dataclasses.Field) -> Any:
    """Element type of a ``list[X]`` / ``tuple[X, ...]`` field (``str`` when not int or float)."""
    text = str(field.type)
    inner = text[text.find("[") + 1 :].split(",")[0].split("]")[0].strip() if "[" in text else "str"
    return _SCALARS.get(inner, str)


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default) if isinstance(field.default, str) else str(field.default)
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return str(field.default_factory())  # type: ignore[misc]
    return "required"


def add_dataclass_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    skip: Iterable[str] = (),
    config: bool = True,
    defaults: dict[str, str] | None = None,
) -> None:
    """Add one flag per field of the dataclass ``cls`` (and ``--config FILE.toml``).

    Args:
        parser: the parser (or argument group) to extend.
        cls: a dataclass whose fields carry ``metadata={"help": ..., "choices": ..., "aliases": ...}``
            (``aliases``: other field names that are accepted as flags too, e.g. ``ratio``).
        skip: fields that have no flag (TOML-only tables such as ``training``).
        config: also add ``--config``, the TOML file :func:`load_script_arguments` reads.
        defaults: the default shown in a field's help when the command's differs from the
            dataclass's (e.g. ``{"temperature": "0.0"}``).
    """
    if config:
        parser.add_argument(
            "--config", metavar="FILE.toml", help="TOML file of these options; flags override it"
        )
    skipped = set(skip)
    shown = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skipped or not f.init:
            continue
        help_text = f.metadata.get("help", "")
        kwargs: dict[str, Any] = {
            "dest": f.name,
            "default": argparse.SUPPRESS,
            "help": f"{help_text} (default: {shown.get(f.name, _default_text(f))})".replace("%", "%%")
            if help_text
            else None,
        }
        kind = _kind(f)
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind in ("list", "tuple"):
            kwargs["action"] = "extend"  # ``--x a b`` and ``--x a --x b`` both give [a, b]
            kwargs["nargs"] = "+"
            kwargs["type"] = _item_type(f)
        else:
            kwargs["type"] = json.loads if kind == "dict" else _SCALARS.get(kind, str)
        if "choices" in f.metadata:
            kwargs["choices"] = list(f.metadata["choices"])
        aliases = [flag(a) for a in f.metadata.get("aliases", ())]
        parser.add_argument(flag(f.name), *aliases, **kwargs)


def given_fields(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of dataclass ``cls`` that ``args`` sets (flags given), as ``{name: value}``;
    list values of tuple fields become tuples."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if hasattr(args, f.name):
            value = getattr(args, f.name)
            out[f.name] = tuple(value) if _kind(f) == "tuple" and isinstance(value, list) else value
    return out


def read_toml_config(
    config: str | Path, valid: Iterable[str], *, hint: str = "", table: str | None = None
) -> dict[str, Any]:
    """The table of the config file ``config`` (TOML, or JSON for ``*.json``), keys checked against ``valid``.

    Args:
        table: a TOML table that may hold the keys instead of the top level (e.g. ``[server]``).

    Raises:
        InvalidArgumentError: no such file, not a table, or unknown keys (the message lists the
            valid ones, then ``hint`` in parentheses, e.g. where nested config fields go).
    """
    import tomllib

    path = Path(config)
    if not path.is_file():
        raise InvalidArgumentError(f"--config {config}: no such file")
    if path.suffix == ".json":
        values = json.loads(path.read_text())
    else:
        with path.open("rb") as fh:
            values = tomllib.load(fh)
    if table is not None and isinstance(values, dict) and isinstance(values.get(table), dict):
        values = values[table]
    if not isinstance(values, dict):
        raise InvalidArgumentError(f"{config}: expected a table of options")
    names = set(valid)
    unknown = sorted(set(values) - names)
    if unknown:
        raise InvalidArgumentError(
            f"{config}: unknown keys {unknown}; valid keys: {sorted(names)}" + (f" ({hint})" if hint else "")
        )
    return values


def load_script_arguments(
    cls: type[T],
    args: argparse.Namespace,
    *,
    required: Iterable[str] = (),
    hint: str = "",
    table: str | None = None,
) -> T:
    """Merge the defaults of ``cls`` < the ``--config`` TOML file < the flags given in ``args``.

    Args:
        cls: the script-arguments dataclass (its ``__post_init__``, if any, still validates).
        args: parsed flags (from :func:`add_dataclass_arguments`); attributes that are not fields
            of ``cls`` (``func``, the sub-command name, ...) are ignored.
        required: fields that must end up truthy, from a flag or the file.
        hint: appended to the unknown-key error, e.g. ``"TreeSFTConfig fields go in a [training] table"``.
        table: the config file's table that holds the fields, if not the top level (``"server"``).

    Returns:
        The ``cls`` instance.

    Raises:
        InvalidArgumentError: a missing ``--config`` file, an unknown key in it (named, with the
            valid keys), or a missing required value (``--model is required (a flag or the config
            key 'model')``).
    """
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    config = getattr(args, "config", None)
    values = read_toml_config(config, names, hint=hint, table=table) if config else {}
    values.update(given_fields(cls, args))
    script = cls(**values)
    for name in required:
        if not getattr(script, name):
            raise InvalidArgumentError(f"{flag(name)} is required (a flag or the config key '{name}')")
    return script


def _description(doc: str | None) -> str:
    return (doc or "").split("\n\n")[0]


def add_script_command(
    subparsers: argparse._SubParsersAction,
    name: str,
    *,
    help: str,
    doc: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> argparse.ArgumentParser:
    """Add the sub-command ``name`` (described by the first paragraph of ``doc``) that calls ``run``."""
    parser = subparsers.add_parser(name, help=help, description=_description(doc))
    add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def script_parser(
    prog: str, doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None]
) -> argparse.ArgumentParser:
    """A standalone parser for ``python -m <module>``, described by the first paragraph of ``doc``."""
    parser = argparse.ArgumentParser(prog=prog, description=_description(doc))
    add_arguments(parser)
    return parser


def run_script(
    prog: str, args: argparse.Namespace, parse: Callable[[argparse.Namespace], T], main: Callable[[T], Any]
) -> int:
    """``main(parse(args))``; an :class:`InvalidArgumentError` from ``parse`` is printed as
    ``PROG: message`` on stderr and returns 2. Returns ``main``'s exit status (0 if it returns a
    non-int, e.g. a summary dict)."""
    try:
        script = parse(args)
    except InvalidArgumentError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    status = main(script)
    return status if isinstance(status, int) else 0


def check_output_dir(path: str | Path | None, flag: str) -> None:
    """Fail fast (before any model loads) when ``path`` cannot be an output directory.

    Creates it if missing. Raises:
        InvalidArgumentError: ``path`` is a file, lies under a file, or is not writable.
    """
    if path is None:
        return
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InvalidArgumentError(f"{flag} {path}: is a file, not a directory")
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InvalidArgumentError(f"{flag} {path}: cannot create it ({exc.strerror or exc})") from None
    if not os.access(p, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"{flag} {path}: not writable")


def check_output_file(path: str | Path | None, flag: str) -> None:
    """Fail fast when ``path`` cannot be written as a file (its folder is created if missing).

    Raises:
        InvalidArgumentError: ``path`` is a directory, or its folder cannot be created or written.
    """
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise InvalidArgumentError(f"{flag} {path}: is a directory, not a file")
    check_output_dir(p.parent, f"{flag} (its folder)")
    if p.exists() and not os.access(p, os.W_OK):
        raise InvalidArgumentError(f"{flag} {path}: not writable")
