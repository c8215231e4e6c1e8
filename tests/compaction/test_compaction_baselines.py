"""The selection baselines against brute-force float64 re-implementations of their papers' / kvpress 0.5.5's
formulas, written with loops over query heads, probes and keys, on GQA-shaped random caches.

Layout as in the engine: ``queries [L, H_q, n, d]`` of the last ``n`` cache rows (the observation
window), grouped per KV head by ``gqa_probes``; ``keys [L * H_kv, T, d]``.
"""

from __future__ import annotations

import math

import pytest
import torch
from compaction_reference import F64, brute_top, gather_rows
from hypothesis import given, settings
from hypothesis import strategies as st

from compaction_gym.compaction import compact, gqa_probes
from compaction_gym.compaction.baselines import h2o_indices, snapkv_indices

L, H_Q, H_KV, D = 2, 6, 2, 8
G = H_Q // H_KV


def _case(seed: int, length: int, n: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, H_Q, n, D, generator=g, dtype=F64) * 1.5
    keys = torch.randn(L * H_KV, length, D, generator=g, dtype=F64) * (
        1 + torch.rand(L * H_KV, length, 1, generator=g, dtype=F64)
    )
    values = torch.randn(L * H_KV, length, D, generator=g, dtype=F64)
    window = list(range(length - n, length))  # the probes are the queries of the last n rows
    return q, keys, values, window


def _causal_softmax(q_vec, keys_row, pos):
    """Attention of one query at cache row ``pos`` over keys ``0 … pos`` (a list of floats, 0 after pos)."""
    logits = [
        float(q_vec @ keys_row[j]) / math.sqrt(D) if j <= pos else -math.inf for j in range(len(keys_row))
    ]
    m = max(logits)
    e = [math.exp(x - m) if x > -math.inf else 0.0 for x in logits]
    z = sum(e)
    return [x / z for x in e]


def _full_softmax(q_vec, keys_row):
    return _causal_softmax(q_vec, keys_row, len(keys_row))


def _observed_attention(q, keys, window, span, causal, average=True):
    """kvpress ObservedAttentionPress: attention summed over the probes that see each key, divided by
    their number, then averaged over the query heads of the KV group (``average=False``: the H2O
    paper's plain accumulated attention, not divided)."""
    out = torch.zeros(L * H_KV, span[1] - span[0], dtype=F64)
    for layer in range(L):
        for kv in range(H_KV):
            row = layer * H_KV + kv
            for h in range(kv * G, kv * G + G):
                total = [0.0] * keys.shape[1]
                count = [0] * keys.shape[1]
                for i, pos in enumerate(window):
                    a = (
                        _causal_softmax(q[layer, h, i], keys[row], pos)
                        if causal
                        else _full_softmax(q[layer, h, i], keys[row])
                    )
                    for j in range(keys.shape[1]):
                        total[j] += a[j]
                        count[j] += 1 if (not causal or j <= pos) else 0
                for j in range(*span):
                    if not average:
                        out[row, j - span[0]] += total[j] / G
                    else:
                        out[row, j - span[0]] += (total[j] / count[j] if count[j] else 0.0) / G
    return out


