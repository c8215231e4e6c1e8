"""Attention over slot-cache rows with per-key β and per-row lengths (decode and prefill).

**Decode**: one query token per batch row attends to rows ``[0, len_b)`` of its slot, with the
stored float32 logit bias β added to every key's logit. Three implementations of one function:

* :func:`decode_attention` — a Triton split-K flash-decode kernel. Each program takes one
  (batch row, KV head, split): it loads the G query heads that share the KV head once, streams
  only the K/V/β tiles of its share of ``[0, len_b)`` (the length is read from a device tensor,
  so the launch is CUDA-graph capturable and never touches rows past a row's length), and keeps
  an online softmax in float32. The splits are merged by their log-sum-exp in the same launch:
  each program stores its float32 partials, bumps a counter of its (row, KV head) (acq_rel, after
  a barrier), and the last one to finish merges that KV head's query heads and resets the
  counter (graph replays start from zero again); one split stores its output directly.
  ``fused_merge=False`` keeps the earlier second merge kernel.
* :func:`decode_attention_sdpa` — the fallback: SDPA over the whole capacity with a length mask
  (capturable too, but it reads every row of the capacity).
* :func:`decode_attention_ref` — a float64 loop, the reference of the tests.

**Prefill**: :func:`prefill_attention` runs many rows of different lengths in one launch (a flat,
"varlen" batch of new tokens): token ``i`` of row ``b`` sees its slot's rows
``[0, start_b + i]``. Each program takes a block of (token, query-head) pairs of one row and KV
head, so K/V tiles are read once per block and never gathered or padded, and no mask is built.
:func:`prefill_attention_torch` is its per-row SDPA fallback.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from compaction_gym.engine.fast.kernels import HAS_TRITON, launch_counters, pdl_kwargs, use_triton

if HAS_TRITON:
    import triton
    import triton.language as tl

    from compaction_gym.engine.fast.kernels import mma, pdl_prologue

    @triton.jit
    def _merge_splits(
        O_PART, LSE_PART, OUT, b, kvh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
        GROUP: tl.constexpr, BLOCK_G: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
        CHUNK: tl.constexpr, D: tl.constexpr,
    ):  # fmt: skip
        """:func:`_merge_kernel`'s log-sum-exp merge of the splits for the ``GROUP`` query heads of KV
        head ``kvh``, stored into ``OUT``. The partials were written by other programs: reads bypass
        L1. The splits are read in unrolled chunks of ``CHUNK`` (all in flight at once) and summed in
        a fixed order."""
        offs_g = tl.arange(0, BLOCK_G)
        gmask = offs_g < GROUP
        heads = kvh * GROUP + offs_g
        l_base = LSE_PART + b * stride_lb + heads * stride_lh  # [G]
        o_base = O_PART + b * stride_ob + heads * stride_oh  # [G]
        offs_s = tl.arange(0, BLOCK_S)
        lmask = gmask[:, None] & (offs_s < NUM_SPLITS)[None, :]
        lse = tl.load(l_base[:, None] + offs_s[None, :], mask=lmask, other=float("-inf"), cache_modifier=".cg")
        m = tl.max(lse, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp2(lse - m[:, None]), axis=1)
        offs_c = tl.arange(0, CHUNK)
        offs_d = tl.arange(0, D)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        for c0 in tl.static_range(0, NUM_SPLITS, CHUNK):
            sp = c0 + offs_c
            cmask = gmask[:, None] & (sp < NUM_SPLITS)[None, :]  # [G, C]
            lse_c = tl.load(l_base[:, None] + sp[None, :], mask=cmask, other=float("-inf"), cache_modifier=".cg")
            o_ptr = o_base[:, None, None] + sp[None, :, None] * stride_os + offs_d[None, None, :]
            o = tl.load(o_ptr, mask=cmask[:, :, None], other=0.0, cache_modifier=".cg")  # [G, C, D]
            acc += tl.sum(o * tl.exp2(lse_c - m[:, None])[:, :, None], axis=1)
        out = acc / tl.where(total > 0, total, 1.0)[:, None]
        o_ptr = OUT + b * stride_b + heads[:, None] * stride_h + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=gmask[:, None])

    @triton.jit
    def attend_block(q, k, beta, v, rmask, m_i, l_i, acc, scale_log2, IEEE: tl.constexpr):
        """One block of flash-decode: keys ``k`` ``[D, N]`` with β, values ``v`` ``[N, D]`` (rows
        where ``rmask`` is false are ignored) folded into the running max ``m_i``, sum ``l_i`` and
        output ``acc`` of the queries ``q`` (log2 domain: ``scale_log2`` is the scale × log2 e)."""
        qk = mma(q, k, IEEE)
        qk = qk * scale_log2 + beta[None, :] * 1.4426950408889634
        qk = tl.where(rmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, IEEE)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(
        Q, K, V, BETA, SLOTS, LENS, O_PART, LSE_PART, OUT, CNT,
        stride_qb, stride_qh, stride_ks, stride_kh, stride_kr, stride_vs, stride_vh, stride_vr,
        stride_bs, stride_bh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
        scale_log2,
        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
        NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, FUSED: tl.constexpr, PDL: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        slot = tl.load(SLOTS + b).to(tl.int64)
        n = tl.load(LENS + b)
        split = tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = sp * split
        end = tl.minimum(start + split, n)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + offs_h
        hmask = offs_h < GROUP
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        k_base = K + slot * stride_ks + kvh * stride_kh
        v_base = V + slot * stride_vs + kvh * stride_vh
        b_base = BETA + slot * stride_bs + kvh * stride_bh
        for s0 in range(start, end, BLOCK_N):
            rows = s0 + offs_n
            rmask = rows < end
            # K, β and V issued together: with one block per program (short splits) V's load would
            # otherwise wait for the softmax, one more memory round trip on the critical path
            k = tl.load(k_base + rows[None, :] * stride_kr + offs_d[:, None], mask=rmask[None, :], other=0.0)
            beta = tl.load(b_base + rows, mask=rmask, other=0.0)
            v = tl.load(v_base + rows[:, None] * stride_vr + offs_d[None, :], mask=rmask[:, None], other=0.0)
            m_i, l_i, acc = attend_block(q, k, beta, v, rmask, m_i, l_i, acc, scale_log2, IEEE)
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        if FUSED and NUM_SPLITS == 1:  # the only split: its output is the result
            out_ptr = OUT + b * stride_b + heads[:, None] * stride_h + offs_d[None, :]
            tl.store(out_ptr, out.to(OUT.dtype.element_ty), mask=hmask[:, None])
        else:
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            o_ptr = O_PART + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + offs_d[None, :]
            tl.store(o_ptr, out, mask=hmask[:, None])
            tl.store(LSE_PART + b * stride_lb + heads * stride_lh + sp, lse, mask=hmask)
            if FUSED:
                # the last split program of this (row, KV head) merges its query heads, in split order
                tl.debug_barrier()  # every thread's partial is stored before the counter moves
                idx = b * tl.num_programs(1) + kvh
                done = tl.atomic_add(CNT + idx, 1, sem="acq_rel", scope="gpu")
                if done == NUM_SPLITS - 1:
                    _merge_splits(
                        O_PART, LSE_PART, OUT, b, kvh, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                        stride_b, stride_h, GROUP, BLOCK_G, NUM_SPLITS, BLOCK_S, CHUNK, D,
                    )  # fmt: skip
                    tl.atomic_xchg(CNT + idx, 0)  # ready for the next launch (graph replay)

    @triton.jit
    def _merge_kernel(
        O_PART, LSE_PART, OUT, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_b, stride_h,
        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, D)
        smask = offs_s < NUM_SPLITS
        lse = tl.load(LSE_PART + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
        m = tl.max(lse, axis=0)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m)
        o = tl.load(
            O_PART + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
            mask=smask[:, None], other=0.0,
        )  # fmt: skip
        total = tl.sum(w, axis=0)
        out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(OUT + b * stride_b + h * stride_h + offs_d, out.to(OUT.dtype.element_ty))


    @triton.jit
    def _prefill_kernel(
        Q, K, V, BETA, OUT, SLOTS, STARTS, TOK0, NNEW,
        stride_qt, stride_qh, stride_ks, stride_kh, stride_kr, stride_vs, stride_vh, stride_vr,
        stride_bs, stride_bh, stride_ot, stride_oh,
        scale_log2,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
    ):  # fmt: skip
        mb = tl.program_id(0)  # fastest: blocks of one (row, head) run together and share K/V in L2
        b = tl.program_id(1)
        kvh = tl.program_id(2)
        slot = tl.load(SLOTS + b).to(tl.int64)
        start = tl.load(STARTS + b)
        tok0 = tl.load(TOK0 + b).to(tl.int64)
        n_new = tl.load(NNEW + b)
        m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = m // GROUP
        valid = tok < n_new
        heads = kvh * GROUP + m % GROUP
        offs_d = tl.arange(0, D)
        q_ptr = Q + (tok0 + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr, mask=valid[:, None], other=0.0)
        limit = start + tok  # last visible cache row of each query
        last_tok = tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // GROUP, n_new - 1)
        end = tl.where(mb * BLOCK_M < n_new * GROUP, start + last_tok + 1, 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        k_base = K + slot * stride_ks + kvh * stride_kh
        v_base = V + slot * stride_vs + kvh * stride_vh
        b_base = BETA + slot * stride_bs + kvh * stride_bh
        for s0 in range(0, end, BLOCK_N):
            rows = s0 + offs_n
            rmask = rows < end
            k = tl.load(k_base + rows[None, :] * stride_kr + offs_d[:, None], mask=rmask[None, :], other=0.0)
            qk = mma(q, k, IEEE)
            beta = tl.load(b_base + rows, mask=rmask, other=0.0)
            qk = qk * scale_log2 + beta[None, :] * 1.4426950408889634
            qk = tl.where(rmask[None, :] & (rows[None, :] <= limit[:, None]), qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            v = tl.load(v_base + rows[:, None] * stride_vr + offs_d[None, :], mask=rmask[:, None], other=0.0)
            pv = mma(p.to(v.dtype), v, IEEE)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = OUT + (tok0 + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=valid[:, None])


def num_splits_for(batch: int, n_kv_heads: int, capacity: int, sm_count: int = 132, block_n: int = 64) -> int:
    """Splits per (row, KV head) that give every multiprocessor about two programs, at most 64."""
    want = max(1, math.ceil(2 * sm_count / max(1, batch * n_kv_heads)))
    tiles = max(1, math.ceil(capacity / block_n))
    return int(min(64, tiles, 1 << (want - 1).bit_length()))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    num_splits: int = 8,
    block_n: int = 64,
    fused_merge: bool = True,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Attention of one query per row over its slot's first ``lens[b]`` rows, with β.

    Args:
        q: ``[B, H_q, d]`` rotated queries (query head ``h`` reads KV head ``h // G``).
        k_cache, v_cache: one layer of the slot cache ``[slots, H_kv, capacity, d]`` (strided views).
        beta: that layer's β ``[slots, H_kv, capacity]`` (float32).
        slots: slot of each row ``[B]`` (int64). lens: rows to read per row ``[B]`` (int32/64);
            a row with length 0 (padding) gets a zero output.
        scale: logit scale.
        num_splits: sequence splits per (row, KV head) (fixed per captured graph).
        fused_merge: one launch: the last split program of each (row, KV head) to finish merges
            the splits (one split: stores its output directly); else a second kernel merges.
        block_n, num_warps, num_stages: keys per loop step and the split kernel's launch
            (benchmarks sweep them: ``bench_fast_kernels.py --attention``).

    Returns:
        ``[B, H_q, d]`` in ``q``'s dtype.
    """
    batch, n_q, d = q.shape
    n_kv = k_cache.shape[1]
    if not use_triton(q) or d & (d - 1) or d < 16:
        return decode_attention_sdpa(q, k_cache, v_cache, beta, slots, lens, scale)
    group = n_q // n_kv
    block_g, block_s = triton.next_power_of_2(group), triton.next_power_of_2(num_splits)
    out = torch.empty_like(q)
    cnt = None
    if fused_merge and num_splits > 1:
        cnt = launch_counters(q.device, batch * n_kv)
    fused = fused_merge and (num_splits == 1 or cnt is not None)
    if fused and num_splits == 1:  # no partials at all
        o_part, lse_part, cnt = out, out, out
    else:
        o_part = torch.empty(batch, n_q, num_splits, d, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(batch, n_q, num_splits, dtype=torch.float32, device=q.device)
        cnt = cnt if fused else out
    _split_kernel[(batch, n_kv, num_splits)](
        q, k_cache, v_cache, beta, slots, lens, o_part, lse_part, out, cnt,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), beta.stride(0), beta.stride(1),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
        scale * 1.4426950408889634,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, D=d,
        NUM_SPLITS=num_splits, IEEE=q.dtype == torch.float32, FUSED=fused,
        BLOCK_G=block_g, BLOCK_S=block_s, CHUNK=min(block_s, max(1, 32 // block_g)), num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kwargs(q),
    )  # fmt: skip
    if not fused:
        _merge_kernel[(batch, n_q)](
            o_part, lse_part, out, o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1), out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), D=d,
            num_warps=1, **pdl_kwargs(q),
        )  # fmt: skip
    return out


