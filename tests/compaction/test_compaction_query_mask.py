"""``compact(query_mask=...)``: rows whose probes are padded to a common count are scored and fitted
from their real probes alone — each row equals ``compact`` called with that row's real probes only
(float64), for selection, β (its probe guard counted per row) and C2."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from compaction_gym.compaction import apply_event, compact
from compaction_gym.errors import InvalidArgumentError

T, D, SPAN, TARGET = 40, 8, (6, 30), 6


def problem(counts: list[int], seed: int):
    """Rows with ``counts[b]`` real probes each, zero-padded to the largest count, plus β on the cache."""
    g = torch.Generator().manual_seed(seed)
    rows, n = len(counts), max(counts)
    keys = torch.randn(rows, T, D, generator=g, dtype=torch.float64) * 1.5
    values = torch.randn(rows, T, D, generator=g, dtype=torch.float64)
    queries = torch.zeros(rows, n, D, dtype=torch.float64)
    mask = torch.zeros(rows, n, dtype=torch.bool)
    for b, c in enumerate(counts):
        queries[b, :c] = torch.randn(c, D, generator=g, dtype=torch.float64) * 1.5
        mask[b, :c] = True
    bias = torch.randn(rows, T, generator=g, dtype=torch.float64) * 0.3
    return keys, values, queries, mask, bias


@settings(max_examples=30, deadline=None)
@given(
    counts=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    compute_beta=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 10_000),
)
def test_masked_rows_equal_their_own_problems(counts, compute_beta, with_bias, seed):
    keys, values, queries, mask, bias = problem(counts, seed)
    bias = bias if with_bias else None
    got = compact(
        keys, values, queries, SPAN, TARGET, compute_beta=compute_beta, key_bias=bias, query_mask=mask
    )
    for b, c in enumerate(counts):
        own = compact(
            keys[b : b + 1], values[b : b + 1], queries[b : b + 1, :c], SPAN, TARGET, compute_beta=compute_beta,
            key_bias=None if bias is None else bias[b : b + 1],
        )  # fmt: skip
        assert torch.equal(got.indices[b], own.indices[0])
        assert torch.allclose(got.values[b], own.values[0], rtol=1e-10, atol=1e-10)
        if own.beta is not None:
            assert torch.allclose(got.beta[b], own.beta[0], rtol=1e-10, atol=1e-10)


def test_apply_event_passes_the_mask_to_scoring():
    keys, values, queries, mask, bias = problem([5, 30, 12], seed=1)
    kwargs = dict(mode="attention_matching", span=SPAN, target=TARGET, compute_beta=True, key_bias=bias)
    got = apply_event(keys, values, queries, query_mask=mask, **kwargs)
    ref = compact(keys, values, queries, SPAN, TARGET, compute_beta=True, key_bias=bias, query_mask=mask)
    assert torch.equal(got.indices, ref.indices) and torch.equal(got.beta, ref.beta)
    unmasked = apply_event(keys, values, queries, **kwargs)
    assert not torch.equal(unmasked.indices, got.indices)  # the padding probes would change the event


def test_bad_masks_are_refused():
    keys, values, queries, mask, _ = problem([5, 9], seed=2)
    with pytest.raises(InvalidArgumentError, match="query_mask needs mode='attention_matching'"):
        compact(keys, values, queries, SPAN, TARGET, mode="h2o", query_mask=mask)
    with pytest.raises(InvalidArgumentError, match="refit_values=True"):
        compact(keys, values, queries, SPAN, TARGET, refit_values=False, query_mask=mask)
    with pytest.raises(InvalidArgumentError, match="at least one probe in every row"):
        compact(keys, values, queries, SPAN, TARGET, query_mask=torch.zeros_like(mask))
    with pytest.raises(InvalidArgumentError, match="query_mask must be a bool tensor"):
        compact(keys, values, queries, SPAN, TARGET, query_mask=mask.float())
