"""The write-back of a round of stacked events (``SlotKVCache.replace_spans``) and the stacked rows
gathered from the cache (``stack_rows(events, cache)``): byte for byte what one ``replace_span`` per
slot, and the per-event copies of ``stack_rows(events)``, give (docs/engine.md, "Batched events")."""

from __future__ import annotations

from contextlib import ExitStack
from types import SimpleNamespace
from unittest.mock import patch

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import example, given, settings
from test_batched_events import BUDGET, GREEDY, rollout, workload

from compaction_gym.engine import CompactionConfig, event_batch
from compaction_gym.engine.event_batch import PendingEvent, stack_rows
from compaction_gym.engine.session import ProbeRing
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
@example(
    specs=[(0, 8, 0, True), (5, 8, 3, False)],
    t=8,
    with_beta=True,
    known=True,
    dtype="float32",
    strided=True,
    seed=0,
)
@example(
    specs=[(3, 4, 9, True), (0, 16, 0, False), (7, 12, 12, True)],
    t=0,
    with_beta=False,
    known=False,
    dtype="float64",
    strided=False,
    seed=1,
)
@given(
    specs=st.lists(slot_spec, min_size=1, max_size=SLOTS),  # per slot: span start, span extra, rows after, β
    t=st.integers(0, 8),
    with_beta=st.booleans(),
    known=st.booleans(),
    dtype=st.sampled_from(["float32", "float64", "bfloat16"]),
    strided=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_replace_spans_equals_one_replace_span_per_slot(specs, t, with_beta, known, dtype, strided, seed):
    """Property: over slots, span starts and lengths (blocks shorter, equal or — t = 0 — empty),
    suffix lengths, slots with and without β, β given / zero / with the nonzero flag known or not,
    K/V dtypes and strides: the cache after ``replace_spans`` equals it after ``replace_span`` slot by slot."""
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
    if strided:  # a block whose head dim is not contiguous (a solve's output can be)
        values = values.transpose(-1, -2).contiguous().transpose(-1, -2)
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


def event_of(
    cache: SlotKVCache, slot: int, span: tuple[int, int], n: int, ring: int, seed: int, refit: bool = True
) -> PendingEvent:
    """An event on ``slot`` with ``n`` probes per row: a tensor (``ring = 0``) or, as suffix probes,
    the views of a probe ring of 2 query heads per KV head (``n`` recorded positions, after
    ``3 · ring`` older ones, so that the selection wraps around the ring or not)."""
    keys, values, beta = cache.rows(slot)
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(mode="attention_matching", compute_beta=True, ridge=1e-4, refit_values=refit)
    p = PendingEvent(
        session=SimpleNamespace(config=cfg), span=span, trigger="kv_budget", target=2, index=0,
        logical_span=span, kv_len_before=cache.length(slot), keys=keys, values=values,
        key_bias=beta if cache.has_beta[slot] else None, queries=None, query_positions=None, slot=slot,
    )  # fmt: skip
    if not ring:
        p.queries = torch.randn(L * H, n, D, generator=g, dtype=torch.float64).to(keys.dtype)
        return p
    probes = ProbeRing(L, 2 * H, D, n + 2, keys.dtype, torch.device("cpu"))
    probes.push(torch.randn(L, 2 * H, 3 * ring % (n + 2) or 1, D, generator=g), 0)
    probes.push(torch.randn(L, 2 * H, n, D, generator=g), 100)
    p.query_parts, _ = probes.select_parts(100)
    return p


def grouped(p: PendingEvent) -> PendingEvent:
    """``p`` with its probes grouped (as the per-event round had them)."""
    p.probes()
    return p


@settings(max_examples=40, deadline=None)
@example(
    specs=[(4, 10, 0, True, 12), (4, 30, 2, False, 12)], dtype="float32", seed=0, refit=True, row_gathers=True
)
@example(
    specs=[(4, 10, 1, True, 7), (2, 30, 3, False, 12), (3, 0, 0, True, 3)],
    dtype="bfloat16",
    seed=1,
    refit=False,
    row_gathers=False,
)
@given(
    specs=st.lists(  # per event: span start, rows after the span, probes (tensor / ring), β, count
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
    refit=st.booleans(),
    row_gathers=st.booleans(),
)
def test_stack_rows_from_the_cache_equals_per_event_copies(specs, dtype, seed, refit, row_gathers):
    """Property: the stacked keys, values, bias (−inf padding), probes, mask, span and shifts
    gathered from the slots in one indexed copy per buffer (or, as on a GPU, by row gathers from
    flat indices, here with a reference gather), and the probes copied from the rings' views, are
    those the per-event copies of grouped probes give; and the stacked rows are each slot's own
    (values in the span alone when C2 is refitted, zero elsewhere)."""
    span_len = 8
    order = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(seed)).tolist()[: len(specs)]
    lengths = [0] * SLOTS
    for slot, (a, after, *_) in zip(order, specs):
        lengths[slot] = a + span_len + after
    beta_slots = {s for s, spec in zip(order, specs) if spec[3]}
    cache = filled_cache(seed, lengths, beta_slots, getattr(torch, dtype))

    def events():
        return [
            event_of(cache, s, (a, a + span_len), n, ring, seed + i, refit)
            for i, (s, (a, _, ring, _, n)) in enumerate(zip(order, specs))
        ]

    with ExitStack() as patches:
        if row_gathers:  # the GPU path's flat indices, gathered by x[idx] with a zero row for -1
            patches.enter_context(patch.object(event_batch, "_gathers_rows", lambda cache: True))
            patches.enter_context(patch.object(event_batch, "gather_rows", reference_gather))
        got = stack_rows(events(), cache)
    want = stack_rows([grouped(p) for p in events()])
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
    start = max(a for a, *_ in specs)
    for i, (s, (a, after, *_)) in enumerate(zip(order, specs)):
        shift, live = start - a, a + span_len + after
        k, v, b = (x.view(len(specs), L * H, *x.shape[1:])[i] for x in (got.keys, got.values, got.key_bias))
        assert torch.equal(k[:, shift : shift + live], cache.k[s].reshape(L * H, CAP, D)[:, :live])
        assert not k[:, :shift].any() and not k[:, shift + live :].any()
        assert torch.isinf(b[:, :shift]).all() and torch.isinf(b[:, shift + live :]).all()
        kept = (start, start + span_len) if refit else (shift, shift + live)
        src = cache.v[s].reshape(L * H, CAP, D)[:, kept[0] - shift : kept[1] - shift]
        assert torch.equal(v[:, kept[0] : kept[1]], src)
        assert not v[:, : kept[0]].any() and not v[:, kept[1] :].any()


def reference_gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``gather_rows``' result by indexing: row ``idx`` of ``x``, a zero row for ``-1``."""
    assert idx.dtype == torch.int64 and (idx >= -1).all() and (idx < x.shape[0]).all()
    return torch.where((idx >= 0)[..., None], x[idx.clamp(min=0)], torch.zeros((), dtype=x.dtype))  # +0.0


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(1, 12),
    pushes=st.lists(st.integers(1, 12), min_size=0, max_size=6),
    gap=st.integers(0, 3),
    min_position=st.integers(-2, 60),
)
def test_probe_ring_selects_what_the_gather_selects(capacity, pushes, gap, min_position):
    """Property: over ring capacities, push sizes (wrapping or not), gaps between pushes and
    thresholds, the ring's views (or its one copy of two ranges) equal the indexed gather, and so
    does its position range; ``None`` when nothing was recorded."""
    ring = ProbeRing(2, 3, 4, capacity, torch.float32, torch.device("cpu"))
    position = 0
    for i, m in enumerate(pushes):
        m = min(m, capacity)
        ring.push(torch.randn(2, 3, m, 4, generator=torch.Generator().manual_seed(i)), position)
        position += m + gap
    got, want = ring.select(min_position), ring._gather(min_position)
    assert (got is None) == (want is None) == (not pushes)
    if got is not None:
        assert got[1] == want[1] and torch.equal(got[0], want[0])


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from compaction_gym.engine import Engine

    return Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=4, capacity=512
    )


