"""Stacked events (engine/event_batch.py): one ``apply_event`` call over several events' rows gives
each event the block it gets alone (the reference ``compact`` per event, float64), whatever the
span starts, cache lengths, probe counts and β; and the host copy of indices + β is bit-exact."""

from __future__ import annotations

from types import SimpleNamespace

import hypothesis.strategies as st
import pytest
import torch
from engine_helpers import stacked_blocks
from hypothesis import given, settings

from compaction_gym.compaction import compact
from compaction_gym.engine.event_batch import (
    MAX_STACKED_ELEMENTS,
    MAX_STACKED_ROWS,
    PendingEvent,
    batch_key,
    group_events,
    stack_rows,
)

ROWS, D = 6, 16  # layers × KV heads, head dim


def pending(
    seed: int,
    start: int,
    kv_len: int,
    span_len: int,
    n: int,
    with_bias: bool,
    dtype=torch.float64,
    refit=True,
):
    """A random event: rows ``[ROWS, kv_len, D]``, span ``(start, start + span_len)``, ``n`` probes."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(ROWS, kv_len, D, generator=g, dtype=dtype) * 2
    values = torch.randn(ROWS, kv_len, D, generator=g, dtype=dtype)
    queries = torch.randn(ROWS, n, D, generator=g, dtype=dtype) * 2
    bias = (torch.randn(ROWS, kv_len, generator=g) * 0.5).float() if with_bias else None
    cfg = SimpleNamespace(mode="attention_matching", compute_beta=True, ridge=1e-4, refit_values=refit)
    session = SimpleNamespace(config=cfg)
    return PendingEvent(
        session=session, span=(start, start + span_len), trigger="kv_budget", target=max(1, span_len // 4),
        index=0, logical_span=(start, start + span_len), kv_len_before=kv_len, keys=keys, values=values,
        key_bias=bias, queries=queries, query_positions=None,
    )  # fmt: skip


def alone(p: PendingEvent, compute_beta: bool, refit_values: bool):
    return compact(
        p.keys, p.values, p.queries, p.span, p.target, compute_beta=compute_beta, key_bias=p.key_bias,
        refit_values=refit_values,
    )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    layout=st.lists(
        st.tuples(st.integers(0, 20), st.integers(0, 30), st.booleans(), st.sampled_from([3, 12, 40])),
        min_size=2,
        max_size=4,
    ),  # per event: span start, rows after the span, whether the slot holds β, probes
    span_len=st.sampled_from([8, 24]),
    compute_beta=st.booleans(),
    refit_values=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_stacked_events_match_each_alone(layout, span_len, compute_beta, refit_values, seed):
    """Indices equal, β and C2 to 1e-9 (float64): the padding rows (bias −inf) and padding probes
    (masked) weigh exactly nothing; the probe guard (fewer than 2 probes per kept key: no β) holds
    per event. Kept values (``refit_values=False``) stack equal probe counts only."""
    if not refit_values:
        layout = [(start, tail, bias, layout[0][3]) for start, tail, bias, _ in layout]
    events = [
        pending(seed + i, start, start + span_len + tail, span_len, n, with_bias, refit=refit_values)
        for i, (start, tail, with_bias, n) in enumerate(layout)
    ]
    for p, got in zip(events, stacked_blocks(events, compute_beta=compute_beta, refit_values=refit_values)):
        ref = alone(p, compute_beta, refit_values)
        assert torch.equal(got.indices, ref.indices)
        assert torch.allclose(got.keys, ref.keys, rtol=0, atol=0)
        assert torch.allclose(got.values, ref.values, rtol=1e-9, atol=1e-9)
        if ref.beta is None:  # no β fitted, none stored: the stacked block carries the zero padding bias
            assert got.beta is not None and not got.beta.any()
        else:
            assert torch.allclose(got.beta.double(), ref.beta.double(), rtol=1e-9, atol=1e-9)


def test_stacking_places_every_span_at_one_row():
    events = [pending(0, 3, 40, 8, 5, False), pending(1, 10, 25, 8, 3, True)]
    rows = stack_rows(events)
    assert rows.span == (10, 18) and rows.shifts.tolist() == [7, 0]
    assert rows.keys.shape == (2 * ROWS, 48, D)  # the longest shifted session (47 rows), to 16 rows
    bias = rows.key_bias.view(2, ROWS, -1)
    assert torch.isinf(bias[0, :, :7]).all() and torch.isinf(bias[0, :, 47:]).all()
    assert not bias[0, :, 7:47].isinf().any()
    assert torch.isinf(bias[1, :, 25:]).all() and torch.equal(bias[1, :, :25], events[1].key_bias)
    assert torch.equal(rows.keys.view(2, ROWS, -1, D)[0, :, 7:47], events[0].keys)
    queries, mask = rows.queries.view(2, ROWS, 5, D), rows.query_mask.view(2, ROWS, 5)
    assert mask[0].all() and mask[1, :, :3].all() and not mask[1, :, 3:].any()
    assert torch.equal(queries[1, :, :3], events[1].queries) and not queries[1, :, 3:].any()
    assert stack_rows(events[:1] * 2).query_mask is None  # equal probe counts: no mask


def test_batch_key_separates_shapes_and_modes():
    a, b = pending(0, 3, 40, 8, 5, False), pending(1, 10, 25, 8, 5, True)
    assert batch_key(a) == batch_key(b)  # span starts, lengths and β differ: still one stacked call
    assert batch_key(pending(2, 3, 40, 16, 5, False)) != batch_key(a)  # span length
    assert batch_key(pending(2, 3, 40, 8, 6, False)) == batch_key(a)  # probe counts: padded
    kept = pending(2, 3, 40, 8, 5, False, refit=False)
    assert batch_key(pending(2, 3, 40, 8, 6, False, refit=False)) != batch_key(kept) != batch_key(a)
    c = pending(3, 3, 40, 8, 5, False)
    c.session = SimpleNamespace(config=SimpleNamespace(**{**vars(a.session.config), "mode": "h2o"}))
    assert batch_key(c) is None


def test_groups_split_at_the_row_and_size_limits():
    events = [pending(i, 0, 16, 8, 4, False) for i in range(5)]  # n = 4 probes, d = 16, t = 2
    assert group_events(events, 1) == [[0, 1, 2, 3, 4]]
    assert group_events(events, MAX_STACKED_ROWS // 2) == [[0, 1], [2, 3], [4]]
    many_probes = [pending(i, 0, 16, 8, 1000, False) for i in range(5)]  # n · (d + t) = 18,000 per row
    assert group_events(many_probes, MAX_STACKED_ELEMENTS // 18_000 // 3) == [[0, 1, 2], [3, 4]]
    assert group_events(events, MAX_STACKED_ROWS + 1) == [[0], [1], [2], [3], [4]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_cache_dtypes_agree_to_rounding(dtype):
    """The engine's cache dtypes: the stacked call differs from the lone one by rounding at most."""
    events = [pending(i, 4 * i, 40 + 3 * i, 16, 32, i % 2 == 1, dtype) for i in range(3)]
    for p, got in zip(events, stacked_blocks(events, compute_beta=True, refit_values=True)):
        ref = alone(p, True, True)
        assert torch.equal(got.indices, ref.indices)
        assert torch.allclose(got.beta, ref.beta, rtol=0, atol=1e-5)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        assert torch.allclose(got.values.float(), ref.values.float(), rtol=tol, atol=tol)
