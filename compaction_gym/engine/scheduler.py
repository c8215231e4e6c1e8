"""Session scheduler: owns the sessions and runs one batched step over many of them.

:meth:`Scheduler.run` is the heart of ``create_session``/``step``/``step_batch``:

1. **Input** — per session, KV-budget compaction makes room for the pending tokens (the last
   sampled token of the previous response) plus the new input; the input and any budget message
   are appended.
2. **Prefill** — one batched forward (chunked at ``prefill_chunk`` tokens) feeds every session's
   pending tokens; rows with nothing to feed reuse the logits kept from their last call.
3. **Decode** — rows holding logits sample one token each (their own parameters and random
   stream); rows with one pending token run a *chunk* of decode steps on the runner
   (:meth:`~compaction_gym.engine.model_runner.ModelRunner.decode_chunk`: on the fast path up to
   32 steps on the device per host synchronisation), each row limited to the steps it can take
   before the host must act — its ``max_new_tokens``, its budget, the next KV-budget event or a
   full slot — and stopped on the device by its stop tokens. After each token the same checks
   run on the host: stop, budget, length, then KV-budget compaction to make room for the next
   token (an event's budget message, or the periodic one every ``inject_budget_every`` sampled
   tokens, makes the row feed several tokens: a batched forward, then it samples again from the
   logits).
4. **After the response** — turn-based compaction (and its budget message) per session that
   sampled tokens, or whose input ended with a complete (teacher-forced) response.

Steps 1–2 are :meth:`Scheduler.begin` (the works join :attr:`Scheduler.running`), step 3 runs in
rounds (:meth:`Scheduler.advance`: one decode chunk per round) and step 4 runs for the works that
a round finished, so new works can join running ones between rounds (continuous batching);
:meth:`Scheduler.run` is ``begin`` plus rounds until its works are done.

:meth:`Scheduler.check` runs for every request before :meth:`Scheduler.run` changes anything: it
plans the KV-budget compaction an input would trigger (pure arithmetic, nothing applied) and
refuses an input that would not fit even then, so a batch either runs whole or changes nothing.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.engine.chunk_policy import ChunkCosts
from compaction_gym.engine.compactor import Compactor, records_queries
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.model_runner import DecodeRow, ModelRunner, RowFeed
from compaction_gym.engine.sampler import SampleStream, sample
from compaction_gym.engine.session import ProbeRing, Session
from compaction_gym.engine.slot_cache import SlotKVCache
from compaction_gym.engine.types import StepResult
from compaction_gym.errors import CapacityError, InvalidArgumentError, UnknownSessionError


@dataclass(eq=False)
class Work:
    """One session's share of a :meth:`Scheduler.run` call."""

    session: Session
    new_ids: list[int]
    params: SamplingParams
    stream: SampleStream
    response_complete: bool = False
    out_start: int = 0
    sampled: int = 0
    finish: str | None = None
    events: list[CompactionEvent] = field(default_factory=list)
    inject_ranges: list[tuple[int, int]] = field(default_factory=list)
    logits: torch.Tensor | None = None
    compaction_s: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    score_input: bool = False
    input_logprobs: list[float | None] | None = None
    input_entropies: list[float | None] | None = None
    created: bool = False  # the work opened its session (a create)
    started: float = 0.0  # perf_counter when its input began
    prefill_s: float = 0.0
    decode_from: float = 0.0  # perf_counter when its prefill ended
    deferred: bool = False  # its input waits for the next round's forward (``begin(prefill=False)``)