def per_event_round(monkeypatch, engine) -> None:
    """The round as it ran before the batched one: probes gathered by index and grouped, rows
    stacked by one copy per event and buffer, one ``replace_span`` per slot."""
    from compaction_gym.engine import compactor as compactor_module

    cache = engine.cache

    def replace_spans(slots, spans, keys, values, beta, *, nonzero=None):
        return [
            cache.replace_span(
                s, span, keys[i], values[i], None if beta is None else beta[i], nonzero=nonzero[i]
            )
            for i, (s, span) in enumerate(zip(slots, spans))
        ]

    def gathered(ring, min_position):
        picked = ring._gather(min_position)
        return None if picked is None else ((picked[0],), picked[1])

    monkeypatch.setattr(
        compactor_module, "stack_rows", lambda events, cache=None: stack_rows(list(map(grouped, events)))
    )
    monkeypatch.setattr(cache, "replace_spans", replace_spans)
    monkeypatch.setattr(ProbeRing, "select_parts", gathered)


def compare_rounds(engine, n, lens, seed, temperature, beta, probes, raw) -> list[int]:
    """Step ``n`` sessions together with the batched round and with the per-event round; assert
    equal tokens, log-probs, events and cache bytes; return the scoring calls' row counts."""
    cfg = CompactionConfig(
        mode="attention_matching", compute_beta=beta, queries=probes, kv_budget_from="raw" if raw else "prompt",
        **BUDGET,
    )  # fmt: skip
    prompts, inputs = workload(n, lens, seed)
    sampling = GREEDY.replace(temperature=temperature)
    batched = rollout(engine, [cfg] * n, prompts, inputs, sampling, stacked=True)
    with pytest.MonkeyPatch.context() as mp:
        per_event_round(mp, engine)
        reference = rollout(engine, [cfg] * n, prompts, inputs, sampling, stacked=True)
    assert batched[2] == reference[2]
    for va, vb, ca, cb in zip(batched[0], reference[0], batched[1], reference[1]):
        assert va.token_ids == vb.token_ids and va.logprobs == vb.logprobs
        assert len(va.events) == len(vb.events) >= 2
        for ea, eb in zip(va.events, vb.events):
            assert (ea.span, ea.logical_span, ea.kv_len_after, ea.probe_logical_range, ea.probe_rows) == (
                eb.span, eb.logical_span, eb.kv_len_after, eb.probe_logical_range, eb.probe_rows,
            )  # fmt: skip
            assert torch.equal(ea.indices, eb.indices)
            assert (ea.beta is None) == (eb.beta is None)
            if ea.beta is not None:
                assert torch.equal(ea.beta.view(torch.int32), eb.beta.view(torch.int32))
        for xa, xb in zip(ca, cb):  # K, V and β of every live row
            assert torch.equal(xa.view(torch.uint8), xb.view(torch.uint8))
    return batched[2]


