"""The write-back of a round of stacked events (``SlotKVCache.replace_spans``) and the stacked rows
gathered from the cache (``stack_rows(events, cache)``): byte for byte what one ``replace_span`` per
slot, and the per-event copies of ``stack_rows(events)``, give (docs/engine.md, "Batched events")."""

from __future__ import annotations

from types import SimpleNamespace

import hypothesis.strategies as st
import torch
from hypothesis import example, given, settings

from compaction_gym.engine.event_batch import PendingEvent, stack_rows
from compaction_gym.engine.slot_cache import SlotKVCache

L, H, D, SLOTS, CAP = 2, 3, 8, 6, 48


def filled_cache(seed: int, lengths: list[int], beta_slots: set[int], dtype) -> SlotKVCache:
    """Random K/V everywhere (rows past a length are garbage), β random on ``beta_slots``' live rows."""
    g = torch.Generator().manual_seed(seed)
    cache = SlotKVCache(L, H, D, SLOTS, CAP, dtype, torch.device("cpu"))
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, dtype=torch.float64))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, dtype=torch.float64))
    for s, n in enumerate(lengths):
        if s in beta_slots and n:
            cache.beta[s, :, :, :n] = torch.randn(L, H, n, generator=g)
            cache.has_beta[s] = True
    cache.restore_lengths(lengths)
    return cache


def clone(cache: SlotKVCache) -> SlotKVCache:
    new = SlotKVCache(L, H, D, SLOTS, CAP, cache.k.dtype, torch.device("cpu"))
    for name in ("k", "v", "beta"):
        getattr(new, name).copy_(getattr(cache, name))
    new.restore_lengths(list(cache.lengths))
    new.has_beta = list(cache.has_beta)
    return new


def assert_same_cache(a: SlotKVCache, b: SlotKVCache) -> None:
    for name in ("k", "v", "beta"):  # every byte, garbage rows included
        assert torch.equal(getattr(a, name).view(torch.uint8), getattr(b, name).view(torch.uint8)), name
    assert a.lengths == b.lengths and a.has_beta == b.has_beta


slot_spec = st.tuples(st.integers(0, 20), st.integers(0, 16), st.integers(0, 12), st.booleans())


@settings(max_examples=60, deadline=None)
@example(specs=[(0, 8, 0, True), (5, 8, 3, False)], t=8, with_beta=True, known=True, dtype="float32", seed=0)
@example(
    specs=[(3, 4, 9, True), (0, 16, 0, False), (7, 12, 12, True)],
    t=0,
    with_beta=False,
    known=False,
    dtype="float64",
    seed=1,
)
@given(
    specs=st.lists(slot_spec, min_size=1, max_size=SLOTS),  # per slot: span start, span extra, rows after, β
    t=st.integers(0, 8),
    with_beta=st.booleans(),
    known=st.booleans(),
    dtype=st.sampled_from(["float32", "float64", "bfloat16"]),
    seed=st.integers(0, 10_000),
)
def test_replace_spans_equals_one_replace_span_per_slot(specs, t, with_beta, known, dtype, seed):
    """Property: over slots, span starts and lengths (blocks shorter, equal or — t = 0 — empty),
    suffix lengths, slots with and without β, β given / zero / with the nonzero flag known or not,
    and K/V dtypes: the cache after ``replace_spans`` equals it after ``replace_span`` slot by slot."""
    g = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(SLOTS, generator=g).tolist()[: len(specs)]  # slots in any order
    lengths = [0] * SLOTS
    spans = []
    for slot, (a, extra, after, _) in zip(order, specs):
        span = (a, a + t + extra)
        spans.append(span)
        lengths[slot] = min(CAP, span[1] + after)
    spans = [(min(a, lengths[s]), min(b, lengths[s])) for s, (a, b) in zip(order, spans)]
    spans = [(a, b) if b - a >= t else (max(0, b - t), b) for a, b in spans]
    assert all(b - a >= t for a, b in spans)
    torch_dtype = getattr(torch, dtype)
    cache = filled_cache(seed, lengths, {s for s, spec in zip(order, specs) if spec[3]}, torch_dtype)
    ref = clone(cache)
    n = len(order)
    keys = torch.randn(n, L * H, t, D, generator=g, dtype=torch.float64).to(torch_dtype)
    values = torch.randn(n, L * H, t, D, generator=g, dtype=torch.float64).to(torch_dtype)
    beta = None
    if with_beta:
        beta = torch.randn(n, L * H, t, generator=g)
        beta[0] = 0.0  # a zero block: has_beta stays as it was
    nonzero = [bool((b != 0).any()) for b in beta] if beta is not None and known else None
    got = cache.replace_spans(order, spans, keys, values, beta, nonzero=nonzero)
    want = [
        ref.replace_span(
            s, span, keys[i], values[i], None if beta is None else beta[i], nonzero=nonzero and nonzero[i]
        )
        for i, (s, span) in enumerate(zip(order, spans))
    ]
    assert got == want
    assert_same_cache(cache, ref)


def event_of(cache: SlotKVCache, slot: int, span: tuple[int, int], n: int, seed: int) -> PendingEvent:
    keys, values, beta = cache.rows(slot)
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(mode="attention_matching", compute_beta=True, ridge=1e-4, refit_values=True)
    return PendingEvent(
        session=SimpleNamespace(config=cfg), span=span, trigger="kv_budget", target=2, index=0,
        logical_span=span, kv_len_before=cache.length(slot), keys=keys, values=values,
        key_bias=beta if cache.has_beta[slot] else None,
        queries=torch.randn(L * H, n, D, generator=g, dtype=torch.float64).to(keys.dtype), query_positions=None,
        slot=slot,
    )  # fmt: skip


@settings(max_examples=40, deadline=None)
@example(specs=[(4, 10, 6, True, 12), (4, 30, 0, False, 12)], dtype="float32", seed=0)
@given(
    specs=st.lists(  # per event: span start, rows after the span, probes, β, probe count
        st.tuples(
            st.integers(0, 20),
            st.integers(0, 16),
            st.integers(0, 3),
            st.booleans(),
            st.sampled_from([3, 7, 12]),
        ),
        min_size=2,
        max_size=SLOTS,
    ),
    dtype=st.sampled_from(["float32", "float64", "bfloat16"]),
    seed=st.integers(0, 10_000),
)
def test_stack_rows_from_the_cache_equals_per_event_copies(specs, dtype, seed):
    """Property: the stacked keys, values, bias (−inf padding), probes, mask, span and shifts
    gathered from the slots in one indexed copy per buffer are those the per-event copies give."""
    span_len = 8
    order = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed)).tolist()[: len(specs)]
    lengths = [0] * SLOTS
    for slot, (a, after, *_) in zip(order, specs):
        lengths[slot] = a + span_len + after
    beta_slots = {s for s, spec in zip(order, specs) if spec[3]}
    cache = filled_cache(seed, lengths, beta_slots, getattr(torch, dtype))
    events = [
        event_of(cache, s, (a, a + span_len), n, seed + i)
        for i, (s, (a, _, _, _, n)) in enumerate(zip(order, specs))
    ]
    got, want = stack_rows(events, cache), stack_rows(events)
    for name in ("keys", "values", "key_bias", "queries", "query_mask", "shifts"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(
                a.view(torch.uint8) if a.is_floating_point() else a,
                b.view(torch.uint8) if b.is_floating_point() else b,
            ), name
    assert got.span == want.span