def decode_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Fallback of :func:`decode_attention`: SDPA over the whole capacity, masked by length (fp32)."""
    batch, n_q, d = q.shape
    n_kv, cap = k_cache.shape[1], k_cache.shape[2]
    group = n_q // n_kv
    k, v = k_cache[slots].float(), v_cache[slots].float()  # [B, H_kv, C, d]
    visible = torch.arange(cap, device=q.device)[None, :] < lens[:, None]
    bias = beta[slots].masked_fill(~visible[:, None, :], float("-inf"))  # [B, H_kv, C]
    bias = torch.where(visible.any(-1)[:, None, None], bias, torch.zeros_like(bias))  # empty rows stay finite
    qg = q.float().reshape(batch, n_kv, group, d)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias[:, :, None, :], scale=scale)
    out = out * visible.any(-1).to(out.dtype)[:, None, None, None]
    return out.reshape(batch, n_q, d).to(q.dtype)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Float64 reference: a plain softmax per row and query head."""
    batch, n_q, d = q.shape
    group = n_q // k_cache.shape[1]
    out = torch.zeros(batch, n_q, v_cache.shape[-1], dtype=torch.float64, device=q.device)
    for b in range(batch):
        n, s = int(lens[b]), int(slots[b])
        if n == 0:
            continue
        for h in range(n_q):
            k = k_cache[s, h // group, :n].double()
            v = v_cache[s, h // group, :n].double()
            logits = k @ q[b, h].double() * scale + beta[s, h // group, :n].double()
            out[b, h] = torch.softmax(logits, 0) @ v
    return out


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    tok0: torch.Tensor,
    n_new: torch.Tensor,
    max_new: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a flat batch of new tokens over their slots' cache rows, with β.

    Args:
        q: ``[N, H_q, d]``: row ``b``'s tokens are ``q[tok0[b] : tok0[b] + n_new[b]]``.
        k_cache, v_cache, beta: one layer of the slot cache (the new tokens' K/V already stored).
        slots, starts: each row's slot and its cache length before the new tokens ``[B]``.
        tok0, n_new: each row's first token in ``q`` and its number of new tokens ``[B]``.
        max_new: ``max(n_new)`` (sizes the grid).
        scale: logit scale.

    Returns:
        ``[N, H_q, d]`` in ``q``'s dtype; token ``i`` of row ``b`` sees rows ``[0, starts[b] + i]``.
    """
    n_tok, n_q, d = q.shape
    n_kv = k_cache.shape[1]
    if not use_triton(q) or d & (d - 1) or d < 16:
        return prefill_attention_torch(q, k_cache, v_cache, beta, slots, starts, tok0, n_new, scale)
    group = n_q // n_kv
    block_m = 64 if d <= 128 else 32
    out = torch.empty_like(q)
    grid = (triton.cdiv(max_new * group, block_m), slots.shape[0], n_kv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, beta, out, slots, starts, tok0, n_new,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), beta.stride(0), beta.stride(1),
        out.stride(0), out.stride(1), scale * 1.4426950408889634,
        GROUP=group, BLOCK_M=block_m, BLOCK_N=64, D=d, IEEE=q.dtype == torch.float32, num_warps=4, num_stages=2,
    )  # fmt: skip
    return out


def prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    tok0: torch.Tensor,
    n_new: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per-row SDPA fallback of :func:`prefill_attention` (float32 logits with β)."""
    out = torch.empty_like(q)
    n_q, n_kv = q.shape[1], k_cache.shape[1]
    group = n_q // n_kv
    for s, n0, t0, n in zip(slots.tolist(), starts.tolist(), tok0.tolist(), n_new.tolist()):
        if n == 0:
            continue
        total = n0 + n
        k, v = k_cache[s, :, :total].float(), v_cache[s, :, :total].float()  # [H_kv, T, d]
        qs = q[t0 : t0 + n].float().transpose(0, 1).reshape(n_kv, group * n, -1)  # [H_kv, G*n, d]
        visible = torch.arange(total, device=q.device)[None, :] <= n0 + torch.arange(n, device=q.device)[:, None]
        bias = beta[s, :, None, :total].float() + torch.zeros(n, total, device=q.device).masked_fill(~visible, float("-inf"))
        bias = bias[:, None].expand(-1, group, -1, -1).reshape(n_kv, group * n, total)
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=bias, scale=scale)  # [H_kv, G*n, d]
        out[t0 : t0 + n] = o.reshape(n_q, n, -1).transpose(0, 1).to(q.dtype)
    return out
