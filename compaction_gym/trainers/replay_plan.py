"""The host half of one-pass replay: every cache state of a batch of trajectories, from the records alone.

One-pass replay (:mod:`compaction_gym.trainers.replay_onepass`, docs/grpo.md "Replay in one
pass") runs the model once over whole trajectories and rebuilds each layer's compacted caches
inside that layer. That works because a recorded event's *keys* are always raw keys: C1 gathers
cache keys at recorded indices, and a kept block row's key is a raw token's key; β is a recorded
constant. Only C2 is new data, and it is linear in the span's values: ``C2 = M · V_span`` with
``M = ridge_solve(X, P, S)`` (the same normal equations as :func:`~compaction_gym.compaction.
values.fit_values`, with the probes' span attention ``P`` and the selection ``S`` as right-hand
sides). So the plan below can describe every cache row the rollout ever attended to as

* a key source: a token position,
* a value source: a token position (``>= 0``) or a fitted row (``-1 - j``, row ``j`` of the
  trajectory's C2 table),
* a constant bias (β; 0 for raw rows),

raw rows shared by every (layer, KV head), a block's rows per head: each compacted row the
session ever held is a *slot* of the trajectory's append-only :class:`SlotTable`, and a
:class:`Snapshot` names its block rows by slot (an event writes only its own kept rows),

built by simulating the session's row bookkeeping (:class:`~compaction_gym.compaction.RowMap`)
and checked against every record exactly as the segment-by-segment replay checks it. The device
half only gathers and solves.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import torch

from compaction_gym.compaction import RowMap
from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.compaction.modes import REPEAT_SOURCES, SUFFIX_SOURCES, replay_needs_probes
from compaction_gym.compaction.probes import key_probe_rows_of_range, random_probes
from compaction_gym.errors import InvalidArgumentError

#: Longest run of queries one attention piece holds (a long segment is cut into pieces).
PIECE_QUERIES = 256


def one_pass_supported(events: list[CompactionEvent]) -> bool:
    """Whether one-pass replay can rebuild these events: not ``repeat`` probes (their queries need a
    scratch forward over the cache, layer after layer) nor version-1 records whose β must be refit."""
    for ev in events:
        if ev.probe_source in REPEAT_SOURCES:
            return False
        if ev.compute_beta and ev.beta is None and ev.mode == "attention_matching":
            return False
    return True


#: ``Snapshot.vcol`` of a block row whose value source differs per head (a kept, not refitted, row).
PER_HEAD = np.iinfo(np.int64).min


class SlotTable:
    """A trajectory's compacted rows, per head: slot ``s`` is one block row at every (layer, KV
    head) — its key token, value source (as :attr:`Snapshot.vcol`) and bias. Append-only: an event
    adds its kept rows as new slots, so the snapshots before it stay valid and no state copies
    per-head arrays (docs/grpo.md, "Replay in one pass").

    Stored as what a refitting session needs at little cost: key tokens ``k`` ``[LH, capacity]``;
    value sources once per slot where every head shares them (``shared``; a per-head table only
    once a selection event keeps different rows per head); biases as each event's own ``[LH, t]``
    array (its recorded β, not copied; ``None``: zeros), joined only when read (:meth:`bias`)."""

    def __init__(self, lh: int, capacity: int) -> None:
        self.lh = lh
        self.k = np.empty((lh, capacity), np.int32)  # a token position (< 2**31)
        self.shared = np.empty(capacity, np.int64)  # PER_HEAD: see per_head
        self.per_head: np.ndarray | None = None  # [LH, capacity] value sources, once a slot needs it
        self.chunks: list[np.ndarray | None] = []  # per add, its [LH, t] biases (None: zeros)
        self.widths: list[int] = []  # per add, its t
        self.biased = np.zeros(capacity, bool)  # per slot: some head's bias is nonzero
        self.n = 0
        self._bias: np.ndarray | None = None

    def add(self, k: np.ndarray, shared: np.ndarray, v: np.ndarray | None, b: np.ndarray | None) -> int:
        """Append ``t`` slots: key tokens ``k`` ``[LH, t]``, value sources ``shared`` ``[t]``
        (:data:`PER_HEAD` where ``v`` ``[LH, t]`` holds them per head) and biases ``b`` ``[LH, t]``
        (``None``: zeros). Returns the first slot."""
        first, t = self.n, k.shape[1]
        if first + t > self.k.shape[1]:  # more than the events announced: grow
            more = max(first + t, 2 * self.k.shape[1]) - self.k.shape[1]
            self.k = np.pad(self.k, ((0, 0), (0, more)))
            self.shared, self.biased = np.pad(self.shared, (0, more)), np.pad(self.biased, (0, more))
            if self.per_head is not None:
                self.per_head = np.pad(self.per_head, ((0, 0), (0, more)))
        at = slice(first, first + t)
        self.k[:, at] = k
        self.shared[at] = shared
        if self.per_head is None and v is not None and (shared == PER_HEAD).any():
            self.per_head = np.empty(self.k.shape, np.int64)
            self.per_head[:, :first] = self.shared[:first]
        if self.per_head is not None:
            self.per_head[:, at] = shared if v is None else v
        nonzero = None if b is None else b.any(0)
        if nonzero is not None and nonzero.any():
            self.biased[at] = nonzero
        else:
            b, self.biased[at] = None, False
        self.chunks.append(b)
        self.widths.append(t)
        self.n, self._bias = first + t, None
        return first

    def values(self, flat: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """Value sources at flat indices ``flat`` into ``[LH, capacity]`` (``slot``: the slots themselves)."""
        return np.take(self.shared, slot) if self.per_head is None else np.take(self.per_head, flat)

    def bias(self) -> np.ndarray:
        """The biases ``[LH, n]`` (float32), joined."""
        if self._bias is None:
            self._bias = np.concatenate(
                [np.zeros((self.lh, 0), np.float32)]
                + [np.zeros((self.lh, w), np.float32) if c is None else c for c, w in zip(self.chunks, self.widths)],
                1,
            )
        return self._bias

    def trim(self) -> None:
        """Drop the unused capacity (the device plan uploads the whole table)."""
        if self.k.shape[1] != self.n:
            self.k = np.ascontiguousarray(self.k[:, : self.n])
            self.shared, self.biased = self.shared[: self.n].copy(), self.biased[: self.n].copy()
            if self.per_head is not None:
                self.per_head = np.ascontiguousarray(self.per_head[:, : self.n])


@dataclass
class Snapshot:
    """A cache state. Raw rows are the same for every (layer, KV head); a compacted block's rows
    hold a different kept key (and bias, and for selection modes value) per head, stored once in
    the trajectory's :class:`SlotTable` and named here by slot.

    Attributes:
        kcol: ``[T]`` the raw row's token, ``-1`` on block rows.
        vcol: ``[T]`` the row's value source when every head shares it (a token ``>= 0`` or a
            fitted row ``-1 - j``, ``j`` counted within the trajectory), :data:`PER_HEAD` otherwise.
        slot: ``[T]`` the block row's slot in ``table``, ``-1`` on raw rows.
        table: the trajectory's slots.
    """

    kcol: np.ndarray
    vcol: np.ndarray
    slot: np.ndarray
    table: SlotTable

    @property
    def length(self) -> int:
        return self.kcol.shape[0]

    @cached_property
    def blocks(self) -> np.ndarray:
        """Rows of compacted blocks, ascending."""
        return np.flatnonzero(self.kcol < 0)

    @property
    def has_bias(self) -> bool:
        """Whether some block row has a nonzero bias at some head."""
        return bool(self.table.biased[self.slot[self.blocks]].any())

    def sliced(self, start: int, end: int) -> Snapshot:
        """Rows ``[start, end)`` (views: snapshots are never written)."""
        return Snapshot(self.kcol[start:end], self.vcol[start:end], self.slot[start:end], self.table)

    def rows_at(self, rows: np.ndarray, values: bool = True,
                bias: bool = True) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:  # fmt: skip
        """Per head, at cache rows ``rows`` ``[LH, t]``: key tokens, value sources (``None`` unless
        ``values``) and biases (``None`` unless ``bias``, and where every one is zero)."""
        kcol = np.take(self.kcol, rows)
        slot = np.take(self.slot, rows)
        raw = slot < 0
        if raw.all():
            return kcol, np.take(self.vcol, rows) if values else None, None
        table, lh = self.table, rows.shape[0]
        # per head, each row's slot as an index into the flat [LH, capacity] tables (a raw row's -1:
        # the previous head's last slot, or the last one; any valid index, overwritten below)
        flat = slot + np.arange(0, lh * table.k.shape[1], table.k.shape[1])[:, None]
        k = np.take(table.k, flat)
        np.copyto(k, kcol, where=raw)
        v = None
        if values:
            v = table.values(flat, slot)
            np.copyto(v, np.take(self.vcol, rows), where=raw)
        if not bias or not table.biased[slot[~raw]].any():
            return k, v, None
        b = np.take(table.bias(), slot + np.arange(0, lh * table.n, table.n)[:, None])
        b[raw] = 0
        return k, v, b


@dataclass
class Fit:
    """One event whose C2 is refitted: the inputs of its value map ``M`` ``[L·H, t, w]``.

    ``span`` holds its span's rows (the values of a refitting session's rows are shared by every
    head); its kept rows are slots ``slot .. slot + t - 1`` of the trajectory's table."""

    row: int  # trajectory
    event: CompactionEvent
    span: Snapshot  # the span's rows
    kept: np.ndarray  # [LH, t] kept rows, relative to the span (int16 when the span is narrower than 2**15)
    beta: np.ndarray | None  # [LH, t] recorded β, or None (kept rows keep their bias)
    probe: tuple  # ("suffix", a, b) | ("keys", Snapshot of the probe rows) | ("random", seed, index, n)
    first: int  # its fitted rows are first .. first + t - 1 (in a TrajectorySim: of the trajectory)
    slot: int  # its kept rows' first slot (of its trajectory's table)
    level: int  # 1 + the deepest fit whose rows its span reads (0: raw rows only)
    ridge: float

    @property
    def width(self) -> int:
        return self.span.length

    @property
    def target(self) -> int:
        return self.kept.shape[1]

    @property
    def n_probes(self) -> int:
        kind = self.probe[0]
        if kind == "suffix":
            return self.probe[2] - self.probe[1]
        if kind == "keys":
            return self.probe[1].length
        return self.probe[3]


