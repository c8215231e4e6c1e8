"""compact(): every mode, forced-index replay, β, key_bias and dtypes, against float64 references."""

from __future__ import annotations

import pytest
import torch
from compaction_reference import F64, attend, gather_rows, make_cache, rel, splice

from compaction_gym.compaction import (
    COMPACTION_MODES,
    CompactionResult,
    compact,
    fit_beta,
    fit_values,
    gqa_probes,
    select_keys,
)

SELECTION = ("h2o", "snapkv", "streaming", "random", "tova", "knorm")
SPANS = [(0, 16), (12, 36), (24, 48)]  # start, middle, end of a 48-row cache


def test_modes_exported():
    assert set(COMPACTION_MODES) == {"attention_matching", "markovian", *SELECTION}


@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("target", [0, 1, 5])
def test_markovian_removes_exactly_the_span(span, target):
    keys, values, queries = make_cache(0, 3, 48, 8, 6, dtype=torch.float32)
    res = compact(keys, values, queries, span, target, mode="markovian")
    assert res.keys.shape == (3, 0, 8) and res.values.shape == (3, 0, 8) and res.indices.shape == (3, 0)
    assert res.beta is None and res.target == 0 and res.indices.dtype == torch.long
    new_keys, new_values, _ = splice(keys, values, span, res.keys, res.values)
    keep = [j for j in range(48) if not span[0] <= j < span[1]]
    assert torch.equal(new_keys, keys[:, keep].to(F64)) and torch.equal(new_values, values[:, keep].to(F64))
    assert compact(keys, values, None, span, target, mode="markovian").target == 0


@pytest.mark.parametrize("mode", SELECTION)
@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("target", [1, 7, "all"])
def test_selection_baselines_keep_original_rows(mode, span, target):
    keys, values, queries = make_cache(1, 4, 48, 8, 12, dtype=torch.float32)
    target = span[1] - span[0] if target == "all" else target
    res = compact(keys, values, queries, span, target, mode=mode, seed=5)
    assert res.beta is None and res.indices.shape == (4, target)
    assert ((res.indices >= span[0]) & (res.indices < span[1])).all()
    assert (res.indices[:, 1:] > res.indices[:, :-1]).all()
    assert torch.equal(res.keys, gather_rows(keys, res.indices))
    assert torch.equal(res.values, gather_rows(values, res.indices))
    if target == span[1] - span[0]:
        assert torch.equal(res.indices, torch.arange(*span).expand(4, -1))


