"""The value-map designs' two softmaxes in one pass (``span_and_kept_softmax``) vs float64 math.

The reference (torch ops, what runs on CPU) is checked everywhere; the Triton kernel under
``TRITON_INTERPRET=1`` on CPU or on a CUDA device (skipped otherwise).
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from compaction_gym.engine.fast.kernels import HAS_TRITON, _interpreting
from compaction_gym.engine.fast.softmax import span_and_kept_softmax, span_and_kept_softmax_ref


def problem(seed: int, B: int, n: int, w: int, t: int, bias: bool, beta: bool, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    raw = 4 * torch.randn(B, n, w, generator=g)
    kept = torch.stack([torch.randperm(w, generator=g)[:t] for _ in range(B)])
    b = torch.randn(B, w, generator=g) - 1 if bias else None
    be = 2 * torch.randn(B, t, generator=g) if beta else None
    return [x.to(device) if x is not None else None for x in (raw, kept, b, be)]


def float64_softmaxes(raw, scale, kept, bias, beta, row_mask=None):
    """``(xs, attn)`` in float64, written out from the definitions (``xs`` rows zero where
    ``row_mask`` is False)."""
    s = raw.double() * scale
    logits = s + (bias.double()[:, None, :] if bias is not None else 0.0)
    attn = torch.exp(logits - logits.amax(-1, keepdim=True))
    attn = attn / attn.sum(-1, keepdim=True)
    kl = torch.stack([(logits if beta is None else s)[b][:, kept[b]] for b in range(raw.shape[0])])
    if beta is not None:
        kl = kl + beta.double()[:, None, :]
    xs = torch.exp(kl - kl.amax(-1, keepdim=True))
    xs = xs / xs.sum(-1, keepdim=True)
    if row_mask is not None:
        xs = torch.where(row_mask[:, :, None], xs, torch.zeros_like(xs))
    return xs, attn


def kernel_device() -> str:
    if HAS_TRITON and _interpreting():
        return "cpu"
    if HAS_TRITON and torch.cuda.is_available():
        return "cuda"
    pytest.skip("the kernel needs TRITON_INTERPRET=1 (CPU) or a CUDA device")


SHAPES = st.tuples(
    st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 5), st.integers(1, 70), st.booleans(), st.booleans()
)


def padding(B: int, n: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """A row mask ``[B, n]``: each problem's first ``count`` probes real, the rest padding."""
    counts = torch.randint(0, n + 1, (B,), generator=torch.Generator().manual_seed(seed))
    return (torch.arange(n)[None, :] < counts[:, None]).to(device)


@settings(max_examples=40, deadline=None)
@given(SHAPES, st.booleans(), st.data())
def test_reference_equals_float64(shape, masked, data):
    seed, B, n, w, bias, beta = shape
    t = data.draw(st.integers(1, w))
    raw, kept, b, be = problem(seed, B, n, w, t, bias, beta)
    mask = padding(B, n, seed) if masked else None
    want = float64_softmaxes(raw, 0.37, kept, b, be, mask)
    got = span_and_kept_softmax_ref(raw.clone(), 0.37, kept, b, be, mask)
    for x, y in zip(got, want):
        assert x.dtype == torch.float32 and (x.double() - y).abs().max().item() < 1e-6


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("beta", [False, True])
@pytest.mark.parametrize(("n", "w", "t"), [(1, 1, 1), (3, 37, 9), (4, 64, 64), (2, 300, 75), (40, 192, 48), (7, 600, 100)])
def test_kernel_equals_float64_and_the_reference(n, w, t, bias, beta, masked):
    dev = kernel_device()
    raw, kept, b, be = problem(w + t, 3, n, w, t, bias, beta, dev)
    mask = padding(3, n, w + t, dev) if masked else None
    want = float64_softmaxes(raw, 0.37, kept, b, be, mask)
    ref = span_and_kept_softmax_ref(raw.clone(), 0.37, kept, b, be, mask)
    buf = raw.clone()
    xs, attn = span_and_kept_softmax(buf, 0.37, kept, b, be, mask)
    assert attn.data_ptr() == buf.data_ptr()  # attn is written over the logits
    for x, y, r in zip((xs, attn), want, ref):
        assert x.shape == r.shape and x.dtype == torch.float32
        assert (x.double() - y).abs().max().item() < 1e-6
        assert (x - r).abs().max().item() < 1e-6