@dataclass
class Piece:
    """Queries ``[q0, q1)`` of trajectory ``row``, inside the segment starting at ``start``, over
    cache snapshot ``ctx`` (the cache as it stood when the segment began)."""

    row: int
    q0: int
    q1: int
    start: int
    ctx: int


@dataclass
class TrajectoryPlan:
    tokens: list[int]
    end: int  # tokens [0, end) are fed
    targets: list[int]
    temperature: float
    num_events: int


@dataclass
class Plan:
    """A batch's replay plan (host side): the trajectories' :class:`TrajectorySim` laid end to end
    (fits numbered across the batch, snapshot indices and rows shifted)."""

    rows: list[TrajectoryPlan]
    width: int  # padded sequence length
    n_layers: int
    n_kv_heads: int
    fits: list[Fit] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    fitted_rows: int = 0
    # per row, where its fitted rows begin: row ``b``'s value source ``-1 - j`` is fitted row
    # ``fitted_offsets[b] + j`` of the batch (sources are numbered per trajectory, docs/grpo.md)
    fitted_offsets: list[int] = field(default_factory=list)
    tables: list[SlotTable] = field(default_factory=list)  # per row, its trajectory's slots
    has_bias: bool = False


@dataclass
class TrajectorySim:
    """One trajectory's cache states, independent of the batch it is replayed in: its fits
    (``row`` 0, ``first`` counted from 0), snapshots and pieces (``row`` 0, ``ctx`` into
    ``snapshots``). Read-only once built: plans share its arrays."""

    end: int
    tokens: list[int] = field(default_factory=list)  # the trajectory's token ids
    num_events: int = 0
    table: SlotTable = field(default_factory=lambda: SlotTable(0, 0))
    fits: list[Fit] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    fitted_rows: int = 0
    has_bias: bool = False
    _levels: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64), repr=False)

    def add_fitted(self, t: int, level: int) -> None:
        """Number ``t`` more fitted rows, of a fit at ``level``."""
        need = self.fitted_rows + t
        if need > self._levels.shape[0]:
            self._levels = np.concatenate(
                [self._levels, np.zeros(max(need, 2 * self._levels.shape[0]), np.int64)]
            )
        self._levels[self.fitted_rows : need] = level
        self.fitted_rows = need

    def levels_of(self, rows: np.ndarray) -> np.ndarray:
        """The levels of the fits that own fitted rows ``rows``."""
        return self._levels[rows]


