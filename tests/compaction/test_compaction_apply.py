"""apply_event: the engine's and replay's one path from an event + a cache's K/V/β to the new block."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from compaction_reference import F64, gather_rows, logits, make_cache, ridge_toward
from hypothesis import given, settings

from compaction_gym.compaction import COMPACTION_MODES, apply_event, compact
from compaction_gym.errors import InvalidArgumentError

SPAN, LENGTH = (6, 38), 48


def _case(seed: int, dtype: torch.dtype, with_bias: bool):
    keys, values, queries = make_cache(seed, 4, LENGTH, 16, 24, dtype=dtype, query_shift=1.0)
    bias = None
    if with_bias:
        g = torch.Generator().manual_seed(seed + 1)
        bias = torch.randn(4, LENGTH, generator=g, dtype=torch.float32)
    return keys, values, queries, bias


def _reference_c2(keys, values, queries, span, indices, beta, key_bias, ridge):
    """C2 in float64: the ridge fit toward the kept rows' values with absolute β given (``docs/compaction.md``)."""
    s_all = logits(keys, queries, key_bias=key_bias)
    raw = logits(keys, queries)
    kept = gather_rows(raw.transpose(1, 2), indices).transpose(1, 2) + beta.to(F64)[:, None, :]
    start, end = span
    y = torch.einsum("bij,bjd->bid", torch.softmax(s_all[:, :, start:end], -1), values[:, start:end].to(F64))
    return ridge_toward(torch.softmax(kept, dim=-1), y, gather_rows(values.to(F64), indices), ridge)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(COMPACTION_MODES),
    compute_beta=st.booleans(),
    with_bias=st.booleans(),
    target=st.integers(1, 32),
)
def test_apply_event_equals_compact(seed, mode, compute_beta, with_bias, target):
    """Scoring (no indices) is compact itself; replaying its indices and β gives the same block."""
    compute_beta = compute_beta and mode == "attention_matching"
    keys, values, queries, bias = _case(seed, torch.float32, with_bias)
    kwargs = dict(mode=mode, compute_beta=compute_beta, key_bias=bias, ridge=1e-4, seed=seed)
    ref = compact(keys, values, queries, SPAN, target, **kwargs)
    scored = apply_event(keys, values, queries, span=SPAN, target=target, **kwargs)
    for a, b in ((scored.keys, ref.keys), (scored.values, ref.values), (scored.indices, ref.indices)):
        assert torch.equal(a, b)
    t = ref.indices.shape[1]
    for differentiable in (False, True):
        replayed = apply_event(
            keys, values, queries if mode == "attention_matching" else None, span=SPAN, target=t,
            indices=ref.indices, beta=ref.beta if compute_beta else None, differentiable=differentiable,
            **kwargs,
        )  # fmt: skip
        assert torch.equal(replayed.keys, ref.keys) and torch.equal(replayed.indices, ref.indices)
        # the same operations on the same inputs: bit-identical (the solve runs in float64)
        assert torch.equal(replayed.values, ref.values)
        if ref.beta is None:
            assert replayed.beta is None
        else:
            assert torch.equal(replayed.beta.float(), ref.beta.float())


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), with_bias=st.booleans(), target=st.integers(1, 32))
def test_recorded_beta_is_used_as_a_constant(seed, with_bias, target):
    """With a recorded β (here a random one, not the NNLS fit) C2 is the float64 ridge solution for
    that β, and gradients reach keys, values and probes but not β."""
    keys, values, queries, bias = _case(seed, F64, with_bias)
    keys, values, queries = (x.clone().requires_grad_() for x in (keys, values, queries))
    g = torch.Generator().manual_seed(seed + 2)
    indices = torch.stack(
        [torch.randperm(32, generator=g)[:target].sort().values + SPAN[0] for _ in range(4)]
    )
    beta = (torch.randn(4, target, generator=g) * 2).requires_grad_()
    res = apply_event(
        keys, values, queries, mode="attention_matching", span=SPAN, target=target, compute_beta=True,
        key_bias=bias, ridge=1e-3, indices=indices, beta=beta, differentiable=True,
    )  # fmt: skip
    ref = _reference_c2(
        keys.detach(), values.detach(), queries.detach(), SPAN, indices, beta.detach(), bias, 1e-3
    )
    assert (res.values.detach() - ref).abs().max() <= 1e-8 * max(1.0, ref.abs().max().item())
    assert torch.equal(res.beta, beta.detach()) and not res.beta.requires_grad
    assert torch.equal(res.keys.detach(), gather_rows(keys.detach(), indices))
    (res.values.sum() + res.keys.sum()).backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (keys, values, queries))
    assert beta.grad is None


def test_selection_modes_replay_without_probes():
    keys, values, queries, bias = _case(3, torch.float32, True)
    for mode in ("h2o", "snapkv", "streaming", "random"):
        ref = compact(keys, values, queries, SPAN, 8, mode=mode, key_bias=bias, seed=1)
        res = apply_event(
            keys, values, None, mode=mode, span=SPAN, target=8, key_bias=bias, indices=ref.indices
        )
        assert torch.equal(res.keys, ref.keys) and torch.equal(res.values, ref.values)
        assert torch.equal(res.beta, ref.beta)
    empty = torch.empty(4, 0, dtype=torch.long)
    res = apply_event(
        keys, values, None, mode="markovian", span=SPAN, target=0, indices=empty, differentiable=True
    )
    assert res.keys.shape == (4, 0, 16) and res.values.shape == (4, 0, 16) and res.beta is None


def test_mixed_dtypes_compact_in_the_keys_dtype():
    """Autocast hands bf16 values with float32 keys: C2 comes back in the values' dtype."""
    keys, values, queries, _ = _case(5, torch.float32, False)
    ref = compact(keys, values.bfloat16().float(), queries, SPAN, 8)
    res = apply_event(keys, values.bfloat16(), queries, mode="attention_matching", span=SPAN, target=8,
                      indices=ref.indices, differentiable=True)  # fmt: skip
    assert res.values.dtype == torch.bfloat16
    assert torch.equal(res.values, ref.values.bfloat16())


def test_apply_event_refuses_bad_arguments():
    keys, values, queries, _ = _case(7, torch.float32, False)
    ref = compact(keys, values, queries, SPAN, 8, compute_beta=True)
    common = dict(span=SPAN, target=8, indices=ref.indices)
    with pytest.raises(InvalidArgumentError, match="mode"):
        apply_event(keys, values, queries, mode="nope", **common)
    with pytest.raises(InvalidArgumentError, match="compute_beta"):
        apply_event(keys, values, queries, mode="attention_matching", beta=ref.beta, **common)
    with pytest.raises(InvalidArgumentError, match="indices"):
        apply_event(
            keys, values, queries, mode="attention_matching", span=SPAN, target=8, differentiable=True
        )
    with pytest.raises(InvalidArgumentError, match="beta"):
        apply_event(keys, values, queries, mode="attention_matching", compute_beta=True, beta=ref.beta[:, :3],
                    **common)  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="queries"):
        apply_event(keys, values, None, mode="attention_matching", differentiable=True, **common)
    with pytest.raises(InvalidArgumentError, match="indices"):
        apply_event(keys, values, None, mode="h2o", span=SPAN, target=8, indices=ref.indices[:, :4])