class Scheduler:
    """Sessions by id, their slots, and the batched step loop.

    The scheduler owns the sessions: it opens (:meth:`open`), forks (:meth:`fork`) and drops
    (:meth:`drop`) them, and the engine only delegates after validating a request.
    """

    def __init__(
        self,
        runner: ModelRunner,
        compactor: Compactor,
        cache: SlotKVCache,
        *,
        eos_token_ids: tuple[int, ...],
        budget_message: Callable[[Session], list[int]],
        decode_text: Callable[[list[int]], str],
        prefill_chunk: int,
    ) -> None:
        self.runner, self.compactor, self.cache = runner, compactor, cache
        self.eos_token_ids = eos_token_ids
        self.budget_message = budget_message
        self.decode_text = decode_text
        self.prefill_chunk = prefill_chunk
        self.sessions: dict[str, Session] = {}
        #: works fed by :meth:`begin` whose responses are not finished (continuous batching)
        self.running: list[Work] = []
        #: results finished by :meth:`run` for works it was not asked about; :meth:`advance` returns them
        self.held: list[tuple[Work, StepResult]] = []
        #: end a decode chunk where rows pause for host work, where that pays at the prices of
        #: :attr:`chunk_costs`; ``False``: run every chunk to its longest row's limit. Each row
        #: samples from its own stream and its events fire at the same tokens either way; only which
        #: events share a stacked call (their rounding) changes.
        self.cut_chunks = True
        self.chunk_costs = ChunkCosts()

    # -------------------------------------------------------------- registry
    def get(self, session_id: str) -> Session:
        try:
            return self.sessions[session_id]
        except (KeyError, TypeError):
            raise UnknownSessionError(
                f"unknown session {session_id!r}: never created, already closed, or expired "
                f"({len(self.sessions)} open)"
            ) from None

    def kv_len(self, s: Session) -> int:
        return self.cache.length(s.slot)

    def open(
        self, session_id: str, prompt_len: int, config: CompactionConfig, sampling: SamplingParams
    ) -> Session:
        """Take a slot and register a new, empty session (its prompt is fed by :meth:`run`).

        Its RNG stream is seeded from ``sampling.seed`` (random when ``None``). The caller has
        checked that the id is new and a slot is free.
        """
        assert session_id not in self.sessions, session_id
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(62)
        slot = self.cache.allocate()
        try:  # transactional: a failure below (e.g. the probe ring's allocation) gives the slot back
            s = Session(
                session_id=session_id,
                slot=slot,
                config=config,
                sampling=sampling,
                stream=SampleStream.fresh(seed),
                seed=seed,
                prompt_len=prompt_len,
                protected_rows=prompt_len if config.protect_prompt else 0,
            )
            if records_queries(config):
                lay, k = self.runner.layout, self.cache.k
                s.probes = ProbeRing(
                    lay.n_layers, lay.n_q_heads, lay.head_dim, config.n_probe_queries, k.dtype, k.device
                )
        except BaseException:
            self.cache.release(slot)
            raise
        self.sessions[session_id] = s
        return s

    def fork(self, src: Session, session_id: str) -> Session:
        """Copy ``src`` (:meth:`Session.clone`) and its cache rows into a new slot, registered as ``session_id``."""
        assert session_id not in self.sessions, session_id
        if not self.cache.can_allocate():
            raise CapacityError(
                f"all {self.cache.max_slots} slots are in use; close a session before forking"
            )
        slot = self.cache.allocate()
        try:
            self.cache.copy_slot(src.slot, slot)
            new = src.clone(session_id, slot)
        except BaseException:
            self.cache.release(slot)
            raise
        self.sessions[session_id] = new
        return new

    def drop(self, s: Session) -> None:
        """Unregister ``s`` and free its slot (a running response of it is cancelled)."""
        self.cancel(s)
        self.held = [(w, r) for w, r in self.held if w.session is not s]
        self.sessions.pop(s.session_id, None)
        self.cache.release(s.slot)

    # ------------------------------------------------------------- stepping
    def stream_for(self, s: Session, sampling: SamplingParams | None) -> tuple[SamplingParams, SampleStream]:
        """Request parameters and random stream: a request seed starts a fresh stream, else the session's."""
        if sampling is None:
            return s.sampling, s.stream
        if sampling.seed is not None:
            return sampling, SampleStream.fresh(sampling.seed)
        return sampling, s.stream

    def check(self, s: Session, new_ids: list[int]) -> None:
        """Raise before any state changes if a step on ``s`` cannot run.

        The fit is judged after the KV-budget compaction the input would trigger (planned, not
        applied) and with the budget message that compaction would inject, exactly as
        :meth:`run` will do it.
        """
        if not new_ids and not s.pending and s.last_logits is None:
            raise InvalidArgumentError(
                f"session {s.session_id!r}: nothing to feed and nothing to continue from"
            )
        need = len(s.pending) + len(new_ids)
        spans, kv_after, message = self._plan_input(s, need)
        if kv_after + need + len(message) > self.cache.capacity:
            raise CapacityError(
                f"session {s.session_id!r}: {len(new_ids)} new tokens do not fit: {kv_after} of "
                f"{self.cache.capacity} cache rows used (after {len(spans)} compaction event(s)), "
                f"{need + len(message)} to feed; close the session or raise the engine's capacity"
            )

    def _plan_input(self, s: Session, need: int) -> tuple[list[tuple[int, int]], int, list[int]]:
        """What :meth:`_compact_for` would do for ``need`` rows: ``(spans, kv_len after, message)``."""
        spans, kv = self.compactor.plan_room(s, need)
        message: list[int] = []
        if spans and s.config.inject_budget_message:
            message = self.budget_message(s)
            more, kv = self.compactor.plan_room(s, need + len(message), kv, spans)
            spans += more
        return spans, kv, message

    def run(self, works: list[Work]) -> list[StepResult]:
        """Feed every work's input, generate its response, apply triggers; one result per work.

        Work already in flight (:meth:`begin` without the matching :meth:`advance` rounds) is
        advanced too; its results are kept for the next :meth:`advance`. Works that generate
        nothing (``max_new_tokens=0``: a create, a teacher-forced turn) run no decode round, so
        they never advance the work in flight.
        """
        self.begin(works)
        mine = {id(w) for w in works}
        results: dict[int, StepResult] = {}
        while len(results) < len(works):
            generating = any(w.finish is None for w in works)
            for w, r in self.advance(decode=generating):
                if id(w) in mine:
                    results[id(w)] = r
                else:
                    self.held.append((w, r))
        return [results[id(w)] for w in works]

    def begin(self, works: list[Work], *, prefill: bool = True) -> None:
        """Input and one batched prefill for ``works``, which then join :attr:`running`.

        Touches only these works' sessions: on an exception, the work already running is intact.
        ``prefill=False`` leaves the inputs of works that will generate to the next round, whose
        forward feeds them together with the running rows' decode step (:meth:`_decode_round`);
        the others (no new tokens, scored inputs, nothing to generate) are fed now.
        """
        t0 = time.perf_counter()
        messages = self._make_room(works)
        for w, msgs in zip(works, messages):
            self._take_input(w, msgs)
        t1 = time.perf_counter()
        for w in works:
            w.deferred = not prefill and self._can_defer(w)
        now = [w for w in works if not w.deferred]
        self._feed([w for w in now if w.session.pending])
        for w in now:
            if w.logits is None:
                w.logits, w.session.last_logits = w.session.last_logits, None
        t2 = time.perf_counter()
        for w in works:
            w.started, w.prefill_s, w.decode_from = t0, t2 - t1, t2
            s, budget = w.session, w.session.config.max_total_tokens
            if budget is not None and s.generated >= budget:
                self._finish(w, "budget")
            elif w.params.max_new_tokens == 0:
                self._finish(w, "length")
            else:
                s.last_response = (len(s.token_ids), len(s.token_ids))
        self.running += works

    @staticmethod
    def _can_defer(w: Work) -> bool:
        """Whether ``w``'s input may be fed by the next round instead of :meth:`begin`."""
        s, budget = w.session, w.session.config.max_total_tokens
        return (
            bool(s.pending)
            and not w.score_input
            and w.params.max_new_tokens > 0
            and (budget is None or s.generated < budget)
        )

    def advance(self, max_steps: int | None = None, *, decode: bool = True) -> list[tuple[Work, StepResult]]:
        """One decode round over :attr:`running`; the works that finished, with their results.

        A round samples, feeds budget messages and runs one decode chunk of at most
        ``max_steps`` (default ``runner.chunk_steps``) tokens per row. What a row does in a round
        depends on that row alone, so results do not depend on which rounds a work shared with
        which others (docs/engine.md, "Continuous batching"). ``decode=False`` only collects the
        works that are already finished.
        """
        out, self.held = self.held, []
        active = [w for w in self.running if w.finish is None]
        if active and decode:
            self._decode_round(active, self.runner.chunk_steps if max_steps is None else max_steps)
        done = [w for w in self.running if w.finish is not None]
        if not done:
            return out
        self.running = [w for w in self.running if w.finish is None]
        self._after_response(done)
        t = time.perf_counter()
        for w in done:
            timings = {"prefill": w.prefill_s, "decode": t - w.decode_from, "total": t - w.started}
            out.append((w, self._result(w, timings)))
        return out

    def work_of(self, s: Session) -> Work | None:
        """The running work of session ``s`` (``None`` when it is not generating)."""
        return next((w for w in self.running if w.session is s), None)

    def cancel(self, s: Session) -> bool:
        """Stop ``s``'s running work where it stands (its result is dropped); whether there was one."""
        w = self.work_of(s)
        if w is None:
            return False
        self.running.remove(w)
        return True

    def _make_room(self, works: list[Work]) -> list[list[list[int]]]:
        """KV-budget compaction before the inputs; per work, the budget messages to inject after it.

        The fit was checked by :meth:`check` before the batch started.
        """
        needs = [len(w.session.pending) + len(w.new_ids) for w in works]
        messages = self._compact_for(works, needs, [True] * len(works))
        for w, need, message in zip(works, needs, messages):
            s = w.session
            assert self.kv_len(s) + need + len(message) <= self.cache.capacity, (
                s.session_id,
                self.kv_len(s),
                need,
            )
        return [[m] if m else [] for m in messages]

    def _compact_for(self, works: list[Work], needs: list[int], with_message: list[bool]) -> list[list[int]]:
        """KV-budget events so that ``needs[i]`` more rows fit in each work's session, plus the
        budget message each work's events call for.

        The works' events are fired together (:meth:`Compactor.make_room_many`: those due at once
        share stacked calls); a work's events fired back to back share one message, and room is
        made for the message too. Each work is charged its events' share of the time.
        """
        events = self.compactor.make_room_many([(w.session, n) for w, n in zip(works, needs)])
        messages: list[list[int]] = [[] for _ in works]
        more = [
            i
            for i, (w, ev) in enumerate(zip(works, events))
            if ev and with_message[i] and w.session.config.inject_budget_message
        ]
        if more:
            extra = self.compactor.make_room_many(
                [(works[i].session, needs[i] + len(self.budget_message(works[i].session))) for i in more]
            )
            for i, ev in zip(more, extra):
                events[i] += ev
                messages[i] = self.budget_message(works[i].session)
        for w, ev in zip(works, events):
            w.events += ev
            w.compaction_s += sum(e.timings["total"] for e in ev)
        return messages

    def _take_input(self, w: Work, messages: list[list[int]]) -> None:
        s = w.session
        w.stop_ids = frozenset(w.params.stop_token_ids) | frozenset(
            () if w.params.ignore_eos else self.eos_token_ids
        )
        s.turn_starts.append(len(s.token_ids))
        if w.response_complete:  # the latest response is the fed one: `keys` probes use the newest rows
            s.last_response = None
        s.append(w.new_ids, sampled=False)
        w.out_start = len(s.token_ids)
        for msg in messages:
            self._inject(w, msg)

    def _inject(self, w: Work, ids: list[int]) -> None:
        s = w.session
        start = len(s.token_ids) - w.out_start
        s.append(ids, sampled=False)
        w.inject_ranges.append((start, start + len(ids)))

    def _feed(self, works: list[Work]) -> None:
        """Feed every work's pending tokens (chunked); set ``w.logits`` to its last token's logits.

        A work with ``score_input`` gets the log-probs of its input tokens (``new_ids``) in
        ``w.input_logprobs`` (docs/engine.md, "Scoring fed tokens"): each token under the logits
        of the position before it, computed when that position was fed — in this chunk, the
        previous chunk, or an earlier call (the session's ``last_logits``); ``None`` without one.
        """
        todo = list(works)
        while todo:
            feeds = self._next_chunks(todo)
            self._took_chunks(todo, feeds, self.runner.forward(feeds))
            todo = [w for w in todo if w.session.pending]

    def _next_chunks(self, works: list[Work]) -> list[RowFeed]:
        """Each work's next prefill chunk (at most ``prefill_chunk`` of its pending tokens)."""
        feeds = []
        for w in works:
            s = w.session
            chunk = s.pending[: self.prefill_chunk]
            feeds.append(
                RowFeed(s.slot, chunk, s.fed, s.probes, score=self._scores_input(w, s.fed, len(chunk)))
            )
        return feeds

    def _took_chunks(self, works: list[Work], feeds: list[RowFeed], logits: torch.Tensor) -> None:
        """Book the fed chunks: scores, row map, fed count; ``w.logits`` = its last token's logits."""
        for i, (w, f) in enumerate(zip(works, feeds)):
            if f.score:
                self._take_scores(w, f)
            w.session.row_map.append(f.start, len(f.token_ids))
            w.session.fed += len(f.token_ids)
            w.session.last_logits = None
            w.logits = logits[i]

    @staticmethod
    def _scores_input(w: Work, start: int, n: int) -> bool:
        """Whether positions ``[start, start + n)`` hold input tokens of a scoring work."""
        first = w.out_start - len(w.new_ids)
        return w.score_input and start < w.out_start and start + n > first

    @staticmethod
    def _take_scores(w: Work, f: RowFeed) -> None:
        """Store the input positions' log-probs and entropies from a scored chunk (and the
        logits before it)."""
        first = w.out_start - len(w.new_ids)
        if w.input_logprobs is None:
            w.input_logprobs = [None] * len(w.new_ids)
            w.input_entropies = [None] * len(w.new_ids)
        assert w.input_entropies is not None
        prev = w.logits if w.logits is not None else w.session.last_logits
        if prev is not None and first <= f.start < w.out_start:
            lp = torch.log_softmax(prev.float(), -1)
            w.input_logprobs[f.start - first] = lp[f.token_ids[0]].item()
            w.input_entropies[f.start - first] = -(lp.exp() * lp).sum().item()
        ents = f.entropies.tolist() if f.entropies is not None else [None] * len(f.scores)
        for j, (lp, h) in enumerate(zip(f.scores.tolist(), ents), start=f.start + 1):
            if first <= j < w.out_start:
                w.input_logprobs[j - first] = lp
                w.input_entropies[j - first] = h

    def _decode_round(self, active: list[Work], horizon: int) -> None:
        """Each row's next step: sample from held logits, feed a budget message, or run a decode chunk."""
        holding = [w for w in active if w.logits is not None]
        if holding:
            tokens, logprobs = sample(
                torch.stack([w.logits for w in holding]),
                [w.params for w in holding],
                [w.stream for w in holding],
            )
            going = []
            for w, tok, lp in zip(holding, tokens, logprobs):
                w.logits = None
                if self._take_token(w, tok, lp):
                    going.append(w)
            self._room_for_next(going)
        active = [w for w in active if w.finish is None]
        feeding = [w for w in active if len(w.session.pending) > 1]
        decoding = [w for w in active if len(w.session.pending) == 1]
        merge = bool(decoding) and any(w.deferred for w in feeding)
        for w in active:
            w.deferred = False
        if merge:  # submitted inputs share the decode step's forward (docs/engine.md, "Continuous batching")
            decoding = self._feed_and_step(feeding, decoding)
            horizon -= 1
        self._feed([w for w in feeding if w.session.pending])
        if horizon > 0:
            self._decode_chunk(decoding, horizon)

    def _feed_and_step(self, feeding: list[Work], decoding: list[Work]) -> list[Work]:
        """One forward: the feeding rows' next prefill chunk and the decoding rows' first decode step.

        A decoding row feeds its pending token and samples from its logits, as the first step of
        :meth:`~ModelRunner.decode_chunk` does (same sampler, same stream). Returns the decoding
        rows that may run more steps in this round.
        """
        feeds = self._next_chunks(feeding)
        steps = [
            RowFeed(w.session.slot, w.session.pending[:1], w.session.fed, w.session.probes) for w in decoding
        ]
        logits = self.runner.forward(feeds + steps)
        self._took_chunks(feeding, feeds, logits[: len(feeds)])
        tokens, logprobs = sample(
            logits[len(feeds) :], [w.params for w in decoding], [w.stream for w in decoding]
        )
        taken = []
        for w, tok, lp in zip(decoding, tokens, logprobs):
            s = w.session
            s.row_map.append(s.fed, 1)
            s.fed += 1
            s.last_logits = None
            if self._take_token(w, tok, lp):
                taken.append(w)
        self._room_for_next(taken)
        return [w for w in taken if w.finish is None and len(w.session.pending) == 1]

    def _decode_chunk(self, works: list[Work], horizon: int) -> None:
        """One :meth:`~ModelRunner.decode_chunk` over rows whose one pending token is cleared to feed.

        The chunk runs to its longest row's limit, or ends at a step where rows pause for host work
        when that saves time at the prices of :attr:`chunk_costs` (docs/engine.md, "Decode chunks
        end at pauses")."""
        if not works:
            return
        free = [self._free_steps(w, horizon) for w in works]
        longest = max(n for n, _ in free)
        steps = longest
        if self.cut_chunks:
            steps = self.chunk_costs.chunk_steps([n for n, pauses in free if pauses], longest)
        rows = [
            DecodeRow(w.session.slot, w.session.pending[0], w.session.fed, min(n, steps), w.params, w.stream, w.stop_ids, w.session.probes)
            for w, (n, _) in zip(works, free)
        ]  # fmt: skip
        decoded = self.runner.decode_chunk(rows, steps)
        going = []
        for w, (tokens, logprobs) in zip(works, decoded):
            s = w.session
            s.row_map.append(s.fed, len(tokens))  # fed: the pending token and every sampled one but the last
            s.fed += len(tokens)
            s.last_logits = None
            for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
                going_on = self._take_token(w, tok, lp)
                assert going_on or i == len(tokens) - 1, "a row ran past its stop"
            if going_on:
                going.append(w)
        self._room_for_next(going)

    def _free_steps(self, w: Work, horizon: int) -> tuple[int, bool]:
        """Decode steps ``w`` may run before the host must act (at least 1, at most ``horizon``),
        and whether the row then *pauses* (host work, then it goes on) rather than ends.

        Its remaining ``max_new_tokens`` and budget bound it, and so does the first step after
        which feeding the sampled token needs a KV-budget event or overflows the slot (both only
        grow with the cache, so a bisection over the steps finds it). It pauses for a KV-budget
        event and for the periodic budget message.
        """
        s = w.session
        n = min(horizon, w.params.max_new_tokens - w.sampled)
        if s.config.max_total_tokens is not None:
            n = min(n, s.config.max_total_tokens - s.generated)
        ends = n < horizon  # the response ends after n steps unless something comes first
        every = s.config.inject_budget_every
        if every is not None and every - s.generated % every < n:  # the host injects the budget message
            n, ends = every - s.generated % every, False
        kv0 = self.kv_len(s)  # before feeding the pending token; after step j it holds kv0 + j rows

        def event(j: int) -> bool:
            return bool(self.compactor.plan_room(s, 1, kv0 + j)[0])

        def blocked(j: int) -> bool:
            return kv0 + j + 1 > self.cache.capacity or event(j)

        if not blocked(n):
            return n, not ends and n < horizon
        lo, hi = 1, n
        while lo < hi:
            mid = (lo + hi) // 2
            if blocked(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo, event(lo) and not (ends and lo == n)

    def _take_token(self, w: Work, tok: int, logprob: float) -> bool:
        """Append a sampled token; end the response on a stop token, the budget or ``max_new_tokens``.

        Returns whether the response goes on.
        """
        s = w.session
        s.append([tok], sampled=True, logprobs=[logprob])
        s.last_response = (s.last_response[0], len(s.token_ids))
        w.sampled += 1
        budget = s.config.max_total_tokens
        if tok in w.stop_ids:
            self._finish(w, "stop")
        elif budget is not None and s.generated >= budget:
            self._finish(w, "budget")
        elif w.sampled >= w.params.max_new_tokens:
            self._finish(w, "length")
        return w.finish is None

    def _room_for_next(self, works: list[Work]) -> None:
        """Per work: the periodic budget message when ``inject_budget_every`` sampled tokens have
        passed, then KV-budget compaction (and its budget message, unless the periodic one was just
        injected) so the pending tokens fit; ``length`` if the slot is full. The works' events are
        fired together (:meth:`_compact_for`)."""
        periodic = []
        for w in works:
            s = w.session
            every = s.config.inject_budget_every
            periodic.append(every is not None and s.generated % every == 0)
            if periodic[-1]:
                self._inject(w, self.budget_message(s))
        needs = [len(w.session.pending) for w in works]
        messages = self._compact_for(works, needs, [not p for p in periodic])
        for w, message in zip(works, messages):
            if message:
                self._inject(w, message)
            if self.kv_len(w.session) + len(w.session.pending) > self.cache.capacity:
                self._finish(w, "length")

    def _finish(self, w: Work, reason: str) -> None:
        w.finish = reason
        s = w.session
        # logits not consumed by sampling are kept so that a later step([]) can continue from them
        s.last_logits = w.logits if not s.pending else None
        w.logits = None

    def _after_response(self, works: list[Work]) -> None:
        due: list[tuple[Work, tuple[int, int]]] = []
        for w in works:
            s = w.session
            if not s.config.turn_based or (w.sampled == 0 and not w.response_complete):
                continue
            span = self.compactor.turn_span(s)
            if span is not None:
                due.append((w, span))
        events = self.compactor.compact_many(
            [(w.session, span, w.session.config.compact_target_ratio, "turn") for w, span in due]
        )
        feed = []
        for (w, _), event in zip(due, events):
            s = w.session
            w.events.append(event)
            w.compaction_s += event.timings["total"]
            if s.config.inject_budget_message:
                self._inject(w, self.budget_message(s))
                if self.kv_len(s) + len(s.pending) <= self.cache.capacity:
                    feed.append(w)
        if feed:
            self._feed(feed)
            for w in feed:
                w.session.last_logits, w.logits = w.logits, None

    def _result(self, w: Work, timings: dict[str, float]) -> StepResult:
        s = w.session
        out = s.token_ids[w.out_start :]
        return StepResult(
            session_id=s.session_id,
            token_ids=list(out),
            logprobs=list(s.logprobs[w.out_start :]),
            completion_mask=list(s.completion_mask[w.out_start :]),
            text=self.decode_text(out),
            finish_reason=w.finish,
            events=list(w.events),
            kv_len=self.kv_len(s),
            total_tokens=len(s.token_ids),
            prompt_len=len(w.new_ids),
            inject_ranges=list(w.inject_ranges),
            timings={**timings, "compaction": w.compaction_s},
            input_logprobs=(w.input_logprobs or [None] * len(w.new_ids)) if w.score_input else None,
            input_entropies=(w.input_entropies or [None] * len(w.new_ids)) if w.score_input else None,
        )