def build_plan(
    trajectories: list[Any],
    *,
    targets: list[list[int]],
    temperatures: list[float],
    configs: list[tuple[int, float]],
    n_layers: int,
    n_kv_heads: int,
    piece_queries: int = PIECE_QUERIES,
    sims: list[TrajectorySim | None] | None = None,
) -> Plan:
    """Simulate every trajectory's cache through its events (validated against the records).

    Args:
        trajectories: the trajectories (``token_ids``, ``events``).
        targets: per trajectory, the sorted positions to score (``>= 1``).
        temperatures: per trajectory, the logits' divisor.
        configs: per trajectory, ``(n_probe_queries, ridge)`` of its session.
        n_layers, n_kv_heads: the model's cache layout.
        piece_queries: longest query run of one attention piece.
        sims: per trajectory, its :func:`simulate` output when already known (``None`` entries:
            simulated here), e.g. from a :class:`~compaction_gym.trainers.replay_cache.ReplayPlanCache`.

    Raises:
        InvalidArgumentError: a record that does not match what replay rebuilds (as the
            segment-by-segment replay words it).
    """
    known = sims if sims is not None else [None] * len(trajectories)
    out = []
    for i, (traj, tg, (n_probe, ridge), sim) in enumerate(zip(trajectories, targets, configs, known)):
        if sim is None:
            sim = simulate(traj, i, tg[-1] if tg else 0, n_probe, ridge, n_layers, n_kv_heads, piece_queries)
        out.append(sim)
    return assemble(out, targets=targets, temperatures=temperatures, n_layers=n_layers, n_kv_heads=n_kv_heads)


