"""fit_beta (span-mass matching) and the batched NNLS solver against float64 references."""

from __future__ import annotations

import math

import pytest
import torch
from compaction_reference import F64, kept_mass, logits, make_cache, span_mass
from scipy.optimize import nnls as scipy_nnls

from compaction_gym.compaction import fit_beta, nnls, select_keys

#: The unregularised span-mass NNLS (no box, no ridge, no probe guard): what the solver tests check.
UNREG = dict(bounds=None, ridge=0.0, min_probes_per_key=0.0)


def _max_rel(a, b) -> float:
    return float(((a - b).abs() / b.abs()).max())


# (seed, B, T, d, n, span, target): target >= span/2 and few probes per kept key (n <= t/4, or
# n <= t/2 when target >= 3/4 span), where exact non-negative mass matching is feasible (with more probes it
# generally is not: see test_beta_rank_deficient_probes_near_optimal); GQA-style n = G × positions.
FEASIBLE = [
    (0, 4, 48, 16, 4, (0, 32), 16),
    (1, 3, 64, 32, 12, (16, 48), 24),
    (2, 2, 40, 8, 4, (24, 40), 8),
    (3, 5, 30, 16, 4, (5, 15), 10),
    (4, 4, 48, 16, 12, (16, 48), 24),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("seed", "batch", "length", "d", "n", "span", "target"), FEASIBLE)
def test_beta_matches_span_mass(seed, batch, length, d, n, span, target, dtype):
    keys, _, queries = make_cache(seed, batch, length, d, n, dtype=dtype)
    idx = select_keys(keys, queries, span, target)
    beta = fit_beta(keys, queries, span, idx, **UNREG)
    assert beta.dtype == (F64 if dtype == F64 else torch.float32)
    assert beta.shape == (batch, target)
    err = _max_rel(kept_mass(keys, queries, idx, beta), span_mass(keys, queries, span))
    assert err < (1e-9 if dtype == F64 else 1e-3)


def test_beta_with_one_probe_and_one_key_is_log_mass_ratio():
    keys, _, queries = make_cache(5, 3, 20, 8, 1)
    span = (4, 12)
    idx = torch.tensor([[6], [4], [11]])
    beta = fit_beta(keys, queries, span, idx, **UNREG)
    s = logits(keys, queries)[:, 0]
    want = torch.logsumexp(s[:, 4:12], dim=-1) - s[torch.arange(3), idx[:, 0]]
    torch.testing.assert_close(beta[:, 0], want, rtol=0, atol=1e-10)


def test_full_span_keeps_mass_exactly():
    keys, _, queries = make_cache(6, 3, 40, 16, 30)
    span = (10, 30)
    idx = torch.arange(10, 30).expand(3, -1)
    beta = fit_beta(keys, queries, span, idx)
    assert _max_rel(kept_mass(keys, queries, idx, beta), span_mass(keys, queries, span)) < 1e-9
    torch.testing.assert_close(beta, torch.zeros_like(beta), rtol=0, atol=1e-6)  # w = 1 is the unique fit


def test_beta_is_absolute_over_existing_key_bias():
    keys, _, queries = make_cache(8, 4, 48, 16, 8)
    bias = torch.zeros(4, 48, dtype=F64)
    bias[:, 10:30] = torch.rand(4, 20, generator=torch.Generator().manual_seed(1), dtype=F64) * 4 - 2
    span = (8, 40)
    idx = select_keys(keys, queries, span, 24, key_bias=bias)
    beta = fit_beta(keys, queries, span, idx, key_bias=bias, **UNREG)
    # the new β replaces the old bias on kept rows: kept mass uses β alone
    assert _max_rel(kept_mass(keys, queries, idx, beta), span_mass(keys, queries, span, key_bias=bias)) < 1e-9


def _crafted(key_rows):
    """Two probes e0, e1 with scale 1, so key (x, y) has logits (x, y)."""
    keys = torch.tensor([key_rows], dtype=F64)
    return keys, torch.eye(2, dtype=F64)[None]


def test_beta_zero_weight_clamps_to_minus_30():
    # columns a=(1,1), b=(1,e^-3), c with b + c = 2a: the span mass is exactly 3a, so w = (3, 0)
    keys, queries = _crafted([[0.0, 0.0], [0.0, -3.0], [0.0, math.log(2 - math.exp(-3))]])
    beta = fit_beta(keys, queries, (0, 3), torch.tensor([[0, 1]]), scale=1.0, **UNREG)
    torch.testing.assert_close(beta, torch.tensor([[math.log(3), -30.0]], dtype=F64), rtol=0, atol=1e-9)


