"""``compaction-gym serve``: load a model into an engine and serve the session API with uvicorn.

Every :class:`~compaction_gym.servers.args.ServerArgs` field is a flag (``--max-slots``,
``--batch-window-ms``, ``--session-ttl-s``, ...); ``--config FILE`` (TOML or JSON) supplies
defaults that flags override.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.servers.args import ServerArgs

logger = logging.getLogger(__name__)


def _scalar_type(annotation: Any) -> type:
    """``int | None`` -> ``int``; plain types pass through."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0]
    return annotation


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ServerArgs field (defaults are ``SUPPRESS`` so ``--config`` can fill them)."""
    hints = typing.get_type_hints(ServerArgs)
    parser.add_argument("--config", type=Path, default=None, help="TOML or JSON file of ServerArgs fields")
    for f in fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        kind = _scalar_type(hints[f.name])
        default = f.default if f.default is not MISSING else None
        help_text = f.metadata.get("help", "")
        if "default" not in help_text:
            help_text += f" (default: {default})"
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text
            )
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=help_text, dest=f.name)


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """Merge ``--config`` (if any) with the flags given; flags win."""
    data: dict[str, Any] = {}
    if getattr(ns, "config", None) is not None:
        data.update(_load_config(ns.config))
    names = {f.name for f in fields(ServerArgs)}
    data.update({k: v for k, v in vars(ns).items() if k in names})
    return ServerArgs.from_dict(data)


def _load_config(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".json":
        data = json.loads(text)
    else:
        import tomllib

        data = tomllib.loads(text)
        data = data.get("server", data)  # allow a [server] table
    if not isinstance(data, dict):
        raise InvalidArgumentError(f"{path}: expected a table of ServerArgs fields")
    return data


def serve(args: ServerArgs) -> None:
    """Load ``args.model`` into an Engine and run the app with uvicorn until interrupted."""
    import uvicorn

    from compaction_gym.engine import Engine
    from compaction_gym.servers.app import create_app

    if not args.model:
        raise InvalidArgumentError("serve needs --model PATH_OR_HUB_ID")
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    dtype = None if args.dtype == "auto" else args.dtype
    engine = Engine.from_pretrained(
        args.model, dtype=dtype, device=args.device, max_slots=args.max_slots, capacity=args.capacity
    )
    app = create_app(engine, args)
    logger.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=args.keep_alive_s
    )


def _run(ns: argparse.Namespace) -> int:
    try:
        args = args_from_namespace(ns)
    except InvalidArgumentError as exc:
        print(f"compaction-gym serve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper() if args.log_level != "trace" else "DEBUG")
    serve(args)
    return 0


def register(subparsers: Any) -> None:
    """Add the ``serve`` subcommand to the ``compaction-gym`` CLI."""
    parser = subparsers.add_parser(
        "serve",
        help="serve the session API over HTTP",
        description="Serve compacted KV-cache sessions over HTTP (the session API, /metrics, /v1/chat/completions).",
    )
    add_server_arguments(parser)
    parser.set_defaults(func=_run)