def assemble(sims: list[TrajectorySim], *, targets: list[list[int]], temperatures: list[float], n_layers: int,
             n_kv_heads: int) -> Plan:  # fmt: skip
    """The batch's :class:`Plan` from its trajectories' simulations (no copies of their arrays)."""
    rows = []
    for tg, temp, sim in zip(targets, temperatures, sims):
        rows.append(TrajectoryPlan(sim.tokens, sim.end, tg, temp, sim.num_events))
    plan = Plan(rows, max([r.end for r in rows] + [1]), n_layers, n_kv_heads)
    for i, sim in enumerate(sims):
        ctx0, first0 = len(plan.snapshots), plan.fitted_rows
        plan.fitted_offsets.append(first0)
        plan.snapshots += sim.snapshots
        plan.pieces += [Piece(i, p.q0, p.q1, p.start, p.ctx + ctx0) for p in sim.pieces]
        plan.fits += [_moved(f, i, first0) for f in sim.fits]
        plan.fitted_rows += sim.fitted_rows
        plan.tables.append(sim.table)
        plan.has_bias |= sim.has_bias
    return plan


def _moved(fit: Fit, row: int, first0: int) -> Fit:
    """``fit`` as row ``row`` of a batch whose fitted rows before it number ``first0`` (a shallow copy:
    ``dataclasses.replace`` re-runs ``__init__``, several times slower at 180 fits a batch)."""
    out = copy.copy(fit)
    out.row, out.first = row, fit.first + first0
    return out


def checked_events(traj: Any, index: int, end: int) -> list[CompactionEvent]:
    """The trajectory's events in order, checked for a non-decreasing clock; those that fire at or
    after ``end`` are dropped (they change no score)."""
    n = len(traj.token_ids)
    events = sorted(traj.events, key=lambda e: e.index)
    last = 0
    for e in events:
        if not last <= e.logical_len <= n or e.logical_len < 1:
            raise InvalidArgumentError(
                f"trajectory {index}: event {e.index} fires at logical_len={e.logical_len}, not in "
                f"[max(1, previous event's {last}), {n}]"
            )
        last = e.logical_len
    return [e for e in events if e.logical_len < end]


def simulate(traj: Any, index: int, end: int, n_probe: int, ridge: float, n_layers: int, n_kv_heads: int,
             piece_queries: int = PIECE_QUERIES) -> TrajectorySim:  # fmt: skip
    """Trajectory ``index``'s cache through its events up to token ``end`` (checked against the
    records; ``index`` only names it in errors)."""
    ids = traj.token_ids
    sim = TrajectorySim(end, ids.tolist() if isinstance(ids, (torch.Tensor, np.ndarray)) else list(map(int, ids)))
    lh = n_layers * n_kv_heads
    events = checked_events(traj, index, end)
    sim.num_events = len(events)
    sim.table = SlotTable(lh, sum(int(e.indices.shape[-1]) for e in events))
    prepared = _prepared(events, lh)
    empty = np.zeros(0, np.int64)
    state = Snapshot(empty, empty, empty, sim.table)
    row_map = RowMap()
    fed, e_next = 0, 0
    while fed < end or (e_next < len(events) and events[e_next].logical_len == fed):
        if e_next < len(events) and events[e_next].logical_len == fed:
            ev = events[e_next]
            state, fit = _apply(sim, index, lh, ev, prepared[e_next], state, row_map, n_probe, ridge)
            if fit is not None:
                sim.fits.append(fit)
            e_next += 1
            continue
        stop = events[e_next].logical_len if e_next < len(events) else end
        ctx = len(sim.snapshots)
        sim.snapshots.append(state)
        for q0 in range(fed, stop, piece_queries):
            sim.pieces.append(Piece(0, q0, min(stop, q0 + piece_queries), fed, ctx))
        raw = np.arange(fed, stop, dtype=np.int64)
        state = Snapshot(
            np.concatenate([state.kcol, raw]), np.concatenate([state.vcol, raw]),
            np.concatenate([state.slot, np.full(stop - fed, -1, np.int64)]), sim.table,
        )  # fmt: skip
        row_map.append(fed, stop - fed)
        fed = stop
    sim.table.trim()
    return sim


