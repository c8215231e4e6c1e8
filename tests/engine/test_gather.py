"""``gather_rows``: the same rows as ``embedding`` (the reference), and the same gradient bits."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from compaction_gym.engine.fast.gather import gather_rows, gather_supported

CUDA = torch.cuda.is_available()


def test_on_cpu_it_is_embedding():
    x = torch.randn(50, 7, requires_grad=True)
    idx = torch.randint(0, 50, (3, 4))
    assert not gather_supported(x, idx)
    got = gather_rows(x, idx)
    assert got.shape == (3, 4, 7) and torch.equal(got, x.detach()[idx])
    got.sum().backward()
    want = torch.zeros(50, 7).index_add_(0, idx.reshape(-1), torch.ones(12, 7))
    assert torch.equal(x.grad, want)


class _EmulatedKernel:
    """``_gather_rows_kernel[grid](...)`` in torch on the CPU: what the Triton program computes
    (rows at a row stride, a zero row for an index outside ``[0, rows)``), written into ``out``."""

    def __getitem__(self, grid):
        def launch(x, flat, out, n, rows, stride_x, D, BLOCK_D, BLOCK_R, num_warps):
            assert grid[0] * BLOCK_R >= n and BLOCK_D >= D and out.is_contiguous()
            src = torch.as_strided(x, (rows, D), (stride_x, 1))
            ok = (flat >= 0) & (flat < rows)
            out.view(-1, D).copy_(src[flat.clamp(0, rows - 1)] * ok[:, None])

        return launch


def test_the_autograd_function_on_cpu_with_the_kernel_emulated(monkeypatch):
    """The Triton path's autograd structure, run on the CPU with the kernel emulated: values and
    gradients equal embedding's for indices of several shapes, and the output may be written in
    place (as the folded-β attention writes its gathered keys) before the backward."""
    from types import SimpleNamespace

    import compaction_gym.engine.fast.gather as gather

    monkeypatch.setattr(gather, "_gather_rows_kernel", _EmulatedKernel(), raising=False)
    monkeypatch.setattr(
        gather, "triton", SimpleNamespace(next_power_of_2=lambda v: 1 << (v - 1).bit_length(),
                                          cdiv=lambda a, b: -(-a // b)), raising=False,
    )  # fmt: skip
    monkeypatch.setattr(gather, "gather_supported", lambda x, idx: True)
    g = torch.Generator().manual_seed(0)
    for shape, d in (((7,), 5), ((3, 4), 136), ((2, 0), 8), ((2, 3, 5), 1)):
        x = torch.randn(40, d, generator=g, dtype=torch.float64)
        idx = torch.randint(0, 40, shape, generator=g)
        xg, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        got, want = gather_rows(xg, idx), torch.nn.functional.embedding(idx, xe)
        assert got.shape == want.shape and torch.equal(got, want)
        assert got._base is None  # a tensor of its own, not a view made inside the Function
        grad = torch.randn(want.shape, generator=g, dtype=torch.float64)
        for y in (got, want):
            y[..., d - 1] = 0  # through a view, in place
            y.backward(grad)
        assert torch.equal(xg.grad, xe.grad)
        with torch.no_grad():
            assert torch.equal(gather_rows(x, idx), x[idx])
    far = gather_rows(torch.ones(4, 3), torch.tensor([1, 4, -1]))
    assert far.tolist() == [[1.0] * 3, [0.0] * 3, [0.0] * 3]
    _check_cast(gather_rows, torch.device("cpu"))


def _check_cast(gather, device: torch.device) -> None:
    """``gather(x, idx, dtype)`` equals ``embedding(idx, x).to(dtype)``, values and gradient bits."""
    g = torch.Generator(device=device).manual_seed(3)
    for src, dst in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float64)):
        x = (torch.randn(300, 72, generator=g, device=device) * 30).to(src)
        idx = torch.randint(0, 300, (5, 41), generator=g, device=device)
        xg, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        got, want = gather(xg, idx, dst), torch.nn.functional.embedding(idx, xe).to(dst)
        assert got.dtype == dst and torch.equal(got, want)
        grad = torch.randn(want.shape, generator=g, device=device).to(dst)
        got.backward(grad)
        want.backward(grad)
        assert xg.grad.dtype == src and torch.equal(xg.grad, xe.grad)
        with torch.no_grad():
            assert torch.equal(gather(x, idx, dst), x[idx].to(dst))


def _check(rows: int, d: int, shape: tuple[int, ...], dtype: torch.dtype, index_dtype: torch.dtype,
           seed: int, row_stride: int | None = None) -> None:  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(seed)
    width = row_stride or d
    base = (torch.randn(rows, width, generator=g, device="cuda") * 100).to(dtype)
    x = base[:, :d]  # rows wider than d: a row stride of their own
    idx = torch.randint(0, rows, shape, generator=g, device="cuda").to(index_dtype)
    assert gather_supported(x, idx)
    got = gather_rows(x, idx)
    want = torch.nn.functional.embedding(idx, x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got, want)
    if dtype.is_floating_point:
        xg = x.detach().clone().requires_grad_(True)
        xe = x.detach().clone().requires_grad_(True)
        grad = torch.randn(want.shape, generator=g, device="cuda").to(dtype)
        for x_, f in ((xg, gather_rows), (xe, lambda w, i: torch.nn.functional.embedding(i, w))):
            y = f(x_, idx)
            if d > 1:  # written in place through a view, as the folded-β attention writes its keys
                y[..., d - 1] = 0
            y.backward(grad)
        # embedding's own backward: the same bits up to 3,072 indices; above that (CUDA's sort-based
        # path) a case of 3,073 indices of one row differed in the last bit (docs/benchmarks.md,
        # "Session 25"), so every size is held to the float64 sum instead
        if idx.numel() <= 3072:
            assert torch.equal(xg.grad, xe.grad)
        g64 = grad.double().reshape(-1, d).clone()
        if d > 1:
            g64[:, d - 1] = 0
        flat = idx.reshape(-1).long()
        ref = torch.zeros(rows, d, dtype=torch.float64, device="cuda").index_add_(0, flat, g64)
        scale = torch.zeros_like(ref).index_add_(0, flat, g64.abs())
        count = torch.zeros(rows, 1, dtype=torch.float64, device="cuda").index_add_(
            0, flat, torch.ones(flat.numel(), 1, dtype=torch.float64, device="cuda")
        )
        # a sum of k terms in any order is within k·eps·Σ|terms| of the exact one (plus the final rounding)
        tol = (count + 1) * torch.finfo(dtype).eps * scale + 1e-30
        assert ((xg.grad.double() - ref).abs() <= tol).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("d", [1, 64, 128, 136, 200])
def test_rows_and_gradients_equal_embedding(dtype, d):
    _check(3000, d, (40, 37), dtype, torch.int64, seed=d)
    _check(3000, d, (501,), dtype, torch.int32, seed=d + 1, row_stride=d + 24)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 5000),
    d=st.integers(1, 300),
    n=st.integers(0, 4000),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_any_shape_equals_embedding(rows, d, n, dtype, index_dtype, seed):
    _check(rows, d, (n,), dtype, index_dtype, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_the_cast_in_the_gather_equals_embedding_then_to():
    _check_cast(gather_rows, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_an_index_out_of_range_reads_a_zero_row_not_memory_past_x():
    x = torch.randn(10, 128, device="cuda", dtype=torch.bfloat16) + 5
    got = gather_rows(x, torch.tensor([3, 10, -1, 1 << 40, 9], device="cuda"))
    assert torch.equal(got[[0, 4]], x[[3, 9]])
    assert not got[1:4].any()
