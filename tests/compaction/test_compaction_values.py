"""fit_values (C2) against a float64 block-local attention reference."""

from __future__ import annotations

import pytest
import torch
from compaction_reference import (
    F64,
    attend,
    block_output,
    gather_rows,
    logits,
    make_cache,
    rel,
    ridge_toward,
)

from compaction_gym.compaction import fit_beta, fit_values, select_keys
from compaction_gym.errors import InvalidArgumentError

# (seed, B, T, d, n, span): spans at the start, middle and end; n = 12 and 24 are GQA-style
# counts (fewer probes than span keys in the first case).
CASES = [
    (0, 3, 40, 16, 12, (0, 24)),
    (1, 4, 64, 16, 48, (16, 48)),
    (2, 2, 48, 32, 24, (24, 48)),
]


def _block_error(keys, values, queries, span, idx, c2, beta=None):
    """Relative error of attention over the compacted block vs the span's own attention output."""
    want = block_output(keys, values, queries, span)
    got = attend(queries, gather_rows(keys, idx), c2, bias=beta)
    return rel(got, want)


@pytest.mark.parametrize(("seed", "batch", "length", "d", "n", "span"), CASES)
def test_block_output_error_shrinks_to_zero_as_target_grows(seed, batch, length, d, n, span):
    keys, values, queries = make_cache(seed, batch, length, d, n)
    width = span[1] - span[0]
    errors = []
    for target in (1, width // 8, width // 4, width // 2, (3 * width) // 4, width):
        idx = select_keys(keys, queries, span, target)
        c2 = fit_values(keys, values, queries, span, idx, ridge=0.0)
        errors.append(_block_error(keys, values, queries, span, idx, c2))
    assert errors[-1] <= 1e-6
    for bigger, smaller in zip(errors[1:], errors[:-1]):
        assert bigger <= smaller * 1.05 + 1e-9  # monotone up to a little slack
    assert errors[0] > 2 * errors[3] > 0


@pytest.mark.parametrize(("seed", "batch", "length", "d", "n", "span"), CASES)
def test_full_target_reproduces_span_values(seed, batch, length, d, n, span):
    keys, values, queries = make_cache(seed, batch, length, d, n)
    idx = torch.arange(*span).expand(batch, -1)
    c2 = fit_values(keys, values, queries, span, idx, ridge=0.0)
    assert _block_error(keys, values, queries, span, idx, c2) <= 1e-6
    if n >= span[1] - span[0]:  # overdetermined and full rank: C2 is V itself
        torch.testing.assert_close(c2, values[:, span[0] : span[1]], rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [20, 8])
def test_matches_reference_ridge_solution(n):
    """C2 is the ridge solution toward the kept rows' original values (float64 least squares on the
    stacked system), over- (20 probes) and under-determined (8 probes for 8 kept keys)."""
    keys, values, queries = make_cache(3, 4, 50, 16, n)
    span, ridge = (10, 40), 1e-3
    idx = select_keys(keys, queries, span, 8)
    bias = torch.randn(4, 50, generator=torch.Generator().manual_seed(2), dtype=F64)
    beta = torch.randn(4, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    for key_bias, new_beta in ((None, None), (bias, None), (bias, beta), (None, beta)):
        got = fit_values(keys, values, queries, span, idx, beta=new_beta, key_bias=key_bias, ridge=ridge)
        s = logits(keys, queries, key_bias=key_bias)
        y = torch.einsum(
            "bij,bjd->bid", torch.softmax(s[:, :, span[0] : span[1]], -1), values[:, span[0] : span[1]]
        )
        kept = torch.stack([s[b][:, idx[b]] for b in range(4)])
        if new_beta is not None:
            kept = logits(gather_rows(keys, idx), queries) + new_beta[:, None, :]
        want = ridge_toward(torch.softmax(kept, -1), y, gather_rows(values, idx), ridge)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_unseen_directions_keep_the_original_values():
    """Fewer probes than kept keys: in the directions no probe sees (the null space of X), C2 is the
    kept rows' original values exactly, however small the ridge; a zero prior would put 0 there."""
    keys, values, queries = make_cache(7, 3, 40, 16, 5)
    span, t = (4, 36), 12
    idx = select_keys(keys, queries, span, t)
    x = torch.softmax(torch.stack([logits(keys, queries)[b][:, idx[b]] for b in range(3)]), -1)
    null = torch.linalg.svd(x, full_matrices=True).Vh[:, 5:]  # [B, t − n, t]: X u = 0
    kept = gather_rows(values, idx)
    for ridge in (1e-6, 1e-4, 1e-1):
        c2 = fit_values(keys, values, queries, span, idx, ridge=ridge)
        assert (null @ (c2 - kept)).abs().max() < 1e-12 / ridge  # float64 rounding ÷ λ's scale
        assert (null @ kept).abs().max() > 0.1  # not trivially zero there


def test_duplicate_keys_singular_system_still_reproduces_block_output():
    keys, values, queries = make_cache(4, 2, 30, 8, 40)
    keys[:, 12] = keys[:, 11]  # two identical kept keys: XᵀX is singular
    span = (8, 20)
    idx = torch.arange(*span).expand(2, -1)
    c2 = fit_values(keys, values, queries, span, idx, ridge=0.0)
    assert c2.isfinite().all()
    assert _block_error(keys, values, queries, span, idx, c2) <= 1e-6
    assert float(c2.norm()) < 10 * float(
        values[:, span[0] : span[1]].norm()
    )  # no blow-up along the null space


def test_beta_fitted_values_reproduce_block_output_with_beta():
    keys, values, queries = make_cache(5, 3, 48, 16, 8)
    span = (8, 40)
    idx = select_keys(keys, queries, span, 16)
    beta = fit_beta(keys, queries, span, idx)
    c2 = fit_values(keys, values, queries, span, idx, beta=beta, ridge=0.0)
    # 8 probes < 16 kept keys: the block output is matched exactly
    assert _block_error(keys, values, queries, span, idx, c2, beta=beta) <= 1e-8


def test_one_probe_per_kept_key_does_not_amplify_rounding(monkeypatch):
    """At n = t (the interpolation peak) a 1e-7 relative change of K — float32 rounding between a
    rollout and its replay — moves C2 by less than 5e-7 with the peak ridge; with the plain ridge
    (``PEAK_RIDGE_FACTOR = 1``) by 3–10× more (float64, so the change is the fit's alone)."""
    import compaction_gym.compaction.values as values_module

    def moves() -> list[float]:
        out = []
        for seed in range(4):
            keys, values, queries = make_cache(seed, 8, 48, 16, 16)
            span = (8, 40)
            idx = select_keys(keys, queries, span, 16)
            g = torch.Generator().manual_seed(100 + seed)
            noisy = keys * (1 + 1e-7 * torch.randn(keys.shape, generator=g, dtype=F64))
            out.append(rel(*(fit_values(k, values, queries, span, idx) for k in (noisy, keys))))
        return out

    peak = moves()
    monkeypatch.setattr(values_module, "PEAK_RIDGE_FACTOR", 1.0)
    plain = moves()
    assert max(peak) < 5e-7, peak
    assert sum(plain) > 2 * sum(peak), (plain, peak)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_return_input_dtype(dtype):
    keys, values, queries = make_cache(6, 4, 40, 16, 32, dtype=dtype)
    span = (4, 36)
    idx = select_keys(keys, queries, span, 16)
    c2 = fit_values(keys, values, queries, span, idx)
    assert c2.dtype == dtype and c2.shape == (4, 16, 16)
    k64, v64, q64 = keys.to(F64), values.to(F64), queries.to(F64)
    ref = fit_values(k64, v64, q64, span, idx)
    tol = 1e-3 if dtype == torch.float32 else 5e-2
    assert rel(c2, ref) < tol


def test_cholesky_solve_ex_solves_and_flags_what_does_not_factor():
    """The sync-free solver (the GPU fast path's C2): SPD problems match ``torch.linalg.solve`` in
    float64; a problem that is not positive definite is flagged instead of solved."""
    from compaction_gym.compaction.values import cholesky_solve_ex

    g = torch.Generator().manual_seed(5)
    m = torch.randn(4, 12, 12, generator=g, dtype=F64)
    a = m @ m.mT + 0.1 * torch.eye(12, dtype=F64)
    a[2] = -a[2]  # negative definite: Cholesky fails
    rhs = torch.randn(4, 12, 3, generator=g, dtype=F64)
    sol, ok = cholesky_solve_ex(a, rhs)
    assert ok.tolist() == [True, True, False, True]
    want = torch.linalg.solve(a, rhs)
    assert rel(sol[ok], want[ok]) < 1e-10


def test_ridge_solve_ex_is_the_fast_paths_c2():
    """The GPU fast path's C2 (``ridge_solve_ex``, no host sync) is the reference ridge solution
    toward the prior where the system factors, and the prior itself (the kept values) where not."""
    from compaction_gym.compaction.values import ridge_solve_ex

    g = torch.Generator().manual_seed(11)
    x = torch.softmax(torch.randn(5, 12, 8, generator=g, dtype=F64), -1)
    x[:, 9:] = 0  # padding probes in every problem: 9 real probes for 8 keys (the peak ramp)
    y = torch.randn(5, 12, 4, generator=g, dtype=F64)
    prior = torch.randn(5, 8, 4, generator=g, dtype=F64)
    x[3, 0, 0] = float("nan")  # problem 3 does not solve
    sol, ok, _ = ridge_solve_ex(x, y, prior, 1e-3)
    assert ok.tolist() == [True, True, True, False, True]
    assert torch.equal(sol[3], prior[3])
    want = ridge_toward(x[ok], y[ok], prior[ok], 1e-3, n_probes=[9] * 4)
    torch.testing.assert_close(sol[ok], want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("beta", [False, True])
def test_query_mask_fits_each_problem_from_its_real_probes(beta):
    """Problems with 5, 17 and 30 probes stacked with zero padding and a mask give each problem's
    own fit (float64, each problem fitted alone); without the mask the padding changes C2."""
    counts = [5, 17, 30]
    span, d = (4, 28), 16
    idx_all, parts, fits = [], [], []
    for i, n in enumerate(counts):
        keys, values, queries = make_cache(10 + i, 2, 32, d, n, dtype=F64)
        idx = select_keys(keys, queries, span, 6)
        b = torch.randn(2, 6, dtype=F64) * 0.3 if beta else None
        fits.append(fit_values(keys, values, queries, span, idx, beta=b, ridge=1e-3))
        parts.append((keys, values, queries, b))
        idx_all.append(idx)
    width = max(counts)
    keys = torch.cat([p[0] for p in parts])
    values = torch.cat([p[1] for p in parts])
    queries = torch.cat([torch.nn.functional.pad(p[2], (0, 0, 0, width - p[2].shape[1])) for p in parts])
    mask = torch.cat([(torch.arange(width) < n).expand(2, width) for n in counts])
    b = torch.cat([p[3] for p in parts]) if beta else None
    idx = torch.cat(idx_all)
    got = fit_values(keys, values, queries, span, idx, beta=b, ridge=1e-3, query_mask=mask)
    want = torch.cat(fits)
    assert (got - want).abs().max().item() < 1e-12 * max(1.0, want.abs().max().item())
    unmasked = fit_values(keys, values, queries, span, idx, beta=b, ridge=1e-3)
    assert (unmasked - want).abs().max().item() > 1e-3  # the padding rows do matter without the mask
    with pytest.raises(InvalidArgumentError, match="query_mask"):
        fit_values(keys, values, queries, span, idx, query_mask=mask.float())


@pytest.mark.parametrize("width", [3, 8, 40])
def test_cholesky_solve_ex_matches_a_float64_reference_at_any_width(width):
    """Narrow right-hand sides by the two triangular solves, wide ones (replay's value maps) through
    the factor's inverse: both against ``torch.linalg.solve`` on ill-conditioned ridge systems."""
    from compaction_gym.compaction.values import cholesky_solve_ex, normal_matrix

    g = torch.Generator().manual_seed(width)
    x = torch.softmax(4 * torch.randn(5, 12, 8, generator=g, dtype=torch.float64), -1)
    a, _ = normal_matrix(x, 1e-4)
    rhs = torch.randn(5, 8, width, generator=g, dtype=torch.float64)
    sol, ok = cholesky_solve_ex(a, rhs)
    assert ok.all()
    ref = torch.linalg.solve(a, rhs)
    assert torch.allclose(sol, ref, rtol=1e-9, atol=1e-9 * ref.abs().max().item())
    bad = a.clone()
    bad[0] = -torch.eye(8, dtype=torch.float64)  # not positive definite: flagged, no exception
    assert cholesky_solve_ex(bad, rhs)[1].tolist() == [False, True, True, True, True]
