"""The one-pass plan's slot tables against a dense per-head cache.

A :class:`~compaction_gym.trainers.replay_plan.Snapshot` names its block rows by slot in an
append-only :class:`~compaction_gym.trainers.replay_plan.SlotTable`; here every cache state is also
kept the brute-force way — key token, value source and bias of every row at every (layer, head),
``[LH, T]`` — and both are driven through the same random appends and compactions (refits with
shared fitted values, selections keeping per-head values, β recorded or kept, all-zero β), with
the table starting too small so that it grows.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from compaction_gym.trainers.replay_plan import PER_HEAD, SlotTable, Snapshot


class _Dense:
    def __init__(self, lh: int) -> None:
        self.k = np.zeros((lh, 0), np.int64)
        self.v = np.zeros((lh, 0), np.int64)
        self.b = np.zeros((lh, 0), np.float32)


def _append(snap: Snapshot, dense: _Dense, first: int, n: int) -> Snapshot:
    raw = np.arange(first, first + n, dtype=np.int64)
    lh = dense.k.shape[0]
    dense.k = np.concatenate([dense.k, np.broadcast_to(raw, (lh, n))], 1)
    dense.v = np.concatenate([dense.v, np.broadcast_to(raw, (lh, n))], 1)
    dense.b = np.concatenate([dense.b, np.zeros((lh, n), np.float32)], 1)
    return Snapshot(
        np.concatenate([snap.kcol, raw]), np.concatenate([snap.vcol, raw]),
        np.concatenate([snap.slot, np.full(n, -1, np.int64)]), snap.table,
    )  # fmt: skip


def _compact(snap: Snapshot, dense: _Dense, rng: np.random.Generator, refit: bool, beta: str,
             fitted: list[int]) -> Snapshot:  # fmt: skip
    lh, length = dense.k.shape
    start = int(rng.integers(0, length - 1))
    end = int(rng.integers(start + 1, length + 1))
    t = int(rng.integers(1, end - start + 1))
    rows = np.sort(np.stack([rng.choice(np.arange(start, end), t, replace=False) for _ in range(lh)]), 1)
    kept_k, kept_v, old_b = snap.rows_at(rows, values=not refit, bias=beta == "kept")
    # the brute-force cache at the same rows
    want_k = np.take_along_axis(dense.k, rows, 1)
    want_b = np.take_along_axis(dense.b, rows, 1)
    np.testing.assert_array_equal(kept_k, want_k)
    if not refit:
        np.testing.assert_array_equal(kept_v, np.take_along_axis(dense.v, rows, 1))
    if beta == "kept":
        np.testing.assert_array_equal(np.zeros_like(want_b) if old_b is None else old_b, want_b)
    if refit:
        shared = -1 - np.arange(fitted[0], fitted[0] + t, dtype=np.int64)
        fitted[0] += t
        new_v, per_head = np.broadcast_to(shared, (lh, t)), None
    else:
        shared = np.where((kept_v == kept_v[:1]).all(0), kept_v[0], PER_HEAD)
        new_v = per_head = kept_v
    if beta == "recorded":
        new_b = rng.standard_normal((lh, t)).astype(np.float32)
    elif beta == "zero":
        new_b = np.zeros((lh, t), np.float32)
    else:
        new_b = want_b
    slot = snap.table.add(kept_k, shared, per_head, new_b if beta != "kept" else old_b)
    dense.k = np.concatenate([dense.k[:, :start], want_k, dense.k[:, end:]], 1)
    dense.v = np.concatenate([dense.v[:, :start], new_v, dense.v[:, end:]], 1)
    dense.b = np.concatenate([dense.b[:, :start], new_b, dense.b[:, end:]], 1)
    return Snapshot(
        np.concatenate([snap.kcol[:start], np.full(t, -1, np.int64), snap.kcol[end:]]),
        np.concatenate([snap.vcol[:start], shared, snap.vcol[end:]]),
        np.concatenate([snap.slot[:start], np.arange(slot, slot + t, dtype=np.int64), snap.slot[end:]]),
        snap.table,
    )


def _check(snap: Snapshot, dense: _Dense) -> None:
    lh, length = dense.k.shape
    rows = np.broadcast_to(np.arange(length), (lh, length))
    k, v, b = snap.rows_at(rows)
    np.testing.assert_array_equal(k, dense.k)
    np.testing.assert_array_equal(v, dense.v)
    np.testing.assert_array_equal(np.zeros_like(dense.b) if b is None else b, dense.b)
    assert snap.has_bias == bool((dense.b != 0).any())
    # a block row's value source is the snapshot's vcol wherever every head shares it
    shared = snap.vcol != PER_HEAD
    np.testing.assert_array_equal(np.broadcast_to(snap.vcol, dense.v.shape)[:, shared], dense.v[:, shared])


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    lh=st.sampled_from([1, 3, 6]),
    ops=st.lists(
        st.tuples(st.booleans(), st.sampled_from(["recorded", "zero", "kept"]), st.integers(1, 9)),
        min_size=1, max_size=8,
    ),
)  # fmt: skip
def test_slot_snapshots_equal_a_dense_per_head_cache(seed: int, lh: int, ops: list) -> None:
    rng = np.random.default_rng(seed)
    table = SlotTable(lh, 2)  # too small: grows
    empty = np.zeros(0, np.int64)
    snap, dense, fed, fitted = Snapshot(empty, empty, empty, table), _Dense(lh), 0, [0]
    history = []
    for refit, beta, n in ops:
        snap = _append(snap, dense, fed, n)
        fed += n
        history.append((snap, [a.copy() for a in (dense.k, dense.v, dense.b)]))
        if snap.length >= 2:
            snap = _compact(snap, dense, rng, refit, beta, fitted)
            history.append((snap, [a.copy() for a in (dense.k, dense.v, dense.b)]))
        _check(snap, dense)
    table.trim()
    for old, arrays in history:  # earlier states still read right after later events and the trim
        past = _Dense(lh)
        past.k, past.v, past.b = arrays
        _check(old, past)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 40), real=st.integers(0, 40), padding=st.integers(0, 20))
def test_read_once_gather_backward_equals_the_embedding_backward(seed: int, rows: int, real: int,
                                                                  padding: int) -> None:  # fmt: skip
    """The one-pass replay's query and output gathers: each source row read by at most one real entry,
    padding entries reading any row with a zero upstream gradient (their outputs are never used)."""
    import torch

    from compaction_gym.trainers.replay_onepass import _inverse, _ReadOnce

    g = torch.Generator().manual_seed(seed)
    real = min(real, rows)
    idx = torch.cat([torch.randperm(rows, generator=g)[:real], torch.randint(0, rows, (padding,), generator=g)])
    order = torch.randperm(idx.numel(), generator=g)
    idx, is_real = idx[order], (torch.arange(idx.numel()) < real)[order]
    src = torch.randn(rows, 5, dtype=torch.float64, generator=g, requires_grad=True)
    upstream = torch.randn(idx.numel(), 5, dtype=torch.float64, generator=g) * is_real[:, None]
    out = _ReadOnce.apply(src, idx, _inverse(idx, is_real, rows))
    (grad,) = torch.autograd.grad(out, src, upstream)
    want_out = torch.nn.functional.embedding(idx, src)
    (want,) = torch.autograd.grad(want_out, src, upstream)
    assert torch.equal(out, want_out)
    assert torch.equal(grad, want)