@dataclass
class _EventArrays:
    """An event's records as the simulation reads them, prepared for all events at once."""

    indices: np.ndarray  # [LH, t] int64
    local: np.ndarray  # [LH, t] relative to the span (int16 when the span is narrower than 2**15)
    beta: np.ndarray | None  # [LH, t] float32, when the event recorded β and uses it
    ascending: bool  # its indices ascend inside its recorded span


def _prepared(events: list[CompactionEvent], lh: int) -> list[_EventArrays | None]:
    """Every event's :class:`_EventArrays`, events of one shape stacked (one conversion and one
    check for all instead of one per event); ``None`` for an event whose indices do not hold ``lh``
    rows (:func:`_apply` raises on it, in order)."""
    out: list[_EventArrays | None] = [None] * len(events)
    by_shape: dict[tuple, list[int]] = {}
    for j, e in enumerate(events):
        if e.indices.dim() == 3 and e.indices.shape[0] * e.indices.shape[1] == lh:
            by_shape.setdefault(tuple(e.indices.shape), []).append(j)
    for shape, js in by_shape.items():
        t = shape[-1]
        ind = torch.stack([events[j].indices for j in js]).reshape(len(js), lh, t).long().numpy()
        start = np.array([events[j].span[0] for j in js], np.int64)
        end = np.array([events[j].span[1] for j in js], np.int64)
        ok = np.ones(len(js), bool)
        if t:
            ok = (ind[:, :, 0].min(1) >= start) & (ind[:, :, -1].max(1) < end)
            if t > 1:
                ok &= (ind[:, :, 1:] > ind[:, :, :-1]).all((1, 2))
        narrow = bool((end - start < 2**15).all())
        local = (ind - start[:, None, None]).astype(np.int16 if narrow else np.int64)
        for k, j in enumerate(js):
            e = events[j]
            beta = e.recorded_beta() if e.compute_beta else None
            beta = None if beta is None else np.asarray(beta.numpy(), np.float32)
            out[j] = _EventArrays(ind[k], local[k], beta, bool(ok[k]))
    return out


