"""``compaction-gym serve``: load a model into an engine and serve the session API with uvicorn.

Every :class:`~compaction_gym.servers.args.ServerArgs` field is a flag (``--max-slots``,
``--batch-window-ms``, ``--session-ttl-s``, ...), built by :mod:`compaction_gym.cli_args` like every
other command's; ``--config FILE`` (TOML, fields at the top level or in a ``[server]`` table, or
JSON) supplies defaults that flags override. ``--model`` takes registered names (``babyai-tiny``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from compaction_gym.cli_args import add_dataclass_arguments, load_script_arguments
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.servers.args import ServerArgs

logger = logging.getLogger(__name__)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per ServerArgs field, and ``--config`` (TOML, optionally a ``[server]`` table, or JSON)."""
    add_dataclass_arguments(parser, ServerArgs)


def args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    """Merge ``--config`` (if any) with the flags given; flags win."""
    return load_script_arguments(ServerArgs, ns, table="server")


def serve(args: ServerArgs) -> None:
    """Load ``args.model`` into an Engine and run the app with uvicorn until interrupted."""
    import uvicorn

    from compaction_gym.engine import Engine
    from compaction_gym.servers.app import create_app

    if not args.model:
        raise InvalidArgumentError("serve needs --model (a registered name such as babyai-tiny, a directory or a hub id)")
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    dtype = None if args.dtype == "auto" else args.dtype
    if args.backend == "vllm":  # the engine inside vLLM's workers, same interface (docs/vllm.md)
        from compaction_gym.backends.vllm_backend import VLLMBackend

        if args.device is not None:
            raise InvalidArgumentError("device: --backend vllm places the model itself (vLLM's build decides)")
        vllm_args = {} if dtype is None else {"dtype": dtype}
        engine = VLLMBackend(
            args.model, max_slots=args.max_slots, capacity=args.capacity, torch_threads=args.torch_threads, **vllm_args
        )
    else:
        engine = Engine.from_pretrained(
            args.model, dtype=dtype, device=args.device, max_slots=args.max_slots, capacity=args.capacity
        )
    app = create_app(engine, args)
    logger.info("serving %s on http://%s:%d", args.model, args.host, args.port)
    try:
        uvicorn.run(
            app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=args.keep_alive_s
        )
    finally:
        if hasattr(engine, "shutdown"):  # vLLM's engine processes
            engine.shutdown()


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
