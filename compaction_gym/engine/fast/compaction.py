"""Attention Matching in one pass over the cache: fused Triton kernels, no ``[B, n, T]`` tensor.

:func:`compact_fast` computes what :func:`compaction_gym.compaction.api` computes for
``mode="attention_matching"`` (same selection rule, same β target and NNLS, same ridge C2), for
all layers × KV heads at once, without materialising the probe × key logits:

1. ``_stats_kernel`` (one program per block of probes of one row) streams the row's keys once:
   an online log-sum-exp over the whole cache (``lse_all``), and over the span a flash-attention
   pass that yields ``lse_span`` and the target ``Y = softmax_W(S) V_W`` (float32);
2. ``_importance_kernel`` (one program per block of span keys) recomputes the span logits tile
   by tile and sums ``exp(2 (S − lse_all))`` over the probes: RMS attention up to a constant, so
   the top-t set is the same;
3. the kept keys' logits ``S_sel`` give the β design ``A = exp(S_sel − lse_span)``
   (``_design_kernel``, written straight in bf16 for half-precision caches) and C2's design
   ``softmax(S_sel + β)`` (``_kept_softmax_kernel``); both gather the kept keys and recompute their
   logits on the tensor cores, so ``S_sel`` is never stored. β's fit is the package's
   (same box ``w ∈ [e⁻³, e³]``, ridge toward ``w = 1``, probe guard and ``w = 1`` safeguard,
   :func:`~compaction_gym.compaction.beta.beta_weights`), solved on the Gram matrix ``AᵀA`` (one
   batched product, bf16 operands for half-precision caches) by a fixed number of box-projected
   FISTA iterations in one Triton kernel (:mod:`~compaction_gym.engine.fast.nnls`: no
   factorisation, no host sync); C2 is the package's own ridge system without a host sync
   (:func:`~compaction_gym.compaction.values.ridge_solve_ex`: ridge toward the kept rows' values)
   with its products and its Cholesky solve as Triton kernels (:mod:`~compaction_gym.engine.fast.ridge`;
   both designs are written with the probes contiguous for the tensor cores): a problem that does
   not factor (never seen with the ridge floor) keeps its selected rows' values instead of the
   reference's pseudo-inverse fallback.

Products of bf16 keys and queries are exact in the kernels' float32 accumulators, so the scores
match the reference's float32 scores to rounding. Other modes, CPU tensors and machines without
Triton go to :func:`~compaction_gym.compaction.api` itself.
"""

from __future__ import annotations

import math

import torch

from compaction_gym.compaction import CompactionResult, compact
from compaction_gym.compaction.beta import (
    BETA_BOUNDS,
    BETA_CLAMP,
    BETA_MIN_PROBES_PER_KEY,
    BETA_RIDGE,
    keep_if_better,
    probe_guard,
    regularised_system,
)
from compaction_gym.compaction.values import ridge_solve_ex
from compaction_gym.engine.fast.kernels import HAS_TRITON, use_triton
from compaction_gym.engine.fast.nnls import FISTA_ITERS, nnls_fista
from compaction_gym.engine.fast.ridge import cholesky_solve, normal_products

