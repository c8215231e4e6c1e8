"""One-pass replay: a batch of compacted trajectories scored by one forward of the model.

The segment-by-segment replay (:mod:`compaction_gym.trainers.replay`) runs one forward per
stretch of tokens between events, so its cost grows with the number of events (6.5–10.5× a plain
forward on a GPU, docs/benchmarks.md). This module runs the model once over the whole,
right-padded trajectories and rebuilds the compacted caches *inside each layer*: a layer's
queries, keys and values of every token are known at once, and everything an event needs at that
layer is one of them (the plan's key sources, the suffix queries) or a recorded constant (kept
indices, β). Per layer, in the layer's attention call:

1. **value maps**: every refitting event's ``M = ridge_solve(X, P, S)`` ``[t, w]`` — all events of
   the batch in one batched solve per group of equal span width and target;
2. **C2**: ``M · V_span`` in dependency order (an event's span holds the previous events' fitted
   rows: one gather and one product per level of that chain, all trajectories at once);
3. **attention**: every segment's queries over its cache snapshot (gathered) and its own earlier
   tokens, in a few padded SDPA calls, β added per key row.

The result equals the segment-by-segment replay up to float rounding (tests compare both, values
and gradients); docs/grpo.md, "Replay in one pass".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import numpy as np
import torch

from compaction_gym.compaction.scoring import attention_logits, half_product
from compaction_gym.compaction.values import SOLVE_DTYPE, compute_dtype, factor_inverse, normal_matrix
from compaction_gym.engine.attention import fold_query, grouped_sdpa_heads, pad_head, write_bias_columns
from compaction_gym.engine.fast.flex import (
    FlexUnavailable,
    flex_bias_supported,
    key_bias_attention,
    position_block_mask,
)
from compaction_gym.engine.fast.gather import gather_rows
from compaction_gym.engine.fast.softmax import kept_and_span_softmax_of, span_and_kept_softmax
from compaction_gym.engine.host_copy import upload
from compaction_gym.engine.profiling import profiler_range
from compaction_gym.trainers.replay_plan import PER_HEAD, Fit, Plan, Snapshot, random_probe_tensor

#: Pieces whose key widths differ by less than this factor share one padded SDPA call.
BUCKET_SPREAD = 1.3
#: β's buckets run FlexAttention (the bias added to the float32 scores at the model's head dim) where
#: it can (a half-precision model on a GPU); off, they fold β into head-dim columns (docs/grpo.md).
FLEX_BIAS = True
#: For half-precision models, the gradients through the value maps and the C2 chain take TF32
#: products (the forward stays float32-exact); docs/grpo.md, "Replay in one pass".
TF32_BACKWARD = True


@dataclass
class _Rows:
    """Indices (or biases) ``[L, H, n]`` stored as one row every (layer, KV head) shares plus, at a
    few columns, per-(layer, head) values read from a slot table: raw rows are shared, a block's
    rows are not (:class:`~compaction_gym.trainers.replay_plan.SlotTable`)."""

    base: torch.Tensor  # [n]
    cols: torch.Tensor  # [k]
    slots: torch.Tensor | None  # [k] the columns' slots in ``table``; None when k = 0
    table: torch.Tensor | None  # [L, H, S] the plan's slots (shared by every _Rows of that kind)
    add: int = 0  # added to what the table holds

    @classmethod
    def of(cls, base: np.ndarray, cols: np.ndarray, slots: np.ndarray, table: Any, stage: _Stage,
           add: int = 0) -> _Rows:  # fmt: skip
        """From host arrays (staged for the device): ``base`` ``[n]``, and at columns ``cols`` the
        table's slots ``slots`` (plus ``add``)."""
        if not cols.size:
            return cls(stage(base), stage(np.zeros(0, np.int64)), None, None)
        return cls(stage(base), stage(cols), stage(slots), table, add)

    def at(self, layer: int, heads: int) -> torch.Tensor:
        """``[H, n]`` at ``layer`` (``[1, n]`` when every head shares the row)."""
        if self.slots is None:
            return self.base[None]
        out = self.base.expand(heads, -1).clone()
        vals = self.table[layer].index_select(1, self.slots).to(out.dtype)
        out[:, self.cols] = vals + self.add if self.add else vals
        return out


class _Staged:
    """A host array bound for the device (or arrays of one dtype and shape, stacked there), and what
    to make of it there (``then``)."""

    __slots__ = ("array", "then", "value")

    def __init__(self, array: np.ndarray | list[np.ndarray],
                 then: Callable[[torch.Tensor], torch.Tensor] | None) -> None:  # fmt: skip
        self.array, self.then, self.value = array, then, None

    @property
    def parts(self) -> list[np.ndarray]:
        return self.array if isinstance(self.array, list) else [self.array]


