"""The engine worker: one thread owns the (not thread-safe) engine; an auto-batcher feeds it.

Every engine call of the server goes through :class:`EngineWorker`, in arrival order. Create and
step requests that are queued, or keep arriving at most ``batch_window_s`` apart (for at most
``max_wait_s``), become one batch of at most ``max_batch_size``; its creates and steps run as one
``Engine.step_batch``, each with its own parameters and RNG. The window is only waited
while requests come concurrently (the previous batch held more than one), so a lone client never
pays it. Anything else (close, stats, ...) is a plain job that ends the batch being collected, so
the order of requests is kept. Idle sessions are closed after ``session_ttl_s``.
"""

from __future__ import annotations

import asyncio
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
from compaction_gym.errors import CapacityError, CompactionGymError, UnknownSessionError
from compaction_gym.servers.metrics import Metrics

logger = logging.getLogger(__name__)

JobKind = Literal["create", "step", "call"]
_SAMPLING_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_STOP = object()  # queue sentinel: finish and exit
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
        decode: ``token_ids -> final_text``; run on the worker thread after each request.
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
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.engine = engine
        self.batch_window_s = batch_window_s
        self.max_wait_s = 10 * batch_window_s if max_wait_s is None else max_wait_s
        self.max_batch_size = max_batch_size or int(engine.max_slots)
        self.session_ttl_s = session_ttl_s
        self.metrics = metrics or Metrics()
        self.decode = decode or (lambda ids: "")
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()  # _Job or _STOP
        self._carry: _Job | None = None  # a job pulled while collecting that starts the next round
        self._last_batch = 0  # jobs in the previous batch: >1 means clients are concurrent
        self._expected: set[str] = set()  # open sessions served by the previous batch (likely to return)
        self._last_used: dict[str, float] = {}  # sessions created through this worker
        self._expired: OrderedDict[str, float] = OrderedDict()
        self._pending = 0
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
        return self._pending

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
        with self._pending_lock:
            self._pending += 1
        self.metrics.queue_depth.set(self._pending)
        self._queue.put(job)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
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
        while True:
            try:
                if not self._iteration():
                    break
            except Exception:  # noqa: BLE001 - a bug here must not leave the server without a worker
                logger.exception("engine worker iteration failed; continuing")
        self._drain()

    def _iteration(self) -> bool:
        """Run the next call, or the next batch of create/step jobs; ``False`` once stopped."""
        job = self._next(timeout=self._sweep_interval())
        self._sweep_expired()
        if job is None:
            return True
        if job is _STOP:
            return False
        if job.kind == "call":
            self._run_call(job)
            return True
        batch = [job]
        self._collect(batch)
        self._last_batch = len(batch)
        try:
            self._run_batch(batch)
        finally:  # whatever happened, no caller waits forever
            for j in batch:
                if not j.future.done():
                    self._fail(j, RuntimeError("the engine worker failed to run this request"))
        return True

    def _collect(self, batch: list[_Job]) -> None:
        """Add queued and arriving create/step jobs to ``batch`` (the batching policy).

        * Sessions of the previous step batch are awaited for up to ``max_wait_s``: clients that
          step in lockstep (a vector of envs) return as a stream while the previous responses are
          still being sent, and a batch that starts early leaves the rest for a second batch.
        * Then the batch keeps collecting while requests arrive at most ``batch_window_s`` apart,
          still never past ``max_wait_s`` after its first job.
        * Only while requests come concurrently (the previous batch held more than one): a lone
          client never waits.
        """
        concurrent = self._last_batch > 1 or len(self._expected) > 1
        window = self.batch_window_s if concurrent else 0.0
        expected = self._expected if concurrent else set()
        now = time.monotonic()
        cap, deadline = now + self.max_wait_s, now + window
        missing = expected - {j.payload.get("session_id") for j in batch}
        while len(batch) < self.max_batch_size:
            until = cap if missing else min(deadline, cap)
            nxt = self._next(timeout=until - time.monotonic())
            if nxt is None:
                break
            if nxt is _STOP or nxt.kind == "call":
                self._carry = nxt  # keeps arrival order: it runs right after this batch
                break
            batch.append(nxt)
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

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError("the server is shutting down"))

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

    def _run_batch(self, jobs: list[_Job]) -> None:
        """Run create/step jobs in as few ``step_batch`` calls as correctness allows."""
        live = [j for j in jobs if j.future.set_running_or_notify_cancel()]
        try:
            self._run_rounds(live)
        finally:  # these sessions' clients are likely to step again, together
            served = (
                j.future.result()[0].session_id for j in live if j.future.done() and not j.future.exception()
            )
            self._expected = set(served) & set(self.engine.session_ids)

    def _run_rounds(self, live: list[_Job]) -> None:
        now = time.monotonic()
        for j in live:
            self.metrics.queue_wait.observe(now - j.enqueued)
        # A session may appear at most once per engine batch; later steps of it wait for a round.
        while live:
            seen: set[str] = set()
            round_, rest = [], []
            for j in live:
                sid = j.payload.get("session_id")
                if j.kind == "step" and sid in seen:
                    rest.append(j)
                else:
                    if sid is not None:
                        seen.add(sid)
                    round_.append(j)
            self._run_round(round_)
            live = rest

    def _run_round(self, jobs: list[_Job]) -> None:
        """Every create and step of the round in one ``Engine.step_batch``."""
        ready: list[tuple[_Job, StepRequest | CreateRequest]] = []
        for job in jobs:
            try:
                ready.append(
                    (job, self._prepare_create(job) if job.kind == "create" else self._prepare_step(job))
                )
            except Exception as exc:  # noqa: BLE001
                self._fail(job, exc)
        if ready:
            self._execute(ready)

    def _prepare_create(self, job: _Job) -> CreateRequest:
        p = job.payload
        return CreateRequest(
            list(p["prompt_ids"]), p["config"], p["sampling"], p["session_id"], bool(p.get("score_input", False))
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
        return StepRequest(
            sid, list(p["new_ids"]), sampling, bool(p.get("response_complete", False)), bool(p.get("score_input", False))
        )

    def _execute(self, ready: list[tuple[_Job, StepRequest | CreateRequest]]) -> None:
        """One ``step_batch`` for all ``ready`` creates and steps; a rejected request fails alone.

        ``Engine.step_batch`` validates the whole batch before anything changes, and its typed
        error names the offending request (``request_index``): that request fails and the others
        run again as one batch (without an index they run one by one). An untyped exception the
        engine marks ``batch_unchanged`` (raised while validating or opening sessions) is isolated
        the same way. Any other exception came from the batched computation itself: no single
        request can be blamed and sessions may have changed, so every request of the batch fails
        rather than being replayed (a replay could apply a step twice).
        """
        while ready:
            t0 = time.monotonic()
            try:
                results = self.engine.step_batch([r for _, r in ready])
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
                    "step_batch of %d rejected (%s); running its requests one by one", len(ready), exc
                )
                for item in ready:
                    self._execute([item])
                return
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving
                index = getattr(exc, "request_index", None)
                if getattr(exc, "batch_unchanged", False) and isinstance(index, int) and 0 <= index < len(ready):
                    # raised before any session advanced (validation, opening a session): only the
                    # culprit fails, the others run again as one batch
                    logger.warning("request %d of a batch failed before it ran: %r", index, exc)
                    self._fail(ready[index][0], exc)
                    ready = ready[:index] + ready[index + 1 :]
                    continue
                for job, _ in ready:
                    self._fail(job, exc)
                return
            self._record(results, time.monotonic() - t0, batch_size=len(ready))
            now = time.monotonic()
            for (job, _), result in zip(ready, results):
                if job.kind == "create":
                    self._opened(result.session_id)
                self._last_used[result.session_id] = now
                self._complete(job, result, batch_size=len(ready))
            return

    def _complete(self, job: _Job, result: StepResult, batch_size: int) -> None:
        try:
            text = self.decode(result.token_ids)
        except Exception:  # noqa: BLE001 - a decode problem must not lose the result
            text = result.text
        if job.kind == "create" and job.payload["ephemeral"]:
            self._close(result.session_id, "ephemeral")
        info = {"queue_s": time.monotonic() - job.enqueued, "batch_size": float(batch_size)}
        self._finish(job, (result, text, info))

    def _finish(self, job: _Job, value: Any) -> None:
        job.future.set_result(value)
        with job.lock:
            job.finished = True
            abandoned = job.abandoned
        if abandoned:
            self._undo(job)

    def _fail(self, job: _Job, exc: BaseException) -> None:
        self.metrics.errors.inc(type=type(exc).__name__)
        if not isinstance(exc, UnknownSessionError | CapacityError | ValueError):
            logger.exception("engine job %s failed", job.kind, exc_info=exc)
        job.future.set_exception(exc)
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

    def _sweep_interval(self) -> float:
        if self.session_ttl_s is None:
            return 1.0
        return min(1.0, max(0.01, self.session_ttl_s / 4))

    def _sweep_expired(self) -> None:
        if self.session_ttl_s is None or not self._last_used:
            return
        cutoff = time.monotonic() - self.session_ttl_s
        for sid in [s for s, t in self._last_used.items() if t < cutoff]:
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

    def _record(self, results: list[StepResult], elapsed: float, batch_size: int) -> None:
        m = self.metrics
        m.batch_size.observe(batch_size)
        m.batch_latency.observe(elapsed)
        for r in results:
            sampled = sum(r.completion_mask)
            m.tokens.inc(r.prompt_len, kind="prompt")
            m.tokens.inc(sampled, kind="generated")
            m.tokens.inc(len(r.token_ids) - sampled, kind="injected")
            for e in r.events:
                m.compaction_events.inc(mode=str(e.mode), trigger=str(e.trigger))
