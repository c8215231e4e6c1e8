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
3. the kept keys' logits ``S_sel`` (a ``[B, n, t]`` product) give the β design
   ``A = exp(S_sel − lse_span)`` and C2's design ``softmax(S_sel + β)``. β's fit is the package's
   (same box ``w ∈ [e⁻³, e³]``, ridge toward ``w = 1``, probe guard and ``w = 1`` safeguard,
   :func:`~compaction_gym.compaction.beta.beta_weights`), solved on the Gram matrix ``AᵀA`` (one
   batched product, bf16 operands for half-precision caches) by a fixed number of box-projected
   FISTA iterations in one Triton kernel (:mod:`~compaction_gym.engine.fast.nnls`: no
   factorisation, no host sync); C2 is the package's own solve without a host sync
   (:func:`~compaction_gym.compaction.values.ridge_solve_ex`: ridge toward the kept rows' values,
   a batched Cholesky factor and two triangular solves): a problem that does not factor (never
   seen with the ridge floor) keeps its selected rows' values instead of the reference's
   pseudo-inverse fallback.

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
from compaction_gym.compaction.scoring import half_product
from compaction_gym.compaction.values import ridge_solve_ex
from compaction_gym.engine.fast.kernels import HAS_TRITON, use_triton
from compaction_gym.engine.fast.nnls import FISTA_ITERS, nnls_fista

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
        Q, K, V, KB, LSE_ALL, LSE_SPAN, Y,
        stride_qb, stride_qn, stride_kb, stride_kt, stride_vb, stride_vt, stride_kbb, stride_yb, stride_yn,
        n, T, s, e, scale_log2,
        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
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
        tl.store(LSE_ALL + b * n + offs_m, lse_all2 * ln2, mask=mmask)
        tl.store(LSE_SPAN + b * n + offs_m, lse_span2 * ln2, mask=mmask)
        y_ptr = Y + b * stride_yb + offs_m[:, None] * stride_yn + offs_d[None, :]
        tl.store(y_ptr, acc / l_s[:, None], mask=mmask[:, None])

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


def _span_stats(
    keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, span: tuple[int, int], scale: float,
    key_bias: torch.Tensor | None, query_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``lse_all [B, n]``, ``lse_span [B, n]``, ``Y [B, n, d_v]`` and importance ``[B, W]`` (kernels).

    Padding probes (``query_mask`` ``False``) get ``lse_all = +inf``, so their attention, and their
    share of the importance, is exactly 0 (the importance is then the real probes' RMS attention
    scaled by ``sqrt(n_real / n)``, a per-row constant: the same top-t set).
    """
    batch, T, d = keys.shape
    n = queries.shape[1]
    s, e = span
    dev = keys.device
    lse_all = torch.empty(batch, n, dtype=torch.float32, device=dev)
    lse_span = torch.empty_like(lse_all)
    y = torch.empty(batch, n, values.shape[-1], dtype=torch.float32, device=dev)
    imp = torch.empty(batch, e - s, dtype=torch.float32, device=dev)
    ieee = keys.dtype == torch.float32
    kb = key_bias.float().contiguous() if key_bias is not None else lse_all
    common = dict(HAS_BIAS=key_bias is not None, D=d, IEEE=ieee)
    block_m = 64
    _stats_kernel[(triton.cdiv(n, block_m), batch)](
        queries, keys, values, kb, lse_all, lse_span, y,
        queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        kb.stride(0), y.stride(0), y.stride(1), n, T, s, e, scale * 1.4426950408889634,
        BLOCK_M=block_m, BLOCK_N=32 if ieee else 64, num_warps=4, num_stages=2, **common,
    )  # fmt: skip
    if query_mask is not None:
        lse_all.masked_fill_(~query_mask, float("inf"))
    _importance_kernel[(triton.cdiv(e - s, 64), batch)](
        queries, keys, kb, lse_all, imp,
        queries.stride(0), queries.stride(1), keys.stride(0), keys.stride(1), kb.stride(0),
        n, s, e, scale * 1.4426950408889634,
        BLOCK_M=32 if ieee else 64, BLOCK_N=64, num_warps=4, num_stages=2, **common,
    )  # fmt: skip
    return lse_all, lse_span, y, imp


def _logits_at(
    keys: torch.Tensor, queries: torch.Tensor, indices: torch.Tensor, scale: float
) -> torch.Tensor:
    """Raw float32 logits ``[B, n, t]`` of the probes against the keys at ``indices``."""
    kept = torch.gather(keys, 1, indices[:, :, None].expand(-1, -1, keys.shape[2]))
    raw = half_product(queries, kept)
    if raw is None:
        raw = torch.bmm(queries.float(), kept.float().transpose(1, 2))
    return raw * scale


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
    batch, n, t = biased.shape
    if n < BETA_MIN_PROBES_PER_KEY * t:  # probe guard: keep the old bias
        return torch.ones(batch, t, dtype=torch.float32, device=biased.device)
    design = torch.exp(biased - lse_span[:, :, None])  # the span softmax at the kept keys
    if query_mask is not None:
        design.mul_(query_mask[:, :, None])
    gram, rhs = regularised_system(*_gram(design.to(torch.bfloat16) if half else design), BETA_RIDGE)
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
    raw = _logits_at(keys, queries, indices, scale)  # [B, n, t]
    old_beta = torch.gather(key_bias.float(), 1, indices) if key_bias is not None else None
    biased = raw + old_beta[:, None, :] if old_beta is not None else raw
    beta = None
    if compute_beta:
        w = fast_beta_weights(
            biased, lse_span, half=keys.dtype != torch.float32, iters=beta_iters, query_mask=query_mask
        )
        beta = torch.log(w.clamp_min(torch.finfo(w.dtype).tiny))
        if old_beta is not None:
            beta = beta + old_beta
        beta = beta.clamp(-BETA_CLAMP, BETA_CLAMP)
        x = torch.softmax(raw + beta[:, None, :], dim=-1)
    else:
        x = torch.softmax(biased, dim=-1)
    if query_mask is not None:  # padding probes leave the C2 solve (and its relative ridge's probe count)
        keep = query_mask[:, :, None]
        x.mul_(keep)  # in place: both are this call's own [B, n, ·] buffers
        y.mul_(keep)
    gather = indices[:, :, None].expand(-1, -1, d)
    # the package's C2 solve, sync-free: a problem that does not factor keeps its selected rows' values.
    # The real probes are known (a softmax row is never all zero), so no pass over x counts them.
    if query_mask is None:
        probes = torch.full((x.shape[0],), x.shape[1], dtype=x.dtype, device=x.device)
    else:
        probes = query_mask.sum(-1, dtype=x.dtype)
    prior = torch.gather(values, 1, gather).to(x.dtype)
    fitted = ridge_solve_ex(x, y, prior, ridge, probes)[0].to(values.dtype)
    kept_keys = torch.gather(keys, 1, gather)
    return CompactionResult(kept_keys, fitted, beta if compute_beta else old_beta, indices)