class _Stage:
    """The device plan's host arrays, sent together: one pinned buffer and one asynchronous copy per
    dtype (:func:`~compaction_gym.engine.host_copy.upload`) instead of a synchronising copy each."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.items: list[_Staged] = []

    def __call__(self, array: np.ndarray | list[np.ndarray],
                 then: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Any:  # fmt: skip
        """Stage ``array``; a list of arrays (one dtype and shape) arrives stacked, written into the
        pinned buffer one by one instead of stacked on the host first (a fresh host copy)."""
        item = _Staged(array, then)
        self.items.append(item)
        return item

    def send(self) -> None:
        by_dtype: dict[np.dtype, list[_Staged]] = {}
        for item in self.items:
            by_dtype.setdefault(item.parts[0].dtype, []).append(item)
        for items in by_dtype.values():
            sent = iter(upload([a for i in items for a in i.parts], self.device))
            for item in items:
                t = next(sent) if not isinstance(item.array, list) else torch.stack([next(sent) for _ in item.array])
                item.value = t if item.then is None else item.then(t)
                item.array = None
        self.items = []


def _resolve(x: Any) -> Any:
    """``x`` with every :class:`_Staged` inside (dataclass fields, dicts, tuples, lists) replaced by its tensor."""
    if isinstance(x, _Staged):
        return x.value
    if type(x) in _LEAVES:
        return x
    names = _FIELDS.get(type(x))
    if names is not None:
        for name in names:
            setattr(x, name, _resolve(getattr(x, name)))
        return x
    if isinstance(x, dict):
        return {k: _resolve(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)([_resolve(v) for v in x])
    return x


#: What :func:`_resolve` need not look into (the plan's levels, slices, sizes).
_LEAVES = frozenset({int, float, str, bool, type(None), torch.Tensor})
#: The fields :func:`_resolve` looks into, per dataclass of the device plan.
_FIELDS: dict[type, tuple[str, ...]] = {}


@dataclass
class _Stack:
    """Snapshots laid end to end, each followed by its piece's own tokens and padding: the columns
    of a bucket's (or a group's) rows, built in a few array operations instead of per snapshot."""

    kcol: np.ndarray  # [n] key token; -1 on block rows, -2 on padding
    vcol: np.ndarray  # [n] value source; PER_HEAD on padding
    row: np.ndarray  # [n] each column's trajectory
    blocks: np.ndarray  # [k] the block rows' columns
    slots: np.ndarray  # [k] the block rows' slots in their trajectory's table

    @classmethod
    def of(cls, rows: list[int] | np.ndarray, snaps: list[Snapshot], pads: list[int] | None = None) -> _Stack:
        """Snapshots end to end, each followed by ``pads`` padding columns."""
        kcol, vcol = np.concatenate([s.kcol for s in snaps]), np.concatenate([s.vcol for s in snaps])
        slot = np.concatenate([s.slot for s in snaps])
        lengths = np.array([s.kcol.shape[0] for s in snaps], np.int64)
        blocks = np.flatnonzero(kcol == -1)
        slots = slot[blocks]
        if pads is not None and any(pads):
            pads = np.asarray(pads, np.int64)
            at = np.arange(kcol.shape[0]) + np.repeat(np.cumsum(pads) - pads, lengths)  # each row's column
            lengths += pads
            kcol, vcol = _placed(kcol, at, int(lengths.sum()), -2), _placed(vcol, at, int(lengths.sum()), PER_HEAD)
            blocks = at[blocks]
        row = np.repeat(np.asarray(rows, np.int64), lengths)
        return cls(kcol, vcol, row, blocks, slots)

    @classmethod
    def pieces(cls, rows: np.ndarray, snaps: list[Snapshot], in_snap: np.ndarray, own: np.ndarray,
               token: np.ndarray) -> _Stack:  # fmt: skip
        """A bucket's ``[P, W]`` columns: where ``in_snap``, piece ``p``'s snapshot's rows in order;
        where ``own``, its own token ``token``; padding elsewhere."""
        kcol = np.where(own, token, -2).reshape(-1)
        vcol = np.where(own, token, PER_HEAD).reshape(-1)
        at = np.flatnonzero(in_snap)  # row-major: snapshot after snapshot
        snap_k = np.concatenate([s.kcol for s in snaps])
        kcol[at] = snap_k
        vcol[at] = np.concatenate([s.vcol for s in snaps])
        blocks = np.flatnonzero(snap_k == -1)  # only snapshot rows are block rows
        slots = np.concatenate([s.slot for s in snaps])[blocks]
        return cls(kcol, vcol, np.repeat(rows, in_snap.shape[1]), at[blocks], slots)


def _placed(x: np.ndarray, at: np.ndarray, n: int, fill: int) -> np.ndarray:
    """``[n]`` of ``fill`` with ``x`` at ``at``."""
    out = np.full(n, fill, np.int64)
    out[at] = x
    return out


@dataclass
class _Group:
    """Fits of equal span width, target, probe kind, β-ness and ridge, sorted by level."""

    width: int
    target: int
    kind: str
    ridge: float
    n: int  # probes per event, padded
    count: int
    keys: _Rows  # [L, H, E·w] the span's key rows
    bias: _Rows | None  # [L, H, E·w] the span's bias
    kept: torch.Tensor  # [L, E·H, t]
    beta_slots: torch.Tensor | None  # [E·t] the slots of the events' kept rows (their recorded β)
    raw_idx: torch.Tensor  # [E·w] the span's raw value rows (fitted columns: 0)
    raw_mask: torch.Tensor  # [E, 1, 1, w] bool
    probe_idx: torch.Tensor | _Rows | None  # suffix: [E·H·G·n] query rows; keys: [L, H, E·n] key rows
    probes: torch.Tensor | None  # random: [L, E·H, n, d]
    probe_mask: torch.Tensor | None  # [E·H, G·n] bool (the designs' probe rows), or None when no padding
    probe_counts: torch.Tensor  # [E·H] real probes per problem
    fit_cols: torch.Tensor | None  # [E·H, t, f] (expanded) the span's columns holding fitted rows, padded
    fit_valid: torch.Tensor | None  # [E, 1, 1, f] which of them are real
    slices: dict[int, tuple[int, int]] = field(default_factory=dict)  # level -> events [lo, hi)
    # level -> (levels read, rows [E_level·H·f] of their concatenated event-major C2)
    chain: dict[int, tuple[list[int], torch.Tensor]] = field(default_factory=dict)


@dataclass
class _Bucket:
    pieces: int
    queries: int
    width: int
    keys: _Rows  # [L, H, P·W] key rows
    values: _Rows  # [L, H, P·W] value rows (raw, then fitted)
    bias: _Rows | None  # [L, H, P·W] float32
    colpos: torch.Tensor  # [P, W] each column's token (-1: the snapshot's rows, a large value: padding)
    qpos: torch.Tensor  # [P, n_q] each query's token (padding queries: see every real column)
    qidx: torch.Tensor  # [P·H_q·n_q] rows of the layer's queries [B·N·H_q, d], grouped by KV head
    qreal: torch.Tensor  # [P, n_q] which queries are real (not padding)


@dataclass
class _Tokens:
    """Per token row of the batch ``[B·N]``: its bucket (-1: padding), its piece in it and its query
    index (staged, then on the device)."""

    bucket: Any
    piece: Any
    query: Any


_FIELDS.update({c: tuple(f.name for f in fields(c)) for c in (_Rows, _Group, _Bucket, _Tokens)})


class OnePassReplay:
    """A :class:`~compaction_gym.trainers.replay_plan.Plan` on the device, and the attention that
    uses it: the object passed to the model as ``replay_plan`` (the attention function calls
    :meth:`attend`)."""

    def __init__(self, plan: Plan, device: torch.device, *, through: bool, head_dim: int, q_heads: int,
                 probe_dtype: torch.dtype, scale: float) -> None:  # fmt: skip
        self.plan, self.device, self.through, self.scale = plan, device, through, scale
        self.batch, self.width = len(plan.rows), plan.width
        self.rows = self.batch * self.width  # raw token rows (per head)
        self.n_layers, self.n_kv_heads = plan.n_layers, plan.n_kv_heads
        self._q_heads = q_heads
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}
        self._block_masks: dict[int, Any] = {}  # per bucket, FlexAttention's (kept with the plan)
        self._out_index: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # per output layout: index, real
        self._inverses: dict[Any, torch.Tensor] = {}  # per read-once lookup, its inverse (kept with the plan)
        self.failed: list[torch.Tensor] = []  # per value-map solve, which problems did not factor
        self._stage = stage = _Stage(device)
        self._layout_fits()
        self._stage_tables()
        self.groups = [self._group(fs, head_dim, probe_dtype) for fs in self._members]
        self._build_buckets()
        stage.send()
        self._join_tables()
        self._bias_table = self._tables["b"].value  # [L, H, S]
        self.groups, self.buckets, self._tokens = _resolve((self.groups, self.buckets, self._tokens))
        del self._stage, self._tables, self._value_tables

    def reset(self) -> None:
        """Forget the last pass's state (its masks, its solves' flags) before a kept plan serves another."""
        self._masks.clear()
        self.failed = []

    # ------------------------------------------------------------------------------- host → device
    def _value_rows(self, b: np.ndarray, vsrc: np.ndarray, block: np.ndarray | bool = False) -> np.ndarray:
        """Value rows of ``[values | detached values (gradients stopped at blocks) | fitted C2]``
        for sources ``vsrc`` of trajectories ``b`` (broadcast)."""
        out = b * self.width + vsrc  # raw sources' rows; the others' below
        if not self.through:
            out += self.rows * np.asarray(block, np.int64)
        out = out.reshape(-1)
        at = np.flatnonzero(vsrc < 0)
        if at.size:
            v, b = vsrc.reshape(-1)[at], np.broadcast_to(b, vsrc.shape).reshape(-1)[at]
            # trajectory b's fitted source -1 - j is the batch's fitted row offsets[b] + j
            j = np.maximum(np.minimum(-1 - v, self._counts[b] - 1), 0)
            fitted = self._fitted_pos[np.minimum(self._starts[b] + j, len(self._fitted_pos) - 1)]
            out[at] = np.where(v == PER_HEAD, 0, (1 if self.through else 2) * self.rows + fitted)
        return out.reshape(vsrc.shape)

    def _rows(self, st: _Stack, *, values: bool = False, bias: bool = False,
              attention: bool = False) -> tuple[_Rows, _Rows | None, _Rows | None]:  # fmt: skip
        """The stack's key rows (and value rows, biases); ``attention``: rows the attention reads
        (its block keys and kept values are the detached copy when gradients stop at the blocks)."""
        stage = self._stage
        slots = st.slots + self._slot_offsets[st.row[st.blocks]]  # the batch's slots
        keys = _Rows.of(
            np.where(st.kcol >= 0, st.row * self.width + st.kcol, 0), st.blocks, slots, self._tables["k"], stage,
            add=self.rows if attention and not self.through else 0,
        )  # fmt: skip
        vals = None
        if values:
            varies = np.flatnonzero(st.vcol[st.blocks] == PER_HEAD)
            # a kept (not refitted) value is the block's own copy (read only when gradients stop there)
            kept = attention and not self.through and st.kcol == -1
            table = self._value_table(attention) if varies.size else None
            vals = _Rows.of(self._value_rows(st.row, st.vcol, kept), st.blocks[varies], slots[varies], table, stage)
        b = (
            _Rows.of(np.zeros(st.kcol.shape, np.float32), st.blocks, slots, self._tables["b"], stage)
            if bias
            else None
        )
        return keys, vals, b

    def _stage_tables(self) -> None:
        """Stage the plan's slot tables (key tokens and biases; value sources on demand,
        :meth:`_value_table`): laid end to end they are the batch's slots, joined on the device
        (:meth:`_join_tables`)."""
        sizes = np.array([t.n for t in self.plan.tables], np.int64)
        self._slot_offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        self._slot_row = np.repeat(np.arange(len(sizes)), sizes)  # each slot's trajectory
        self._table_parts = {
            "k": [(self._stage(t.k), 0) for t in self.plan.tables],
            # a table's biases joined on the host (SlotTable.bias: cached, often already read by the
            # simulation): one staged array per trajectory instead of one per event
            "b": [(self._stage(t.bias()) if t.biased[: t.n].any() else None, t.n) for t in self.plan.tables],
        }  # (part, width): a part of None is zeros
        # a key slot holds a token; its key row is row·width + token (int32: rows < 2**31)
        self._key_offsets = self._stage((self._slot_row * self.width).astype(np.int32))
        self._tables = {name: _Staged(None, None) for name in "kb"}  # set by _join_tables
        self._value_tables: dict[bool, Any] = {}

    def _join_tables(self) -> None:
        """The uploaded tables joined: ``[L, H, S]`` key rows (int32) and biases (float32)."""
        L, H = self.n_layers, self.n_kv_heads
        for name, parts in self._table_parts.items():
            dtype = torch.int32 if name == "k" else torch.float32
            zero = partial(torch.zeros, L * H, dtype=dtype, device=self.device)
            x = torch.cat([zero(0), *(zero(w) if p is None else p.value for p, w in parts)], 1)
            if name == "k":
                x += self._key_offsets.value
            self._tables[name].value = x.reshape(L, H, -1)
        del self._table_parts, self._key_offsets

    def _value_table(self, attention: bool) -> Any:
        """The batch's value slots as value rows (:meth:`_value_rows`), staged."""
        if attention not in self._value_tables:
            v = np.concatenate(
                [np.broadcast_to(t.shared, t.k.shape) if t.per_head is None else t.per_head for t in self.plan.tables], 1
            )
            rows = self._value_rows(self._slot_row[None], v, attention)
            self._value_tables[attention] = self._stage(
                rows, lambda r: r.reshape(self.n_layers, self.n_kv_heads, -1)
            )
        return self._value_tables[attention]

    def _layout_fits(self) -> None:
        """Group the fits and place every fitted row: level by level, group by group, so that a
        level's C2 is one tensor."""
        plan = self.plan
        keys: dict[tuple, int] = {}  # (span width, target, probe kind, β-ness, ridge) -> group
        fits = np.array([
            (keys.setdefault((f.width, t, f.probe[0], f.beta is not None, f.ridge), len(keys)), f.level, f.first, t)
            for f in plan.fits
            for t in [f.target]
        ], np.int64).reshape(-1, 4)  # fmt: skip
        order = np.lexsort((fits[:, 1], fits[:, 0]))  # group by group, each by level (stable)
        bounds = np.flatnonzero(np.diff(fits[order, 0])) + 1
        self._members = [[plan.fits[i] for i in part.tolist()] for part in np.split(order, bounds)] if plan.fits else []
        offsets = np.array([*plan.fitted_offsets, plan.fitted_rows], np.int64)
        self._starts, self._counts = offsets[:-1], np.diff(offsets)  # per trajectory, its fitted rows
        # a level's fitted rows, group by group: head-major for the attention's value rows
        # (``_fitted_pos``), event-major [E, H, t] for the C2 chain (``_meta``)
        _, level, first, t = fits[np.lexsort((fits[:, 0], fits[:, 1]))].T  # level by level, group by group
        self.levels = np.unique(level).tolist()
        # fit by fit in that order, its fitted rows f.first .. are the next positions
        ends = np.cumsum(t)
        at = np.repeat(first - ends + t, t) + np.arange(ends[-1] if t.size else 0)
        self._fitted_pos = np.zeros(max(plan.fitted_rows, 1), np.int64)
        self._fitted_pos[at] = np.arange(at.size)
        # each fit's offset in its level's event-major C2 [E, H, t] rows, and each level's rows
        rows = self.n_kv_heads * t
        flat = np.cumsum(rows) - rows
        starts = np.flatnonzero(np.diff(level, prepend=-1))  # each level's first fit
        offset = flat - np.repeat(flat[starts], np.diff(starts, append=level.size))
        self._level_flat = np.zeros(int(level.max(initial=-1)) + 1, np.int64)  # level -> rows
        self._level_flat[level[starts]] = np.add.reduceat(rows, starts) if starts.size else 0
        # per fit, by first fitted row: (level, offset, t)
        order = np.argsort(first, kind="stable")
        self._firsts = first[order]
        self._meta = np.stack([level, offset, t], 1)[order]

    def _group(self, fs: list[Fit], head_dim: int, probe_dtype: torch.dtype) -> _Group:
        dev, stage, L, H = self.device, self._stage, self.n_layers, self.n_kv_heads
        E, w, t = len(fs), fs[0].width, fs[0].target
        kind = fs[0].probe[0]
        n_probes = [f.n_probes for f in fs]
        n = max(n_probes)
        rows = np.array([f.row for f in fs], np.int64)
        span = _Stack.of(rows, [f.span for f in fs])
        has_bias = any(f.span.has_bias for f in fs)
        keys, _, bias = self._rows(span, bias=has_bias)

        def per_eh(a: list[np.ndarray], dtype: type, to: torch.dtype) -> Any:  # [E, LH, t] -> [L, E·H, t]
            a = [x if x.dtype == dtype else x.astype(dtype, casting="same_kind") for x in a]  # stacked on the device
            return stage(a, lambda v: v.reshape(E, L, H, -1).transpose(0, 1).reshape(L, E * H, -1).to(to))

        vcol = span.vcol
        raw_rows = np.where(vcol >= 0, self._value_rows(span.row, vcol), 0)
        g = _Group(
            width=w, target=t, kind=kind, ridge=fs[0].ridge, n=n, count=E, keys=keys, bias=bias,
            kept=per_eh([f.kept for f in fs], np.int16 if w < 2**15 else np.int64, torch.long),  # 1/4 of the copy
            beta_slots=stage(self._beta_slots(fs, rows, t)) if fs[0].beta is not None else None,
            raw_idx=stage(raw_rows), raw_mask=stage((vcol >= 0).reshape(E, 1, 1, w)),
            probe_idx=None, probes=None, probe_mask=None, probe_counts=None, fit_cols=None, fit_valid=None,
        )  # fmt: skip
        counts = np.array(n_probes)
        groups = self._q_heads // H if kind == "suffix" else 1
        if (counts != n).any():  # laid out as the designs' rows once, not at every layer
            g.probe_mask = stage(
                np.arange(n)[None, :] < counts[:, None],
                lambda m: m[:, None, None, :].expand(-1, H, groups, -1).reshape(E * H, groups * n),
            )
        g.probe_counts = stage(np.repeat(counts * groups, H))
        # per event, its span's columns holding fitted rows (ascending, padded with column 0)
        fitted = vcol.reshape(E, w) < 0
        found = fitted.sum(1)
        width = int(found.max()) if E else 0
        cols = valid = None
        if width:
            cols = np.argsort(~fitted, axis=1, kind="stable")[:, :width]
            valid = np.arange(width)[None, :] < found[:, None]
            cols[~valid] = 0
            g.fit_cols = stage(cols, lambda c: c.repeat_interleave(H, 0)[:, None, :].expand(-1, t, -1))
            g.fit_valid = stage(valid.reshape(E, 1, 1, width))
        if kind == "suffix":
            # event e's probe j is the query row of token probe[1] + j (padding: row 0)
            j = np.arange(n)
            first = rows * self.width + np.array([f.probe[1] for f in fs], np.int64)
            probe_rows = np.where(j < counts[:, None], first[:, None] + j, 0)
            # query rows [B·N·H_q, d]: probe j of event e at KV head h, group member g is head h·G + g
            # (expanded on the device: E·H_q·n indices)
            g.probe_idx = stage(probe_rows, partial(_head_rows, heads=self._q_heads))
        elif kind == "keys":
            probe = _Stack.of(
                [f.row for f in fs], [f.probe[1] for f in fs], pads=[n - f.n_probes for f in fs]
            )
            g.probe_idx = self._rows(probe)[0]
        else:  # random
            probes = torch.zeros(L, E, H, n, head_dim, dtype=probe_dtype, device=dev)
            for e, f in enumerate(fs):
                p = random_probe_tensor(f, L, H, head_dim, probe_dtype, dev)
                probes[:, e, :, : p.shape[1]] = p.reshape(L, H, p.shape[1], head_dim)
            g.probes = probes.reshape(L, E * H, n, head_dim)
        levels = np.array([f.level for f in fs])
        bounds = np.flatnonzero(np.diff(levels)) + 1  # fs are sorted by level
        for lo, hi in zip([0, *bounds.tolist()], [*bounds.tolist(), E]):
            lv = int(levels[lo])
            g.slices[lv] = (lo, hi)
        if width and levels[-1] > 0:
            self._chains(g, span.vcol.reshape(E, w), rows, cols, valid)
        return g

    def _beta_slots(self, fs: list[Fit], rows: np.ndarray, t: int) -> np.ndarray:
        """The batch's slots of the fits' kept rows ``[E·t]`` (fit ``e``'s are its ``slot .. slot + t - 1``)."""
        first = self._slot_offsets[rows] + np.array([f.slot for f in fs], np.int64)
        return (first[:, None] + np.arange(t)).reshape(-1)

    def _chains(self, g: _Group, vcol: np.ndarray, rows: np.ndarray, cols: np.ndarray, valid: np.ndarray) -> None:
        """Per level of ``g`` above 0, where the fitted rows its spans read lie in the event-major C2
        of the levels they come from (concatenated): ``g.chain[level] = (levels, rows [E·H·f])``
        (padding: row 0); ``vcol`` ``[E, w]`` the spans' value sources, ``cols``/``valid`` ``[E, f]``
        their fitted columns."""
        H = self.n_kv_heads
        firsts, meta = self._firsts, self._meta
        # each fitted column's row of the batch's fitted rows, the fit that owns it, its (level, offset, t)
        j = self._starts[rows][:, None] - 1 - np.take_along_axis(vcol, cols, 1)
        o = np.maximum(np.searchsorted(firsts, j, side="right") - 1, 0)
        lv, off, t = meta[o, 0], meta[o, 1], meta[o, 2]
        base = off + j - firsts[o]  # within its level's C2
        # per level of the group, which levels its spans read, and where each lies in their concatenation
        spans = [hi - lo for lo, hi in g.slices.values()]
        which = np.repeat(np.arange(len(spans)), spans)  # each event's level, as an index into g.slices
        reads = np.zeros((len(spans), self._level_flat.size), bool)
        reads[np.broadcast_to(which[:, None], lv.shape)[valid], lv[valid]] = True
        sizes = reads * self._level_flat
        at = np.cumsum(sizes, 1) - sizes
        # head h's rows follow head h - 1's t rows; padding columns read row 0
        out = np.arange(H)[None, :, None] * np.where(valid, t, 0)[:, None, :]
        out += np.where(valid, at[which[:, None], lv] + base, 0)[:, None, :]
        for i, (level, (lo, hi)) in enumerate(g.slices.items()):
            if level:
                g.chain[level] = (np.flatnonzero(reads[i]).tolist(), self._stage(out[lo:hi].reshape(-1)))

    def _build_buckets(self) -> None:
        plan = self.plan
        pieces = np.array([(p.row, p.q0, p.q1, p.start, p.ctx) for p in plan.pieces], np.int64).reshape(-1, 5)
        row, q0, q1, first, snap = pieces.T
        ctx = np.array([s.length for s in plan.snapshots], np.int64)[snap]
        order = np.argsort(ctx + q1 - first, kind="stable")  # pieces by key width
        ctx, row, q0, q1, first = ctx[order], row[order], q0[order], q1[order], first[order]
        widths = (ctx + q1 - first).tolist()
        starts = [0]  # the buckets: runs of pieces whose widths differ by less than BUCKET_SPREAD
        for j in range(1, len(widths)):
            if widths[j] > BUCKET_SPREAD * widths[starts[-1]]:
                starts.append(j)
        bounds = list(zip(starts, [*starts[1:], len(widths)]))
        snaps = [plan.snapshots[j] for j in snap[order].tolist()]
        self.buckets = [
            self._bucket(snaps[lo:hi], ctx[lo:hi], row[lo:hi], q0[lo:hi], q1[lo:hi], first[lo:hi]) for lo, hi in bounds
        ]
        # each token row's bucket (-1: padding), piece and query (for _output_index)
        bucket, piece, query = np.full(self.rows, -1, np.int64), np.zeros(self.rows, np.int64), np.zeros(self.rows, np.int64)
        size = np.array([hi - lo for lo, hi in bounds])
        lens = q1 - q0
        query_of = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
        at = np.repeat(row * self.width + q0, lens) + query_of
        bucket[at] = np.repeat(np.repeat(np.arange(len(bounds)), size), lens)
        piece[at] = np.repeat(np.arange(len(widths)) - np.repeat(np.cumsum(size) - size, size), lens)
        query[at] = query_of
        self._tokens = _Tokens(self._stage(bucket), self._stage(piece), self._stage(query))

    def _bucket(self, snaps: list[Snapshot], ctx: np.ndarray, row: np.ndarray, q0: np.ndarray, q1: np.ndarray,
                first: np.ndarray) -> _Bucket:  # fmt: skip
        """A bucket of pieces: per piece its snapshot (of ``ctx`` rows), trajectory ``row``, queries
        ``[q0, q1)`` and segment start ``first``."""
        stage = self._stage
        P, W, nq = len(snaps), int((ctx + q1 - first).max()), int((q1 - q0).max())
        # each piece's columns: its snapshot's rows, then its segment's tokens first .. q1 - 1, then padding
        k = np.arange(W)[None, :]
        in_snap = k < ctx[:, None]
        own = ~in_snap & (k < (ctx + q1 - first)[:, None])
        token = (first - ctx)[:, None] + k
        stack = _Stack.pieces(row, snaps, in_snap, own, token)
        big = np.iinfo(np.int64).max
        colpos = np.where(in_snap, -1, np.where(own, token, big))
        i = np.arange(nq)[None, :]
        real = i < (q1 - q0)[:, None]
        qrows = np.where(real, row[:, None] * self.width + q0[:, None] + i, 0)
        qpos = np.where(real, q0[:, None] + i, big - 1)  # padding queries see every real column
        keys, values, bias = self._rows(stack, values=True, bias=self.plan.has_bias, attention=True)
        return _Bucket(
            pieces=P, queries=nq, width=W, keys=keys, values=values, bias=bias,
            colpos=stage(colpos), qpos=stage(qpos),
            qidx=stage(qrows, partial(_head_rows, heads=self._q_heads)), qreal=stage(real),
        )  # fmt: skip

    # ----------------------------------------------------------------------------------- per layer
    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:  # fmt: skip
        """The layer's attention output ``[B, N, H_q, d_v]`` over the replayed caches."""
        B, Hq, N, d = query.shape
        H, dv = key.shape[1], value.shape[-1]
        keys = key.transpose(0, 1).reshape(H, B * N, d)
        values = value.transpose(0, 1).reshape(H, B * N, dv)
        q_rows = query.transpose(1, 2).reshape(B * N * Hq, d)  # token-major, query head fastest
        with profiler_range("replay.compacted_values"):
            fitted = self._fitted_values(layer, q_rows, keys, values)
        key_rows = keys if self.through else torch.cat([keys, keys.detach()], 1)
        value_rows = torch.cat([values, *([] if self.through else [values.detach()]), *fitted], 1)
        with profiler_range("replay.attention"):
            if self._folds(query):  # β's head-dim columns added once per layer, not per bucket
                key_rows, value_rows, q_rows = pad_head(key_rows), pad_head(value_rows), fold_query(q_rows)
            outs = [
                self._bucket_attention(b, layer, q_rows, key_rows, value_rows, scaling) for b in self.buckets
            ]
            rows, layout = zip(*(_dense_rows(o) for o in outs))
            zero = rows[0].new_zeros(1, rows[0].shape[-1])  # the padding tokens' row
            rows = torch.cat([*rows, zero])
            index, real = self._output_index(layout)
            out = self._read_once(rows[:, :dv], index, real, layout)
        return out.reshape(B, N, Hq, dv)

    def _bucket_attention(self, b: _Bucket, layer: int, q_rows: torch.Tensor, key_rows: torch.Tensor,
                          value_rows: torch.Tensor, scaling: float | None) -> torch.Tensor:  # fmt: skip
        """A bucket's pieces attending over their snapshots and own tokens: ``[P, H_kv, G·n_q, d_v]``
        (query heads grouped by KV head, as :func:`~compaction_gym.engine.attention.grouped_sdpa`)."""
        H = key_rows.shape[0]
        kp = _gather_blocks(key_rows, b.keys.at(layer, H), b.pieces)
        vp = _gather_blocks(value_rows, b.values.at(layer, H), b.pieces)
        # the queries gathered straight into the grouped layout [P, H_kv, G·n_q, d]
        qp = self._read_once(q_rows, b.qidx, lambda: b.qreal[:, None, :].expand(-1, self._q_heads, -1), id(b))
        qp = qp.reshape(b.pieces, H, -1, q_rows.shape[-1])
        groups = self._q_heads // H
        if b.bias is None:
            return grouped_sdpa_heads(qp, kp, vp, self._mask(b, q_rows.dtype, groups), scaling=scaling)
        bias = b.bias.at(layer, H).expand(H, -1).reshape(H, b.pieces, b.width).transpose(0, 1)
        if self._flex(q_rows):  # β added to the float32 scores inside the kernel
            try:
                block_mask = self._block_mask(b, groups)
                return key_bias_attention(qp, kp, vp, bias.contiguous(), block_mask, scaling=scaling)
            except FlexUnavailable:  # this layer's rows are not padded for the folded path: float32 below
                pass
        elif self._folds(q_rows):  # β inside the half-precision product (folded_bias_sdpa's columns)
            scale = write_bias_columns(kp, bias, scaling)
            return grouped_sdpa_heads(qp, kp, vp, self._mask(b, q_rows.dtype, groups), scaling=scale)
        # β: float32 product, as the engine and the segment replay
        dtype = torch.promote_types(q_rows.dtype, torch.float32)
        mask = self._mask(b, dtype, groups) + bias[:, :, None, :].to(dtype)
        with torch.autocast(q_rows.device.type, enabled=False):
            out = grouped_sdpa_heads(qp, kp, vp, mask, scaling=scaling, compute_dtype=dtype)
        return out.to(q_rows.dtype)

    def _flex(self, x: torch.Tensor) -> bool:
        """Whether β's buckets run :func:`~compaction_gym.engine.fast.flex.key_bias_attention` (a plan
        with β, half precision on a GPU, :data:`FLEX_BIAS` on)."""
        return self.plan.has_bias and FLEX_BIAS and flex_bias_supported(x)

    def _folds(self, x: torch.Tensor) -> bool:
        """Whether β rides in extra head-dim columns (:func:`~compaction_gym.engine.attention.folded_bias_sdpa`):
        a plan with β in a half-precision model, where FlexAttention does not run."""
        return self.plan.has_bias and x.dtype in (torch.bfloat16, torch.float16) and not self._flex(x)

    def _mask(self, b: _Bucket, dtype: torch.dtype, groups: int) -> torch.Tensor:
        """The bucket's additive mask ``[P, 1, G·n_q, W]`` (the same at every layer: built once)."""
        key = (id(b), dtype)
        if key not in self._masks:
            allowed = b.colpos[:, None, :] <= b.qpos[:, :, None]  # [P, n_q, W]
            m = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            m.masked_fill_(~allowed, float("-inf"))
            self._masks[key] = m[:, None].repeat(1, 1, groups, 1)
        return self._masks[key]

    def _block_mask(self, b: _Bucket, groups: int) -> Any:
        """The bucket's FlexAttention block mask (built once per plan)."""
        if id(b) not in self._block_masks:
            self._block_masks[id(b)] = position_block_mask(b.colpos, b.qpos, groups)
        return self._block_masks[id(b)]

    def _output_index(self, layout: tuple[tuple[int, int, int, int], ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """For every token row and query head ``[B·N·H_q]``, its output row among the buckets' dense
        rows laid end to end (then the zero row), for the buckets' row strides ``layout`` (per bucket
        ``(rows, piece, head, query)``: the kernels choose their output layout, the same at every layer);
        and which of them are real tokens (a dense row is the output of at most one)."""
        if layout not in self._out_index:  # on the device: [B·N·H_q] indices are too many for the host
            tok = self._tokens
            meta = torch.tensor([[*s, b.queries] for s, b in zip(layout, self.buckets)], dtype=torch.long)
            counts, sp, sh, sq, nq = upload([meta.T.contiguous()], self.device)[0]  # no synchronisation
            base = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            dev = base.device
            G = self._q_heads // self.n_kv_heads
            hq = torch.arange(self._q_heads, device=dev)
            k = tok.bucket.clamp(min=0)[:, None]
            idx = (
                base[k] + tok.piece[:, None] * sp[k] + (hq // G)[None] * sh[k]
                + ((hq % G)[None] * nq[k] + tok.query[:, None]) * sq[k]
            )  # fmt: skip
            padding = tok.bucket[:, None] < 0
            idx = idx.masked_fill_(padding, base[-1]).reshape(-1)
            self._out_index[layout] = idx, (~padding).expand(-1, self._q_heads)
        return self._out_index[layout]

    def _read_once(self, src: torch.Tensor, idx: torch.Tensor, real: Any, key: Hashable) -> torch.Tensor:
        """``src[idx]`` (rows) for a lookup whose ``real`` entries (a mask of ``idx``'s shape, or a
        function making it) read every row at most once: with a gradient, through :class:`_ReadOnce`
        and its inverse map, built at the first use and kept with the plan under ``key``."""
        if not (torch.is_grad_enabled() and src.requires_grad):
            return gather_rows(src, idx)
        if key not in self._inverses:
            mask = (real() if callable(real) else real).reshape(-1)
            self._inverses[key] = _inverse(idx, mask, src.shape[0])
        return _ReadOnce.apply(src, idx, self._inverses[key])

    def _fitted_values(self, layer: int, query: torch.Tensor, keys: torch.Tensor,
                       values: torch.Tensor) -> list[torch.Tensor]:  # fmt: skip
        """Every fitted row's C2 at this layer, level by level: ``[H, rows_of_level, d_v]`` each
        (``query``: the layer's query rows ``[B·N·H_q, d]``, token-major)."""
        if not self.groups:
            return []
        grad = self.through and torch.is_grad_enabled()
        if not grad:
            query, keys, values = query.detach(), keys.detach(), values.detach()
        H, dv = keys.shape[0], values.shape[-1]
        cdt = compute_dtype(values.dtype)
        tf32 = TF32_BACKWARD and values.dtype in (torch.bfloat16, torch.float16)
        product = partial(_product, tf32 and grad)
        with torch.set_grad_enabled(grad), torch.autocast(query.device.type, enabled=False):
            with profiler_range("replay.value_maps"):
                maps = []
                for g in self.groups:
                    if grad:  # the solves' intermediates are large: recompute them in backward
                        m = _ValueMap.apply(self, g, layer, tf32, query, keys)
                    else:
                        m = self._value_map(g, layer, query, keys)
                    maps.append(m)
            with profiler_range("replay.c2_chain"):
                raw, fit = [], []
                for g, m in zip(self.groups, maps):
                    span = _gather_events(values, g.raw_idx[None], g.count, cdt)
                    raw.append(product(None, _masked(m, g.raw_mask, g.count), span))  # the raw columns' share
                    if g.fit_cols is not None:  # the fitted columns' maps, [E·H, t, f]
                        fit.append(_masked(torch.gather(m, 2, g.fit_cols), g.fit_valid, g.count))
                    else:
                        fit.append(None)
                # per group, its levels' events (one split: a slice each would cost a zero-filled
                # gradient of the whole tensor per slice in backward)
                raw = [_by_level(r, g, H) for g, r in zip(self.groups, raw)]
                fit = [None if f is None else _by_level(f, g, H) for g, f in zip(self.groups, fit)]
                flat: dict[int, torch.Tensor] = {}  # level -> event-major C2 rows [Σ E·H·t, d_v]
                for lv in self.levels:
                    parts = []
                    for g, r, mf in zip(self.groups, raw, fit):
                        if lv not in g.slices:
                            continue
                        lo, hi = g.slices[lv]
                        c2 = r[lv]
                        if lv in g.chain:
                            refs, rows = g.chain[lv]
                            src = flat[refs[0]] if len(refs) == 1 else torch.cat([flat[x] for x in refs])
                            prev = gather_rows(src, rows, cdt).reshape((hi - lo) * H, -1, dv)
                            c2 = product(c2, mf[lv], prev)
                        parts.append(c2.to(values.dtype).reshape(-1, dv))
                    flat[lv] = parts[0] if len(parts) == 1 else torch.cat(parts)
                out = []
                for lv in self.levels:  # [H, rows, d_v] for the attention's value rows
                    shapes = [
                        (hi - lo, g.target)
                        for g in self.groups
                        if lv in g.slices
                        for lo, hi in [g.slices[lv]]
                    ]
                    pieces = flat[lv].split([e * H * t for e, t in shapes]) if len(shapes) > 1 else [flat[lv]]
                    parts = [
                        p.reshape(e, H, t, dv).transpose(0, 1).reshape(H, -1, dv)
                        for p, (e, t) in zip(pieces, shapes)
                    ]
                    out.append(parts[0] if len(parts) == 1 else torch.cat(parts, 1))
        return out

    def _value_map(self, g: _Group, layer: int, query: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The group's value maps ``M`` ``[E·H, t, w]`` (compute dtype): ``C2 = M · V_span``.

        The normal equations of :func:`~compaction_gym.compaction.values.fit_values` with the
        probes' span attention ``P`` and the selection ``S`` in place of ``P·V`` and ``S·V``.
        """
        return self._map_forward(g, layer, query, keys)[0]

    def _map_forward(self, g: _Group, layer: int, query: torch.Tensor, keys: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor
    ]:  # fmt: skip
        """:meth:`_value_map` with what its backward keeps: ``(M, A⁻¹, κ)``."""
        with profiler_range("replay.value_maps.designs"):
            probes, span_keys, mask, bias = self._map_inputs(g, layer, query, keys)
            x, attn = self._map_designs(g, layer, probes, span_keys, mask, bias)
        with profiler_range("replay.value_maps.solve"):
            m, ok, a_inv, kappa = self._map_solve(g, layer, x, attn)
        self.failed.append(~ok)
        return m, a_inv, kappa

    def _map_inputs(self, g: _Group, layer: int, query: torch.Tensor, keys: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None
    ]:  # fmt: skip
        """The group's probes ``[E·H, n, d]``, span keys ``[E·H, w, d]``, padding-probe mask
        ``[E·H, n]`` and β of the span's rows ``[E·H, w]`` (``None`` where absent)."""
        H, d = keys.shape[0], keys.shape[-1]
        span_keys = _gather_events(keys, g.keys.at(layer, H), g.count)
        mask = g.probe_mask
        if g.kind == "suffix":  # one row gather straight into the event-major layout [E·H, G·n, d]
            groups = self._q_heads // H
            probes = gather_rows(query, g.probe_idx).reshape(g.count * H, groups * g.n, d)
        elif g.kind == "keys":
            probes = _gather_events(keys, g.probe_idx.at(layer, H), g.count)
        else:
            probes = g.probes[layer].to(keys.dtype)
        bias = None
        if g.bias is not None:
            bias = g.bias.at(layer, H).expand(H, -1).reshape(H, g.count, g.width).transpose(0, 1)
            bias = bias.reshape(g.count * H, g.width)
        return probes.to(span_keys.dtype), span_keys, mask, bias

    def _map_designs(self, g: _Group, layer: int, probes: torch.Tensor, span_keys: torch.Tensor,
                     mask: torch.Tensor | None, bias: torch.Tensor | None) -> tuple[
        torch.Tensor, torch.Tensor
    ]:  # fmt: skip
        """The design ``X`` ``[E·H, n, t]`` (the kept keys' softmax, padding probes' rows zero) and
        the probes' span attention ``P`` ``[E·H, n, w]``, in the compute dtype."""
        beta = None if g.beta_slots is None else self._kept_beta(g, layer)
        raw = half_product(probes, span_keys)  # no float32 copies when it applies
        if raw is not None:  # both softmaxes (and the padding) in one pass over the logits where Triton runs
            return span_and_kept_softmax(raw, self.scale, g.kept[layer], bias, beta, mask)
        with _exact_tf32(span_keys.dtype):  # the float32 copies' product (gradients need it)
            raw, logits = attention_logits(span_keys, probes, self.scale, bias)
        beta = None if beta is None else beta.to(raw.dtype)
        xs, attn = kept_and_span_softmax_of(raw, logits, g.kept[layer], beta)
        return (xs if mask is None else xs * mask[:, :, None].to(xs.dtype)), attn

    def _kept_beta(self, g: _Group, layer: int) -> torch.Tensor:
        """The group's recorded β at ``layer`` ``[E·H, t]``: its kept rows' biases."""
        H = self.n_kv_heads
        beta = self._bias_table[layer].index_select(1, g.beta_slots)  # [H, E·t]
        return beta.reshape(H, g.count, g.target).transpose(0, 1).reshape(g.count * H, g.target)

    def _map_solve(self, g: _Group, layer: int, x: torch.Tensor, attn: torch.Tensor) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
    ]:  # fmt: skip
        """``M = (XᵀX + λI)⁻¹ (XᵀP + λS)`` in the compute dtype; returns ``M``, which problems factored,
        ``A⁻¹`` (float64) and ``κ = λ / tr(XᵀX)``.

        Formed as ``M = Z·P + λ·A⁻¹S`` with ``Z = A⁻¹Xᵀ`` (``[t, n]``; ``A⁻¹ = L⁻ᵀL⁻¹``) in float64: only the
        wide product ``Z·P`` is in the compute dtype. Not ``A⁻¹ (XᵀP)`` with ``XᵀP`` in float32:
        its rounding is not of the form ``Xᵀδ``, so ``A⁻¹`` amplifies it by ``cond(A)`` (~1e5 at
        the ridge) instead of ``‖Z‖ ≤ 1/(2√λ)`` as the segment replay's (and the rollout's)
        ``A⁻¹Xᵀ(P·V)`` (docs/grpo.md, "Numerics")."""
        x64 = x.to(SOLVE_DTYPE)
        a, lam = normal_matrix(x64, g.ridge, g.probe_counts)
        t = a.shape[-1]
        chol, info = torch.linalg.cholesky_ex(a)
        a_inv, finite = factor_inverse(chol)  # float64
        m = torch.bmm((a_inv @ x64.mT).to(attn.dtype), attn)  # Z·P [E·H, t, w]
        kept = g.kept[layer][:, None, :].expand(-1, t, -1)  # λ·A⁻¹S: column j of λA⁻¹ at kept_j
        m.scatter_add_(2, kept, (lam[:, None, None] * a_inv).to(m.dtype))
        trace = torch.diagonal(a, dim1=-2, dim2=-1).sum(-1) - lam * t  # tr(XᵀX)
        kappa = torch.where(trace > 0, lam / trace, torch.zeros_like(lam))
        return m, (info == 0) & finite, a_inv, kappa


class _ValueMap(torch.autograd.Function):
    """A group's value maps with a hand-written backward (docs/grpo.md, "Replay in one pass").

    Saves only ``A⁻¹`` (``[t, t]``), ``κ`` and ``M``; the backward recomputes the designs (the
    ``[E·H, n, w]`` attention is too large to keep for every layer) and differentiates
    ``M = A⁻¹R``, ``A = XᵀX + λI``, ``R = XᵀP + λS``, ``λ = κ·tr(XᵀX)``:
    ``dR = A⁻¹dM``, ``dA = −dR·Mᵀ``, ``dX = P·dRᵀ + X(dA + dAᵀ) + 2κ·dλ·X``, ``dP = X·dR`` with
    ``dλ = tr(dA) + Σ_j dR[j, kept_j]``, then through both softmaxes and the logits' product to the
    probes and span keys, and by autograd through their gathers to the layer's queries and keys.
    """

    @staticmethod
    def forward(ctx: Any, replay: OnePassReplay, g: _Group, layer: int, tf32: bool, query: torch.Tensor,
                keys: torch.Tensor) -> torch.Tensor:  # fmt: skip
        out, a_inv, kappa = replay._map_forward(g, layer, query, keys)
        ctx.replay, ctx.g, ctx.layer, ctx.tf32 = replay, g, layer, tf32
        ctx.save_for_backward(query, keys, a_inv, kappa, out)
        return out

    @staticmethod
    def backward(ctx: Any, dm: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        replay, g, layer = ctx.replay, ctx.g, ctx.layer
        query, keys, a_inv, kappa, m = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        q, k = (t.detach().requires_grad_(n) for t, n in zip((query, keys), needs))
        off = torch.autocast(dm.device.type, enabled=False)
        with profiler_range("replay.value_maps.backward.recompute"), off:
            with torch.enable_grad():
                probes, span_keys, mask, bias = replay._map_inputs(g, layer, q, k)
            with torch.no_grad():
                x, attn = replay._map_designs(g, layer, probes.detach(), span_keys.detach(), mask, bias)
        with profiler_range("replay.value_maps.backward.solve"), torch.no_grad(), off:
            cdt = x.dtype
            kept = g.kept[layer]  # [E·H, t]
            d_r = a_inv @ dm.to(a_inv.dtype)  # A⁻¹ dM (A symmetric), float64 [E·H, t, w]
            d_a = -(d_r @ m.to(d_r.dtype).mT)
            d_lam = torch.diagonal(d_a, dim1=-2, dim2=-1).sum(-1)  # λ in A ...
            d_lam += torch.gather(d_r, 2, kept[:, :, None]).sum((-2, -1))  # ... and in R, at the kept columns
            d_g = (d_a + d_a.mT).to(cdt)
            d_r = d_r.to(cdt)
        with profiler_range("replay.value_maps.backward.softmax"), torch.no_grad(), off, _tf32(ctx.tf32):
            p_dr = torch.bmm(attn, d_r.mT)  # P·dRᵀ [E·H, n, t]
            d_x = torch.baddbmm(p_dr, x, d_g)  # from R = XᵀP and A's XᵀX
            d_x.add_(x * (2 * kappa * d_lam).to(cdt)[:, None, None])  # from λ's trace
            if mask is not None:
                d_x.mul_(mask[:, :, None].to(cdt))
            # through the kept keys' softmax X (the padding rows' d_x is zero, so their zero X serves)
            d_kept = x * (d_x - (d_x * x).sum(-1, keepdim=True))
            # through P's softmax, P ⊙ (dP − Σ_w dP ⊙ P) with dP = X·dR: the row sums are Σ_j X ⊙ P·dRᵀ
            # ([n, t], not [n, w]), and one product with −row sum as an extra column of X subtracts them
            # (padded to a multiple of 4 columns: aligned rows keep the product on the tensor cores)
            row = (x * p_dr).sum(-1, keepdim=True)
            pad = (-(x.shape[-1] + 1)) % 4
            # d(logits · scale)
            lhs = torch.cat([x, -row, x.new_zeros(*row.shape[:-1], pad)], -1).mul_(replay.scale)
            ones = d_r.new_ones(d_r.shape[0], 1, d_r.shape[-1])
            rhs = torch.cat([d_r, ones, d_r.new_zeros(d_r.shape[0], pad, d_r.shape[-1])], -2)
            d_logits = torch.bmm(lhs, rhs).mul_(attn)
            d_kept.mul_(replay.scale)
            d_logits.scatter_add_(2, kept[:, None, :].expand(-1, d_logits.shape[1], -1), d_kept)
        with profiler_range("replay.value_maps.backward.keys"), off, _tf32(ctx.tf32):
            with torch.no_grad():
                d_probes = torch.bmm(d_logits, span_keys.detach().to(cdt)).to(probes.dtype)
                d_span = torch.bmm(d_logits.mT, probes.detach().to(cdt)).to(span_keys.dtype)
            outputs, grads = [span_keys], [d_span]
            if probes.requires_grad:
                outputs.append(probes)
                grads.append(d_probes)
            wanted = [t for t in (q, k) if t.requires_grad]
            found = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True))
        return None, None, None, None, *(next(found) if n else None for n in needs)


@contextmanager
def _tf32(on: bool) -> Iterator[None]:
    """Let float32 matrix products use TF32 while ``on`` (on a CUDA machine)."""
    if not on or not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def _exact_tf32(dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Let float32 matrix products of half-precision values use TF32: a bf16/fp16 value is exact in
    TF32's 10-bit mantissa, so the products are the float32 ones (accumulation stays float32)."""
    return _tf32(dtype in (torch.bfloat16, torch.float16))


class _Product(torch.autograd.Function):
    """``c + a · b`` (batched; ``c`` optional) in float32 whose backward products use TF32."""

    @staticmethod
    def forward(ctx: Any, c: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        ctx.has_c = c is not None
        return torch.bmm(a, b) if c is None else torch.baddbmm(c, a, b)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b = ctx.saved_tensors
        need_c, need_a, need_b = ctx.needs_input_grad
        with _tf32(True):
            ga = torch.bmm(grad, b.mT) if need_a else None
            gb = torch.bmm(a.mT, grad) if need_b else None
        return grad if ctx.has_c and need_c else None, ga, gb


def _product(tf32: bool, c: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``c + a · b`` (batched; ``c`` optional); with ``tf32`` its backward's products in TF32."""
    if tf32:
        return _Product.apply(c, a, b)
    if c is None:
        return torch.bmm(a, b)
    if torch.is_grad_enabled():
        return torch.baddbmm(c, a, b)
    return c.baddbmm_(a, b)  # without autograd c is the chain's own product, read only here: no copy of it


def _by_level(x: torch.Tensor, g: _Group, heads: int) -> dict[int, torch.Tensor]:
    """``x`` ``[E·H, ...]`` (a group's events, level by level) split into each level's events."""
    levels = sorted(g.slices)
    sizes = [(g.slices[lv][1] - g.slices[lv][0]) * heads for lv in levels]
    return dict(zip(levels, x.split(sizes) if len(levels) > 1 else [x]))


def _masked(m: torch.Tensor, columns: torch.Tensor, events: int) -> torch.Tensor:
    """``M`` ``[E·H, t, w]`` with the columns ``[E, 1, 1, w]`` (raw or fitted ones) kept, the others 0."""
    shape = m.shape
    return (m.reshape(events, -1, *shape[1:]) * columns).reshape(shape)


def _gather_blocks(x: torch.Tensor, idx: torch.Tensor, blocks: int,
                   dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """``x[h, idx[h, b·w + j]]`` laid out block-major, ``[blocks, H, w, d]`` (contiguous: attention's
    ``[P, H, W, d]``, and a view away from the plan's event-major ``[E·H, w, d]`` batch), for ``x``
    ``[H, R, d]`` and ``idx`` ``[H|1, blocks·w]``; with ``dtype``, cast in the gather.

    Row gathers (:func:`~compaction_gym.engine.fast.gather.gather_rows`), not ``gather``: one index
    per row instead of one per element, at memory bandwidth on a GPU, and embedding's backward,
    which sums each source row's gradients after sorting the indices (measured 1.2–1.8× faster on
    an H200 than ``index_select``'s ``index_add``, docs/grpo.md). The indices are put in
    block-major order first, so no transpose of the gathered rows is copied."""
    H, R = x.shape[0], x.shape[1]
    flat = idx + torch.arange(0, H * R, R, device=idx.device)[:, None]
    flat = flat.reshape(H, blocks, -1).transpose(0, 1).reshape(-1)
    return gather_rows(x.reshape(H * R, -1), flat, dtype).reshape(blocks, H, -1, x.shape[-1])


def _inverse(idx: torch.Tensor, real: torch.Tensor, rows: int) -> torch.Tensor:
    """For each of ``rows`` source rows, the entry of ``idx`` that reads it among the ``real`` ones
    (at most one, by construction), or ``len(idx)``: none. Built on the device without a
    synchronisation (no boolean indexing: the other entries write to a spare slot)."""
    n = idx.numel()
    out = torch.full((rows + 1,), n, dtype=torch.long, device=idx.device)
    at = torch.where(real, idx, rows)
    out.scatter_(0, at, torch.where(real, torch.arange(n, device=idx.device), n))
    return out[:rows]


class _ReadOnce(torch.autograd.Function):
    """``src[idx]`` (rows) where every source row is read by at most one entry whose gradient can be
    nonzero (the others are padding whose outputs nothing reads): the backward is one row gather
    through the inverse map instead of an embedding backward's sort and segment sums."""

    @staticmethod
    def forward(ctx: Any, src: torch.Tensor, idx: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return gather_rows(src, idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (inverse,) = ctx.saved_tensors
        grad = torch.cat([grad, grad.new_zeros(1, grad.shape[-1])])  # row len(idx): no reader
        return gather_rows(grad, inverse), None, None


def _head_rows(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of the layer's query rows ``[B·N·H_q, d]`` (token-major, query head fastest) for token
    rows ``rows`` ``[P, n]``, every query head's: ``[P·H_q·n]``, piece-major then head."""
    h = torch.arange(heads, device=rows.device)
    return (rows[:, None, :] * heads + h[None, :, None]).reshape(-1)


def _dense_rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """``x`` ``[P, H, Q, D]`` as rows ``[P·H·Q, D]`` in memory order — a view where ``x`` is a
    permutation of a contiguous tensor, as attention kernels return it — and the row strides
    ``(rows, piece, head, query)`` that find a row."""
    D = x.shape[-1]
    order = sorted(range(3), key=lambda i: -x.stride(i))
    if x.stride(-1) != 1 or not x.permute(*order, 3).is_contiguous():
        x, order = x.contiguous(), [0, 1, 2]
    rows = x.permute(*order, 3).reshape(-1, D)
    return rows, (rows.shape[0], x.stride(0) // D, x.stride(1) // D, x.stride(2) // D)


def _gather_events(x: torch.Tensor, idx: torch.Tensor, events: int,
                   dtype: torch.dtype | None = None) -> torch.Tensor:  # fmt: skip
    """:func:`_gather_blocks` as the plan's event-major batch ``[E·H, w, d]``."""
    return _gather_blocks(x, idx, events, dtype).flatten(0, 1)


def score_hidden(
    lm_head: torch.nn.Module,
    hidden: torch.Tensor,
    plan: Plan,
    *,
    softcap: float | None,
    compute_entropy: bool,
    return_logits: bool,
    chunk: int = 1024,
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Log-probs (and entropies, logits) of every row's targets from the final hidden states.

    Launches its work without waiting for the device: the positions and tokens travel in one
    asynchronous copy (a tensor made from a list on the device would wait for the forward before
    it), so the host is free once the scoring is queued (docs/grpo.md, "Building the next chunk's
    plan during this one")."""
    logps: list[torch.Tensor] = []
    ents: list[torch.Tensor] | None = [] if compute_entropy else None
    logits_out: list[torch.Tensor] | None = [] if return_logits else None
    index = iter(_score_index(plan, chunk, hidden.device))
    for b, row in enumerate(plan.rows):
        lp_parts, ent_parts, lg_parts = [], [], []
        for _ in range(0, len(row.targets), chunk):
            pos, tok = next(index), next(index)
            logits = lm_head(hidden[b, pos - 1])
            if softcap:
                logits = torch.tanh(logits / softcap) * softcap
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / row.temperature
            logp = torch.log_softmax(logits, dim=-1)
            lp_parts.append(logp.gather(-1, tok[:, None])[:, 0])
            if compute_entropy:
                ent_parts.append(-(logp.exp() * logp).sum(-1))
            if return_logits:
                lg_parts.append(logits)
        idx = next(index)
        logps.append(_aligned(lp_parts, idx, len(row.tokens), hidden))
        if ents is not None:
            ents.append(_aligned(ent_parts, idx, len(row.tokens), hidden))
        if logits_out is not None:
            width = lm_head.weight.shape[0]
            logits_out.append(
                torch.cat(lg_parts) if lg_parts else hidden.new_zeros(0, width, dtype=torch.float32)
            )
    return logps, ents, logits_out


def _score_index(plan: Plan, chunk: int, device: torch.device) -> list[torch.Tensor]:
    """On ``device``, in one asynchronous copy: per row, each chunk's target positions and target
    tokens, then all its target positions."""
    host = []
    for row in plan.rows:
        targets = np.asarray(row.targets, np.int64)
        tokens = np.asarray(row.tokens, np.int64)
        for s in range(0, targets.shape[0], chunk):
            host += [targets[s : s + chunk], tokens[targets[s : s + chunk]]]
        host.append(targets)
    return upload(host, device)


def _aligned(parts: Sequence[torch.Tensor], idx: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    """Scores at the target positions ``idx`` in a zero vector of the trajectory's length (float32 at least)."""
    if not parts:
        return torch.zeros(n, device=like.device, dtype=torch.promote_types(like.dtype, torch.float32))
    flat = torch.cat(parts)
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
    return flat.new_zeros(n).index_put((idx,), flat)


def fused_scores(
    out: Any, plan: Plan, compute_entropy: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Log-probs (entropies) from TRL's fused LM head output (``log_probs`` ``[B, N]``, shifted labels)."""
    logps, ents = [], [] if compute_entropy else None
    host = [np.asarray(row.targets, np.int64) for row in plan.rows]
    for b, (row, idx) in enumerate(zip(plan.rows, upload(host, out.log_probs.device))):
        cols = idx - 1
        logps.append(_aligned([out.log_probs[b, cols]] if row.targets else [], idx, len(row.tokens),
                              out.log_probs))  # fmt: skip
        if ents is not None:
            ents.append(_aligned([out.entropy[b, cols]] if row.targets else [], idx, len(row.tokens),
                                 out.log_probs))  # fmt: skip
    return logps, ents


def shifted_labels(plan: Plan) -> torch.Tensor:
    """TRL's ``shift_labels`` ``[B, N]``: the target token at column ``p − 1``, −100 elsewhere."""
    out = torch.full((len(plan.rows), plan.width), -100, dtype=torch.long)
    for b, row in enumerate(plan.rows):
        for p in row.targets:
            out[b, p - 1] = row.tokens[p]
    return out


def padded_inputs(plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``position_ids`` ``[B, N]``: tokens ``[0, end)`` at their logical positions."""
    ids = torch.zeros(len(plan.rows), plan.width, dtype=torch.long)
    for b, row in enumerate(plan.rows):
        ids[b, : row.end] = torch.tensor(row.tokens[: row.end], dtype=torch.long)
    pos = torch.arange(plan.width).expand(len(plan.rows), -1).contiguous()
    return ids, pos


__all__ = ["OnePassReplay", "fused_scores", "padded_inputs", "score_hidden", "shifted_labels"]