@pytest.mark.parametrize("span", SPANS)
@pytest.mark.parametrize("compute_beta", [False, True])
def test_attention_matching_composes_the_parts(span, compute_beta):
    keys, values, queries = make_cache(2, 4, 48, 16, 12)
    res = compact(keys, values, queries, span, 6, compute_beta=compute_beta, ridge=1e-3)
    idx = select_keys(keys, queries, span, 6)
    assert isinstance(res, CompactionResult) and torch.equal(res.indices, idx)
    assert torch.equal(res.keys, gather_rows(keys, idx))
    beta = fit_beta(keys, queries, span, idx) if compute_beta else None
    assert (res.beta is None) == (not compute_beta)
    if compute_beta:
        torch.testing.assert_close(res.beta, beta, rtol=0, atol=1e-12)
    torch.testing.assert_close(
        res.values, fit_values(keys, values, queries, span, idx, beta=beta, ridge=1e-3), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mode", COMPACTION_MODES)
def test_forced_indices_replay_is_bit_identical(mode, dtype):
    keys, values, queries = make_cache(3, 6, 40, 16, 12, dtype=dtype)
    bias = torch.zeros(6, 40)
    bias[:, 5:15] = torch.randn(6, 10, generator=torch.Generator().manual_seed(0))
    beta_options = (False, True) if mode == "attention_matching" else (False,)
    for compute_beta in beta_options:
        for key_bias in (None, bias):
            kwargs = dict(mode=mode, compute_beta=compute_beta, key_bias=key_bias, seed=11)
            scored = compact(keys, values, queries, (4, 30), 9, **kwargs)
            replay = compact(keys, values, queries, (4, 30), 9, forced_indices=scored.indices.int(), **kwargs)
            assert torch.equal(scored.indices, replay.indices)
            assert torch.equal(scored.keys, replay.keys) and torch.equal(scored.values, replay.values)
            assert (scored.beta is None and replay.beta is None) or torch.equal(scored.beta, replay.beta)


def _attention_case(seed, t):
    """Probes whose attention splits about evenly between the span and the rest of the cache."""
    keys, values, queries = make_cache(seed, 6, 96, 32, 48, query_shift=1.0)
    span = (24, 72)
    full = attend(queries, keys, values)
    errors = {}
    for compute_beta in (False, True):
        res = compact(keys, values, queries, span, t, compute_beta=compute_beta)
        k, v, b = splice(keys, values, span, res.keys, res.values, new_bias=res.beta)
        errors[compute_beta] = rel(attend(queries, k, v, bias=b), full)
    return errors


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("t", [6, 12])
def test_beta_improves_full_attention(seed, t):
    errors = _attention_case(seed, t)
    assert errors[True] < 0.75 * errors[False]


def test_compacting_everything_preserves_full_attention_with_old_bias():
    """Re-compacting a span that holds earlier C1/C2/β: the bias enters S and survives."""
    keys, values, queries = make_cache(4, 3, 48, 16, 40)
    bias = torch.zeros(3, 48, dtype=F64)
    bias[:, 10:30] = torch.rand(3, 20, generator=torch.Generator().manual_seed(1), dtype=F64) * 6 - 3
    span = (8, 32)
    full = attend(queries, keys, values, bias=bias)
    for compute_beta in (False, True):
        res = compact(keys, values, queries, span, 24, compute_beta=compute_beta, key_bias=bias, ridge=0.0)
        torch.testing.assert_close(res.beta, bias[:, 8:32], rtol=0, atol=1e-8)
        k, v, b = splice(keys, values, span, res.keys, res.values, key_bias=bias, new_bias=res.beta)
        assert rel(attend(queries, k, v, bias=b), full) < 1e-8


def test_selection_modes_keep_old_bias_of_kept_rows():
    keys, values, queries = make_cache(5, 2, 30, 8, 6, dtype=torch.bfloat16)
    bias = torch.randn(2, 30, generator=torch.Generator().manual_seed(0))
    for mode in ("attention_matching", *SELECTION):
        res = compact(keys, values, queries, (5, 25), 4, mode=mode, key_bias=bias, seed=0)
        assert res.beta.dtype == torch.float32
        assert torch.equal(res.beta, gather_rows(bias, res.indices))


@pytest.mark.parametrize(
    ("dtype", "beta_dtype"),
    [(torch.float64, F64), (torch.float32, torch.float32), (torch.bfloat16, torch.float32)],
)
def test_result_dtypes(dtype, beta_dtype):
    keys, values, queries = make_cache(6, 2, 30, 8, 12, dtype=dtype)
    res = compact(keys, values, queries, (5, 25), 5, compute_beta=True)
    assert res.keys.dtype == dtype and res.values.dtype == dtype and res.beta.dtype == beta_dtype
    assert res.indices.dtype == torch.long


def test_batch_rows_are_independent():
    keys, values, queries = make_cache(7, 5, 40, 16, 12)
    whole = compact(keys, values, queries, (8, 32), 6, compute_beta=True)
    for b in range(5):
        row = compact(keys[b : b + 1], values[b : b + 1], queries[b : b + 1], (8, 32), 6, compute_beta=True)
        assert torch.equal(row.indices, whole.indices[b : b + 1])
        torch.testing.assert_close(row.values, whole.values[b : b + 1], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(row.beta, whole.beta[b : b + 1], rtol=1e-9, atol=1e-9)


def test_gqa_probes_feed_compact():
    layers, h_q, h_kv, d = 2, 8, 2, 16
    queries = torch.randn(layers, h_q, 5, d)
    keys, values = torch.randn(layers * h_kv, 64, d), torch.randn(layers * h_kv, 64, d)
    res = compact(keys, values, gqa_probes(queries, h_kv), (16, 48), 8, compute_beta=True)
    assert res.keys.shape == (4, 8, d) and res.beta.shape == (4, 8)
    assert res.values.isfinite().all() and res.beta.isfinite().all()