if HAS_TRITON:
    import triton
    import triton.language as tl

    from compaction_gym.engine.fast.kernels import mma

    @triton.jit
    def _lse_range(q, K, KB, stride_kt, lo, hi, scale_log2, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        """Online (max, sum) in base 2 of ``q``'s logits against keys ``[lo, hi)``."""
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for t0 in range(lo, hi, BLOCK_N):
            cols = t0 + offs_n
            cmask = cols < hi
            k = tl.load(K + cols[None, :] * stride_kt + offs_d[:, None], mask=cmask[None, :], other=0.0)
            st = mma(q, k, IEEE) * scale_log2
            if HAS_BIAS:
                st += tl.load(KB + cols, mask=cmask, other=0.0)[None, :] * 1.4426950408889634
            st = tl.where(cmask[None, :], st, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(st, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(st - m_safe[:, None]), axis=1)
            m_i = m_new
        return m_i, l_i

    @triton.jit(do_not_specialize=["n", "T", "s", "e"])  # sizes vary per event: compile once
    def _stats_kernel(
        Q, K, V, KB, MASK, LSE_ALL, LSE_SPAN, Y,
        stride_qb, stride_qn, stride_kb, stride_kt, stride_vb, stride_vt, stride_kbb, stride_yb, stride_yn, stride_yd,
        n, T, s, e, scale_log2,
        HAS_BIAS: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        D: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """Per probe, its log-sum-exp over the whole row and over the span, and its span attention
        output ``Y``; a padding probe (``MASK`` 0) gets ``lse_all = +inf`` and ``Y = 0``."""
        mb = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        mmask = offs_m < n
        q = tl.load(Q + b * stride_qb + offs_m[:, None] * stride_qn + offs_d[None, :], mask=mmask[:, None], other=0.0)
        # keys outside the span: log-sum-exp only
        m_o, l_o = _lse_range(q, K + b * stride_kb, KB + b * stride_kbb, stride_kt, 0, s, scale_log2, HAS_BIAS, BLOCK_M, BLOCK_N, D, IEEE)
        m_2, l_2 = _lse_range(q, K + b * stride_kb, KB + b * stride_kbb, stride_kt, e, T, scale_log2, HAS_BIAS, BLOCK_M, BLOCK_N, D, IEEE)
        m_x = tl.maximum(m_o, m_2)
        m_x = tl.where(m_x == float("-inf"), 0.0, m_x)
        l_o = l_o * tl.exp2(m_o - m_x) + l_2 * tl.exp2(m_2 - m_x)
        m_o = m_x
        # the span: flash attention for Y and its own log-sum-exp
        m_s = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_s = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for t0 in range(s, e, BLOCK_N):
            cols = t0 + offs_n
            cmask = cols < e
            k = tl.load(K + b * stride_kb + cols[None, :] * stride_kt + offs_d[:, None], mask=cmask[None, :], other=0.0)
            st = mma(q, k, IEEE) * scale_log2
            if HAS_BIAS:
                st += tl.load(KB + b * stride_kbb + cols, mask=cmask, other=0.0)[None, :] * 1.4426950408889634
            st = tl.where(cmask[None, :], st, float("-inf"))
            m_new = tl.maximum(m_s, tl.max(st, axis=1))
            p = tl.exp2(st - m_new[:, None])
            alpha = tl.exp2(m_s - m_new)
            v = tl.load(V + b * stride_vb + cols[:, None] * stride_vt + offs_d[None, :], mask=cmask[:, None], other=0.0)
            pv = mma(p.to(v.dtype), v, IEEE)
            acc = acc * alpha[:, None] + pv
            l_s = l_s * alpha + tl.sum(p, axis=1)
            m_s = m_new
        lse_span2 = m_s + tl.log2(l_s)
        mx = tl.maximum(m_o, lse_span2)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        lse_all2 = mx + tl.log2(tl.exp2(m_o - mx) * l_o + tl.exp2(lse_span2 - mx))
        ln2 = 0.6931471805599453
        y = acc / l_s[:, None]
        lse_all = lse_all2 * ln2
        if HAS_MASK:
            real = tl.load(MASK + b * n + offs_m, mask=mmask, other=0) != 0
            lse_all = tl.where(real, lse_all, float("inf"))
            y = tl.where(real[:, None], y, 0.0)
        tl.store(LSE_ALL + b * n + offs_m, lse_all, mask=mmask)
        tl.store(LSE_SPAN + b * n + offs_m, lse_span2 * ln2, mask=mmask)
        y_ptr = Y + b * stride_yb + offs_m[:, None] * stride_yn + offs_d[None, :] * stride_yd
        tl.store(y_ptr, y, mask=mmask[:, None])

    @triton.jit(do_not_specialize=["n", "s", "e"])
    def _importance_kernel(
        Q, K, KB, LSE_ALL, OUT,
        stride_qb, stride_qn, stride_kb, stride_kt, stride_kbb,
        n, s, e, scale_log2,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        cb = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        cols = s + cb * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < e
        offs_d = tl.arange(0, D)
        k = tl.load(K + b * stride_kb + cols[None, :] * stride_kt + offs_d[:, None], mask=cmask[None, :], other=0.0)
        bias = tl.zeros([BLOCK_N], tl.float32)
        if HAS_BIAS:
            bias = tl.load(KB + b * stride_kbb + cols, mask=cmask, other=0.0) * 1.4426950408889634
        acc = tl.zeros([BLOCK_N], tl.float32)
        for m0 in range(0, n, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            mmask = offs_m < n
            q = tl.load(Q + b * stride_qb + offs_m[:, None] * stride_qn + offs_d[None, :], mask=mmask[:, None], other=0.0)
            st = mma(q, k, IEEE) * scale_log2
            lse2 = tl.load(LSE_ALL + b * n + offs_m, mask=mmask, other=0.0) * 1.4426950408889634
            a = tl.exp2(2.0 * (st + bias[None, :] - lse2[:, None]))
            acc += tl.sum(tl.where(mmask[:, None], a, 0.0), axis=0)
        tl.store(OUT + b * (e - s) + cols - s, tl.sqrt(acc / n), mask=cmask)

    @triton.jit
    def _kept_logits(Q, K, IDX, BETA, b, offs_m, mmask, cols, stride_qb, stride_qn, stride_kb, stride_kt, t,
                      scale_log2, HAS_BETA: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):  # fmt: skip
        """Base-2 logits ``[BLOCK_M, BLOCK_N]`` of probes ``offs_m`` against the kept keys ``cols`` (+ β)."""
        offs_d = tl.arange(0, D)
        cmask = cols < t
        idx = tl.load(IDX + b * t + cols, mask=cmask, other=0)
        q = tl.load(Q + b * stride_qb + offs_m[:, None] * stride_qn + offs_d[None, :], mask=mmask[:, None], other=0.0)
        k = tl.load(K + b * stride_kb + idx[None, :] * stride_kt + offs_d[:, None], mask=cmask[None, :], other=0.0)
        st = mma(q, k, IEEE) * scale_log2
        if HAS_BETA:
            st += tl.load(BETA + b * t + cols, mask=cmask, other=0.0)[None, :] * 1.4426950408889634
        return st

    @triton.jit(do_not_specialize=["n", "t"])
    def _design_kernel(
        Q, K, IDX, BETA, LSE, MASK, OUT,
        stride_qb, stride_qn, stride_kb, stride_kt, n, t, scale_log2,
        HAS_BETA: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        D: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        """β's design ``exp(S_sel + β_old − lse_span)`` ``[B, n, t]`` (zero on padding probes)."""
        mb = tl.program_id(0)
        cb = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        mmask = offs_m < n
        st = _kept_logits(Q, K, IDX, BETA, b, offs_m, mmask, cols, stride_qb, stride_qn, stride_kb, stride_kt, t,
                           scale_log2, HAS_BETA, D, IEEE)  # fmt: skip
        lse2 = tl.load(LSE + b * n + offs_m, mask=mmask, other=0.0) * 1.4426950408889634
        keep = mmask
        if HAS_MASK:
            keep = keep & (tl.load(MASK + b * n + offs_m, mask=mmask, other=0) != 0)
        a = tl.where(keep[:, None], tl.exp2(st - lse2[:, None]), 0.0)
        out = OUT + b * n * t + offs_m[:, None] * t + cols[None, :]
        tl.store(out, a.to(OUT.dtype.element_ty), mask=mmask[:, None] & (cols[None, :] < t))

    @triton.jit(do_not_specialize=["n", "t"])
    def _kept_softmax_kernel(
        Q, K, IDX, BETA, MASK, OUT,
        stride_qb, stride_qn, stride_kb, stride_kt, n, t, scale_log2,
        HAS_BETA: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        D: tl.constexpr, IEEE: tl.constexpr, ONE_TILE: tl.constexpr,
    ):  # fmt: skip
        """C2's design ``softmax(S_sel + β)`` ``[B, n, t]`` float32 (zero on padding probes), stored
        with the probes contiguous (``OUT`` is ``[B, t, n]``): in one tile when ``t ≤ BLOCK_N``,
        else the row's log-sum-exp online over the kept keys, then the probabilities."""
        mb = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = offs_m < n
        keep = mmask
        if HAS_MASK:
            keep = keep & (tl.load(MASK + b * n + offs_m, mask=mmask, other=0) != 0)
        if ONE_TILE:  # every kept key in one tile: the logits are computed once
            cols = tl.arange(0, BLOCK_N)
            st = _kept_logits(Q, K, IDX, BETA, b, offs_m, mmask, cols, stride_qb, stride_qn, stride_kb, stride_kt,
                               t, scale_log2, HAS_BETA, D, IEEE)  # fmt: skip
            st = tl.where(cols[None, :] < t, st, float("-inf"))
            m_i = tl.max(st, axis=1)
            p = tl.exp2(st - m_i[:, None])
            x = tl.where(keep[:, None], p / tl.sum(p, axis=1)[:, None], 0.0)
            out = OUT + b * n * t + offs_m[:, None] + cols[None, :] * n
            tl.store(out, x, mask=mmask[:, None] & (cols[None, :] < t))
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            for c0 in range(0, t, BLOCK_N):
                cols = c0 + tl.arange(0, BLOCK_N)
                st = _kept_logits(Q, K, IDX, BETA, b, offs_m, mmask, cols, stride_qb, stride_qn, stride_kb, stride_kt,
                                   t, scale_log2, HAS_BETA, D, IEEE)  # fmt: skip
                st = tl.where(cols[None, :] < t, st, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(st, axis=1))
                l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(st - m_new[:, None]), axis=1)
                m_i = m_new
            lse2 = m_i + tl.log2(l_i)
            for c0 in range(0, t, BLOCK_N):
                cols = c0 + tl.arange(0, BLOCK_N)
                st = _kept_logits(Q, K, IDX, BETA, b, offs_m, mmask, cols, stride_qb, stride_qn, stride_kb, stride_kt,
                                   t, scale_log2, HAS_BETA, D, IEEE)  # fmt: skip
                x = tl.where(keep[:, None], tl.exp2(st - lse2[:, None]), 0.0)
                out = OUT + b * n * t + offs_m[:, None] + cols[None, :] * n
                tl.store(out, x, mask=mmask[:, None] & (cols[None, :] < t))


def _span_stats(
    keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, span: tuple[int, int], scale: float,
    key_bias: torch.Tensor | None, query_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``lse_all [B, n]``, ``lse_span [B, n]``, ``Y [B, n, d_v]`` and importance ``[B, W]`` (kernels).

    Padding probes (``query_mask`` ``False``) get ``lse_all = +inf``, so their attention, and their
    share of the importance, is exactly 0 (the importance is then the real probes' RMS attention
    scaled by ``sqrt(n_real / n)``, a per-row constant: the same top-t set), and ``Y = 0``, which
    leaves them out of C2's products.
    """
    batch, T, d = keys.shape
    n = queries.shape[1]
    s, e = span
    dev = keys.device
    lse_all = torch.empty(batch, n, dtype=torch.float32, device=dev)
    lse_span = torch.empty_like(lse_all)
    # Y with the probes contiguous (a [B, d_v, n] buffer): what C2's tensor-core products want
    y = torch.empty(batch, values.shape[-1], n, dtype=torch.float32, device=dev).mT
    imp = torch.empty(batch, e - s, dtype=torch.float32, device=dev)
    ieee = keys.dtype == torch.float32
    kb = key_bias.float().contiguous() if key_bias is not None else lse_all
    common = dict(HAS_BIAS=key_bias is not None, D=d, IEEE=ieee)
    block_m = 64
    mask = query_mask.contiguous() if query_mask is not None else lse_all  # never read without HAS_MASK
    _stats_kernel[(triton.cdiv(n, block_m), batch)](
        queries, keys, values, kb, mask, lse_all, lse_span, y,
        queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        kb.stride(0), *y.stride(), n, T, s, e, scale * 1.4426950408889634, HAS_MASK=query_mask is not None,
        BLOCK_M=block_m, BLOCK_N=32 if ieee else 64, num_warps=4, num_stages=2 if ieee else 3, **common,
    )  # fmt: skip
    _importance_kernel[(triton.cdiv(e - s, 64), batch)](
        queries, keys, kb, lse_all, imp,
        queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(1), kb.stride(0),
        n, s, e, scale * 1.4426950408889634,
        BLOCK_M=32 if ieee else 64, BLOCK_N=64, num_warps=4, num_stages=2, **common,
    )  # fmt: skip
    return lse_all, lse_span, y, imp


def _kept_launch(
    kernel, grid, keys: torch.Tensor, queries: torch.Tensor, indices: torch.Tensor, beta: torch.Tensor | None,
    query_mask: torch.Tensor | None, out: torch.Tensor, scale: float, *extra: torch.Tensor,
    block_n: int | None = None, **constexprs: object,
) -> torch.Tensor:  # fmt: skip
    """Launch a kept-key kernel (:func:`_kept_design`, :func:`_kept_softmax`) over ``out [B, n, t]``
    (``block_n``: the key tile, default 32 / 64 for float32 / half caches)."""
    n, t, d = queries.shape[1], indices.shape[1], keys.shape[-1]
    ieee = keys.dtype == torch.float32
    block_m = 32 if ieee else 64
    block_n = block_n or (32 if ieee else 64)
    dummy = out  # never read: HAS_BETA / HAS_MASK off
    kernel[grid(block_m, block_n)](
        queries, keys, indices.contiguous(), beta.contiguous() if beta is not None else dummy, *extra,
        query_mask.contiguous() if query_mask is not None else dummy, out,
        queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(1), n, t, scale * 1.4426950408889634,
        HAS_BETA=beta is not None, HAS_MASK=query_mask is not None, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
        IEEE=ieee, num_warps=4 if block_n <= 64 else 8, num_stages=2, **constexprs,
    )  # fmt: skip
    return out


def _kept_design(
    keys: torch.Tensor, queries: torch.Tensor, indices: torch.Tensor, old_beta: torch.Tensor | None,
    lse_span: torch.Tensor, scale: float, query_mask: torch.Tensor | None, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """β's design ``exp(S_sel + β_old − lse_span)`` ``[B, n, t]`` in ``dtype``, zero on padding probes
    (one kernel: the kept keys' logits are never stored)."""
    batch, n, t = queries.shape[0], queries.shape[1], indices.shape[1]
    out = torch.empty(batch, n, t, dtype=dtype, device=keys.device)

    def grid(bm: int, bn: int) -> tuple[int, int, int]:
        return triton.cdiv(n, bm), triton.cdiv(t, bn), batch

    lse_span = lse_span.contiguous()
    return _kept_launch(_design_kernel, grid, keys, queries, indices, old_beta, query_mask, out, scale, lse_span)


def _kept_softmax(
    keys: torch.Tensor, queries: torch.Tensor, indices: torch.Tensor, beta: torch.Tensor | None, scale: float,
    query_mask: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """C2's design ``softmax(S_sel + β)`` ``[B, n, t]`` float32 over the kept keys, zero on padding
    probes (one kernel), a view of a ``[B, t, n]`` buffer: the probes contiguous, as C2's
    tensor-core products want them (:func:`~compaction_gym.engine.fast.ridge.normal_products`)."""
    batch, n, t = queries.shape[0], queries.shape[1], indices.shape[1]
    out = torch.empty(batch, t, n, dtype=torch.float32, device=keys.device)

    def grid(bm: int, bn: int) -> tuple[int, int]:
        return triton.cdiv(n, bm), batch

    one_tile = keys.dtype != torch.float32 and t <= 256
    block_n = max(16, triton.next_power_of_2(t)) if one_tile else None
    _kept_launch(
        _kept_softmax_kernel, grid, keys, queries, indices, beta, query_mask, out, scale, block_n=block_n,
        ONE_TILE=one_tile,
    )  # fmt: skip
    return out.mT


def _gram(design: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(AᵀA, Aᵀ1)`` in float32 for a float32 design ``A [B, n, t]``.

    For bf16 designs the product takes bf16 operands (entries in ``[0, 1]``, float32 accumulation):
    the Gram matrix of the rounded design, 0.24 ms instead of float32's 0.95 ms for the 4B-shaped
    event on an H200, with the same NNLS objective to 1e-5.
    """
    if design.dtype == torch.bfloat16 and design.is_cuda:
        try:
            return torch.bmm(design.mT, design, out_dtype=torch.float32), design.sum(1, dtype=torch.float32)
        except (TypeError, RuntimeError):
            design = design.float()
    design = design.float()
    return design.mT @ design, design.sum(1)


def fast_beta_weights(
    biased: torch.Tensor, lse_span: torch.Tensor, *, half: bool, iters: int = FISTA_ITERS,
    query_mask: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """β's relative weights ``w [B, t]`` (float32) from the kept keys' biased logits ``[B, n, t]`` and the
    probes' span log-sum-exp ``[B, n]``: the package's regularised fit
    (:func:`~compaction_gym.compaction.beta.beta_weights`) solved by box-projected FISTA, no host sync.

    ``half``: the cache is bf16/fp16 (bf16 design operands, fp16 Gram storage in the kernel).
    ``query_mask`` (bool ``[B, n]``): padding probes' design rows are zeroed and the probe guard
    counts each row's real probes.
    """
    design = torch.exp(biased - lse_span[:, :, None])  # the span softmax at the kept keys
    if query_mask is not None:
        design.mul_(query_mask[:, :, None])
    return _weights_from_design(design.to(torch.bfloat16) if half else design, half, iters, query_mask)


def _weights_from_design(
    design: torch.Tensor, half: bool, iters: int, query_mask: torch.Tensor | None
) -> torch.Tensor:
    """:func:`fast_beta_weights` from its design ``[B, n, t]`` (bf16 when ``half``; zero rows on padding)."""
    batch, n, t = design.shape
    if n < BETA_MIN_PROBES_PER_KEY * t:  # probe guard: keep the old bias
        return torch.ones(batch, t, dtype=torch.float32, device=design.device)
    gram, rhs = regularised_system(*_gram(design), BETA_RIDGE)  # _gram's own buffers: ρ added in place
    w = nnls_fista(
        gram, rhs, iters, g_dtype=torch.float16 if half else torch.float32,
        lower=math.exp(BETA_BOUNDS[0]), upper=math.exp(BETA_BOUNDS[1]),
    )  # fmt: skip
    return probe_guard(keep_if_better(w, gram, rhs), None if query_mask is None else query_mask.sum(1))


def compact_fast(
    keys: torch.Tensor,
    values: torch.Tensor,
    queries: torch.Tensor | None,
    span: tuple[int, int],
    target: int,
    *,
    mode: str = "attention_matching",
    compute_beta: bool = False,
    scale: float | None = None,
    key_bias: torch.Tensor | None = None,
    ridge: float = 1e-4,
    seed: int | None = None,
    forced_indices: torch.Tensor | None = None,
    beta_iters: int = FISTA_ITERS,
    query_positions: torch.Tensor | None = None,
    n_kv_heads: int | None = None,
    refit_values: bool = True,
    query_mask: torch.Tensor | None = None,
) -> CompactionResult:
    """:func:`~compaction_gym.compaction.api` with the fused GPU path for Attention Matching.

    Same arguments and result (``query_positions`` and ``n_kv_heads`` only matter to the
    selection baselines, which go to ``compact``; so does ``refit_values=False``). Runs the fused kernels when ``mode="attention_matching"``, the
    tensors are on a CUDA device with Triton available, no ``forced_indices`` are given and the
    head dim is a power of two ≥ 16; everything else is delegated to ``compact`` (which also
    validates arguments: the fast path assumes the engine's already-valid inputs).

    β's box-constrained fit is ``beta_iters`` FISTA iterations
    (:func:`~compaction_gym.engine.fast.nnls.nnls_fista`) instead of the package's projected Newton
    to convergence: the span-mass objective agrees to ~0.1 % at the default 128 iterations.

    ``query_mask`` (bool ``[B, n]``, ``False`` on padding probes: events of different probe counts
    stacked in one call) makes every row's selection, β and C2 those of its real probes alone.
    """
    d = keys.shape[-1] if isinstance(keys, torch.Tensor) and keys.dim() == 3 else 0
    fast = (
        mode == "attention_matching"
        and refit_values is True
        and forced_indices is None
        and isinstance(queries, torch.Tensor)
        and use_triton(keys)
        and d >= 16
        and not d & (d - 1)
        and values.shape[-1] == d
        and keys.dtype == values.dtype == queries.dtype
    )
    if not fast:
        return compact(
            keys, values, queries, span, target, mode=mode, compute_beta=compute_beta, forced_indices=forced_indices,
            scale=scale, key_bias=key_bias, ridge=ridge, seed=seed, query_positions=query_positions,
            n_kv_heads=n_kv_heads, refit_values=refit_values, query_mask=query_mask,
        )  # fmt: skip
    start, end = span
    scale = scale if scale is not None else d**-0.5
    lse_all, lse_span, y, imp = _span_stats(keys, values, queries, span, scale, key_bias, query_mask)
    local = torch.topk(imp, target, dim=-1, sorted=False).indices
    indices = torch.sort(local, dim=-1).values + start
    old_beta = torch.gather(key_bias.float(), 1, indices) if key_bias is not None else None
    beta = old_beta
    if compute_beta:
        half = keys.dtype != torch.float32
        dtype = torch.bfloat16 if half else torch.float32
        design = _kept_design(keys, queries, indices, old_beta, lse_span, scale, query_mask, dtype)
        w = _weights_from_design(design, half, beta_iters, query_mask)
        beta = torch.log(w.clamp_min(torch.finfo(w.dtype).tiny))
        if old_beta is not None:
            beta = beta + old_beta
        beta = beta.clamp(-BETA_CLAMP, BETA_CLAMP)
    x = _kept_softmax(keys, queries, indices, beta, scale, query_mask)  # padding probes: zero rows of x and y
    gather = indices[:, :, None].expand(-1, -1, d)
    # the package's C2 solve, sync-free: a problem that does not factor keeps its selected rows' values.
    # The real probes are known (a softmax row is never all zero), so no pass over x counts them.
    if query_mask is None:
        probes = torch.full((x.shape[0],), x.shape[1], dtype=x.dtype, device=x.device)
    else:
        probes = query_mask.sum(-1, dtype=x.dtype)
    prior = torch.gather(values, 1, gather).to(x.dtype)
    fitted = ridge_solve_ex(x, y, prior, ridge, probes, products=normal_products(x, y), solve=cholesky_solve)[0]
    fitted = fitted.to(values.dtype)
    kept_keys = torch.gather(keys, 1, gather)
    return CompactionResult(kept_keys, fitted, beta if compute_beta else old_beta, indices)
