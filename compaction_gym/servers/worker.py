"""The engine worker: one thread owns the (not thread-safe) engine and schedules it continuously.

Every engine call of the server goes through :class:`EngineWorker`, in arrival order. The worker
loops over *rounds*: at each round boundary it admits the waiting create and step requests into
the running work (``Engine.submit``: validation and one batched prefill), then runs one decode
round over everything running (``Engine.advance``: at most one decode chunk per request) and
answers the requests that finished. So a short request sent while a long one runs joins it at the
next round instead of waiting for it (continuous batching, as vLLM and nano-vllm schedule), and
each request keeps its own parameters and RNG, so results equal running the requests one by one.
While idle, requests that are queued or keep arriving at most ``batch_window_s`` apart (for at
most ``max_wait_s``) are admitted together (one prefill); the window is only waited while
requests come concurrently, so a lone client never pays it. Anything else (close, ...) is a plain
job that runs at a boundary once the requests that arrived before it were admitted. A request's
cost is bounded at admission (``max_new_tokens_limit``, ``max_prompt_tokens``, ``max_queue_s``).
Idle sessions are closed after ``session_ttl_s``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import CreateRequest, StepRequest, StepResult
from compaction_gym.errors import CapacityError, CompactionGymError, InvalidArgumentError, UnknownSessionError
from compaction_gym.servers.metrics import Metrics

logger = logging.getLogger(__name__)

JobKind = Literal["create", "step", "call"]
_SAMPLING_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_STOP = object()  # queue sentinel: finish and exit
OS_THREAD_NAME = "cg-engine"  # the worker thread's name in top -H, /proc/PID/task/TID/comm, py-spy
_EXPIRED_MEMORY = 4096  # how many expired ids we remember, to say "expired" instead of "unknown"


@dataclass(eq=False)
class _Job:
    kind: JobKind
    payload: dict[str, Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    enqueued: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    finished: bool = False  # the worker has set the result (under ``lock``)
    abandoned: bool = False  # the caller went away (under ``lock``)
    batch_size: int = 0  # requests admitted with it (one ``Engine.submit``)
    loop: asyncio.AbstractEventLoop | None = None  # the caller's event loop
    waiter: asyncio.Future | None = None  # what the caller awaits on that loop (set by :func:`_resolve`)


class EngineWorker:
    """Runs all engine work on one dedicated thread, batching concurrent create/step requests.

    Args:
        engine: a :class:`compaction_gym.engine.Engine` (used from the worker thread only).
        batch_window_s: a batch keeps collecting while requests arrive at most this far apart.
        max_wait_s: but never longer than this after its first request (default ``10 *
            batch_window_s``).
        max_batch_size: most requests per ``step_batch`` (default: ``engine.max_slots``).
        session_ttl_s: close sessions created here after this long idle (``None``: never).
        metrics: where to record batches, tokens, events and sessions.
        final_text: ``result -> final_text`` (the response text without BOS/EOS markers); run on
            the worker thread after each request.
        continuous: admit new requests into running work at every round (``False``: the former
            one-shot batching, kept for comparison: a batch is admitted only once nothing runs and
            answered when all of it is done).
        max_steps: decode steps per request per round (default: the engine's chunk, 32); new
            requests join at most this many tokens later.
        max_new_tokens_limit: refuse requests asking for more sampled tokens (``None``: no limit).
        max_prompt_tokens: refuse prompts and step inputs longer than this (``None``: the slot).
        max_queue_s: refuse (429) a request not admitted this long after it arrived (``None``: wait).
    """

    def __init__(
        self,
        engine: Any,
        *,
        batch_window_s: float = 0.005,
        max_wait_s: float | None = None,
        max_batch_size: int | None = None,
        session_ttl_s: float | None = None,
        metrics: Metrics | None = None,
        final_text: Callable[[StepResult], str] | None = None,
        continuous: bool = True,
        max_steps: int | None = None,
        max_new_tokens_limit: int | None = None,
        max_prompt_tokens: int | None = None,
        max_queue_s: float | None = None,
    ) -> None:
        self.engine = engine
        self.batch_window_s = batch_window_s
        self.max_wait_s = 10 * batch_window_s if max_wait_s is None else max_wait_s
        self.max_batch_size = max_batch_size or int(engine.max_slots)
        self.session_ttl_s = session_ttl_s
        self.metrics = metrics or Metrics()
        self.final_text = final_text or (lambda result: "")
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # _Job or _STOP
        self.continuous, self.max_steps = continuous, max_steps
        self.max_new_tokens_limit, self.max_prompt_tokens = max_new_tokens_limit, max_prompt_tokens
        self.max_queue_s = max_queue_s
        self._carry: Any = None  # the stop sentinel, pulled while collecting
        self._waiting: collections.deque[_Job] = collections.deque()  # pulled, not yet admitted or run
        self._running: dict[str, _Job] = {}  # session id -> its job generating in the engine
        self._done: list[tuple[_Job, StepResult]] = []  # one-shot: results held until the batch ends
        self._last_batch = 0  # jobs in the last admission: >1 means clients are concurrent
        self._served: set[str] = set()  # sessions answered since the worker was last idle
        self._expected: set[str] = set()  # open sessions served before going idle (likely to return)
        self._last_used: dict[str, float] = {}  # sessions created through this worker
        self._expired: OrderedDict[str, float] = OrderedDict()
        self._pending = 0
        self._settled: list[_Job] = []  # jobs whose future was set, not yet handed to their loop
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._update_gauges()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="compaction-gym-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the job in progress, fail the queued ones, and join the thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    @property
    def queue_depth(self) -> int:
        """Requests received and not yet admitted (queued, or waiting for a place or their session)."""
        return self._pending + len(self._waiting)

    @property
    def running_requests(self) -> int:
        """Requests admitted into the engine and not yet answered."""
        return len(self._running) + len(self._done)

    @property
    def alive(self) -> bool:
        """Whether the worker thread is running."""
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ async API
    async def create(
        self,
        prompt_ids: list[int],
        config: CompactionConfig | None,
        sampling: SamplingParams | None,
        *,
        session_id: str | None = None,
        ephemeral: bool = False,
        score_input: bool = False,
    ) -> tuple[StepResult, str, dict[str, float]]:
        """Create a session (batched with concurrent requests).

        ``score_input``: also return the prompt's log-probs (``StepResult.input_logprobs``).

        Returns:
            ``(result, final_text, server_info)``. With ``ephemeral`` the session is closed right
            after its batch (``/compact_generate``, chat completions).
        """
        payload = {"prompt_ids": prompt_ids, "config": config, "sampling": sampling}
        payload.update(session_id=session_id, ephemeral=ephemeral, score_input=score_input)
        return await self._submit(_Job("create", payload))

    async def step(
        self,
        session_id: str,
        new_ids: list[int],
        overrides: dict[str, Any] | None = None,
        *,
        response_complete: bool = False,
        score_input: bool = False,
    ) -> tuple[StepResult, str, dict[str, float]]:
        """Step a session; ``overrides`` replace fields of the session's sampling for this step.

        ``response_complete``: ``new_ids`` ends with a complete (teacher-forced) response;
        ``score_input``: also return the input's log-probs; see
        :class:`~compaction_gym.engine.types.StepRequest`.
        """
        payload = {"session_id": session_id, "new_ids": new_ids, "overrides": overrides}
        payload.update(response_complete=response_complete, score_input=score_input)
        return await self._submit(_Job("step", payload))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the worker thread, in order with the other jobs."""
        return await self._submit(_Job("call", {"fn": fn, "args": args}))

    async def close(self, session_id: str) -> None:
        """Close a session (``UnknownSessionError`` if it does not exist)."""
        await self.call(self._close, session_id, "delete")

    async def _submit(self, job: _Job) -> Any:
        if self._thread is None or self._stopping:
            raise RuntimeError("the engine worker is not running")
        job.loop = asyncio.get_running_loop()
        job.waiter = job.loop.create_future()
        with self._pending_lock:
            self._pending += 1
        self.metrics.queue_depth.set(self._pending)
        self._queue.put(job)
        try:
            return await job.waiter
        except asyncio.CancelledError:
            job.future.cancel()  # succeeds only while queued: the job never runs
            # The caller went away. A queued job was cancelled with the future (never runs); a job
            # that already ran or is running has its work undone by whoever sees it last.
            with job.lock:
                job.abandoned = True
                finished = job.finished
            self.metrics.abandoned.inc(stage="queued" if job.future.cancelled() else "running")
            if finished:
                self._queue.put(_Job("call", {"fn": self._undo, "args": (job,)}))
            raise

    # ------------------------------------------------------------------ worker thread
    def _loop(self) -> None:
        _name_os_thread(OS_THREAD_NAME)
        while True:
            try:
                if not self._iteration():
                    break
            except Exception:  # noqa: BLE001 - a bug here must not leave the server without a worker
                logger.exception("engine worker iteration failed; continuing")
            finally:
                self._hand_over()
        try:
            self._drain()
        finally:
            self._hand_over()

    def _hand_over(self) -> None:
        """Pass the settled jobs to their callers' event loops: one wake-up per loop for all of
        them, not one per job (each is a write to the loop's self-pipe, made on this thread)."""
        if not self._settled:
            return
        settled, self._settled = self._settled, []
        by_loop: dict[asyncio.AbstractEventLoop, list[_Job]] = {}
        for job in settled:
            if job.loop is not None:
                by_loop.setdefault(job.loop, []).append(job)
        for loop, jobs in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody awaits these jobs
                loop.call_soon_threadsafe(_resolve, jobs)

    def _iteration(self) -> bool:
        """One round boundary: take new jobs, admit those that may join, run one decode round.

        ``False`` once stopped. While nothing runs, it blocks for the next job (and collects a
        batch, see :meth:`_collect`); while work runs, it only takes what is already queued, so a
        new request joins the running ones at the next round (continuous batching).
        """
        if not self._running and not self._waiting:
            if self._served:  # the sessions answered since the worker was last idle will likely return
                self._expected = self._served & set(self.engine.session_ids)
                self._served = set()
            job = self._next(timeout=self._sweep_interval())
            self._sweep_expired()
            if job is None:
                return True
            if job is _STOP:
                return False
            self._waiting.append(job)
            if job.kind != "call":
                self._collect()
        else:
            if not self._pull():
                return False
            self._sweep_expired()
        self._cancel_abandoned()
        self._admit()
        self._hand_over()  # calls and refused requests are answered before the round runs
        if self._running:
            self._round()
        return True

    def _pull(self) -> bool:
        """Move every queued job to the waiting list without blocking; ``False`` on the stop sentinel."""
        while True:
            job = self._next(timeout=0)
            if job is None:
                return True
            if job is _STOP:
                return False
            self._waiting.append(job)

    def _collect(self) -> None:
        """Add queued and arriving jobs to the waiting list while the worker is idle (the batching policy).

        * Sessions served since the worker was last idle are awaited for up to ``max_wait_s``:
          clients that step in lockstep (a vector of envs) return as a stream while the previous
          responses are still being sent, and a batch that starts early leaves the rest for a
          second prefill.
        * Then collection goes on while requests arrive at most ``batch_window_s`` apart, still
          never past ``max_wait_s`` after the first job.
        * Only while requests come concurrently (the last admission held more than one): a lone
          client never waits. A call (close, ...) ends the collection, keeping the arrival order.
        """
        concurrent = self._last_batch > 1 or len(self._expected) > 1
        window = self.batch_window_s if concurrent else 0.0
        expected = self._expected if concurrent else set()
        now = time.monotonic()
        cap, deadline = now + self.max_wait_s, now + window
        missing = expected - {j.payload.get("session_id") for j in self._waiting}
        while len(self._waiting) < self.max_batch_size:
            until = cap if missing else min(deadline, cap)
            nxt = self._next(timeout=until - time.monotonic())
            if nxt is None:
                break
            if nxt is _STOP:
                self._carry = nxt
                break
            self._waiting.append(nxt)
            if nxt.kind == "call":
                break
            missing.discard(nxt.payload.get("session_id"))
            deadline = time.monotonic() + window

    def _next(self, timeout: float) -> Any:
        """The next job, ``_STOP``, or ``None`` after ``timeout`` seconds without one."""
        if self._carry is not None:
            job, self._carry = self._carry, None
            return job
        try:
            job = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        if job is not _STOP:
            with self._pending_lock:
                self._pending -= 1
            self.metrics.queue_depth.set(self._pending)
        return job

    def _shutdown(self) -> None:
        """Fail the jobs not yet admitted, let the running ones finish (bounded by the limits)."""
        for job in self._waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("the server is shutting down"))
                self._settled.append(job)
        self._waiting.clear()
        while self._running:
            self._cancel_abandoned()
            self._round()
            self._hand_over()

    def _drain(self) -> None:
        self._shutdown()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("the server is shutting down"))
                self._settled.append(job)

    def _run_call(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        self.metrics.queue_wait.observe(time.monotonic() - job.enqueued)
        try:
            result = job.payload["fn"](*job.payload["args"])
        except Exception as exc:  # noqa: BLE001 - one failed job must never stop the worker
            self._fail(job, exc)
        else:
            self._finish(job, result)

    # ------------------------------------------------------------------ admission and rounds
    def _admit(self) -> None:
        """Admit waiting create/step jobs into the running work, in arrival order.

        A job waits while its session is generating (or an earlier job of it waits), while
        ``max_batch_size`` requests run, and — without continuous batching — until nothing runs;
        a call waits until every job that arrived before it was admitted. A job that has waited
        longer than ``max_queue_s`` is refused (429: nothing ran).
        """
        if not self.continuous and self._running:
            return
        now = time.monotonic()
        busy = set(self._running)
        batch: list[tuple[_Job, StepRequest | CreateRequest]] = []
        keep: collections.deque[_Job] = collections.deque()
        barrier = False
        while self._waiting:
            job = self._waiting.popleft()
            if job.kind == "call":
                if barrier:
                    keep.append(job)
                    continue
                self._submit_batch(batch)
                batch = []
                self._run_call(job)
                busy = set(self._running)
                continue
            sid = job.payload.get("session_id")
            full = len(self._running) + len(batch) >= self.max_batch_size
            if full or (sid is not None and sid in busy):
                if self.max_queue_s is not None and now - job.enqueued > self.max_queue_s:
                    if job.future.set_running_or_notify_cancel():
                        self._fail(job, CapacityError(
                            f"the request waited {now - job.enqueued:.1f} s without a place among the running "
                            f"requests (the server's max_queue_s is {self.max_queue_s:g}); nothing ran, retry later"
                        ))  # fmt: skip
                    continue
                keep.append(job)
                barrier = True
                if sid is not None:
                    busy.add(sid)  # later jobs of this session wait behind it
                continue
            if not job.future.set_running_or_notify_cancel():
                continue  # cancelled while queued: never runs
            self.metrics.queue_wait.observe(now - job.enqueued)
            try:
                req = self._prepare_create(job) if job.kind == "create" else self._prepare_step(job)
            except Exception as exc:  # noqa: BLE001
                self._fail(job, exc)
                continue
            batch.append((job, req))
            if sid is not None:
                busy.add(sid)
        self._waiting = keep
        self._submit_batch(batch)

    def _submit_batch(self, ready: list[tuple[_Job, StepRequest | CreateRequest]]) -> None:
        """One ``Engine.submit`` (validation and one prefill) for ``ready``; a rejected request fails alone.

        ``Engine.submit`` validates the whole batch before anything changes, and its typed error
        names the offending request (``request_index``): that request fails and the others are
        submitted again (without an index, one by one). An untyped exception the engine marks
        ``batch_unchanged`` (raised while validating or opening sessions) is isolated the same
        way. Any other exception came from the prefill itself: no single request can be blamed
        and their sessions may have changed, so every request of this submission fails rather
        than being replayed (a replay could apply a step twice); the running work is intact.
        """
        while ready:
            try:
                sids = self.engine.submit([r for _, r in ready])
            except CompactionGymError as exc:
                index = getattr(exc, "request_index", None)
                if len(ready) == 1:
                    self._fail(ready[0][0], exc)
                    return
                if isinstance(index, int) and 0 <= index < len(ready):
                    self._fail(ready[index][0], exc)
                    ready = ready[:index] + ready[index + 1 :]
                    continue
                logger.info(
                    "submission of %d rejected (%s); submitting its requests one by one", len(ready), exc
                )
                for item in ready:
                    self._submit_batch([item])
                return
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                index = getattr(exc, "request_index", None)
                if (
                    getattr(exc, "batch_unchanged", False)
                    and isinstance(index, int)
                    and 0 <= index < len(ready)
                ):
                    logger.warning("request %d of a batch failed before it ran: %r", index, exc)
                    self._fail(ready[index][0], exc)
                    ready = ready[:index] + ready[index + 1 :]
                    continue
                for job, _ in ready:
                    self._fail(job, exc)
                return
            self._last_batch = len(ready)
            self.metrics.batch_size.observe(len(ready))
            for (job, _), sid in zip(ready, sids):
                job.batch_size = len(ready)
                self._running[sid] = job
                if job.kind == "create":
                    self._opened(sid)
            return

    def _round(self) -> None:
        """One ``Engine.advance``; complete the jobs it finished. A failed round fails the jobs it lost."""
        t0 = time.monotonic()
        try:
            results = self.engine.advance(self.max_steps)
        except Exception as exc:  # noqa: BLE001 - fail the lost requests, keep serving
            lost = getattr(exc, "lost_session_ids", None)
            for sid in list(self._running) if lost is None else lost:
                job = self._running.pop(sid, None)
                if job is not None:
                    self._fail(job, exc)
            open_now = set(self.engine.session_ids)  # the sessions the lost creates opened are closed
            for sid in [s for s in self._last_used if s not in open_now]:
                self._last_used.pop(sid)
            self._update_gauges()
            self._answer_done()
            return
        self.metrics.batch_latency.observe(time.monotonic() - t0)
        self._record(results)
        now = time.monotonic()
        for result in results:
            sid = result.session_id
            job = self._running.pop(sid, None)
            if job is None:  # not submitted through this worker
                continue
            self._last_used[sid] = now
            self._served.add(sid)
            self._done.append((job, result))
        self._answer_done()

    def _answer_done(self) -> None:
        """Answer the finished jobs (one-shot batching: only once the whole batch is done)."""
        if self.continuous or not self._running:
            done, self._done = self._done, []
            for job, result in done:
                self._complete(job, result, batch_size=job.batch_size)

    def _cancel_abandoned(self) -> None:
        """Stop running creates whose client went away: their sessions are closed, their slots freed.

        A running step goes on (its session has advanced; its cost is bounded by the limits).
        """
        for sid, job in list(self._running.items()):
            with job.lock:
                abandoned = job.abandoned
            if abandoned and job.kind == "create":
                self._running.pop(sid)
                with contextlib.suppress(UnknownSessionError):
                    self._close(sid, "cancelled")
                self._fail(job, RuntimeError("the client went away"), quiet=True)

    def _prepare_create(self, job: _Job) -> CreateRequest:
        p = job.payload
        self._check_limits(p["sampling"] or SamplingParams(), p["prompt_ids"], "prompt_ids")
        return CreateRequest(
            list(p["prompt_ids"]),
            p["config"],
            p["sampling"],
            p["session_id"],
            bool(p.get("score_input", False)),
        )

    def _prepare_step(self, job: _Job) -> StepRequest:
        p = job.payload
        sid, overrides = p["session_id"], p["overrides"]
        self._check_session(sid)
        sampling = None
        if overrides and overrides.keys() >= _SAMPLING_NAMES:
            sampling = SamplingParams(**overrides)
        elif overrides:  # partial overrides start from the session's defaults
            sampling = self.engine.session(sid).sampling.replace(**overrides)
        self._check_limits(sampling, p["new_ids"], "new_token_ids")
        return StepRequest(
            sid,
            list(p["new_ids"]),
            sampling,
            bool(p.get("response_complete", False)),
            bool(p.get("score_input", False)),
        )

    def _check_limits(self, sampling: SamplingParams | None, ids: list[int], ids_field: str) -> None:
        """Refuse a request whose cost exceeds the server's limits, before it runs (422 naming the field)."""
        limit = self.max_new_tokens_limit
        if limit is not None and sampling is not None and sampling.max_new_tokens > limit:
            raise _field_error(
                "max_new_tokens",
                f"max_new_tokens={sampling.max_new_tokens} exceeds this server's limit of {limit} "
                "(--max-new-tokens-limit); ask for fewer tokens and continue with another step",
            )
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise _field_error(
                ids_field,
                f"{ids_field} has {len(ids)} tokens; this server takes at most {self.max_prompt_tokens} "
                "per request (--max-prompt-tokens)",
            )

    def _complete(self, job: _Job, result: StepResult, batch_size: int) -> None:
        try:
            text = self.final_text(result)
        except Exception:  # noqa: BLE001 - a text problem must not lose the result
            text = result.text
        if job.kind == "create" and job.payload["ephemeral"]:
            self._close(result.session_id, "ephemeral")
        info = {"queue_s": time.monotonic() - job.enqueued, "batch_size": float(batch_size)}
        self._finish(job, (result, text, info))

    def _finish(self, job: _Job, value: Any) -> None:
        job.future.set_result(value)
        self._settled.append(job)
        with job.lock:
            job.finished = True
            abandoned = job.abandoned
        if abandoned:
            self._undo(job)

    def _fail(self, job: _Job, exc: BaseException, *, quiet: bool = False) -> None:
        self.metrics.errors.inc(type=type(exc).__name__)
        if not quiet and not isinstance(exc, UnknownSessionError | CapacityError | ValueError):
            logger.exception("engine job %s failed", job.kind, exc_info=exc)
        job.future.set_exception(exc)
        self._settled.append(job)
        with job.lock:
            job.finished = True

    def _undo(self, job: _Job) -> None:
        """Free what an abandoned job holds: a session it created (a step cannot be undone)."""
        if job.kind != "create" or job.payload.get("ephemeral"):
            return
        fut = job.future
        if fut.cancelled() or fut.exception() is not None:
            return
        sid = fut.result()[0].session_id
        with contextlib.suppress(UnknownSessionError):  # the client deleted it meanwhile
            self._close(sid, "cancelled")

    # ------------------------------------------------------------------ sessions
    def _check_session(self, sid: str) -> None:
        if sid not in set(self.engine.session_ids):
            raise self._unknown(sid)

    def _unknown(self, sid: str) -> UnknownSessionError:
        if sid in self._expired:
            return UnknownSessionError(
                f"session {sid!r} expired after {self.session_ttl_s:g} s idle; create a new one"
            )
        return UnknownSessionError(f"unknown session {sid!r}: never created, closed, or expired")

    def _opened(self, sid: str) -> None:
        self._last_used[sid] = time.monotonic()
        self._expired.pop(sid, None)
        self.metrics.sessions_created.inc()
        self._update_gauges()

    def _close(self, sid: str, reason: str) -> None:
        try:
            self.engine.close(sid)
        except UnknownSessionError:
            self._last_used.pop(sid, None)
            raise self._unknown(sid) from None
        self._last_used.pop(sid, None)
        self._expected.discard(sid)
        self.metrics.sessions_closed.inc(reason=reason)
        self._update_gauges()
        job = self._running.pop(sid, None)  # closing a generating session cancels its request
        if job is not None:
            self._fail(job, UnknownSessionError(f"session {sid!r} was closed ({reason}) while generating"))

    def _sweep_interval(self) -> float:
        if self.session_ttl_s is None:
            return 1.0
        return min(1.0, max(0.01, self.session_ttl_s / 4))

    def _sweep_expired(self) -> None:
        if self.session_ttl_s is None or not self._last_used:
            return
        cutoff = time.monotonic() - self.session_ttl_s
        in_use = set(self._running) | {j.payload.get("session_id") for j in self._waiting}
        for sid in [s for s, t in self._last_used.items() if t < cutoff and s not in in_use]:
            try:
                self._close(sid, "ttl")
            except UnknownSessionError:  # closed behind our back (e.g. directly on the engine)
                continue
            self._expired[sid] = time.monotonic()
            while len(self._expired) > _EXPIRED_MEMORY:
                self._expired.popitem(last=False)
            logger.info("session %s expired after %.1f s idle", sid, self.session_ttl_s)

    def _update_gauges(self) -> None:
        try:
            free = int(self.engine.num_free_slots)
            self.metrics.slots_free.set(free)
            self.metrics.sessions_active.set(int(self.engine.max_slots) - free)
        except Exception:  # noqa: BLE001 - gauges are best effort
            pass

    def _record(self, results: list[StepResult]) -> None:
        m = self.metrics
        for r in results:
            sampled = sum(r.completion_mask)
            m.tokens.inc(r.prompt_len, kind="prompt")
            m.tokens.inc(sampled, kind="generated")
            m.tokens.inc(len(r.token_ids) - sampled, kind="injected")
            for e in r.events:
                m.compaction_events.inc(mode=str(e.mode), trigger=str(e.trigger))


def _name_os_thread(name: str) -> None:
    """Name the calling thread for the OS (Linux; best effort), so that tools and
    ``benchmarks/bench_server.py`` can tell the worker's CPU time from the event loop's."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _resolve(jobs: list[_Job]) -> None:
    """On the callers' event loop: copy each job's outcome from its thread-side future to its waiter."""
    for job in jobs:
        waiter, future = job.waiter, job.future
        if waiter is None or waiter.done():  # the caller went away meanwhile
            continue
        if future.cancelled():
            waiter.cancel()
        elif future.exception() is not None:
            waiter.set_exception(future.exception())
        else:
            waiter.set_result(future.result())


def _field_error(param: str, message: str) -> InvalidArgumentError:
    """An ``InvalidArgumentError`` whose ``param`` names the request field (the 422 body's ``param``)."""
    exc = InvalidArgumentError(message)
    exc.param = param  # type: ignore[attr-defined]
    return exc
