"""FlexAttention with a float32 per-key bias (one-pass replay's β buckets) against float64 attention."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from compaction_gym.engine.fast.flex import flex_bias_supported, key_bias_attention, position_block_mask


def problem(seed: int, P: int, H: int, G: int, n: int, W: int, d: int, dtype: torch.dtype):
    """Pieces whose first ``c`` columns are a snapshot every query sees, then their own tokens
    (causal), then padding; the queries grouped by KV head, as one-pass replay lays them out."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(P, H, G * n, d, generator=g).to(dtype)
    k = torch.randn(P, H, W, d, generator=g).to(dtype)
    v = torch.randn(P, H, W, d, generator=g).to(dtype)
    bias = 3 * torch.randn(P, H, W, generator=g)
    big = torch.iinfo(torch.int64).max
    colpos = torch.full((P, W), big, dtype=torch.int64)
    qpos = torch.full((P, n), big - 1, dtype=torch.int64)
    for p in range(P):
        c = int(torch.randint(1, W - n + 1, (1,), generator=g))
        own = int(torch.randint(1, n + 1, (1,), generator=g))
        colpos[p, :c] = -1
        colpos[p, c : c + own] = torch.arange(own)
        qpos[p, :own] = torch.arange(own)
    return q, k, v, bias, colpos, qpos


def float64_attention(q, k, v, bias, colpos, qpos, scale):
    n = qpos.shape[1]
    G = q.shape[2] // n
    allowed = colpos[:, None, :] <= qpos.repeat(1, G)[:, :, None]  # [P, G·n, W]
    s = scale * q.double() @ k.double().mT + bias.double()[:, :, None, :]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 2, 2, 40, 200, 64), (5, 4, 3, 129, 300, 128), (1, 1, 1, 7, 9, 64)])
def test_key_bias_attention_equals_float64(dtype, shape):
    """Forward and gradients (q, k, v) within the half-precision rounding of float64 attention with
    β added to the logits and the positions' mask; a wrong β (zeros) is far off."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    P, H, G, n, W, d = shape
    q, k, v, bias, colpos, qpos = (x.cuda() for x in problem(sum(shape), P, H, G, n, W, d, dtype))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    assert flex_bias_supported(q)
    scale = d**-0.5
    block_mask = position_block_mask(colpos, qpos, G)
    out = key_bias_attention(q, k, v, bias, block_mask, scaling=scale)
    grad_out = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = float64_attention(q64, k64, v64, bias, colpos, qpos, scale)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), grad_out.double())
    eps = torch.finfo(dtype).eps
    assert out.dtype == dtype and out.shape == ref.shape
    assert (out.double() - ref).abs().max().item() < 8 * eps
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        scale_ = want.abs().max().item()
        assert (got.double() - want).abs().max().item() < 16 * eps * max(scale_, 1.0)
    without = key_bias_attention(q, k, v, torch.zeros_like(bias), block_mask, scaling=scale)
    assert (without.double() - ref).abs().max().item() > 20 * eps


def test_not_supported_off_the_gpu():
    """On CPU tensors (and in float32) one-pass replay keeps the folded / float32 β paths."""
    assert not flex_bias_supported(torch.zeros(2, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        assert not flex_bias_supported(torch.zeros(2, device="cuda"))


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 200), st.integers(2, 400)),
    block=st.sampled_from([16, 128]),
)
def test_position_block_mask_equals_create_block_mask(seed, shape, block):
    """The padded rule is the real one where it is real, never shows padding keys and leaves no query
    row fully masked; its tiles, built from the positions' extremes, are exactly ``create_block_mask``'s
    (the dense evaluation of the same rule): which tiles are skipped, partial and full, and the
    element mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    P, G, n, W = shape
    n = min(n, W - 1)
    _, _, _, _, colpos, qpos = problem(seed, P, 1, G, n, W, 8, torch.float32)

    mask = position_block_mask(colpos, qpos, G, block=block)
    Pp, Qp, Wp = mask.colpos.shape[0], mask.qpos.shape[1], mask.colpos.shape[1]
    assert Pp >= max(P, 2) and Qp > block and Wp > block  # no size dynamo would specialise
    dense = mask.colpos[:, None, :] <= mask.qpos[:, :, None]  # [P', Q', W']
    want = colpos[:, None, :] <= qpos.repeat(1, G)[:, :, None]
    assert torch.equal(dense[:P, : G * n, :W], want)  # the real rule where it is real ...
    assert not dense[:P, :, W:].any()  # ... padding keys never seen ...
    real_cols = colpos < torch.iinfo(torch.int64).max
    assert torch.equal(dense[:P, G * n :, :W], real_cols[:, None, :].expand(-1, Qp - G * n, -1))  # padded queries
    assert dense.any(-1).all()  # ... and no query row fully masked (padded pieces see column 0)

    def padded(b, h, q, k):
        return mask.colpos[b, k] <= mask.qpos[b, q]

    ref = create_block_mask(padded, Pp, None, Qp, Wp, device="cpu", BLOCK_SIZE=block)
    got = mask.block_mask
    assert got.shape == ref.shape
    for nums, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        a_num, b_num = getattr(got, nums), getattr(ref, nums)
        assert torch.equal(a_num.long(), b_num.long()), nums
        a_idx, b_idx = getattr(got, idx), getattr(ref, idx)
        for p in range(P):
            for t in range(a_num.shape[-1]):
                k = int(a_num[p, 0, t])
                assert sorted(a_idx[p, 0, t, :k].tolist()) == sorted(b_idx[p, 0, t, :k].tolist())
    assert torch.equal(got.to_dense(), ref.to_dense())


@pytest.mark.gpu
def test_new_bucket_shapes_do_not_recompile():
    """A GRPO batch's buckets change shape every step: from a fresh process's state, four shapes
    (tile counts of queries and keys equal and not) compile one graph, and twelve more (pieces,
    queries, widths — single pieces, fewer than 128 queries or keys included — forward and backward)
    compile nothing new — a static compile would hit
    dynamo's recompile limit and fall back to the unfused kernel, ~60× slower."""
    from torch._dynamo.utils import counters

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import compaction_gym.engine.fast.flex as flex

    # as a new process: earlier tests' compiles would have let dynamo widen the guards already
    torch._dynamo.reset()
    flex._compiled = None
    start = counters["stats"]["unique_graphs"]

    def run(P, n, W, seed):
        q, k, v, bias, colpos, qpos = (x.cuda() for x in problem(seed, P, 2, 2, n, W, 64, torch.bfloat16))
        q.requires_grad_()
        out = key_bias_attention(q, k, v, bias, position_block_mask(colpos, qpos, 2), scaling=0.125)
        out.float().sum().backward()

    # first shapes: every combination of query / key lengths divisible by the kernel's block or not
    for i, (P, n, W) in enumerate([(5, 64, 256), (7, 90, 410), (4, 64, 300), (6, 45, 256)]):
        run(P, n, W, i)
    before = counters["stats"]["unique_graphs"]
    assert before == start + 1  # one graph, whatever the tile counts
    for i, (P, n, W) in enumerate([(3, 17, 140), (9, 129, 520), (1, 5, 60), (4, 200, 333), (12, 40, 90),
                                   (2, 256, 700), (6, 33, 257), (1, 64, 128), (8, 101, 384), (5, 7, 64),
                                   (10, 77, 199), (3, 150, 611)]):  # fmt: skip
        run(P, n, W, 10 + i)
    assert counters["stats"]["unique_graphs"] == before
    assert flex._failure is None