def test_beta_large_weight_clamps_to_plus_30():
    # keeping only a key 100 logits below the other needs β = 100, clamped to 30
    keys, queries = _crafted([[0.0, 0.0], [-100.0, -100.0]])
    beta = fit_beta(keys, queries, (0, 2), torch.tensor([[1]]), scale=1.0, **UNREG)
    assert beta.tolist() == [[30.0]]


def _kkt(a, m, w):
    """Largest violation of the NNLS optimality conditions (g = Aᵀ(Aw − m): g ≥ 0, g = 0 where w > 0)."""
    g = torch.einsum("bni,bn->bi", a, torch.einsum("bni,bi->bn", a, w) - m)
    scale = torch.einsum("bni,bn->bi", a, m).abs().amax(-1, keepdim=True)
    return float((torch.where(w > 0, g.abs(), (-g).clamp_min(0)) / scale).max())


@pytest.mark.parametrize(("seed", "n", "t"), [(0, 40, 10), (1, 12, 12), (2, 64, 24), (3, 8, 20)])
def test_nnls_reaches_optimum(seed, n, t):
    g = torch.Generator().manual_seed(seed)
    a = torch.rand(6, n, t, generator=g, dtype=F64)
    m = torch.rand(6, n, generator=g, dtype=F64) * t
    m[:3] = torch.einsum("bni,bi->bn", a[:3], torch.randn(3, t, generator=g, dtype=F64))  # mixed signs
    w = nnls(torch.einsum("bni,bnj->bij", a, a), torch.einsum("bni,bn->bi", a, m))
    assert (w >= 0).all()
    assert _kkt(a, m, w) < 1e-8
    for b in range(6):
        ref, _ = scipy_nnls(a[b].numpy(), m[b].numpy())
        ours = float((a[b] @ w[b] - m[b]).norm())
        best = float((a[b] @ torch.from_numpy(ref) - m[b]).norm())
        assert ours <= best * (1 + 1e-8) + 1e-10


def test_nnls_float32_close_to_optimum():
    g = torch.Generator().manual_seed(4)
    a = torch.rand(8, 48, 16, generator=g, dtype=F64)
    m = torch.rand(8, 48, generator=g, dtype=F64) * 16
    a32, m32 = a.float(), m.float()
    w = nnls(a32.mT @ a32, (a32.mT @ m32[..., None])[..., 0]).double()
    for b in range(8):
        ref, _ = scipy_nnls(a[b].numpy(), m[b].numpy())
        best = float((a[b] @ torch.from_numpy(ref) - m[b]).norm())
        assert float((a[b] @ w[b] - m[b]).norm()) <= best * (1 + 1e-4) + 1e-5


def test_beta_rank_deficient_probes_near_optimal():
    """Many probes in a low-dimensional subspace: ill-conditioned NNLS, still near scipy's optimum."""
    g = torch.Generator().manual_seed(0)
    batch, length, d, n, span, t = 2, 84, 32, 64, (10, 74), 48
    keys = torch.randn(batch, length, d, generator=g, dtype=F64)
    queries = torch.randn(batch, n, 2, generator=g, dtype=F64) @ torch.randn(
        batch, 2, d, generator=g, dtype=F64
    )
    idx = select_keys(keys, queries, span, t)
    beta = fit_beta(keys, queries, span, idx, **UNREG)
    s = logits(keys, queries)[:, :, span[0] : span[1]]
    probs = torch.exp(s) / torch.exp(s).sum(-1, keepdim=True)  # relative-error rows, target 1
    a = torch.stack([probs[b][:, idx[b] - span[0]] for b in range(batch)])
    m = torch.ones(batch, n, dtype=F64)
    w = torch.exp(beta)
    for b in range(batch):
        ref, _ = scipy_nnls(a[b].numpy(), m[b].numpy())
        best = float((a[b] @ torch.from_numpy(ref) - m[b]).norm())
        ours = float((a[b] @ w[b] - m[b]).norm())
        assert ours <= 2 * best + 1e-6 * float(m[b].norm())
    assert _max_rel(kept_mass(keys, queries, idx, beta), span_mass(keys, queries, span)) < 1e-2