def _apply(
    sim: TrajectorySim,
    i: int,
    lh: int,
    ev: CompactionEvent,
    arrays: _EventArrays | None,
    state: Snapshot,
    row_map: RowMap,
    n_probe: int,
    ridge: float,
) -> tuple[Snapshot, Fit | None]:
    """The cache after ``ev`` (and its fit, if it refits C2), checked against the record."""
    where = f"trajectory {i}, event {ev.index}"
    length = state.length
    if length != ev.kv_len_before:
        raise InvalidArgumentError(
            f"{where}: the replayed cache holds {length} rows "
            f"after {ev.logical_len} tokens but the rollout held {ev.kv_len_before}; the trajectory's events do "
            "not belong to its tokens (or it was produced by a different engine configuration)"
        )
    start, end = ev.span
    if not 0 <= start < end <= length:
        raise InvalidArgumentError(f"{where}: span {ev.span} outside the cache's {length} rows")
    if row_map.logical_span(start, end) != ev.logical_span:
        raise InvalidArgumentError(
            f"{where}: rows {ev.span} stand for logical tokens "
            f"{row_map.logical_span(start, end)} in the replay but {ev.logical_span} in the record"
        )
    if arrays is None:
        rows = ev.forced_indices().shape[0]
        raise InvalidArgumentError(f"{where}: indices hold {rows} (layer, KV head) rows, the model has {lh}")
    if not arrays.ascending:
        raise InvalidArgumentError(f"{where}: kept indices must be ascending inside span {ev.span}")
    indices, local, beta_np = arrays.indices, arrays.local, arrays.beta
    t = indices.shape[1]
    refit = replay_needs_probes(ev.mode, ev.refit_values)  # its values: new fitted rows
    # kept rows keep their bias unless the event recorded β
    kept_k, kept_v, old_b = state.rows_at(indices, values=not refit, bias=sim.has_bias and beta_np is None)
    kept_b = beta_np if beta_np is not None else old_b
    fit = None
    if refit:
        first = sim.fitted_rows
        span = state.sliced(start, end)
        if (span.vcol == PER_HEAD).any():  # kept values of a selection event: not in one session
            raise InvalidArgumentError(f"{where}: an attention_matching event over rows kept by another mode")
        refs = -1 - span.vcol[span.vcol < 0]
        level = 1 + (int(sim.levels_of(refs).max()) if refs.size else -1)
        sim.add_fitted(t, level)
        new_vcol = -1 - np.arange(first, first + t, dtype=np.int64)
        kept_v = None  # every head's: new_vcol
    else:
        new_vcol = np.where((kept_v == kept_v[:1]).all(0), kept_v[0], PER_HEAD)
    slot = sim.table.add(kept_k, new_vcol, kept_v, kept_b)
    if refit:
        fit = Fit(
            row=0, event=ev, span=span, kept=local, beta=beta_np,
            probe=_probe_spec(ev, state, row_map, n_probe, where), first=first, slot=slot, level=level,
            ridge=ridge,
        )  # fmt: skip
    sim.has_bias = sim.has_bias or bool(sim.table.biased[slot : slot + t].any())
    out = Snapshot(
        np.concatenate([state.kcol[:start], np.full(t, -1, np.int64), state.kcol[end:]]),
        np.concatenate([state.vcol[:start], new_vcol, state.vcol[end:]]),
        np.concatenate([state.slot[:start], np.arange(slot, slot + t, dtype=np.int64), state.slot[end:]]),
        sim.table,
    )
    row_map.replace(start, end, t, ev.logical_span)
    if out.length != ev.kv_len_after:
        raise InvalidArgumentError(
            f"{where}: {out.length} rows after replaying the event, the rollout had {ev.kv_len_after}"
        )
    return out, fit


def _probe_spec(ev: CompactionEvent, state: Snapshot, row_map: RowMap, n_probe: int, where: str) -> tuple:
    if ev.probe_source in ("keys", "suffix") and ev.probe_logical_range is None:
        raise InvalidArgumentError(f"{where}: {ev.probe_source} probes without a probe_logical_range")
    if ev.probe_source == "keys":
        return ("keys", state.sliced(*key_probe_rows(ev, row_map, state.length, n_probe, where)))
    if ev.probe_source in SUFFIX_SOURCES:
        a, b = ev.probe_logical_range
        if not 0 <= a < b <= ev.logical_len:
            raise InvalidArgumentError(
                f"{where}: suffix probes need the queries of logical "
                f"positions [{a}, {b}) but only {max(0, min(b, ev.logical_len) - max(a, 0))} of them were fed "
                "before the event"
            )
        return ("suffix", a, b)
    if ev.probe_source == "random":
        if ev.probe_seed is None:
            raise InvalidArgumentError(f"event {ev.index}: random probes need probe_seed")
        return ("random", ev.probe_seed, ev.index, n_probe)
    raise InvalidArgumentError(f"{where}: probe_source {ev.probe_source!r} cannot be replayed in one pass")


def key_probe_rows(
    ev: CompactionEvent, row_map: RowMap, length: int, n_probe: int, where: str
) -> tuple[int, int]:
    """The cache rows ``(lo, hi)`` of a ``keys`` event's probes, checked against its logical range
    (version-1 records without ``probe_rows``: located as the engine chose them)."""
    rows = ev.probe_rows
    try:
        if rows is None:
            rows = key_probe_rows_of_range(row_map, length, n_probe, ev.probe_logical_range)
        ok = 0 <= rows[0] < rows[1] <= length
        if not ok or row_map.logical_span(*rows) != ev.probe_logical_range:
            raise InvalidArgumentError(
                f"probe_rows {rows} do not hold logical range {ev.probe_logical_range} in the replay"
            )
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{where}: {exc}") from None
    return rows


def random_probe_tensor(fit: Fit, n_layers: int, n_kv_heads: int, d: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:  # fmt: skip
    """A ``random`` fit's probes ``[L·H_kv, n, d]``, regenerated exactly."""
    _, seed, index, n = fit.probe
    return random_probes(seed, index, n_layers, n_kv_heads, n, d, dtype=dtype, device=device)
