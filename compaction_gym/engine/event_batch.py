"""Compaction events due at the same step, stacked into one call (docs/engine.md, "Batched events").

The :class:`~compaction_gym.engine.compactor.Compactor` prepares every event of a scheduler step
first (span, probes: a :class:`PendingEvent`), groups those of one shape (:func:`batch_key`) and
scores each group with one :func:`~compaction_gym.compaction.apply_event` call over the stacked
rows of all its sessions (:func:`stack_rows`), instead of one call per session.

What the math reads. Attention Matching reads, per row (layer × KV head), the span's keys, values
and β and the probes, and also every other row's key and β: the importance is the probes' softmax
over the *whole* cache, so the keys outside the span enter through one log-sum-exp per probe
(and with ``refit_values=False`` the β check compares full-cache attention outputs, which read
every value). So whole rows are stacked: each session's rows are placed so that its span starts
at the same stacked row ``P`` (the largest span start), and the shorter ones are padded. Padding
rows carry key bias ``-inf``: weight exactly 0 in every softmax and log-sum-exp, so each session's
problem is its own, up to the float rounding of sums over a longer row. Events of different
probe counts are stacked too: the probes are padded with zeros to the largest count and a
``query_mask`` tells the math which probes are real (selection, β and C2 then read each row's real
probes alone). Only ``attention_matching`` is stacked: the baselines' causal masks
(``query_positions``), per-event seeds and per-layer head averages address rows or events
individually; with ``refit_values=False`` (whose β check reads no mask) only equal probe counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from compaction_gym.compaction import CompactionResult, gqa_probes
from compaction_gym.engine.fast.gather import gather_rows, gather_supported
from compaction_gym.engine.host_copy import upload
from compaction_gym.engine.session import Session
from compaction_gym.engine.slot_cache import SlotKVCache, as_words

#: Most rows (sessions × layers × KV heads) of one stacked call: the fused kernels launch one
#: program per row on CUDA's second grid axis, which holds at most 65,535.
MAX_STACKED_ROWS = 65_535
#: Most ``rows · n · (d + t)`` of one stacked call (``n`` probes, head dim ``d``, ``t`` kept rows):
#: the size of its float32 intermediates, ``Y [rows, n, d]`` and the ``[rows, n, t]`` logits, so
#: that a call's working memory stays near 4 GiB each (Qwen3-4B, 1,024 probes, t = 64: 18 sessions).
MAX_STACKED_ELEMENTS = 1 << 30


@dataclass(eq=False)
class PendingEvent:
    """One event between its probes and its write-back: what scoring reads and the event records."""

    session: Session
    span: tuple[int, int]
    trigger: str
    target: int
    index: int
    logical_span: tuple[int, int]
    kv_len_before: int
    keys: torch.Tensor  # the slot's rows [L * H_kv, T, d] (views, valid until the write-back)
    values: torch.Tensor
    key_bias: torch.Tensor | None  # [L * H_kv, T], None when the slot holds no β
    queries: torch.Tensor | None  # probes [L * H_kv, n, d] (see query_parts)
    query_positions: torch.Tensor | None
    probe_range: tuple[int, int] | None = None
    probe_seed: int | None = None
    probe_rows: tuple[int, int] | None = None
    probe_tokens: tuple[int, ...] | None = None
    slot: int | None = None  # the session's cache slot (its rows are ``keys`` / ``values``)
    #: suffix probes not grouped yet: views ``[L, H_q, m, d]`` of the session's probe ring, in order
    #: (``queries`` is ``None`` until :meth:`probes` groups them; a stacked call copies them
    #: straight into its rows, so a stacked event's probes are copied once)
    query_parts: tuple[torch.Tensor, ...] = ()
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def has_probes(self) -> bool:
        return self.queries is not None or bool(self.query_parts)

    def probe_count(self) -> int:
        """Probes per row: ``queries.shape[1]``, or what grouping ``query_parts`` gives (0: none)."""
        if self.queries is not None or not self.query_parts:
            return 0 if self.queries is None else self.queries.shape[1]
        group = self.query_parts[0].shape[1] // self._kv_heads()
        return group * sum(part.shape[2] for part in self.query_parts)

    def probes(self) -> torch.Tensor | None:
        """``queries``, grouped from ``query_parts`` on first use (:func:`gqa_probes`, as
        :func:`~compaction_gym.compaction.event_probes` groups ``suffix`` probes)."""
        if self.queries is None and self.query_parts:
            parts = self.query_parts
            self.queries = gqa_probes(
                torch.cat(parts, dim=2) if len(parts) > 1 else parts[0].contiguous(), self._kv_heads()
            )
        return self.queries

    def write_probes(self, out: torch.Tensor) -> None:
        """Copy the probes into ``out[:, :probe_count()]`` (``out``: ``[L * H_kv, n, d]``, contiguous)."""
        if self.queries is not None or not self.query_parts:
            out[:, : self.probe_count()] = self.probes()
            return
        layers, heads, _, d = self.query_parts[0].shape
        kv = self._kv_heads()
        m = sum(part.shape[2] for part in self.query_parts)
        # row l * H_kv + h holds query heads h*G .. h*G+G-1, each with its m probes (gqa_probes)
        grouped = out.view(layers, kv, -1, d)[:, :, : heads // kv * m].view(layers, kv, heads // kv, m, d)
        a = 0
        for part in self.query_parts:
            grouped[:, :, :, a : a + part.shape[2]] = part.view(layers, kv, heads // kv, -1, d)
            a += part.shape[2]

    def _kv_heads(self) -> int:
        return self.keys.shape[0] // self.query_parts[0].shape[0]


def batch_key(p: PendingEvent) -> tuple | None:
    """Events with equal keys can be scored in one stacked call; ``None``: this one goes alone."""
    cfg = p.session.config
    if cfg.mode != "attention_matching" or not p.has_probes:
        return None
    n, d = p.probe_count(), p.keys.shape[-1]
    span_len = p.span[1] - p.span[0]
    probes = None if cfg.refit_values else n  # stacked with padding probes only when C2 is refitted
    return (
        cfg.mode,
        span_len,
        p.target,
        probes,
        d,
        p.keys.dtype,
        cfg.compute_beta,
        cfg.ridge,
        cfg.refit_values,
    )


def group_events(pending: Sequence[PendingEvent], rows_per_event: int) -> list[list[int]]:
    """Indices of ``pending`` by batch key, in first-seen order, each group split into calls of at
    most :data:`MAX_STACKED_ROWS` rows and :data:`MAX_STACKED_ELEMENTS`; an event without a key
    is a group of its own."""
    groups: dict[object, list[int]] = {}
    for i, p in enumerate(pending):
        key = batch_key(p)
        groups.setdefault(("alone", i) if key is None else key, []).append(i)
    calls = []
    for g in groups.values():
        first = pending[g[0]]
        n = max(pending[i].probe_count() for i in g)
        size = 0 if not first.has_probes else n * (first.keys.shape[-1] + first.target)
        rows = min(MAX_STACKED_ROWS, MAX_STACKED_ELEMENTS // max(1, size))
        per_call = max(1, rows // rows_per_event)
        calls += [g[a : a + per_call] for a in range(0, len(g), per_call)]
    return calls


@dataclass
class StackedRows:
    """Rows of several events laid out for one scoring call: span ``span`` in every row."""

    keys: torch.Tensor  # [S * B, T, d]
    values: torch.Tensor  # [S * B, T, d_v]
    key_bias: torch.Tensor  # [S * B, T] float32, -inf on padding rows
    queries: torch.Tensor  # [S * B, n, d], zero-padded to the largest probe count
    query_mask: torch.Tensor | None  # [S * B, n] bool, False on padding probes (None: no padding)
    span: tuple[int, int]
    shifts: torch.Tensor  # [S] int64: stacked row = session row + shift


def stack_rows(events: Sequence[PendingEvent], cache: SlotKVCache | None = None) -> StackedRows:
    """Each event's rows shifted so its span starts at the same row; padding rows get bias ``-inf``,
    padding probes (zeros) ``False`` in the query mask.

    With the ``cache`` whose slots the events read (every event's ``slot`` set), K, V and β of all
    events are gathered by one indexed copy each (:func:`_gather_rows`) instead of one copy per
    event and buffer; the result is the same, byte for byte.

    When C2 is refitted (``refit_values``, the default) the math reads values in the span alone, so
    only the span's values are copied and the stacked values are zero elsewhere.
    """
    first = events[0]
    rows, _, d = first.keys.shape
    span_len = first.span[1] - first.span[0]
    start = max(p.span[0] for p in events)
    shifts = [start - p.span[0] for p in events]
    # rounded up to 16 rows: the kernels' row strides keep one divisibility (one compiled variant)
    length = -(-max(s + p.keys.shape[1] for s, p in zip(shifts, events)) // 16) * 16
    n_ev = len(events)
    counts = [p.probe_count() for p in events]
    n = max(counts)
    # C2 refitted: values are read in the span alone (stats, C2's prior), the rest stays zero
    value_span = (start, start + span_len) if first.session.config.refit_values else None
    if cache is not None and all(p.slot is not None for p in events):
        keys, values, bias, shift_t = _gather_rows(events, cache, shifts, length, value_span)
    else:
        keys = first.keys.new_zeros(n_ev, rows, length, d)
        values = first.values.new_zeros(n_ev, rows, length, first.values.shape[-1])
        bias = torch.full((n_ev, rows, length), float("-inf"), dtype=torch.float32, device=keys.device)
        for i, (s, p) in enumerate(zip(shifts, events)):
            t = p.keys.shape[1]
            keys[i, :, s : s + t] = p.keys
            if value_span is None:
                values[i, :, s : s + t] = p.values
            else:
                values[i, :, value_span[0] : value_span[1]] = p.values[:, p.span[0] : p.span[1]]
            bias[i, :, s : s + t] = 0.0 if p.key_bias is None else p.key_bias
        (shift_t,) = upload([np.array(shifts, np.int64)], keys.device)
    mask = None
    if min(counts) == n and all(p.queries is not None for p in events):
        queries = torch.cat([p.queries for p in events])
    else:
        like = first.queries if first.queries is not None else first.query_parts[0]
        queries = (like.new_zeros if min(counts) < n else like.new_empty)(n_ev, rows, n, d)
        for i, p in enumerate(events):
            p.write_probes(queries[i])
        if min(counts) < n:
            host_mask = np.arange(n)[None, :] < np.array(counts)[:, None]
            (mask,) = upload([host_mask], keys.device)
            mask = mask[:, None, :].expand(n_ev, rows, n).reshape(n_ev * rows, n)
        queries = queries.view(n_ev * rows, n, d)
    return StackedRows(
        keys.view(n_ev * rows, length, d),
        values.view(n_ev * rows, length, -1),
        bias.view(n_ev * rows, length),
        queries,
        mask,
        (start, start + span_len),
        shift_t,
    )


def _gather_rows(
    events: Sequence[PendingEvent],
    cache: SlotKVCache,
    shifts: list[int],
    length: int,
    value_span: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked K, V ``[S, B, length, d]``, bias ``[S, B, length]`` and shifts ``[S]`` read from the
    cache's slots: stacked row ``r`` of event ``i`` is its slot's row ``r - shifts[i]``; rows outside
    the slot's live rows (padding) are 0 (K, V) and ``-inf`` (bias). With ``value_span`` only the
    values of those stacked rows are read, the others are 0.

    The bias is the slot's β, which is zero on a slot without β (``SlotKVCache.has_beta``), as the
    per-event copy's ``0.0``. On a GPU, K and V are row gathers at memory bandwidth
    (:func:`~compaction_gym.engine.fast.gather.gather_rows`, a zero row for index ``-1``); elsewhere
    indexed copies of int64 words.
    """
    rows = events[0].keys.shape[0]
    # host indices with numpy (docs/engine.md, "Batched events": torch's CPU ops cost ~50 µs each)
    shift = np.array(shifts, np.int64)
    src = np.arange(length)[None, :] - shift[:, None]
    live = np.array([p.keys.shape[1] for p in events], np.int64)
    pad = (src < 0) | (src >= live[:, None])
    slot = np.array([p.slot for p in events], np.int64)
    if _gathers_rows(cache):
        return _gather_rows_fast(cache, slot, np.where(pad, -1, src), shift, rows, value_span)
    per_row = (cache.max_slots, rows, cache.capacity)
    pad_event, pad_row = np.nonzero(pad)
    host = [slot[:, None, None], np.arange(rows)[None, :, None], np.where(pad, 0, src)[:, None, :]]
    slot, head, src, pad_event, pad_row, shift_t = upload([*host, pad_event, pad_row, shift], cache.k.device)
    keys, values = (as_words(buf.view(*per_row, -1))[slot, head, src] for buf in (cache.k, cache.v))
    bias = cache.beta.view(per_row)[slot, head, src]
    # device scalars: a Python number on the right of an indexed write is first copied from pageable
    # host memory, which waits for the device (docs/engine.md, "Batched events")
    keys[pad_event, :, pad_row] = keys.new_zeros(())  # all bits zero: +0.0 in any float dtype
    values[pad_event, :, pad_row] = values.new_zeros(())
    if value_span is not None:
        values[:, :, : value_span[0]] = values.new_zeros(())
        values[:, :, value_span[1] :] = values.new_zeros(())
    bias[pad_event, :, pad_row] = bias.new_full((), float("-inf"))
    return keys.view(cache.k.dtype), values.view(cache.v.dtype), bias, shift_t


def _gathers_rows(cache: SlotKVCache) -> bool:
    """Whether the cache's K and V rows can be stacked by :func:`gather_rows`' kernel."""
    index = torch.empty(0, dtype=torch.int64, device=cache.k.device)
    return all(gather_supported(buf.view(-1, buf.shape[-1]), index) for buf in (cache.k, cache.v))


def _gather_rows_fast(
    cache: SlotKVCache,
    slot: np.ndarray,
    src: np.ndarray,
    shift: np.ndarray,
    rows: int,
    value_span: tuple[int, int] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_gather_rows` by row gathers: ``src`` ``[S, length]`` is each stacked row's slot row,
    ``-1`` on padding. Row ``(slot · B + b) · capacity + src`` of the cache's ``[·, d]`` rows is
    stacked row ``(i, b, ·)``; the flat indices are made on the device from per-event arrays."""
    vsrc = src.copy()
    if value_span is not None:
        vsrc[:, : value_span[0]] = -1
        vsrc[:, value_span[1] :] = -1
    dev = cache.k.device
    slot_t, src_t, vsrc_t, shift_t = upload([slot, src, vsrc, shift], dev)
    base = (slot_t[:, None] * rows + torch.arange(rows, device=dev)) * cache.capacity  # [S, B]

    def flat(s: torch.Tensor) -> torch.Tensor:
        # a padding row keeps -1 (a zero row) instead of pointing into the slot
        return torch.where(s[:, None, :] >= 0, base[:, :, None] + s[:, None, :], -1)

    idx = flat(src_t)
    keys = gather_rows(cache.k.view(-1, cache.k.shape[-1]), idx)
    values = gather_rows(cache.v.view(-1, cache.v.shape[-1]), idx if value_span is None else flat(vsrc_t))
    bias = cache.beta.view(-1)[idx.clamp(min=0)].masked_fill_(idx < 0, float("-inf"))
    return keys, values, bias, shift_t


@dataclass
class EventBlocks:
    """The blocks of the events of one scoring call, event by event: ``[S, B, t, ...]``, the kept
    indices in each event's own cache rows."""

    keys: torch.Tensor  # [S, B, t, d]
    values: torch.Tensor  # [S, B, t, d_v]
    beta: torch.Tensor | None  # [S, B, t]
    indices: torch.Tensor  # [S, B, t]

    def __getitem__(self, i: int) -> CompactionResult:
        beta = None if self.beta is None else self.beta[i]
        return CompactionResult(self.keys[i], self.values[i], beta, self.indices[i])


def event_blocks(result: CompactionResult, stacked: StackedRows | None = None) -> EventBlocks:
    """The blocks of a stacked call's events (views; the indices shifted back), or of a lone event's
    call (``stacked=None``: one event)."""
    if stacked is None:
        return EventBlocks(
            result.keys[None], result.values[None], None if result.beta is None else result.beta[None], result.indices[None]
        )  # fmt: skip
    n_ev = stacked.shifts.shape[0]
    rows = result.indices.shape[0] // n_ev
    t = result.indices.shape[1]
    return EventBlocks(
        result.keys.view(n_ev, rows, t, -1),
        result.values.view(n_ev, rows, t, -1),
        None if result.beta is None else result.beta.view(n_ev, rows, t),
        result.indices.view(n_ev, rows, t) - stacked.shifts[:, None, None],
    )
