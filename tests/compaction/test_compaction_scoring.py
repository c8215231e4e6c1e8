"""select_keys and the selection baselines against brute-force float64 references."""

from __future__ import annotations

import pytest
import torch
from compaction_reference import brute_top, importance, logits, make_cache

from compaction_gym.compaction import compact, gqa_probes, select_keys

# (seed, B, T, d, n, span, target): spans at the start, middle and end; target 1 and full span;
# n = 12 and 24 are GQA-style counts (G query heads × positions).
CASES = [
    (0, 3, 40, 16, 12, (0, 16), 1),
    (1, 4, 48, 8, 24, (10, 34), 7),
    (2, 2, 33, 32, 5, (20, 33), 13),
    (3, 6, 64, 16, 12, (16, 48), 32),
    (4, 1, 20, 4, 3, (0, 20), 10),
]


@pytest.mark.parametrize(("seed", "batch", "length", "d", "n", "span", "target"), CASES)
def test_select_keys_matches_brute_force(seed, batch, length, d, n, span, target):
    keys, _, queries = make_cache(seed, batch, length, d, n)
    got = select_keys(keys, queries, span, target)
    want = brute_top(importance(keys, queries, span), target, span[0])
    assert got.dtype == torch.long
    assert torch.equal(got, want)


def test_select_keys_uses_key_bias_and_scale():
    keys, _, queries = make_cache(7, 4, 40, 16, 12)
    bias = torch.randn(4, 40, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    span = (8, 32)
    got = select_keys(keys, queries, span, 6, scale=0.7, key_bias=bias)
    want = brute_top(importance(keys, queries, span, scale=0.7, key_bias=bias), 6, span[0])
    assert torch.equal(got, want)
    # a large bias on one key makes it the first choice everywhere
    bias = torch.zeros(4, 40, dtype=torch.float64)
    bias[:, 20] = 50.0
    assert (select_keys(keys, queries, span, 1, key_bias=bias) == 20).all()


def test_select_keys_float32_picks_reference_importance():
    keys, _, queries = make_cache(11, 4, 64, 32, 24, dtype=torch.float32)
    span, target = (8, 56), 12
    got = select_keys(keys, queries, span, target)
    imp = importance(keys, queries, span)
    chosen = torch.gather(imp, 1, got - span[0])
    kth = imp.topk(target, dim=-1).values[:, -1:]
    assert (chosen >= kth * (1 - 1e-5)).all()
    assert (got[:, 1:] > got[:, :-1]).all()


def test_select_keys_with_gqa_probes_scores_each_kv_head_with_its_group():
    layers, h_q, h_kv, pos, d = 2, 6, 2, 4, 16
    g = torch.Generator().manual_seed(5)
    q = torch.randn(layers, h_q, pos, d, generator=g, dtype=torch.float64)
    keys = torch.randn(layers * h_kv, 30, d, generator=g, dtype=torch.float64)
    probes = gqa_probes(q, h_kv)
    got = select_keys(keys, probes, (5, 25), 4)
    for layer in range(layers):
        for kv in range(h_kv):
            group = torch.cat([q[layer, h] for h in range(h_q) if h // (h_q // h_kv) == kv])
            row = layer * h_kv + kv
            want = brute_top(importance(keys[row : row + 1], group[None], (5, 25)), 4, 5)
            assert torch.equal(got[row : row + 1], want)


def _softmax_rows(s):
    return torch.softmax(s, dim=-1)


@pytest.mark.parametrize(("span", "target"), [((0, 24), 1), ((10, 30), 6), ((20, 40), 20)])
def test_h2o_keeps_heaviest_accumulated_attention(span, target):
    keys, values, queries = make_cache(3, 3, 40, 8, 12)
    res = compact(keys, values, queries, span, target, mode="h2o")
    mass = _softmax_rows(logits(keys, queries))[:, :, span[0] : span[1]].sum(1)
    assert torch.equal(res.indices, brute_top(mass, target, span[0]))
    assert res.beta is None


@pytest.mark.parametrize(("span", "target"), [((0, 24), 1), ((10, 30), 6), ((20, 40), 20), ((28, 35), 2)])
def test_snapkv_pools_votes_over_neighbours(span, target):
    keys, values, queries = make_cache(4, 3, 40, 8, 12)
    votes = _softmax_rows(logits(keys, queries))[:, :, span[0] : span[1]].sum(1)
    length = span[1] - span[0]
    radius = 2  # SnapKV's 5-wide window; zero padding at the span's edges counts (kvpress)
    pooled = torch.zeros_like(votes)
    for j in range(length):
        lo, hi = max(0, j - radius), min(length, j + radius + 1)
        pooled[:, j] = votes[:, lo:hi].sum(-1) / (2 * radius + 1)
    res = compact(keys, values, queries, span, target, mode="snapkv")
    assert torch.equal(res.indices, brute_top(pooled, target, span[0]))


@pytest.mark.parametrize(
    ("span", "target", "want"),
    [
        ((10, 30), 1, [10]),  # kvpress: sinks first (min(4, t) of them), then the most recent rows
        ((10, 30), 3, [10, 11, 12]),
        ((10, 30), 5, [10, 11, 12, 13, 29]),
        ((10, 30), 12, [10, 11, 12, 13, *range(22, 30)]),
        ((0, 6), 6, list(range(6))),
    ],
)
def test_streaming_keeps_sinks_and_recent(span, target, want):
    keys, values, _ = make_cache(0, 2, 30, 4, 1)
    res = compact(keys, values, None, span, target, mode="streaming")
    assert res.indices.tolist() == [want, want]


def test_random_is_seeded_uniform_subset():
    keys, values, _ = make_cache(0, 5, 50, 4, 1)
    a = compact(keys, values, None, (10, 40), 8, mode="random", seed=3)
    b = compact(keys, values, None, (10, 40), 8, mode="random", seed=3)
    c = compact(keys, values, None, (10, 40), 8, mode="random", seed=4)
    assert torch.equal(a.indices, b.indices) and not torch.equal(a.indices, c.indices)
    assert ((a.indices >= 10) & (a.indices < 40)).all()
    assert (a.indices[:, 1:] > a.indices[:, :-1]).all()
    # rows draw independently, and every position is reachable
    assert len({tuple(r) for r in a.indices.tolist()}) > 1
    hits = torch.zeros(30)
    for seed in range(60):
        idx = compact(keys, values, None, (10, 40), 8, mode="random", seed=seed).indices
        hits += torch.bincount((idx - 10).flatten(), minlength=30)
    assert (hits > 0).all()
