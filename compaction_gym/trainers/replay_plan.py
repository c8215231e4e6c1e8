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

import operator
from collections.abc import Callable
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

    def add(self, k: np.ndarray | None, shared: np.ndarray, v: np.ndarray | None, b: np.ndarray | None) -> int:
        """Append ``t`` slots: key tokens ``k`` ``[LH, t]`` (``None``: written later),
        value sources ``shared`` ``[t]`` (:data:`PER_HEAD` where ``v`` ``[LH, t]`` holds them per head)
        and biases ``b`` ``[LH, t]`` (``None``: zeros). Returns the first slot."""
        first, t = self.n, shared.shape[0]
        if first + t > self.k.shape[1]:  # more than the events announced: grow
            more = max(first + t, 2 * self.k.shape[1]) - self.k.shape[1]
            self.k = np.pad(self.k, ((0, 0), (0, more)))
            self.shared, self.biased = np.pad(self.shared, (0, more)), np.pad(self.biased, (0, more))
            if self.per_head is not None:
                self.per_head = np.pad(self.per_head, ((0, 0), (0, more)))
        at = slice(first, first + t)
        if k is not None:
            self.k[:, at] = k
        self.shared[at] = shared
        if self.per_head is None and v is not None and (shared == PER_HEAD).any():
            self.per_head = np.empty(self.k.shape, np.int64)
            self.per_head[:, :first] = self.shared[:first]
        if self.per_head is not None:
            self.per_head[:, at] = shared if v is None else v
        nonzero = None
        if b is not None:  # β is rarely 0: where the first head's is nonzero at every slot, so is some head's
            nonzero = b[:1].any(0)
            nonzero = nonzero if nonzero.all() else b.any(0)
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

    def rows_at(self, rows: np.ndarray, values: bool = True, bias: bool = True,
                keys: bool = True) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:  # fmt: skip
        """Per head, at cache rows ``rows`` ``[LH, t]``: key tokens (``None`` unless ``keys``), value
        sources (``None`` unless ``values``) and biases (``None`` unless ``bias``, and where every one
        is zero)."""
        kcol = np.take(self.kcol, rows) if keys else None
        slot = np.take(self.slot, rows)
        raw = slot < 0
        if raw.all():
            return kcol, np.take(self.vcol, rows) if values else None, None
        table, lh = self.table, rows.shape[0]
        # per head, each row's slot as an index into the flat [LH, capacity] tables (a raw row's -1:
        # the previous head's last slot, or the last one; any valid index, overwritten below)
        flat = slot + np.arange(0, lh * table.k.shape[1], table.k.shape[1])[:, None]
        k = v = None
        if keys:
            k = np.take(table.k, flat)
            np.copyto(k, kcol, where=raw)
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
    ``dataclasses.replace`` re-runs ``__init__``, several times slower at 180 fits a batch, and
    ``copy.copy`` goes through the reduce protocol, ~5x slower than copying the ``__dict__``)."""
    out = object.__new__(type(fit))
    out.__dict__.update(fit.__dict__)
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
    sim = TrajectorySim(end, _token_list(traj.token_ids))
    lh = n_layers * n_kv_heads
    events = checked_events(traj, index, end)
    sim.num_events = len(events)
    sim.table = SlotTable(lh, sum(int(e.indices.shape[-1]) for e in events))
    walk = _Walk(sim, index, lh, n_probe, ridge, _local_dtypes(events, lh))
    fed, e_next = 0, 0
    while fed < end or (e_next < len(events) and events[e_next].logical_len == fed):
        if e_next < len(events) and events[e_next].logical_len == fed:
            fit = walk.apply(events[e_next])
            if fit is not None:
                sim.fits.append(fit)
            e_next += 1
            continue
        stop = events[e_next].logical_len if e_next < len(events) else end
        ctx = len(sim.snapshots)
        sim.snapshots.append(walk.snapshot())
        for q0 in range(fed, stop, piece_queries):
            sim.pieces.append(Piece(0, q0, min(stop, q0 + piece_queries), fed, ctx))
        walk.feed(fed, stop)
        fed = stop
    sim.table.trim()
    return sim


def _token_list(ids: Any) -> list[int]:
    """The token ids as ints (``int`` of each)."""
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        return ids.tolist()
    try:  # half the cost of int() where every id is already an integer
        return list(map(operator.index, ids))
    except TypeError:
        return list(map(int, ids))


def _local_dtypes(events: list[CompactionEvent], lh: int) -> dict[tuple, type]:
    """Per shape of kept indices, the dtype of :attr:`Fit.kept`: int16 when every span of that shape
    is narrower than ``2**15``."""
    out: dict[tuple, type] = {}
    for e in events:
        shape = tuple(e.indices.shape)
        if out.get(shape) is not np.int64:
            out[shape] = np.int16 if e.span[1] - e.span[0] < 2**15 else np.int64
    return out


def _relative(indices: np.ndarray, start: int, dtype: type) -> np.ndarray:
    """``indices - start`` as ``dtype``, ``indices`` inside a span from ``start`` that ``dtype`` holds."""
    if dtype is np.int64:
        return np.subtract(indices, start, order="C")
    # narrow first, then subtract there (half the passes): both sides wrap alike, exact where the result fits
    local = indices.astype(dtype, order="C")
    local -= np.asarray(start).astype(dtype)
    return local


#: Rows of :attr:`_Walk.state`: key token, value source, slot (as :class:`Snapshot`), key code
#: (the key token on raw rows, :data:`_BLOCK` + slot on block rows; :meth:`_Walk.kept_keys`) and
#: the logical tokens ``[lo, hi)`` the row stands for (a block's: all of its range, as in a RowMap).
_KCOL, _VCOL, _SLOT, _CODE, _LO, _HI = range(6)
_BLOCK = 2**62


class _Walk:
    """A trajectory's cache while it is simulated: its rows as one ``[6, T]`` array (:data:`_CODE`),
    replaced at every event and fed segment (never written: snapshots are views of it), and the
    events' records, checked and converted one event at a time (its arrays stay in cache)."""

    def __init__(self, sim: TrajectorySim, index: int, lh: int, n_probe: int, ridge: float,
                 dtypes: dict[tuple, type]) -> None:  # fmt: skip
        self.sim, self.index, self.lh, self.n_probe, self.ridge, self.dtypes = sim, index, lh, n_probe, ridge, dtypes
        self.state = np.zeros((6, 0), np.int64)
        # the rows as a RowMap, for key_probe_rows only: its calls are queued until it is read
        self._row_map, self._map_calls = RowMap(), []
        raw = np.arange(sim.end, dtype=np.int64)
        # rows of fed tokens
        self.raw = np.stack([raw, raw, np.full(sim.end, -1, np.int64), raw, raw, raw + 1])
        cap = sim.table.k.shape[1]
        slots = np.arange(cap, dtype=np.int64)
        # vcol, lo and hi: set per event
        self.blocks = np.stack([np.full_like(slots, -1), slots, slots, _BLOCK + slots, slots, slots])
        # the slots' key tokens per head after a sentinel (flat index 0, the largest int32) where a raw
        # row's lookup lands: the smaller of lookup and code is the key token (kept_keys)
        self.keys = np.empty(1 + lh * cap, np.int32)
        self.keys[0] = np.iinfo(np.int32).max
        sim.table.k = self.keys[1:].reshape(lh, cap)
        self.key_at = 1 + cap * np.arange(lh, dtype=np.int64)[:, None] - _BLOCK
        self.key_at_t: dict[int, np.ndarray] = {}  # per width t, key_at repeated to [LH, t]

    def snapshot(self) -> Snapshot:
        st = self.state
        return Snapshot(st[_KCOL], st[_VCOL], st[_SLOT], self.sim.table)

    def row_map(self) -> RowMap:
        """The rows' logical tokens as a :class:`RowMap`."""
        for name, args in self._map_calls:
            getattr(self._row_map, name)(*args)
        self._map_calls.clear()
        return self._row_map

    def logical_span(self, start: int, end: int) -> tuple[int, int]:
        """As :meth:`RowMap.logical_span` (``0 <= start < end <= T``)."""
        st = self.state
        return int(st[_LO, start]), int(st[_HI, end - 1])

    def feed(self, fed: int, stop: int) -> None:
        """Tokens ``[fed, stop)`` appended as raw rows."""
        self.state = np.concatenate([self.state, self.raw[:, fed:stop]], 1)
        self._map_calls.append(("append", (fed, stop - fed)))

    def apply(self, ev: CompactionEvent) -> Fit | None:
        """The cache after ``ev`` (and its fit, if it refits C2), checked against the record."""
        sim, table, state = self.sim, self.sim.table, self.state
        where = f"trajectory {self.index}, event {ev.index}"
        start, end = self._check_span(ev, where)
        indices = self._kept_rows(ev, where)
        t = indices.shape[1]
        beta = None
        if ev.compute_beta and ev.beta is not None:
            b = ev.beta
            if b.dtype == torch.float32 and b.dim() == 3:  # recorded_beta(), without torch's reshape
                beta = b.numpy().reshape(b.shape[0] * b.shape[1], b.shape[2])
            else:
                beta = np.asarray(ev.recorded_beta().numpy(), np.float32)
        refit = replay_needs_probes(ev.mode, ev.refit_values)  # its values: new fitted rows
        snap = self.snapshot()
        kept_v = old_b = None
        if not refit or (sim.has_bias and beta is None):  # kept rows keep their bias unless β is recorded
            _, kept_v, old_b = snap.rows_at(indices, values=not refit, bias=sim.has_bias and beta is None,
                                            keys=False)  # fmt: skip
        if refit:
            first = sim.fitted_rows
            level = self._level(state[_VCOL, start:end], where)
            sim.add_fitted(t, level)
            new_vcol = np.arange(-1 - first, -1 - first - t, -1, dtype=np.int64)
        else:
            new_vcol = np.where((kept_v == kept_v[:1]).all(0), kept_v[0], PER_HEAD)
        slot = table.add(None, new_vcol, kept_v, beta if beta is not None else old_b)
        self.kept_keys(state[_CODE], indices, slot)
        fit = None
        if refit:
            local = _relative(indices, start, self.dtypes[tuple(ev.indices.shape)])
            fit = Fit(
                row=0, event=ev, span=snap.sliced(start, end), kept=local, beta=beta,
                probe=_probe_spec(ev, snap, self.row_map, self.n_probe, where), first=first, slot=slot, level=level,
                ridge=self.ridge,
            )  # fmt: skip
        sim.has_bias = sim.has_bias or bool(table.biased[slot : slot + t].any())
        block = self.blocks[:, slot : slot + t]
        block[_VCOL] = new_vcol
        block[_LO], block[_HI] = ev.logical_span
        self.state = np.concatenate([state[:, :start], block, state[:, end:]], 1)
        self._map_calls.append(("replace", (start, end, t, ev.logical_span)))
        if self.state.shape[1] != ev.kv_len_after:
            raise InvalidArgumentError(
                f"{where}: {self.state.shape[1]} rows after replaying the event, the rollout had {ev.kv_len_after}"
            )
        return fit

    def _check_span(self, ev: CompactionEvent, where: str) -> tuple[int, int]:
        """The event's span, checked against the cache's length and logical tokens."""
        length = self.state.shape[1]
        if length != ev.kv_len_before:
            raise InvalidArgumentError(
                f"{where}: the replayed cache holds {length} rows "
                f"after {ev.logical_len} tokens but the rollout held {ev.kv_len_before}; the trajectory's events "
                "do not belong to its tokens (or it was produced by a different engine configuration)"
            )
        start, end = ev.span
        if not 0 <= start < end <= length:
            raise InvalidArgumentError(f"{where}: span {ev.span} outside the cache's {length} rows")
        if self.logical_span(start, end) != ev.logical_span:
            raise InvalidArgumentError(
                f"{where}: rows {ev.span} stand for logical tokens "
                f"{self.logical_span(start, end)} in the replay but {ev.logical_span} in the record"
            )
        return start, end

    def _kept_rows(self, ev: CompactionEvent, where: str) -> np.ndarray:
        """The kept rows ``[LH, t]`` (int64), checked: inside the span, ascending."""
        x = ev.indices
        if x.dim() != 3 or x.shape[0] * x.shape[1] != self.lh:
            rows = ev.forced_indices().shape[0]
            raise InvalidArgumentError(f"{where}: indices hold {rows} (layer, KV head) rows, the model has {self.lh}")
        start, end = ev.span
        indices = x.long().numpy().reshape(self.lh, -1)  # numpy's reshape: a few µs less than torch's
        if indices.size:
            # ascending along each row: every neighbour pair of the flat array but the lh - 1 across rows
            t, flat = indices.shape[1], np.ascontiguousarray(indices).reshape(-1)
            up = flat[1:] > flat[:-1]
            ascending = np.count_nonzero(up) - np.count_nonzero(up[t - 1 :: t]) == self.lh * (t - 1)
            # then each row's first and last index are its least and greatest
            if not (ascending and indices[:, 0].min() >= start and indices[:, -1].max() < end):
                raise InvalidArgumentError(f"{where}: kept indices must be ascending inside span {ev.span}")
        return indices

    def _level(self, sources: np.ndarray, where: str) -> int:
        """A refit's level: 1 + the deepest fit whose rows its span's value ``sources`` read."""
        low = sources.min()  # the span is not empty
        if low >= 0:
            return 0
        if low == PER_HEAD:  # kept values of a selection event: not in one session
            raise InvalidArgumentError(f"{where}: an attention_matching event over rows kept by another mode")
        return 1 + int(self.sim.levels_of(-1 - sources[sources < 0]).max())

    def kept_keys(self, code: np.ndarray, rows: np.ndarray, slot: int) -> None:
        """Write the key tokens of slots ``slot ..``: at kept rows ``rows`` ``[LH, t]`` of a state
        whose :data:`_CODE` row is ``code``, a raw row's token or the same head's key of a block
        row's slot (an earlier event's)."""
        if rows.size:
            t = rows.shape[1]
            key_at = self.key_at_t.get(t)
            if key_at is None:  # the same layout as c: one flat add, not one per head
                key_at = self.key_at_t[t] = np.repeat(self.key_at, t, 1)
            c = code.take(rows)
            lookup = self.keys.take(c + key_at, mode="clip")  # a raw row's: the sentinel
            np.minimum(lookup, c, out=lookup)
            self.sim.table.k[:, slot : slot + t] = lookup


def _probe_spec(ev: CompactionEvent, state: Snapshot, row_map: Callable[[], RowMap], n_probe: int,
                where: str) -> tuple:  # fmt: skip
    """The fit's :attr:`Fit.probe` (``row_map``: the cache's, called for ``keys`` probes only)."""
    if ev.probe_source in ("keys", "suffix") and ev.probe_logical_range is None:
        raise InvalidArgumentError(f"{where}: {ev.probe_source} probes without a probe_logical_range")
    if ev.probe_source == "keys":
        return ("keys", state.sliced(*key_probe_rows(ev, row_map(), state.length, n_probe, where)))
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
