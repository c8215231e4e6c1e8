"""Compaction triggers and their application to a session's slot (docs/engine.md, "Triggers").

The math lives in :mod:`compaction_gym.compaction`; this module decides *when* and *which span*,
gathers the probes (:func:`~compaction_gym.compaction.event_probes`), calls
:func:`~compaction_gym.compaction.apply_event` once for all layers × KV heads (the same call replay
makes), writes ``[prefix | block | suffix]`` back into the slot and records a replayable
:class:`~compaction_gym.compaction.events.CompactionEvent` (kept indices, key-probe rows, fitted β).

Triggers:

* **KV budget** — before feeding ``need`` tokens, while ``kv_len + need > max_kv_len``, the
  ``compact_window`` rows after the protected prompt are compacted to
  ``max(1, floor(window · ratio))`` rows (the next event's span includes the previous block);
  with ``kv_budget_from="raw"`` the window starts at the end of the last compacted block instead
  (while ``window`` raw rows follow it). Skipped when fewer than ``window`` rows follow the prompt,
  when ``n_compacts`` events happened, or when an event would free nothing (``ratio = 1``).
* **Turn-based** — after a response: rows from the end of the last compacted block (or the
  prompt, with ``recompact_from_prompt``) to the start of the last ``k`` turns.
* **Manual** — any span, any ratio.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from compaction_gym.compaction import CompactionResult, apply_event, compact, event_probes, key_probe_rows
from compaction_gym.compaction.events import CompactionEvent, Trigger
from compaction_gym.compaction.mass import attention_mass_kept
from compaction_gym.compaction.modes import (
    POSITION_MODES,
    QUERY_MODES,
    REPEAT_SOURCES,
    SUFFIX_SOURCES,
    target_size,
)
from compaction_gym.compaction.rowmap import replace_blocks
from compaction_gym.engine.event_batch import (
    EventBlocks,
    PendingEvent,
    StackedRows,
    event_blocks,
    group_events,
    stack_rows,
)
from compaction_gym.engine.host_copy import HostCopy
from compaction_gym.engine.model_runner import ModelLayout
from compaction_gym.engine.profiling import profiler_range
from compaction_gym.engine.session import Session
from compaction_gym.engine.slot_cache import SlotKVCache
from compaction_gym.errors import InvalidArgumentError

#: The prompt fed before the re-read span of ``repeat`` probes (the Attention Matching paper's
#: repeat-prefill: "{context} Repeat the previous context. {context}").
REPEAT_PROMPT = "\n\nRepeat the previous text exactly.\n\n"

#: Harvests post-RoPE queries ``[L, H_q, n, d]`` of ``token_ids`` fed to ``slot`` at logical
#: positions ``start ..`` over the slot's cache as it stands, leaving the slot unchanged.
Harvest = Callable[[int, Sequence[int], int], torch.Tensor]


def harvest_queries(
    runner, cache: SlotKVCache, slot: int, token_ids: Sequence[int], start: int, chunk: int
) -> torch.Tensor:
    """Post-RoPE queries ``[L, H_q, n, d]`` of ``token_ids`` fed to ``slot`` at logical positions
    ``start ..`` over its cache as it stands (with its β), ``chunk`` tokens per forward; the slot's
    length is restored afterwards, so the fed rows are discarded (a scratch forward).

    ``runner`` is the engine's model runner (``forward(list[RowFeed])`` with a query recorder).
    """
    from compaction_gym.engine.model_runner import RowFeed
    from compaction_gym.engine.session import ProbeRing

    lay, n0, n = runner.layout, cache.length(slot), len(token_ids)
    ring = ProbeRing(lay.n_layers, lay.n_q_heads, lay.head_dim, n, cache.k.dtype, cache.k.device)
    try:
        for a in range(0, n, chunk):
            part = list(token_ids[a : a + chunk])
            runner.forward([RowFeed(slot, part, start + a, recorder=ring)])
    finally:
        lengths = list(cache.lengths)
        lengths[slot] = n0
        cache.restore_lengths(lengths)
    picked = ring.select(start)
    assert picked is not None and picked[1] == (start, start + n), picked
    return picked[0]


def records_queries(config) -> bool:
    """Whether a session with ``config`` must record post-RoPE queries (``suffix`` probes)."""
    return config.mode in QUERY_MODES and config.queries in SUFFIX_SOURCES


def repeat_tokens(prompt: Sequence[int], span_tokens: Sequence[int], n_probe: int, room: int) -> list[int]:
    """A ``repeat`` event's probe tokens: ``prompt`` then the last span tokens that fit.

    At most ``n_probe`` span tokens, and ``prompt + span`` at most ``room`` tokens (the slot's free
    rows: the scratch forward writes there before the slot's length is restored).

    Raises:
        InvalidArgumentError: not even the prompt and one span token fit.
    """
    n = min(n_probe, len(span_tokens), room - len(prompt))
    if n < 1:
        raise InvalidArgumentError(
            f"queries='repeat' needs {len(prompt) + 1} free cache rows at a compaction event, the slot "
            f"has {room}: raise the engine's capacity or lower max_kv_len"
        )
    return [*prompt, *span_tokens[len(span_tokens) - n :]]


class Compactor:
    """Applies compaction events to sessions' slots."""

    def __init__(
        self,
        cache: SlotKVCache,
        layout: ModelLayout,
        compact_fn: Callable[..., CompactionResult] = compact,
        record_mass: bool = False,
        harvest: Harvest | None = None,
        repeat_prompt: Sequence[int] = (),
    ) -> None:
        self.cache = cache
        self.layout = layout
        self.compact_fn = compact_fn  # the fast path passes its fused Attention Matching
        #: measure each event's ``mass_kept`` (a diagnostic: one more probes × span product per event)
        self.record_mass = record_mass
        self.harvest = harvest  # the engine's scratch forward (``repeat`` probes)
        self.repeat_prompt = list(repeat_prompt)
        #: score the events due at one step in stacked calls (docs/engine.md, "Batched events"): on
        #: by default on CUDA, where an event's cost is kernel launches and host syncs; off on CPU,
        #: where it is arithmetic and padding would add some. ``benchmarks/bench_sessions.py
        #: --compare-unbatched-events`` times both.
        self.batch_events = cache.k.is_cuda

    # -------------------------------------------------------------- triggers
    def kv_budget_span(
        self, s: Session, kv_len: int | None = None, planned: Sequence[tuple[int, int]] = ()
    ) -> tuple[int, int] | None:
        """The span a KV-budget event would compact now, or ``None`` if none can fire.

        ``kv_budget_from="prompt"``: the ``compact_window`` rows after the protected prompt.
        ``"raw"``: the ``compact_window`` rows after the last compacted block (the oldest rows not
        compacted yet), or the prompt-anchored span when fewer remain. Either fires exactly when
        the prompt-anchored span fits, so both schedules keep the same cache lengths.

        ``kv_len`` / ``planned``: pretend the slot holds ``kv_len`` rows and the ``planned`` spans
        were already compacted, in order (planning, see :meth:`plan_room`).
        """
        cfg = s.config
        if not cfg.kv_budget or s.budget_events + len(planned) >= cfg.n_compacts:
            return None
        kv = self.cache.length(s.slot) if kv_len is None else kv_len
        window = cfg.compact_window
        start = s.protected_rows
        if start + window > kv or target_size(cfg.mode, window, cfg.compact_target_ratio) >= window:
            return None
        if cfg.kv_budget_from == "raw":
            block_end = self._block_end(s, planned)
            if block_end is not None and max(start, block_end) + window <= kv:
                start = max(start, block_end)
        return start, start + window

    def _block_end(self, s: Session, planned: Sequence[tuple[int, int]]) -> int | None:
        """End row of the last compacted block once the ``planned`` spans are compacted."""
        blocks = s.row_map.blocks()
        for a, b in planned:
            blocks = replace_blocks(
                blocks, a, b, target_size(s.config.mode, b - a, s.config.compact_target_ratio)
            )
        return max((b for _, b in blocks), default=None)

    def plan_room(
        self, s: Session, need: int, kv_len: int | None = None, planned: Sequence[tuple[int, int]] = ()
    ) -> tuple[list[tuple[int, int]], int]:
        """What :meth:`make_room` would do, without changing anything.

        A KV-budget event's outcome is pure arithmetic (``window`` rows become
        ``target_size(window)``, the compacted blocks move by
        :func:`~compaction_gym.compaction.rowmap.replace_blocks`), so the spans and the resulting
        cache length are known up front.

        Args:
            need: rows to make room for under ``max_kv_len``.
            kv_len, planned: start from this cache length, after these spans (already planned, in
                firing order) were compacted (default: the slot's length, none).

        Returns:
            ``(spans, kv_len_after)``: the new spans, in firing order, and the slot length after them.
        """
        kv = self.cache.length(s.slot) if kv_len is None else kv_len
        spans: list[tuple[int, int]] = []
        cfg = s.config
        while cfg.kv_budget and kv + need > cfg.max_kv_len:
            span = self.kv_budget_span(s, kv, [*planned, *spans])
            if span is None:
                break
            spans.append(span)
            n = span[1] - span[0]
            kv -= n - target_size(cfg.mode, n, cfg.compact_target_ratio)
        return spans, kv

    def make_room(self, s: Session, need: int) -> list[CompactionEvent]:
        """KV-budget events until ``need`` more rows fit under ``max_kv_len`` (or none can fire)."""
        return self.make_room_many([(s, need)])[0]

    def make_room_many(self, requests: Sequence[tuple[Session, int]]) -> list[list[CompactionEvent]]:
        """:meth:`make_room` for several distinct sessions at once, one list of events each.

        Every session's spans are planned first (:meth:`plan_room`); round ``r`` then fires the
        ``r``-th event of every session that needs one, in one :meth:`compact_many` call.
        """
        plans = [self.plan_room(s, need) for s, need in requests]
        out: list[list[CompactionEvent]] = [[] for _ in requests]
        for r in range(max((len(spans) for spans, _ in plans), default=0)):
            due = [i for i, (spans, _) in enumerate(plans) if len(spans) > r]
            batch = [
                (requests[i][0], plans[i][0][r], requests[i][0].config.compact_target_ratio, "kv_budget")
                for i in due
            ]
            for i, event in zip(due, self.compact_many(batch)):
                out[i].append(event)
                requests[i][0].budget_events += 1
        for (s, _), (_, kv_after) in zip(requests, plans):
            assert self.cache.length(s.slot) == kv_after, (self.cache.length(s.slot), kv_after)
        return out

    def turn_span(self, s: Session) -> tuple[int, int] | None:
        """The region a turn-based event compacts after a response, or ``None``."""
        cfg = s.config
        if not cfg.turn_based:
            return None
        kv_len = self.cache.length(s.slot)
        floor = s.protected_rows
        block_end = s.row_map.last_block_end()
        start = floor if cfg.recompact_from_prompt or block_end is None else max(floor, block_end)
        k = cfg.n_protect_turns
        if k == 0:
            end = kv_len
        elif len(s.turn_starts) < k:
            return None
        else:
            end = s.row_map.row_of(s.turn_starts[-k])
            if end is None:  # the protected turn was compacted by hand: protect what is left raw
                return None
        if end - start < 1:
            return None
        return start, end

    # ---------------------------------------------------------------- events
    def compact(self, s: Session, span: tuple[int, int], ratio: float, trigger: Trigger) -> CompactionEvent:
        """Compact rows ``span`` of ``s`` to ``target_size(mode, len, ratio)`` rows; return the event."""
        return self.compact_many([(s, span, ratio, trigger)])[0]

    def compact_many(
        self, requests: Sequence[tuple[Session, tuple[int, int], float, Trigger]]
    ) -> list[CompactionEvent]:
        """One event per ``(session, span, ratio, trigger)``, all due now; the events, in order.

        Every event's probes are gathered first; events of one shape (:func:`batch_key`) are then
        scored by one stacked :func:`apply_event` call (docs/engine.md, "Batched events"), the
        others alone; each call's blocks are written back into their slots at once
        (:meth:`SlotKVCache.replace_spans`) and every event is recorded as if it had been
        compacted alone. The sessions must be distinct (a session's next event depends on this
        one's block).
        """
        assert len({id(r[0]) for r in requests}) == len(requests), "one event per session per call"
        if not requests:  # the scheduler asks after every response (turn events): no profiler ranges then
            return []
        with profiler_range("compaction.prepare"):
            pending = [self._prepare(*r) for r in requests]
        rows = self.layout.n_layers * self.layout.n_kv_heads
        groups = group_events(pending, rows) if self.batch_events else [[i] for i in range(len(pending))]
        # every call is launched and written back before the host waits once (docs/engine.md,
        # "Batched events"): the host's work on one call overlaps the device's on the previous ones
        launched = []
        for group in groups:
            t0 = time.perf_counter()
            events = [pending[i] for i in group]
            if len(group) == 1:
                with profiler_range("compaction.score"):
                    blocks = event_blocks(self._score(events[0]))
            else:
                with profiler_range("compaction.stack"):
                    stacked = stack_rows(events, self.cache)
                with profiler_range("compaction.score"):
                    blocks = event_blocks(self._score(events[0], stacked), stacked)
            # the recorded indices and β of the whole call: one device→host copy, waited for below
            recorded = events[0].session.config.compute_beta and blocks.beta is not None
            with profiler_range("compaction.to_host"):
                copy = HostCopy(blocks.indices, blocks.beta if recorded else None)
            with profiler_range("compaction.write_back"):
                masses, kv_after = self._write_back(events, blocks)
            launched.append((group, events, copy, masses, kv_after, time.perf_counter() - t0))
        done: dict[int, CompactionEvent] = {}
        for group, events, copy, masses, kv_after, launch_s in launched:
            with profiler_range("compaction.record"):
                # recorded while the copy is on its way: the records hold views of the host buffers it fills
                done.update(zip(group, self._record(events, copy.indices, copy.beta, masses, kv_after)))
            t0 = time.perf_counter()
            with profiler_range("compaction.wait"):
                copy.wait()
            share = (launch_s + time.perf_counter() - t0) / len(group)  # a call's time, split evenly
            self._settle(events, copy.beta, share)
        return [done[i] for i in range(len(pending))]

    def _prepare(self, s: Session, span: tuple[int, int], ratio: float, trigger: Trigger) -> PendingEvent:
        """An event's span, target and probes, read from the slot as it stands."""
        t0 = time.perf_counter()
        cfg, cache = s.config, self.cache
        start, end = span
        kv_before = cache.length(s.slot)
        assert 0 <= start < end <= kv_before, (span, kv_before)
        index = len(s.events)
        log_span = s.row_map.logical_span(start, end)
        keys_all, values_all, beta_all = cache.rows(s.slot)
        p = PendingEvent(
            session=s, span=span, trigger=trigger, target=target_size(cfg.mode, end - start, ratio),
            index=index, logical_span=log_span, kv_len_before=kv_before, keys=keys_all, values=values_all,
            key_bias=beta_all if cache.has_beta[s.slot] else None, queries=None, query_positions=None,
            slot=s.slot,
        )  # fmt: skip
        if cfg.mode != "markovian":  # a deletion needs no probes
            probes, p.probe_range, p.probe_seed, p.probe_rows, p.probe_tokens = self._probes(
                s, keys_all, log_span, index
            )
            if isinstance(probes, tuple):  # suffix probes, grouped on first use (PendingEvent.probes)
                p.query_parts = probes
            else:
                p.queries = probes
        p.query_positions = self._probe_positions(
            s, p.probe_range, p.probe_rows, keys_all.device, len(p.probe_tokens) if p.probe_tokens else 0
        )
        p.timings["probes"] = time.perf_counter() - t0
        return p

    def _score(self, p: PendingEvent, stacked: StackedRows | None = None) -> CompactionResult:
        """``p``'s block by :func:`apply_event` (the call replay makes), or the block of every event
        in ``stacked`` when given (``p`` then only supplies the shared settings)."""
        cfg, lay = p.session.config, self.layout
        one = stacked is None
        return apply_event(
            p.keys if one else stacked.keys,
            p.values if one else stacked.values,
            p.probes() if one else stacked.queries,
            mode=cfg.mode,
            span=p.span if one else stacked.span,
            target=p.target,
            compute_beta=cfg.compute_beta,
            scale=lay.scale,
            key_bias=p.key_bias if one else stacked.key_bias,
            ridge=cfg.ridge,
            seed=_mix(p.session.seed, p.index) if cfg.mode == "random" else None,
            compact_fn=self.compact_fn,
            query_positions=p.query_positions if one else None,
            n_kv_heads=lay.n_kv_heads,
            refit_values=cfg.refit_values,
            query_mask=None if one else stacked.query_mask,
        )

    def _write_back(
        self, events: list[PendingEvent], blocks: EventBlocks
    ) -> tuple[list[float | None], list[int]]:
        """Write the blocks of one scoring call's events into their slots (one batched write-back,
        launched without waiting for the device); returns each event's ``mass_kept`` (read before
        its rows are overwritten) and new cache length. The slots' ``has_beta`` flags are set by
        :meth:`_record`, once the fitted β is on the host."""
        cache = self.cache
        masses = [self._mass(p, blocks[k]) for k, p in enumerate(events)]
        slots = [p.session.slot for p in events]
        # without a fit, a slot without β keeps none: its block's β, when the call has one (a
        # stacked call's or a slot holding β beside it), is its own rows' β, zero (SlotKVCache.has_beta)
        compute_beta = events[0].session.config.compute_beta  # one of the batch key's settings
        beta = blocks.beta if compute_beta or any(cache.has_beta[s] for s in slots) else None
        # nonzero: "nothing new known" (each slot's own flag), so the write-back asks the device nothing
        kv_after = cache.replace_spans(
            slots, [p.span for p in events], blocks.keys, blocks.values, beta,
            nonzero=[cache.has_beta[s] for s in slots],
        )  # fmt: skip
        return masses, kv_after

    def _record(
        self,
        events: list[PendingEvent],
        host_indices: torch.Tensor,
        host_beta: torch.Tensor | None,
        masses: list[float | None],
        kv_after: list[int],
    ) -> list[CompactionEvent]:
        """Record the events of one scoring call, written back by :meth:`_write_back`
        (``host_*``: their indices and fitted β ``[S, B, t]`` on the host, filled once their
        :class:`HostCopy` has landed; :meth:`_settle` then finishes the records)."""
        lay = self.layout
        cfg = events[0].session.config
        target = events[0].target
        out = []
        for k, p in enumerate(events):
            t_record = time.perf_counter()
            s, (start, end) = p.session, p.span
            indices = host_indices[k].reshape(lay.n_layers, lay.n_kv_heads, target)
            # what the cache stores (float32): replay's constant β
            recorded_beta = (
                None if host_beta is None else host_beta[k].reshape(lay.n_layers, lay.n_kv_heads, target)
            )
            s.row_map.replace(start, end, target, p.logical_span)
            assert s.row_map.rows == kv_after[k]
            event = CompactionEvent(
                index=p.index,
                trigger=p.trigger,
                mode=cfg.mode,
                span=(start, end),
                logical_span=p.logical_span,
                indices=indices,
                target=target,
                probe_source=cfg.queries,
                probe_logical_range=p.probe_range,
                probe_seed=p.probe_seed,
                compute_beta=cfg.compute_beta,
                kv_len_before=p.kv_len_before,
                kv_len_after=kv_after[k],
                logical_len=s.fed,
                position_offset=s.fed - kv_after[k],
                timings=p.timings,
                probe_rows=p.probe_rows,
                beta=recorded_beta,
                mass_kept=masses[k],
                probe_tokens=p.probe_tokens,
                refit_values=cfg.refit_values,
            )
            s.events.append(event)
            # the diagnostic is not compaction's cost; :meth:`_settle` adds the call's share
            p.timings["total"] = p.timings["probes"] + time.perf_counter() - t_record
            out.append(event)
        return out

    def _settle(self, events: list[PendingEvent], host_beta: torch.Tensor | None, compact_s: float) -> None:
        """Finish the records of one scoring call once its indices and β are on the host: the slots'
        ``has_beta`` flags and each event's ``compact`` time (``compact_s``: its share of the call's)."""
        if host_beta is not None:  # a slot whose fitted β is nonzero holds β from now on
            fitted = (host_beta.numpy().reshape(len(events), -1) != 0).any(1).tolist()
            for p, f in zip(events, fitted):
                self.cache.has_beta[p.session.slot] = self.cache.has_beta[p.session.slot] or f
        for p in events:
            p.timings["compact"] = compact_s
            p.timings["total"] += compact_s

    def _mass(self, p: PendingEvent, result: CompactionResult) -> float | None:
        """The event's ``mass_kept`` (with ``record_mass``), read before its rows are overwritten."""
        if not self.record_mass:
            return None
        t_mass = time.perf_counter()
        mass = None
        if p.target == 0:
            mass = 0.0
        elif p.has_probes:
            mass = attention_mass_kept(
                p.keys, p.probes(), p.span, result.indices, scale=self.layout.scale, key_bias=p.key_bias,
                beta=result.beta,
            )  # fmt: skip
        p.timings["mass"] = time.perf_counter() - t_mass
        return mass

    def _probe_positions(
        self,
        s: Session,
        probe_range: tuple[int, int] | None,
        probe_rows: tuple[int, int] | None,
        device: torch.device,
        n_repeat: int = 0,
    ) -> torch.Tensor | None:
        """Each probe's cache row (h2o/snapkv's causal masks, tova's last query), in the grouped probes' order.

        ``keys`` probes sit on their own rows; ``suffix`` probes on their tokens' rows, repeated for
        the ``G`` query heads :func:`gqa_probes` concatenates; ``repeat`` probes (after any suffix
        probes) on the rows after the cache where the scratch forward fed them. ``None`` (no mask)
        for ``random`` probes, or when a suffix probe's token is no longer raw in the cache.
        """
        if s.config.mode not in POSITION_MODES:
            return None
        src = s.config.queries
        if probe_rows is not None and src == "keys":
            return torch.arange(*probe_rows, device=device)
        group = self.layout.n_q_heads // self.layout.n_kv_heads
        parts = []
        if src in SUFFIX_SOURCES and probe_range is not None:
            rows = [s.row_map.row_of(p) for p in range(*probe_range)]
            if any(r is None for r in rows):
                return None
            parts.append(torch.tensor(rows, device=device).repeat(group))
        if src in REPEAT_SOURCES and n_repeat:
            kv = self.cache.length(s.slot)
            parts.append(torch.arange(kv, kv + n_repeat, device=device).repeat(group))
        return torch.cat(parts) if parts else None

    def _probes(
        self, s: Session, keys: torch.Tensor, log_span: tuple[int, int], index: int
    ) -> tuple[
        torch.Tensor | tuple[torch.Tensor, ...] | None,
        tuple[int, int] | None,
        int | None,
        tuple[int, int] | None,
        tuple[int, ...] | None,
    ]:
        """Probe queries ``[L * H_kv, n, d]`` for one event, with their logical range, seed, key rows
        and ``repeat`` probe tokens; ``suffix`` probes as the ring's views ``[L, H_q, m, d]``, not
        grouped yet (:attr:`PendingEvent.query_parts`)."""
        cfg, lay = s.config, self.layout
        rows = probe_range = seed = queries = repeat_q = tokens = None
        if cfg.queries == "random":
            seed = s.seed
        elif cfg.queries == "keys":
            rows = key_probe_rows(s.row_map, self.cache.length(s.slot), cfg.n_probe_queries, s.last_response)
            probe_range = s.row_map.logical_span(*rows)
        elif cfg.mode not in QUERY_MODES:  # streaming / random selection: attention is not looked at
            return None, None, None, None, None
        if cfg.queries in SUFFIX_SOURCES and s.probes is not None:
            picked = s.probes.select_parts(log_span[1])
            if picked is None and cfg.queries == "suffix":
                raise InvalidArgumentError("no queries were recorded for suffix probes; feed tokens first")
            if picked is not None:
                parts, probe_range = picked
                if cfg.queries == "suffix":
                    return parts, probe_range, seed, rows, tokens
                queries = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
        if cfg.queries in REPEAT_SOURCES:
            if self.harvest is None:
                raise InvalidArgumentError("queries='repeat' needs an engine that can run a scratch forward")
            a, b = log_span
            room = self.cache.capacity - self.cache.length(s.slot)
            tokens = tuple(repeat_tokens(self.repeat_prompt, s.token_ids[a:b], cfg.n_probe_queries, room))
            repeat_q = self.harvest(s.slot, tokens, s.fed)
        probes = event_probes(
            cfg.queries, keys, n_layers=lay.n_layers, n_kv_heads=lay.n_kv_heads, n_probe=cfg.n_probe_queries,
            event_index=index, seed=seed, rows=rows, queries=queries, repeat_queries=repeat_q,
        )  # fmt: skip
        return probes, probe_range, seed, rows, tokens


def _mix(seed: int, index: int) -> int:
    """Seed of the ``random`` selection baseline for one event."""
    return (seed * 1_000_003 + index) % (2**62)
