"""C2's ridge-solve kernels (``engine/fast/ridge.py``) against float64 math and cuSOLVER.

* ``normal_products``: ``xᵀx`` and ``xᵀy`` to float32 accuracy for either memory layout and sizes
  that are not multiples of the tiles;
* ``cholesky_solve``: the solution of the same float32 system as a float64 solve, to the
  system's conditioning (no worse than torch's factor-and-``trsm``), the same failure flags as
  :func:`~compaction_gym.compaction.values.cholesky_solve_ex` for indefinite and non-finite
  systems, and the torch path itself where the kernels do not apply.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from compaction_gym.compaction.values import cholesky_solve_ex, ridge_system
from compaction_gym.engine.fast.ridge import cholesky_solve, normal_products

EPS32 = torch.finfo(torch.float32).eps


def _design(batch: int, n: int, t: int, d: int, device: str, seed: int = 0):
    """An event-like ridge problem: softmax rows over ``t`` keys, attention outputs as targets."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits = torch.randn(batch, n, t, generator=g) * 2.0
    x = torch.softmax(logits, -1)
    y = torch.softmax(torch.randn(batch, n, 3 * t, generator=g) * 2.0, -1) @ torch.randn(batch, 3 * t, d, generator=g)
    prior = torch.randn(batch, t, d, generator=g)
    return x.to(device), y.to(device), prior.to(device)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (out.double() - ref).norm(dim=(1, 2)) / ref.norm(dim=(1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(3, 100, 37, 20), (2, 1024, 256, 128), (2, 520, 300, 64)])
@pytest.mark.parametrize("probes_contiguous", [False, True])
def test_normal_products_match_float64(shape, probes_contiguous):
    batch, n, t, d = shape
    x, y, _ = _design(batch, n, t, d, "cuda")
    if probes_contiguous:  # the layout the event's kernels write
        x, y = x.mT.contiguous().mT, y.mT.contiguous().mT
    gram, xty = normal_products(x, y)
    x64, y64 = x.double(), y.double()
    assert _rel(gram, x64.mT @ x64).max() < 5e-7
    assert _rel(xty, x64.mT @ y64).max() < 5e-7
    assert torch.equal(gram, gram.mT)  # mirrored tiles: exactly symmetric


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape", [(4, 1024, 256, 128), (3, 130, 37, 20), (2, 700, 300, 128), (5, 64, 32, 100), (2, 200, 48, 300)]
)
def test_cholesky_solve_matches_float64(shape):
    batch, n, t, d = shape
    x, y, prior = _design(batch, n, t, d, "cuda", seed=1)
    a, rhs, _ = ridge_system(x, y, prior, 1e-4)
    a64, rhs64 = a.double(), rhs.double()
    ref = torch.linalg.solve(a64, rhs64)
    torch_sol, torch_ok = cholesky_solve_ex(a, rhs)
    sol, ok = cholesky_solve(a.clone(), rhs)
    assert ok.all() and torch_ok.all()
    cond = torch.linalg.cond(a64)
    err = _rel(sol, ref)
    assert (err <= 20 * cond * EPS32).all(), (err, cond)
    assert (err <= 2 * _rel(torch_sol, ref) + 1e-6).all()


@pytest.mark.gpu
@settings(max_examples=30, deadline=None)
@given(
    batch=st.integers(1, 4),
    t=st.integers(1, 300),
    n=st.integers(1, 700),
    w=st.integers(1, 200),
    ridge=st.sampled_from([1e-6, 1e-4, 1e-2]),
    seed=st.integers(0, 10_000),
)
def test_ridge_kernels_on_any_shape(batch, t, n, w, ridge, seed):
    """Property: for any sizes (fewer probes than keys included, partial tiles and blocks, one
    column) the products match float64 and the solve matches a float64 solve of the same float32
    system to its conditioning, every system flagged good."""
    x, y, prior = _design(batch, n, t, w, "cuda", seed=seed)
    gram, xty = normal_products(x.mT.contiguous().mT, y)
    x64 = x.double()
    assert _rel(gram, x64.mT @ x64).max() < 5e-7 and _rel(xty, x64.mT @ y.double()).max() < 5e-7
    a, rhs, _ = ridge_system(x, y, prior, ridge)
    a64 = a.double()
    ref = torch.linalg.solve(a64, rhs.double())
    sol, ok = cholesky_solve(a.clone(), rhs)
    assert ok.all()
    err = _rel(sol, ref)
    assert (err <= 20 * torch.linalg.cond(a64) * EPS32 + 1e-6).all(), err


@pytest.mark.gpu
def test_cholesky_solve_flags_failures_like_cusolver():
    x, y, prior = _design(8, 256, 64, 32, "cuda", seed=2)
    a, rhs, _ = ridge_system(x, y, prior, 1e-4)
    a[0].diagonal().sub_(10.0)  # indefinite from the first pivot
    a[1, 40, 40] = -1.0  # indefinite in a later block
    a[2, 5, 5] = float("nan")
    rhs[3, 7, 0] = float("inf")  # factors, but the solution is not finite
    sol, ok = cholesky_solve(a.clone(), rhs)
    _, torch_ok = cholesky_solve_ex(a, rhs)
    assert ok.tolist() == torch_ok.tolist() == [False] * 4 + [True] * 4
    assert sol[ok].isfinite().all()


def test_cholesky_solve_falls_back_to_torch_off_the_gpu():
    x, y, prior = _design(2, 64, 16, 8, "cpu", seed=3)
    a, rhs, _ = ridge_system(x, y, prior, 1e-4)
    sol, ok = cholesky_solve(a, rhs)
    ref, ref_ok = cholesky_solve_ex(a, rhs)
    assert torch.equal(sol, ref) and torch.equal(ok, ref_ok)
    gram, xty = normal_products(x, y)
    assert torch.equal(gram, x.mT @ x) and torch.equal(xty, x.mT @ y)