def _snapkv(q, keys, window, span, causal, kernel=5, include_pad=True):
    """kvpress SnapKVPress: mean window attention per head, avg_pool1d(kernel, padding=kernel//2,
    count_include_pad=True) over the span, then the mean over the KV group's query heads
    (``include_pad=False``: each pooled mean divides by the span keys inside the window only)."""
    width = span[1] - span[0]
    out = torch.zeros(L * H_KV, width, dtype=F64)
    for layer in range(L):
        for kv in range(H_KV):
            row = layer * H_KV + kv
            for h in range(kv * G, kv * G + G):
                votes = [0.0] * width
                for i, pos in enumerate(window):
                    a = (
                        _causal_softmax(q[layer, h, i], keys[row], pos)
                        if causal
                        else _full_softmax(q[layer, h, i], keys[row])
                    )
                    for j in range(width):
                        votes[j] += a[span[0] + j] / len(window)
                for j in range(width):
                    inside = [k for k in range(j - kernel // 2, j + kernel // 2 + 1) if 0 <= k < width]
                    pooled = sum(votes[k] for k in inside) / (kernel if include_pad else len(inside))
                    out[row, j] += pooled / G
    return out


def _tova(q, keys, window, span, causal, layer_wide):
    """TOVA / kvpress TOVAPress: the last query's attention averaged over heads (the KV group's, or
    all of the layer's with ``layer_wide``)."""
    width = span[1] - span[0]
    out = torch.zeros(L * H_KV, width, dtype=F64)
    for layer in range(L):
        per_kv = []
        for kv in range(H_KV):
            row = layer * H_KV + kv
            acc = [0.0] * width
            for h in range(kv * G, kv * G + G):
                a = (
                    _causal_softmax(q[layer, h, -1], keys[row], window[-1])
                    if causal
                    else _full_softmax(q[layer, h, -1], keys[row])
                )
                for j in range(width):
                    acc[j] += a[span[0] + j] / G
            per_kv.append(acc)
        for kv in range(H_KV):
            scores = [sum(p[j] for p in per_kv) / H_KV for j in range(width)] if layer_wide else per_kv[kv]
            out[layer * H_KV + kv] = torch.tensor(scores, dtype=F64)
    return out


def _run(mode, q, keys, values, window, span, target, causal, **kw):
    probes = gqa_probes(q, H_KV)
    positions = torch.tensor(window * G) if causal else None
    return compact(keys, values, probes, span, target, mode=mode, query_positions=positions, **kw).indices


# (seed, T, n, span, target): spans at the cache start and middle, small and large targets;
CASES = [
    (0, 40, 8, (0, 24), 6),
    (1, 48, 12, (10, 36), 9),
    (2, 36, 6, (4, 30), 1),
    (3, 40, 10, (5, 30), 25),
    # probes inside the span (the window overlaps it; the last: every prompt row is a query, as
    # kvpress scores a prompt): causal masks give keys different numbers of observers
    (4, 40, 16, (20, 40), 8),
    (5, 30, 30, (0, 30), 10),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seed", "length", "n", "span", "target"), CASES)
def test_h2o_is_kvpress_observed_attention(seed, length, n, span, target, causal):
    q, keys, values, window = _case(seed, length, n)
    want = brute_top(_observed_attention(q, keys, window, span, causal), target, span[0])
    assert torch.equal(_run("h2o", q, keys, values, window, span, target, causal), want)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seed", "length", "n", "span", "target"), CASES)
def test_snapkv_is_kvpress_snapkv(seed, length, n, span, target, causal):
    q, keys, values, window = _case(seed, length, n)
    want = brute_top(_snapkv(q, keys, window, span, causal), target, span[0])
    assert torch.equal(_run("snapkv", q, keys, values, window, span, target, causal), want)


def _logits(q, keys):
    """``σ q·k`` of the grouped probes ``[L·H_kv, G·n, T]`` (the scores' input, no bias)."""
    return torch.einsum("bnd,btd->bnt", gqa_probes(q, H_KV), keys) / math.sqrt(D)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seed", "length", "n", "span", "target"), CASES)
def test_h2o_accumulated_variant_is_the_h2o_papers_sum(seed, length, n, span, target, causal):
    """``h2o_indices(average=False)``: the H2O paper's accumulated attention (kvpress divides by the count)."""
    q, keys, _, window = _case(seed, length, n)
    positions = torch.tensor(window * G) if causal else None
    got = h2o_indices(_logits(q, keys), span, target, query_positions=positions, average=False)
    assert torch.equal(
        got, brute_top(_observed_attention(q, keys, window, span, causal, average=False), target, span[0])
    )


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seed", "length", "n", "span", "target"), CASES)
def test_snapkv_without_pad_variant(seed, length, n, span, target, causal):
    """``snapkv_indices(count_include_pad=False)``: edge keys' pooled means over the span keys only."""
    q, keys, _, window = _case(seed, length, n)
    positions = torch.tensor(window * G) if causal else None
    got = snapkv_indices(_logits(q, keys), span, target, query_positions=positions, count_include_pad=False)
    want = brute_top(_snapkv(q, keys, window, span, causal, include_pad=False), target, span[0])
    assert torch.equal(got, want)


@pytest.mark.parametrize("layer_wide", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("seed", "length", "n", "span", "target"), CASES)
def test_tova_keeps_the_last_querys_heaviest_keys(seed, length, n, span, target, causal, layer_wide):
    q, keys, values, window = _case(seed, length, n)
    want = brute_top(_tova(q, keys, window, span, causal, layer_wide), target, span[0])
    kw = {"n_kv_heads": H_KV} if layer_wide else {}
    if causal:
        got = _run("tova", q, keys, values, window, span, target, True, **kw)
    else:  # the last position's G queries, all at the last row (which sees every key)
        got = compact(keys, values, gqa_probes(q[:, :, -1:], H_KV), span, target, mode="tova",
                      query_positions=torch.full((G,), length - 1), **kw).indices  # fmt: skip
        # without positions the last probe row is the last query
        got_by_layout = compact(
            keys, values, gqa_probes(q[:, :, -1:], H_KV), span, target, mode="tova", **kw
        ).indices
        want_last_row = brute_top(_tova_last_row(q, keys, span, layer_wide), target, span[0])
        assert torch.equal(got_by_layout, want_last_row)
        want = brute_top(_tova(q, keys, window, span, False, layer_wide), target, span[0])
    assert torch.equal(got, want)
    if layer_wide:  # one kept set per layer
        assert torch.equal(got.view(L, H_KV, -1), got.view(L, H_KV, -1)[:, :1].expand(-1, H_KV, -1))


def _tova_last_row(q, keys, span, layer_wide):
    """Without positions: the last probe row of each KV head (its last query head's last query)."""
    width = span[1] - span[0]
    out = torch.zeros(L * H_KV, width, dtype=F64)
    for layer in range(L):
        rows = []
        for kv in range(H_KV):
            a = _full_softmax(q[layer, kv * G + G - 1, -1], keys[layer * H_KV + kv])
            rows.append([a[span[0] + j] for j in range(width)])
        for kv in range(H_KV):
            scores = [sum(r[j] for r in rows) / H_KV for j in range(width)] if layer_wide else rows[kv]
            out[layer * H_KV + kv] = torch.tensor(scores, dtype=F64)
    return out


@pytest.mark.parametrize(("seed", "length", "n", "span", "target"), CASES)
def test_knorm_keeps_the_lowest_key_norms(seed, length, n, span, target):
    _, keys, values, _ = _case(seed, length, n)
    rows = []
    for b in range(keys.shape[0]):
        norms = [math.sqrt(sum(float(x) ** 2 for x in keys[b, j])) for j in range(*span)]
        order = sorted(range(len(norms)), key=lambda j: norms[j])
        rows.append(sorted(j + span[0] for j in order[:target]))
    got = compact(keys, values, None, span, target, mode="knorm")
    assert got.indices.tolist() == rows
    assert got.beta is None and torch.equal(
        got.values, torch.stack([values[b, rows[b]] for b in range(len(rows))])
    )


@pytest.mark.parametrize(
    ("span", "target"), [((10, 30), 1), ((10, 30), 3), ((10, 30), 4), ((10, 30), 12), ((0, 6), 6)]
)
def test_streaming_is_kvpress_streaming_llm(span, target):
    """kvpress: scores 1 everywhere but 0 on the ``n_pruned`` rows right after the 4 sinks; top-t."""
    width = span[1] - span[0]
    n_pruned = width - target
    scores = [1.0] * width
    for j in range(4, min(width, 4 + n_pruned)):
        scores[j] = 0.0
    kept = [j + span[0] for j in range(width) if scores[j] == 1.0][:target]  # ties: the earliest (the sinks)
    keys = torch.randn(2, 30, 4, dtype=F64)
    assert compact(keys, keys, None, span, target, mode="streaming").indices.tolist() == [kept, kept]


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(["h2o", "snapkv", "tova", "knorm", "streaming"]),
    length=st.integers(2, 40),
    n=st.integers(1, 9),
    data=st.data(),
)
def test_baselines_contract(seed, mode, length, n, data):
    """Any shapes: ``t`` distinct ascending rows inside the span, original keys/values, deterministic,
    with or without probe positions (which may lie before, inside or past the cache)."""
    start = data.draw(st.integers(0, length - 1))
    end = data.draw(st.integers(start + 1, length))
    target = data.draw(st.integers(1, end - start))
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(4, length, D, generator=g)
    values = torch.randn(4, length, D, generator=g)
    queries = torch.randn(4, n, D, generator=g)
    positions = data.draw(st.none() | st.lists(st.integers(0, length + 3), min_size=n, max_size=n))
    positions = None if positions is None else torch.tensor(positions)
    res = compact(
        keys, values, queries, (start, end), target, mode=mode, query_positions=positions, n_kv_heads=2
    )
    again = compact(
        keys, values, queries, (start, end), target, mode=mode, query_positions=positions, n_kv_heads=2
    )
    assert res.indices.shape == (4, target) and torch.equal(res.indices, again.indices)
    assert bool(((res.indices >= start) & (res.indices < end)).all())
    assert bool((res.indices.diff(dim=-1) > 0).all())
    assert torch.equal(res.keys, gather_rows(keys, res.indices)) and torch.equal(
        res.values, gather_rows(values, res.indices)
    )
