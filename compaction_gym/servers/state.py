"""What the server's routes share: :class:`ServerState` (engine, worker, metrics, model facts), the
field-tied :class:`FieldError`, and :func:`unless_disconnected` (cancel work when the client leaves)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from compaction_gym.engine.types import StepResult
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.errors import ClientDisconnected
from compaction_gym.servers.metrics import Metrics
from compaction_gym.servers.worker import EngineWorker

T = TypeVar("T")


class ServerState:
    """What the routes share: the engine, its worker, metrics, args and model facts."""

    def __init__(self, engine: Any, args: ServerArgs) -> None:
        self.engine, self.args = engine, args
        self.metrics = Metrics()
        self.tokenizer = getattr(engine, "tokenizer", None)
        self.tokenizer_lock = threading.Lock()  # HF tokenizers are not safe to share across threads
        self.model_name = args.served_model_name or args.model or _model_name(engine)
        self.vocab_size = _vocab_size(engine)
        self.capacity = int(engine.capacity)
        self.max_slots = int(engine.max_slots)
        self.eos_token_ids = [int(t) for t in getattr(engine, "eos_token_ids", ()) or ()]
        self._markers = _special_markers(self.tokenizer, self.eos_token_ids)
        self.started = time.time()
        self.worker = EngineWorker(
            engine,
            batch_window_s=args.batch_window_ms / 1000.0,
            max_wait_s=None if args.max_batch_wait_ms is None else args.max_batch_wait_ms / 1000.0,
            max_batch_size=args.max_batch_size or self.max_slots,
            session_ttl_s=args.session_ttl_s,
            metrics=self.metrics,
            final_text=self.final_text,
            continuous=args.continuous_batching,
            max_steps=args.round_steps,
            max_new_tokens_limit=args.max_new_tokens_limit,
            max_prompt_tokens=args.max_prompt_tokens,
            max_queue_s=args.max_queue_s,
        )

    def final_text(self, result: StepResult) -> str:
        """The response text without BOS/EOS/pad markers (other special tokens are kept).

        ``result.text`` is the engine's decode of ``result.token_ids`` with special tokens kept,
        so only the markers are removed here: no second decode on the worker thread.
        """
        text = result.text
        for marker in self._markers:
            text = text.replace(marker, "")
        return text

    def check_ids(self, name: str, ids: list[int], *, limit: int | None = None) -> None:
        """Reject token ids outside the vocabulary and inputs longer than a session can hold."""
        if ids and max(ids) >= self.vocab_size:
            bad = next(t for t in ids if t >= self.vocab_size)
            raise FieldError(
                name, f"{name} contains token id {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        limit = self.capacity if limit is None else limit
        if len(ids) > limit:
            raise FieldError(
                name,
                f"{name} has {len(ids)} tokens; a session holds at most {limit} (the server's KV capacity)",
            )


class FieldError(InvalidArgumentError):
    """An invalid argument tied to one request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (which frees its engine work).

    ``work`` runs in the calling task (no task of its own); a watcher task cancels the caller
    when the ASGI server reports the disconnect, and the cancellation becomes
    :class:`ClientDisconnected`.
    """
    caller = asyncio.current_task()
    assert caller is not None, "unless_disconnected runs inside a task"
    state = {"awaiting": True, "disconnected": False}

    def on_watcher_done(w: asyncio.Future) -> None:
        if state["awaiting"] and not w.cancelled():  # a callback run after the work ended is ignored
            state["disconnected"] = True
            caller.cancel()

    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(on_watcher_done)
    try:
        return await work
    except asyncio.CancelledError:
        if state["disconnected"]:
            caller.uncancel()  # this task was cancelled for the disconnect only
            raise ClientDisconnected("client disconnected") from None
        raise
    finally:
        state["awaiting"] = False
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    """Return once the ASGI server reports ``http.disconnect`` (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _special_markers(tokenizer: Any, eos_token_ids: list[int]) -> tuple[str, ...]:
    """The BOS/EOS/pad token strings that :meth:`ServerState.final_text` removes (longest first)."""
    if tokenizer is None:
        return ()
    markers = {getattr(tokenizer, a, None) for a in ("bos_token", "eos_token", "pad_token")}
    for tid in eos_token_ids:
        with contextlib.suppress(Exception):  # an id beyond the tokenizer's vocabulary has no string
            markers.add(tokenizer.convert_ids_to_tokens(tid))
    return tuple(sorted((m for m in markers if isinstance(m, str) and m), key=lambda m: (-len(m), m)))


def _model_name(engine: Any) -> str:
    config = getattr(getattr(engine, "model", None), "config", None)
    return str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "") or "model")


def _vocab_size(engine: Any) -> int:
    if isinstance(getattr(engine, "vocab_size", None), int):  # VLLMBackend
        return engine.vocab_size
    model = getattr(engine, "model", None)
    with contextlib.suppress(Exception):
        return int(model.get_input_embeddings().num_embeddings)
    with contextlib.suppress(Exception):
        return int(model.config.vocab_size)
    return len(engine.tokenizer)
