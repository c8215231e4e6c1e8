"""One decode step's decoder layers as one persistent kernel (batch 1, Llama family).

At batch 1 a small model's step is a chain of ~230 short kernels, each paying launch, pipeline
fill and tail (docs/fast-path.md, "Not done yet"). :func:`persistent_layers` runs every decoder
layer of one token in **one launch**: one program per multiprocessor loops over the layers, and
each layer is five phases separated by grid-wide barriers (a monotonic counter, acquire/release):

A. RMSNorm of the residual stream (every program, redundantly) and its share of the q/k/v rows;
B. per (KV head, split of the cached rows): q/k norm, RoPE, the new K/V stored into the slot
   cache, flash-decode over the split with β, and the last split program of each KV head merges
   the splits (as :func:`~compaction_gym.engine.fast.attention.decode_attention` does);
C. its share of the output projection, added into the residual stream;
D. RMSNorm again and its share of the gate/up rows, with SiLU·mul;
E. its share of the down projection, added into the residual stream.

A phase's weights (and attention's first block of cached K/V) never depend on the phase
before, so each program issues those loads between counting itself in at the barrier and waiting
there: the weight stream runs through what are kernel boundaries on the layered path. Roundings
are the layered path's (each projection's output, the norms, RoPE's products, SiLU rounded to the
model dtype); only the order of float32 sums differs. The embedding row is looked up before the
launch; the final norm, ``lm_head`` and sampling run after it, as on the layered path.

The barrier needs every program resident at once: the grid is one program per multiprocessor,
so a kernel that launches at all (one program fits an SM) has all of them running once other
work on the device drains. Where it pays (small models up to Llama-3.2-1B's width, short rows;
it loses at Qwen3-1.7B and 4B and on long rows) is measured, not assumed: the runner times it
against the layered kernels and routes batch-1 steps by their row's length (docs/fast-path.md,
"One launch per step").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from compaction_gym.engine.fast.kernels import HAS_TRITON, pdl_kwargs

#: warps per program (one program per multiprocessor; 4 and 16 measured slower on H100/H200)
NUM_WARPS = 8
#: the largest weight tile one program loads at once (elements; two in flight per matrix)
TILE_ELEMENTS = 32768
#: keys per attention block
BLOCK_KEYS = 64
#: shared-memory stages of a phase whose rows take more than two weight chunks (1B-class widths)
PIPELINE_STAGES = 3
#: a layer's row of the offset table (``_weight`` indexes it by position: ten per layer)
_FIELDS = ("in_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up", "down")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from compaction_gym.engine.fast.attention import attend_block
    from compaction_gym.engine.fast.kernels import pdl_prologue

    _STAGES = tl.constexpr(PIPELINE_STAGES)

    @triton.jit
    def _arrive(BAR):
        """Count this program in at the barrier; its stores so far are released with the count."""
        tl.debug_barrier()  # every thread's stores precede the arrival
        tl.atomic_add(BAR, 1, sem="release", scope="gpu")

    @triton.jit
    def _enter(BAR, phase, TIMES, pid, TIMING: tl.constexpr):
        """Arrive at the barrier before phase ``phase + 1`` (stamped for profiling); returns ``phase + 1``."""
        phase += 1
        _clock(TIMES, pid, 2 * phase - 2, TIMING)
        _arrive(BAR)
        return phase

    @triton.jit
    def _start(BAR, phase, P: tl.constexpr, TIMES, pid, TIMING: tl.constexpr):
        """Wait until all ``P`` programs have entered phase ``phase`` (stamped for profiling)."""
        _wait(BAR, phase * P)
        _clock(TIMES, pid, 2 * phase - 1, TIMING)

    @triton.jit
    def _wait(BAR, target):
        """Wait until every program has arrived (``BAR`` reaches ``target``); their stores are visible after.

        Split from :func:`_arrive` so that a program issues the next phase's weight loads in between:
        the release fence of the arrival would otherwise wait for them too."""
        while tl.atomic_add(BAR, 0, sem="acquire", scope="gpu") < target:
            pass
        tl.debug_barrier()

    @triton.jit
    def _clock(TIMES, pid, slot, TIMING: tl.constexpr):
        """With ``TIMING``: store the global nanosecond timer at ``TIMES[pid, slot]`` (phase profiling)."""
        if TIMING:
            t = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
            tl.store(TIMES + pid * 4096 + slot, t)

    @triton.jit
    def _weight(WBASE, OFFS, layer, field: tl.constexpr):
        """Layer ``layer``'s weight ``field`` (element offsets from ``WBASE``: the loads stay 16-byte vectors)."""
        return WBASE + tl.multiple_of(tl.load(OFFS + layer * 10 + field), 16)

    @triton.jit
    def _tile(W, row0, n_rows, c, K: tl.constexpr, BLOCK_R: tl.constexpr, KC: tl.constexpr):
        """Rows ``[row0, row0 + n_rows)`` (at most ``BLOCK_R``) × columns of chunk ``c`` of a row-major ``[·, K]`` matrix.

        Read once a step, so evicted first: what the layer's chain reads again keeps its place in
        L1 and L2 (6 % faster: docs/fast-path.md, "One launch per step")."""
        rows = row0 + tl.arange(0, BLOCK_R)
        cols = c * KC + tl.arange(0, KC)
        mask = (tl.arange(0, BLOCK_R) < n_rows)[:, None] & (cols < K)[None, :]
        ptrs = W + rows.to(tl.int64)[:, None] * K + cols[None, :]
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")

    @triton.jit
    def _normed_chunk(X, NW, rstd, c, K: tl.constexpr, KC: tl.constexpr, NORM: tl.constexpr):
        """Chunk ``c`` of the input vector (written by other programs: read from L2), RMS-normalised
        with ``NW`` as :func:`~compaction_gym.engine.fast.kernels.rms_norm` rounds; float32."""
        cols = c * KC + tl.arange(0, KC)
        kmask = cols < K
        x = tl.load(X + cols, mask=kmask, other=0.0, cache_modifier=".cg")
        if NORM:
            dt = X.dtype.element_ty
            w = tl.load(NW + cols, mask=kmask, other=0.0).to(tl.float32)
            x = (w * (x.to(tl.float32) * rstd).to(dt).to(tl.float32)).to(dt)
        return x.to(tl.float32)

    @triton.jit
    def _rstd(X, eps, K: tl.constexpr, KP: tl.constexpr):
        cols = tl.arange(0, KP)
        x = tl.load(X + cols, mask=cols < K, other=0.0, cache_modifier=".cg").to(tl.float32)
        return tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)

    @triton.jit
    def _accumulate(acc, acc2, w, u, x, TWO: tl.constexpr):
        """``acc += w · x`` per row (and with ``TWO`` ``acc2 += u · x``), in float32."""
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if TWO:
            acc2 += tl.sum(u.to(tl.float32) * x[None, :], axis=1)
        return acc, acc2

    @triton.jit
    def _rows_dot(W, w0, W2, u0, row0, n_rows, X, NW, rstd, K: tl.constexpr, BLOCK_R: tl.constexpr,
                  KC: tl.constexpr, NORM: tl.constexpr, TWO: tl.constexpr):  # fmt: skip
        """``W[rows] · f(x)`` (and with ``TWO`` ``W2[rows] · f(x)``) in float32 ``[BLOCK_R]``, the first
        chunks ``w0`` (``u0``) already loaded.

        Up to two chunks (every phase at Qwen3-0.6B), each chunk's successor is issued into registers
        before the chunk is used, so two tiles per matrix are in flight. More chunks (the MLP at
        1B-class widths) stream through a :data:`PIPELINE_STAGES`-stage shared-memory pipeline
        instead: with two register tiles in flight the program waited on every chunk
        (docs/fast-path.md, "One launch per step")."""
        NC: tl.constexpr = (K + KC - 1) // KC
        acc = tl.zeros([BLOCK_R], tl.float32)
        acc2 = tl.zeros([BLOCK_R], tl.float32)
        if NC > 2:
            x = _normed_chunk(X, NW, rstd, 0, K, KC, NORM)
            acc, acc2 = _accumulate(acc, acc2, w0, u0, x, TWO)
            for c in tl.range(1, NC, num_stages=_STAGES):
                w = _tile(W, row0, n_rows, c, K, BLOCK_R, KC)
                u = w
                if TWO:
                    u = _tile(W2, row0, n_rows, c, K, BLOCK_R, KC)
                x = _normed_chunk(X, NW, rstd, c, K, KC, NORM)
                acc, acc2 = _accumulate(acc, acc2, w, u, x, TWO)
        else:
            w = w0
            u = u0
            for c in tl.static_range(NC):
                if c + 1 < NC:
                    w_next = _tile(W, row0, n_rows, c + 1, K, BLOCK_R, KC)
                    if TWO:
                        u_next = _tile(W2, row0, n_rows, c + 1, K, BLOCK_R, KC)
                x = _normed_chunk(X, NW, rstd, c, K, KC, NORM)
                acc, acc2 = _accumulate(acc, acc2, w, u, x, TWO)
                if c + 1 < NC:
                    w = w_next
                    if TWO:
                        u = u_next
        return acc, acc2

    @triton.jit
    def _rope(x, xr, w, wr, c, s, eps, dt: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr):
        """Rows ``x`` ``[R, D]`` of the q/k/v output (``xr``: each element's rotation partner),
        per-head RMSNorm'd (weights ``w``, ``wr``) and rotated (``c, s``: cos/sin per element) with
        :func:`~compaction_gym.engine.fast.kernels.qkv_rope_store`'s roundings; model dtype."""
        x = x.to(tl.float32)
        xr = xr.to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
            x = (w[None, :] * (x * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xr = (wr[None, :] * (xr * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        sign = tl.where(tl.arange(0, D) < D // 2, -1.0, 1.0)[None, :]
        return ((x * c[None, :]).to(dt).to(tl.float32) + sign * (xr * s[None, :]).to(dt).to(tl.float32)).to(
            dt
        )

    @triton.jit
    def _norm_pair(NW, D: tl.constexpr, HAS_NORM: tl.constexpr):
        """A per-head norm weight at each element and at its rotation partner (float32), or ones."""
        offs_d = tl.arange(0, D)
        if HAS_NORM:
            w = tl.load(NW + offs_d).to(tl.float32)
            wr = tl.load(NW + (offs_d + D // 2) % D).to(tl.float32)
        else:
            w = tl.full([D], 1.0, tl.float32)
            wr = w
        return w, wr

    @triton.jit
    def _kv_block(
        k_base, v_base, b_base, s0, end, stride_kr, stride_vr, D: tl.constexpr, BLOCK_N: tl.constexpr
    ):
        """Cached keys ``[D, BLOCK_N]``, β and values ``[BLOCK_N, D]`` of rows ``[s0, min(s0 + BLOCK_N, end))``
        (read once a step: evicted first, as :func:`_tile`)."""
        rows = s0 + tl.arange(0, BLOCK_N)
        rmask = rows < end
        offs_d = tl.arange(0, D)
        k_ptrs = k_base + rows[None, :] * stride_kr + offs_d[:, None]
        k = tl.load(k_ptrs, mask=rmask[None, :], other=0.0, eviction_policy="evict_first")
        beta = tl.load(b_base + rows, mask=rmask, other=0.0, eviction_policy="evict_first")
        v_ptrs = v_base + rows[:, None] * stride_vr + offs_d[None, :]
        v = tl.load(v_ptrs, mask=rmask[:, None], other=0.0, eviction_policy="evict_first")
        return k, beta, v

    @triton.jit
    def _merge_heads(O_PART, LSE_PART, ATT, kvh, G: tl.constexpr, BLOCK_G: tl.constexpr, S: tl.constexpr,
                     BLOCK_S: tl.constexpr, D: tl.constexpr):  # fmt: skip
        """The log-sum-exp merge of the ``S`` split partials of KV head ``kvh``'s query heads into ``ATT``.
        Partials and their log-sum-exps are loaded together (one L2 round trip; other programs wrote them)."""
        offs_g = tl.arange(0, BLOCK_G)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, D)
        gmask = offs_g < G
        heads = kvh * G + offs_g
        m2 = gmask[:, None] & (offs_s < S)[None, :]
        lse = tl.load(
            LSE_PART + heads[:, None] * S + offs_s[None, :],
            mask=m2,
            other=float("-inf"),
            cache_modifier=".cg",
        )
        o_ptr = O_PART + heads[:, None, None] * (S * D) + offs_s[None, :, None] * D + offs_d[None, None, :]
        o = tl.load(o_ptr, mask=m2[:, :, None], other=0.0, cache_modifier=".cg")
        m = tl.max(lse, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse - m[:, None])
        total = tl.sum(w, axis=1)
        out = tl.sum(o * w[:, :, None], axis=1) / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            ATT + heads[:, None] * D + offs_d[None, :], out.to(ATT.dtype.element_ty), mask=gmask[:, None]
        )

    @triton.jit
    def _attention_phase(
        layer, pid, WBASE, OFFS, QKV, ATT, O_PART, LSE_PART, HEAD_CNT, Q_OUT, stride_ql, TIMES, TIMING,
        k_base, v_base, b_base, stride_kr, stride_vr, k, beta, v, start, end,
        qw, qwr, kw, kwr, c, s, slot, row, eps, scale_log2,
        NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr,
        HAS_NORM: tl.constexpr, RECORD: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """Phase B for the program's (KV head, split): ``k, beta, v`` are its first block, loaded
        before the barrier (the next block is issued before each is used); the new token's row in
        them is replaced by its K/V computed here."""
        dt = QKV.dtype.element_ty
        kvh = pid // S
        sp = pid % S
        active = kvh < NKV
        kvh = tl.minimum(kvh, NKV - 1)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, D)
        offs_n = tl.arange(0, BLOCK_N)
        heads = kvh * G + offs_h
        hmask = offs_h < G
        # every q/k/v row this program needs, loaded together (written by phase A: read from L2)
        rot = (offs_d + D // 2) % D
        q_rows = QKV + heads[:, None] * D
        xq = tl.load(q_rows + offs_d[None, :], mask=hmask[:, None], other=0.0, cache_modifier=".cg")
        xqr = tl.load(q_rows + rot[None, :], mask=hmask[:, None], other=0.0, cache_modifier=".cg")
        k_row = QKV + (NQ + kvh) * D
        xk = tl.load(k_row + offs_d[None, :], cache_modifier=".cg")  # [1, D]
        xkr = tl.load(k_row + rot[None, :], cache_modifier=".cg")
        v_new = tl.load(QKV + (NQ + NKV + kvh) * D + offs_d, cache_modifier=".cg")
        q = _rope(xq, xqr, qw, qwr, c, s, eps, dt, D, HAS_NORM)
        k_new = tl.reshape(_rope(xk, xkr, kw, kwr, c, s, eps, dt, D, HAS_NORM), [D])
        if RECORD:  # noqa: SIM102 - a constexpr branch around a runtime one
            if active & (sp == 0):
                tl.store(
                    Q_OUT + layer * stride_ql + heads[:, None] * D + offs_d[None, :], q, mask=hmask[:, None]
                )
        if (slot >= 0) & (row >= start) & (row < end):  # this split holds the new token: store its K/V
            tl.store(k_base + row * stride_kr + offs_d, k_new)
            tl.store(v_base + row * stride_vr + offs_d, v_new)
        _clock(TIMES, pid, 3000 + layer * 4, TIMING)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        for s0 in range(start, end, BLOCK_N):
            rows = s0 + offs_n
            rmask = rows < end
            k_nxt, b_nxt, v_nxt = _kv_block(
                k_base, v_base, b_base, s0 + BLOCK_N, end, stride_kr, stride_vr, D, BLOCK_N
            )
            is_new = rows == row
            k = tl.where(is_new[None, :], k_new[:, None], k)
            v = tl.where(is_new[:, None], v_new[None, :], v)
            m_i, l_i, acc = attend_block(q, k, beta, v, rmask, m_i, l_i, acc, scale_log2, False)  # bf16/fp16: exact products
            k, beta, v = k_nxt, b_nxt, v_nxt
        has = l_i > 0
        out = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        _clock(TIMES, pid, 3001 + layer * 4, TIMING)
        if active:
            tl.store(O_PART + heads[:, None] * (S * D) + sp * D + offs_d[None, :], out, mask=hmask[:, None])
            tl.store(LSE_PART + heads * S + sp, lse, mask=hmask)
            tl.debug_barrier()  # every thread's partial is stored before the counter moves
            last = tl.atomic_add(HEAD_CNT + kvh, 1, sem="acq_rel", scope="gpu") == S - 1
            _clock(TIMES, pid, 3002 + layer * 4, TIMING)
            if last:
                _merge_heads(O_PART, LSE_PART, ATT, kvh, G, BLOCK_G, S, BLOCK_S, D)
                tl.atomic_xchg(HEAD_CNT + kvh, 0, sem="relaxed")  # read again layers later, after barriers
                _clock(TIMES, pid, 3003 + layer * 4, TIMING)

    @triton.jit
    def _layers_kernel(
        WBASE, OFFS, H_BUF, QKV, ATT, ACT, O_PART, LSE_PART, HEAD_CNT, BAR, Q_OUT, stride_ql, TIMES,
        K_CACHE, V_CACHE, BETA, stride_ks, stride_kl, stride_kh, stride_kr, stride_vs, stride_vl, stride_vh, stride_vr,
        stride_bs, stride_bl, stride_bh, COS, SIN, stride_cs, POS, SLOTS, ROWS, LENS, eps, scale_log2,
        L: tl.constexpr, H: tl.constexpr, HP: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr,
        FF: tl.constexpr, P: tl.constexpr, S: tl.constexpr, BLOCK_N: tl.constexpr,
        R_QKV: tl.constexpr, B_QKV: tl.constexpr, KC_QKV: tl.constexpr,
        R_O: tl.constexpr, B_O: tl.constexpr, KC_O: tl.constexpr,
        R_I: tl.constexpr, B_I: tl.constexpr, KC_I: tl.constexpr,
        KC_DOWN: tl.constexpr,
        HAS_NORM: tl.constexpr, QKV_BIAS: tl.constexpr, O_BIAS: tl.constexpr, RECORD: tl.constexpr,
        G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr,
        TIMING: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        pid = tl.program_id(0)
        dt = H_BUF.dtype.element_ty
        NQKV: tl.constexpr = (NQ + 2 * NKV) * D
        pos = tl.load(POS)
        slot = tl.load(SLOTS).to(tl.int64)
        row = tl.load(ROWS)
        n = tl.load(LENS)
        n = tl.where(slot >= 0, n, 0)
        slot = tl.maximum(slot, 0)
        r_qkv = pid * R_QKV
        n_qkv = tl.minimum(R_QKV, NQKV - r_qkv)
        r_o = pid * R_O
        n_o = tl.minimum(R_O, H - r_o)
        r_i = pid * R_I
        n_i = tl.minimum(R_I, FF - r_i)
        offs_qkv = r_qkv + tl.arange(0, B_QKV)
        offs_o = r_o + tl.arange(0, B_O)
        offs_i = r_i + tl.arange(0, B_I)
        omask = tl.arange(0, B_O) < n_o
        kvh = tl.minimum(pid // S, NKV - 1)
        split = tl.cdiv(tl.cdiv(n, S), BLOCK_N) * BLOCK_N
        start = (pid % S) * split
        end = tl.where(pid // S < NKV, tl.minimum(start + split, n), start)
        half = tl.arange(0, D) % (D // 2)
        cos = tl.load(COS + pos * stride_cs + half).to(tl.float32)  # the same position in every layer
        sin = tl.load(SIN + pos * stride_cs + half).to(tl.float32)
        phase = 0
        for layer in range(L):
            # A: q/k/v rows of RMSNorm(h)
            w_qkv = _weight(WBASE, OFFS, layer, 1)
            phase = _enter(BAR, phase, TIMES, pid, TIMING)
            w0 = _tile(w_qkv, r_qkv, n_qkv, 0, H, B_QKV, KC_QKV)
            _start(BAR, phase, P, TIMES, pid, TIMING)
            rstd = _rstd(H_BUF, eps, H, HP)
            acc, _ = _rows_dot(w_qkv, w0, w_qkv, w0, r_qkv, n_qkv, H_BUF, _weight(WBASE, OFFS, layer, 0), rstd,
                               H, B_QKV, KC_QKV, True, False)  # fmt: skip
            if QKV_BIAS:
                bias = _weight(WBASE, OFFS, layer, 2)
                acc += tl.load(bias + offs_qkv, mask=tl.arange(0, B_QKV) < n_qkv, other=0.0).to(tl.float32)
            tl.store(QKV + offs_qkv, acc.to(dt), mask=tl.arange(0, B_QKV) < n_qkv)
            # B: attention (its first K/V block is loaded while the q/k/v rows are awaited)
            k_base = K_CACHE + slot * stride_ks + layer * stride_kl + kvh * stride_kh
            v_base = V_CACHE + slot * stride_vs + layer * stride_vl + kvh * stride_vh
            b_base = BETA + slot * stride_bs + layer * stride_bl + kvh * stride_bh
            phase = _enter(BAR, phase, TIMES, pid, TIMING)
            k0, beta0, v0 = _kv_block(k_base, v_base, b_base, start, end, stride_kr, stride_vr, D, BLOCK_N)
            qw, qwr = _norm_pair(_weight(WBASE, OFFS, layer, 3), D, HAS_NORM)
            kw, kwr = _norm_pair(_weight(WBASE, OFFS, layer, 4), D, HAS_NORM)
            _start(BAR, phase, P, TIMES, pid, TIMING)
            _attention_phase(
                layer, pid, WBASE, OFFS, QKV, ATT, O_PART, LSE_PART, HEAD_CNT, Q_OUT, stride_ql, TIMES, TIMING,
                k_base, v_base, b_base, stride_kr, stride_vr, k0, beta0, v0, start, end,
                qw, qwr, kw, kwr, cos, sin, slot, row, eps, scale_log2,
                NQ, NKV, D, S, BLOCK_N, HAS_NORM, RECORD, G, BLOCK_H, BLOCK_G, BLOCK_S,
            )  # fmt: skip
            # C: output projection into the residual stream
            w_o = _weight(WBASE, OFFS, layer, 5)
            phase = _enter(BAR, phase, TIMES, pid, TIMING)
            w0 = _tile(w_o, r_o, n_o, 0, NQ * D, B_O, KC_O)
            _start(BAR, phase, P, TIMES, pid, TIMING)
            acc, _ = _rows_dot(w_o, w0, w_o, w0, r_o, n_o, ATT, w_o, 1.0, NQ * D, B_O, KC_O, False, False)
            if O_BIAS:
                bias = _weight(WBASE, OFFS, layer, 6)
                acc += tl.load(bias + offs_o, mask=omask, other=0.0).to(tl.float32)
            h = tl.load(H_BUF + offs_o, mask=omask, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(H_BUF + offs_o, (h + acc.to(dt).to(tl.float32)).to(dt), mask=omask)
            # D: gate/up rows of RMSNorm(h), SiLU·mul
            w_g = _weight(WBASE, OFFS, layer, 8)
            w_u = w_g + FF * H
            phase = _enter(BAR, phase, TIMES, pid, TIMING)
            g0 = _tile(w_g, r_i, n_i, 0, H, B_I, KC_I)
            u0 = _tile(w_u, r_i, n_i, 0, H, B_I, KC_I)
            _start(BAR, phase, P, TIMES, pid, TIMING)
            rstd = _rstd(H_BUF, eps, H, HP)
            g, u = _rows_dot(w_g, g0, w_u, u0, r_i, n_i, H_BUF, _weight(WBASE, OFFS, layer, 7), rstd,
                             H, B_I, KC_I, True, True)  # fmt: skip
            g = g.to(dt).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            tl.store(ACT + offs_i, (s * u.to(dt).to(tl.float32)).to(dt), mask=tl.arange(0, B_I) < n_i)
            # E: down projection into the residual stream
            w_d = _weight(WBASE, OFFS, layer, 9)
            phase = _enter(BAR, phase, TIMES, pid, TIMING)
            w0 = _tile(w_d, r_o, n_o, 0, FF, B_O, KC_DOWN)
            _start(BAR, phase, P, TIMES, pid, TIMING)
            acc, _ = _rows_dot(w_d, w0, w_d, w0, r_o, n_o, ACT, w_d, 1.0, FF, B_O, KC_DOWN, False, False)
            h = tl.load(H_BUF + offs_o, mask=omask, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(H_BUF + offs_o, (h + acc.to(dt).to(tl.float32)).to(dt), mask=omask)
        _clock(TIMES, pid, 2 * phase, TIMING)
        # the last program out resets the barrier for the next launch (graph replay)
        tl.debug_barrier()
        if tl.atomic_add(BAR + 1, 1, sem="acq_rel", scope="gpu") == P - 1:
            tl.atomic_xchg(BAR, 0)
            tl.atomic_xchg(BAR + 1, 0)


@dataclass
class PersistentPlan:
    """What one model's persistent launch needs besides the step's inputs (built once per decoder)."""

    base: torch.Tensor  # the weight every offset counts from
    ptrs: torch.Tensor  # int64 [L, 10]: each layer's weights as element offsets from ``base``
    h: torch.Tensor  # residual stream [1, H]
    qkv: torch.Tensor
    att: torch.Tensor
    act: torch.Tensor
    o_part: torch.Tensor
    lse_part: torch.Tensor
    head_cnt: torch.Tensor
    bar: torch.Tensor
    programs: int
    meta: dict


def persistent_supported(decoder) -> str | None:
    """Why :func:`persistent_layers` cannot run ``decoder``'s model, or ``None`` when it can."""
    if not HAS_TRITON or decoder.device.type != "cuda":
        return "needs CUDA and Triton"
    if decoder.dtype not in (torch.bfloat16, torch.float16):
        return f"weights in {decoder.dtype} (bf16 or fp16 only)"
    d = decoder.head_dim
    if d & (d - 1) or d < 16:
        return f"head_dim {d} is not a power of two ≥ 16"
    if decoder.n_q % decoder.n_kv:
        return "query heads are not a multiple of KV heads"
    if decoder.sm_count < decoder.n_kv:
        return "fewer multiprocessors than KV heads"
    return None


def _tiling(rows: int, k: int, programs: int) -> tuple[int, int, int]:
    """Rows per program, their power-of-two block, and the K chunk of one ≤ TILE_ELEMENTS tile."""
    per = -(-rows // programs)
    block = triton.next_power_of_2(per)
    chunk = max(64, min(triton.next_power_of_2(k), TILE_ELEMENTS // block))
    return per, block, chunk


def build_plan(decoder) -> PersistentPlan:
    """Pointer table, scratch buffers and launch constants of ``decoder``'s model."""
    dev, dt = decoder.device, decoder.dtype
    layers = decoder.layers
    base = layers[0].qkv
    size = base.element_size()
    offsets = []
    for lw in layers:
        row = []
        for f in _FIELDS:
            t = getattr(lw, f)
            assert t is None or (t.is_contiguous() and t.dtype == dt), (
                f"persistent kernel: {f} must be contiguous {dt}"
            )
            delta = 0 if t is None else t.data_ptr() - base.data_ptr()
            assert delta % (16 * size) == 0, f"persistent kernel: {f} is not 16-element aligned"
            row.append(delta // size)
        offsets.append(row)
    ptrs = torch.tensor(offsets, dtype=torch.int64, device=dev)
    hidden = decoder.embed.shape[1]
    inter = layers[0].down.shape[1]
    n_q, n_kv, d = decoder.n_q, decoder.n_kv, decoder.head_dim
    programs = decoder.sm_count
    splits = programs // n_kv
    r_qkv, b_qkv, kc_qkv = _tiling((n_q + 2 * n_kv) * d, hidden, programs)
    r_o, b_o, kc_o = _tiling(hidden, n_q * d, programs)
    r_i, b_i, kc_i = _tiling(inter, hidden, programs)
    kc_i = max(64, kc_i // 2)  # gate and up tiles are in flight together
    kc_down = max(64, min(triton.next_power_of_2(inter), TILE_ELEMENTS // b_o))
    meta = dict(
        L=len(layers), H=hidden, HP=triton.next_power_of_2(hidden), NQ=n_q, NKV=n_kv, D=d, FF=inter, P=programs,
        S=splits, BLOCK_N=BLOCK_KEYS, R_QKV=r_qkv, B_QKV=b_qkv, KC_QKV=kc_qkv, R_O=r_o, B_O=b_o, KC_O=kc_o,
        R_I=r_i, B_I=b_i, KC_I=kc_i, KC_DOWN=kc_down, HAS_NORM=layers[0].q_norm is not None,
        QKV_BIAS=layers[0].qkv_bias is not None, O_BIAS=layers[0].o_bias is not None,
        G=n_q // n_kv, BLOCK_H=max(16, triton.next_power_of_2(n_q // n_kv)),
        BLOCK_G=triton.next_power_of_2(n_q // n_kv), BLOCK_S=triton.next_power_of_2(splits),
    )  # fmt: skip
    return PersistentPlan(
        base=base,
        ptrs=ptrs,
        h=torch.zeros(1, hidden, dtype=dt, device=dev),
        qkv=torch.zeros((n_q + 2 * n_kv) * d, dtype=dt, device=dev),
        att=torch.zeros(n_q * d, dtype=dt, device=dev),
        act=torch.zeros(inter, dtype=dt, device=dev),
        o_part=torch.zeros(n_q, splits, d, dtype=torch.float32, device=dev),
        lse_part=torch.zeros(n_q, splits, dtype=torch.float32, device=dev),
        head_cnt=torch.zeros(n_kv, dtype=torch.int32, device=dev),
        bar=torch.zeros(2, dtype=torch.int32, device=dev),
        programs=programs,
        meta=meta,
    )


def persistent_layers(
    decoder,
    plan: PersistentPlan,
    ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    beta: torch.Tensor,
    q_out: torch.Tensor | None = None,
    timings: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one token (batch 1) through every decoder layer in one launch; return the residual stream ``[1, H]``.

    Args:
        ids, positions, slots, rows, lens: ``[1]`` device tensors: the token, its logical position, its
            slot (``< 0``: padding — nothing is stored or read), the cache row its K/V go to, and the
            rows to attend (the new one included).
        k_cache, v_cache: the slot cache ``[slots, layers, H_kv, capacity, d]``; ``beta`` its β
            ``[slots, layers, H_kv, capacity]`` (float32).
        q_out: ``[layers, 1, H_q, d]``: where each layer's rotated queries are written.
        timings: int64 ``[programs, 4096]`` for profiling: each program's global timer (ns) before
            and after barrier ``j`` (columns ``2j`` and ``2j + 1``; five per layer, ``j = 5·layer +
            phase``, phases A–E) and at the end (``2 · 5L``); in phase B at ``3000 + 4·layer +``
            0 (q/k rotated), 1 (keys done), 2 (merge counter bumped) and 3 (merged: the merging
            program only). ``benchmarks/bench_decode.py --phases`` prints them.
    """
    torch.index_select(decoder.embed.detach(), 0, ids[:1], out=plan.h)
    record = q_out is not None
    q_ptr = q_out if record else plan.att
    timing = timings is not None
    _layers_kernel[(plan.programs,)](
        plan.base, plan.ptrs, plan.h, plan.qkv, plan.att, plan.act, plan.o_part, plan.lse_part, plan.head_cnt, plan.bar,
        q_ptr, q_out.stride(0) if record else 0, timings if timing else plan.ptrs,
        k_cache, v_cache, beta, *k_cache.stride()[:4], *v_cache.stride()[:4], *beta.stride()[:3],
        decoder.cos, decoder.sin, decoder.cos.stride(0), positions, slots, rows, lens,
        decoder.eps, decoder.scale * 1.4426950408889634,
        RECORD=record, TIMING=timing, num_warps=NUM_WARPS, num_stages=1, **plan.meta, **pdl_kwargs(plan.h),
    )  # fmt: skip
    return plan.h