@pytest.mark.parametrize("probes", ["suffix", "keys"])
def test_a_round_of_stacked_events_is_byte_identical_to_the_per_event_round(engine, probes):
    """Four sessions whose events fall due together (β on, temperature 1): stacked calls happen,
    and every session and cache ends byte for byte as with the per-event round."""
    calls = compare_rounds(engine, 4, [16, 16, 12, 16], 7, 1.0, True, probes, False)
    assert max(calls) == 4 * engine.layout.n_layers * engine.layout.n_kv_heads


@settings(max_examples=5, deadline=None)
@example(n=4, lens=[10, 18, 14, 7], seed=1, temperature=1.0, beta=True, probes="suffix", raw=False)
@example(n=3, lens=[16, 16, 16, 16], seed=2, temperature=2.0, beta=True, probes="keys", raw=True)
@given(
    n=st.integers(2, 4),
    lens=st.lists(st.integers(6, 24), min_size=4, max_size=4),
    seed=st.integers(0, 10_000),
    temperature=st.sampled_from([1.0, 2.0]),
    beta=st.booleans(),
    probes=st.sampled_from(["suffix", "keys", "random"]),
    raw=st.booleans(),
)
def test_a_round_leaves_sessions_and_caches_as_the_per_event_round(
    engine, n, lens, seed, temperature, beta, probes, raw
):
    """Property: sessions stepped together (several events each, sampled at temperature 1–2, β on
    and off, suffix / key / random probes, both KV-budget schedules) end with the same tokens,
    log-probs, events and cache bytes as with the per-event round."""
    compare_rounds(engine, n, lens, seed, temperature, beta, probes, raw)


@settings(max_examples=40, deadline=None)
@given(capacity=st.integers(1, 12), pushes=st.lists(st.integers(1, 12), min_size=1, max_size=6))
def test_probe_ring_push_by_slices_equals_the_indexed_write(capacity, pushes):
    """Property: pushing by one or two slices leaves the ring (queries, positions, count) as the
    indexed write ``(count + arange(m)) % capacity`` does, wrapping or not."""
    ring = ProbeRing(2, 3, 4, capacity, torch.float32, torch.device("cpu"))
    queries = torch.zeros(2, 3, capacity, 4)
    positions = torch.full((capacity,), -1, dtype=torch.long)
    count = position = 0
    for i, m in enumerate(pushes):
        m = min(m, capacity)
        q = torch.randn(2, 3, m, 4, generator=torch.Generator().manual_seed(i), dtype=torch.float64)
        ring.push(q, position)
        idx = (count + torch.arange(m)) % capacity
        queries[:, :, idx] = q.float()
        positions[idx] = torch.arange(position, position + m)
        count, position = count + m, position + m + i % 2
    assert (
        torch.equal(ring.queries, queries)
        and torch.equal(torch.from_numpy(ring.positions), positions)
        and ring.count == count
    )
