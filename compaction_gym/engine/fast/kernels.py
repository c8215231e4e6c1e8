"""Fused elementwise kernels of the fast decoder (Triton), each with a plain-torch reference.

* :func:`rms_norm` — ``y = w · norm(x + r)``, writing ``x + r`` back into ``r`` (the residual
  stream) in the same pass;
* :func:`qkv_rope_store` — per-head RMSNorm of q and k (Qwen3), rotary embedding, and the store
  of k/v straight into the slot cache (no intermediate copies);
* :func:`silu_mul` — ``silu(gate) · up`` from the fused gate/up projection;
* :func:`argmax_logprob` — greedy decoding's token and its log-probability straight from the
  model-dtype logits (two launches, no float32 copy of the logits);
* :func:`decode_advance` — the decode step's bookkeeping in one launch: store the sampled token,
  stop rows at a stop token or their step limit, feed the token back.

Roundings follow Hugging Face's modules (normalise in float32, round to the model dtype, then
multiply by the weight; rotary products rounded one by one), so the fast path tracks the generic
path to the last bit in float32 and closely in bf16. The references are what the kernels are
tested against and what runs where Triton is missing.

**Programmatic dependent launch** (on by default; ``COMPACTION_GYM_PDL=0`` turns it off): on Hopper and later with
Triton ≥ 3.4, the decode step's Triton kernels (these, the GEMV, decode attention) are launched
with ``launch_pdl=True``: each waits for the previous kernel's completion (``griddepcontrol.wait``)
as its first instruction, before any load or store, and then lets the next kernel launch, so the
next launch's set-up overlaps this kernel's run. Results are unchanged (every read and write
happens after the wait). :func:`pdl_enabled` says whether a launch uses it.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton is optional: CPU installs run the references
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None
    tl = None

HAS_TRITON = triton is not None

try:  # grid dependency control (programmatic dependent launch), Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the environment
    gdc_wait = gdc_launch_dependents = None


# --------------------------------------------------------------------------- references
def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference of :func:`rms_norm` (updates ``residual`` in place when given)."""
    if residual is not None:
        residual.copy_(residual + x)
        x = residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def qkv_rope_store_ref(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    n_q: int,
    n_kv: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of :func:`qkv_rope_store`; returns q ``[N, H_q, d]`` (written into ``out`` when given)."""
    n, d = qkv.shape[0], k_cache.shape[-1]
    q = qkv[:, : n_q * d].reshape(n, n_q, d)
    k = qkv[:, n_q * d : (n_q + n_kv) * d].reshape(n, n_kv, d)
    v = qkv[:, (n_q + n_kv) * d :].reshape(n, n_kv, d)
    if q_norm is not None:
        q, k = rms_norm_ref(q, q_norm, eps), rms_norm_ref(k, k_norm, eps)
    c = torch.cat([cos[positions], cos[positions]], -1)[:, None].to(qkv.dtype)
    s = torch.cat([sin[positions], sin[positions]], -1)[:, None].to(qkv.dtype)

    def rope(x: torch.Tensor) -> torch.Tensor:
        rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * c + rot * s

    q, k = rope(q), rope(k)
    live = slots >= 0
    k_cache[slots[live], :, rows[live]] = k[live].to(k_cache.dtype)
    v_cache[slots[live], :, rows[live]] = v[live].to(v_cache.dtype)
    return q if out is None else out.copy_(q)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`silu_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def argmax_logprob_ref(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`argmax_logprob`: ``argmax`` (first of equal maxima) and its float32 log-softmax."""
    logits = logits.float()
    best = logits.argmax(dim=-1)
    return best, logits.gather(1, best[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


def decode_advance_ref(
    tokens: torch.Tensor, logprobs: torch.Tensor, state: torch.Tensor, out_tok: torch.Tensor, out_lp: torch.Tensor,
    step: torch.Tensor,
) -> None:  # fmt: skip
    """Reference of :func:`decode_advance`."""
    ids, pos, slots, rows, lens, remaining = state[:6]
    stops = state[6:]
    out_tok.index_copy_(1, step, tokens[:, None])
    out_lp.index_copy_(1, step, logprobs[:, None])
    live = lens > 0
    remaining.sub_(live.long())
    done = live & ((tokens[None, :] == stops).any(0) | (remaining <= 0))
    ids.copy_(tokens)
    pos.add_(live.long())
    rows.add_(live.long())
    lens.add_(live.long()).masked_fill_(done, 0)
    slots.masked_fill_(done, -1)
    step.add_(1)


# ------------------------------------------------------------------------------ kernels
if HAS_TRITON:

    @triton.jit
    def _decode_advance_kernel(
        TOK, LOGP, STATE, stride_state, OUT_TOK, OUT_LP, stride_out, STEP, n,
        N_STOPS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        b = tl.arange(0, BLOCK)
        m = b < n
        step = tl.load(STEP)
        tok = tl.load(TOK + b, mask=m, other=0)
        tl.store(OUT_TOK + b * stride_out + step, tok, mask=m)
        tl.store(OUT_LP + b * stride_out + step, tl.load(LOGP + b, mask=m, other=0.0), mask=m)
        lens = tl.load(STATE + 4 * stride_state + b, mask=m, other=0)
        inc = (lens > 0).to(tl.int64)
        remaining = tl.load(STATE + 5 * stride_state + b, mask=m, other=0) - inc
        hit = remaining <= 0
        for k in tl.static_range(N_STOPS):
            hit = hit | (tl.load(STATE + (6 + k) * stride_state + b, mask=m, other=-1) == tok)
        done = (inc > 0) & hit
        slot = tl.load(STATE + 2 * stride_state + b, mask=m, other=-1)
        tl.store(STATE + b, tok, mask=m)
        tl.store(STATE + stride_state + b, tl.load(STATE + stride_state + b, mask=m, other=0) + inc, mask=m)
        tl.store(STATE + 2 * stride_state + b, tl.where(done, -1, slot), mask=m)
        tl.store(STATE + 3 * stride_state + b, tl.load(STATE + 3 * stride_state + b, mask=m, other=0) + inc, mask=m)
        tl.store(STATE + 4 * stride_state + b, tl.where(done, 0, lens + inc), mask=m)
        tl.store(STATE + 5 * stride_state + b, remaining, mask=m)
        tl.store(STEP, step + 1)

    @triton.jit
    def pdl_prologue(PDL: tl.constexpr):
        """With ``PDL``: wait for the previous kernel (its writes visible), then let the next one launch."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def mma(a, b, IEEE: tl.constexpr):
        """``a @ b`` accumulated in float32; with ``IEEE``, exact float32 products (no TF32)."""
        if IEEE:  # noqa: SIM108 - a statement-level branch on a constexpr
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)
        return c

    @triton.jit
    def _rms_norm_kernel(
        X, R, W, Y, stride_x, stride_r, stride_y, n, eps,
        HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
            x = (r.to(tl.float32) + x.to(tl.float32)).to(Y.dtype.element_ty)
            tl.store(R + row * stride_r + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
        normed = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32)
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + offs, (w * normed).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(GU, Y, stride_gu, stride_y, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_prologue(PDL)
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(GU + row * stride_gu + n + offs, mask=mask, other=0.0).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(Y.dtype.element_ty).to(tl.float32)
        tl.store(Y + row * stride_y + offs, (s * u).to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _argmax_partial_kernel(
        L, stride_l, vocab, PMAX, PSUM, PIDX, n_chunks, BLOCK: tl.constexpr, PDL: tl.constexpr
    ):  # fmt: skip
        """Per (row, chunk of ``BLOCK`` logits): the max, its first index and ``Σ exp(x − max)``."""
        pdl_prologue(PDL)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(L + row * stride_l + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32)
        m, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
        s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), axis=0)  # a chunk of −inf sums to 0
        out = row * n_chunks + chunk
        tl.store(PMAX + out, m)
        tl.store(PSUM + out, s)
        tl.store(PIDX + out, chunk * BLOCK + i)

    @triton.jit
    def _argmax_merge_kernel(
        PMAX, PSUM, PIDX, n_chunks, TOK, LOGP, BLOCK_C: tl.constexpr, PDL: tl.constexpr
    ):  # fmt: skip
        """Per row: the first chunk holding the max gives the token; ``−log Σ`` of the rescaled sums its log-probability."""
        pdl_prologue(PDL)
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        mask = c < n_chunks
        pm = tl.load(PMAX + row * n_chunks + c, mask=mask, other=float("-inf"))
        ps = tl.load(PSUM + row * n_chunks + c, mask=mask, other=0.0)
        pi = tl.load(PIDX + row * n_chunks + c, mask=mask, other=0)
        m = tl.max(pm, axis=0)
        first = tl.min(tl.where(pm == m, c, BLOCK_C), axis=0)
        token = tl.sum(tl.where(c == first, pi, 0), axis=0)
        total = tl.sum(ps * tl.exp(pm - m), axis=0)
        tl.store(TOK + row, token.to(tl.int64))
        tl.store(LOGP + row, -tl.log(total))

    @triton.jit
    def _qkv_rope_store_kernel(
        QKV, stride_t, POS, COS, SIN, stride_cs, QW, KW, Q_OUT, stride_qo_t, stride_qo_h,
        K_CACHE, V_CACHE, stride_ks, stride_kh, stride_kr, stride_vs, stride_vh, stride_vr,
        SLOTS, ROWS, eps,
        N_Q: tl.constexpr, N_KV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        t = tl.program_id(0)
        h = tl.program_id(1)  # q heads, then k heads, then v heads
        half = tl.arange(0, D // 2)
        dt = QKV.dtype.element_ty
        base = QKV + t * stride_t + h * D
        x1 = tl.load(base + half).to(tl.float32)
        x2 = tl.load(base + D // 2 + half).to(tl.float32)
        slot = tl.load(SLOTS + t).to(tl.int64)  # slot * stride overflows int32 on large caches
        row = tl.load(ROWS + t).to(tl.int64)
        if h < N_Q + N_KV:
            if HAS_NORM:
                rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
                if h < N_Q:
                    w1 = tl.load(QW + half).to(tl.float32)
                    w2 = tl.load(QW + D // 2 + half).to(tl.float32)
                else:
                    w1 = tl.load(KW + half).to(tl.float32)
                    w2 = tl.load(KW + D // 2 + half).to(tl.float32)
                x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
                x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            pos = tl.load(POS + t)
            c = tl.load(COS + pos * stride_cs + half).to(tl.float32)
            s = tl.load(SIN + pos * stride_cs + half).to(tl.float32)
            o1 = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
            o2 = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
            if h < N_Q:
                out = Q_OUT + t * stride_qo_t + h * stride_qo_h
                tl.store(out + half, o1)
                tl.store(out + D // 2 + half, o2)
            elif slot >= 0:
                out = K_CACHE + slot * stride_ks + (h - N_Q) * stride_kh + row * stride_kr
                tl.store(out + half, o1)
                tl.store(out + D // 2 + half, o2)
        elif slot >= 0:
            out = V_CACHE + slot * stride_vs + (h - N_Q - N_KV) * stride_vh + row * stride_vr
            tl.store(out + half, x1.to(dt))
            tl.store(out + D // 2 + half, x2.to(dt))


def use_triton(x: torch.Tensor) -> bool:
    return HAS_TRITON and (x.is_cuda or _interpreting())


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pdl_enabled(x: torch.Tensor) -> bool:
    """Whether Triton launches on ``x``'s device use programmatic dependent launch (module docstring):
    not turned off by ``COMPACTION_GYM_PDL=0``, a CUDA device of compute capability ≥ 9, Triton with
    grid dependency control, not the interpreter."""
    if os.environ.get("COMPACTION_GYM_PDL") == "0" or not x.is_cuda or _interpreting():
        return False
    return _pdl_supported(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_kwargs(x: torch.Tensor) -> dict:
    """A decode kernel's ``PDL`` constexpr and launch option for ``x``'s device (:func:`pdl_enabled`)."""
    return {"PDL": True, "launch_pdl": True} if pdl_enabled(x) else {"PDL": False}


@functools.cache
def _pdl_supported(device: int) -> bool:
    if not HAS_TRITON or gdc_wait is None:
        return False
    major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 4) and torch.cuda.get_device_capability(device)[0] >= 9


_COUNTERS: dict[tuple, torch.Tensor] = {}


def launch_counters(device: torch.device, n: int) -> torch.Tensor | None:
    """``n`` zeroed int32 counters for kernels whose last program to finish reduces (split-K GEMV,
    single-launch attention), shared by every launch that needs ``n`` of them.

    Launches on one stream run one after another and each leaves its counters at zero, so every
    layer and every captured graph can share them. Created on first use outside graph capture (the
    runner's warm-up steps run first); ``None`` if first asked for during a capture.
    """
    key = (device, n)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _COUNTERS[key]


# ----------------------------------------------------------------------------- wrappers
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of the rows of ``x`` ``[N, H]``; with ``residual``, of ``residual + x`` (stored back).

    Returns ``weight · (h · rsqrt(mean(h²) + eps))`` in ``x``'s dtype (rounded before the weight
    multiply, as Hugging Face does).
    """
    if not use_triton(x):
        return rms_norm_ref(x, weight, eps, residual)
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    n_rows, n = x.shape
    y = torch.empty_like(x)
    r = residual if residual is not None else x
    _rms_norm_kernel[(n_rows,)](
        x, r, weight, y, x.stride(0), r.stride(0), y.stride(0), n, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
        num_warps=4 if n <= 4096 else 8, **pdl_kwargs(x),
    )  # fmt: skip
    return y


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` for ``gate_up = [gate | up]`` ``[N, 2I]`` → ``[N, I]``."""
    if not use_triton(gate_up):
        return silu_mul_ref(gate_up)
    n_rows, n2 = gate_up.shape
    n = n2 // 2
    y = gate_up.new_empty(n_rows, n)
    block = 1024
    _silu_mul_kernel[(n_rows, triton.cdiv(n, block))](
        gate_up, y, gate_up.stride(0), y.stride(0), n, BLOCK=block, **pdl_kwargs(gate_up)
    )  # fmt: skip
    return y


def argmax_logprob(logits: torch.Tensor, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens ``[B]`` (int64; the first of equal maxima, as ``torch.argmax``) and their float32
    log-probabilities ``[B]`` for logits ``[B, V]`` in any float dtype.

    Two launches (per-chunk max / index / rescaled sum of ``block`` logits, then a per-row merge)
    instead of converting the logits to float32 and reducing them three times.
    """
    if not use_triton(logits):
        return argmax_logprob_ref(logits)
    assert logits.dim() == 2 and logits.stride(-1) == 1, "argmax_logprob needs [B, V] logits, last dim contiguous"
    batch, vocab = logits.shape
    block = min(block, triton.next_power_of_2(vocab))
    n_chunks = triton.cdiv(vocab, block)
    partials = torch.empty(2, batch, n_chunks, dtype=torch.float32, device=logits.device)  # max, rescaled sum
    pidx = torch.empty(batch, n_chunks, dtype=torch.int32, device=logits.device)
    tokens = torch.empty(batch, dtype=torch.long, device=logits.device)
    logp = torch.empty(batch, dtype=torch.float32, device=logits.device)
    pdl = pdl_kwargs(logits)
    _argmax_partial_kernel[(batch, n_chunks)](
        logits, logits.stride(0), vocab, partials[0], partials[1], pidx, n_chunks, BLOCK=block,
        num_warps=4 if block >= 1024 else 1, **pdl,
    )  # fmt: skip
    _argmax_merge_kernel[(batch,)](
        partials[0], partials[1], pidx, n_chunks, tokens, logp, BLOCK_C=max(16, triton.next_power_of_2(n_chunks)),
        num_warps=1, **pdl,
    )  # fmt: skip
    return tokens, logp


def decode_advance(
    tokens: torch.Tensor, logprobs: torch.Tensor, state: torch.Tensor, out_tok: torch.Tensor, out_lp: torch.Tensor,
    step: torch.Tensor,
) -> None:  # fmt: skip
    """After sampling one decode step of ``B`` rows: record, stop, and feed back, in place.

    Args:
        tokens, logprobs: the step's samples ``[B]`` (int64, float32).
        state: int64 ``[6 + S, B]`` (a strided view is fine): the rows' token to feed, logical
            position, slot, cache row, slot length (0: the row is stopped or padding), steps
            left, then ``S`` stop ids per row (``-1``: none).
        out_tok, out_lp: ``[B, C]`` outputs; column ``step`` receives the samples.
        step: int64 ``[1]``, incremented.

    A live row (``length > 0``) that sampled a stop id or used its last step stops: length 0,
    slot −1, so later steps neither write nor read its cache. Live rows advance their position,
    cache row and length by one; every row's next input is its sampled token.
    """
    if not use_triton(tokens):
        return decode_advance_ref(tokens, logprobs, state, out_tok, out_lp, step)
    batch = tokens.shape[0]
    assert state.shape[1] == batch and state.stride(1) == 1 and out_tok.stride(1) == out_lp.stride(1) == 1
    assert out_tok.stride(0) == out_lp.stride(0)
    _decode_advance_kernel[(1,)](
        tokens, logprobs, state, state.stride(0), out_tok, out_lp, out_tok.stride(0), step, batch,
        N_STOPS=state.shape[0] - 6, BLOCK=max(16, triton.next_power_of_2(batch)), num_warps=1, **pdl_kwargs(tokens),
    )  # fmt: skip


def qkv_rope_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    n_q: int,
    n_kv: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Split the fused projection, normalise and rotate q/k, store k/v in the slot cache.

    Args:
        qkv: ``[N, (H_q + 2 H_kv) · d]`` output of the fused q/k/v projection.
        positions: logical position of each token ``[N]`` (int64), indexing ``cos``/``sin``.
        cos, sin: rotary tables ``[P, d / 2]`` (the two halves of Hugging Face's tables are equal).
        q_norm, k_norm: per-head RMSNorm weights ``[d]`` (Qwen3) or ``None``.
        k_cache, v_cache: one layer of the slot cache ``[slots, H_kv, capacity, d]`` (strided views).
        slots, rows: where each token's k/v go; ``slot < 0`` skips the store (padding rows).
        out: where to write the queries (``[N, H_q, d]``, last dim contiguous; e.g. a recording
            buffer, which saves a copy), else a new tensor.

    Returns:
        Rotated queries ``[N, H_q, d]`` (``out`` when given).
    """
    d = k_cache.shape[-1]
    if not use_triton(qkv) or d % 2 or (d & (d - 1)):
        return qkv_rope_store_ref(
            qkv, positions, cos, sin, q_norm, k_norm, eps, k_cache, v_cache, slots, rows, n_q, n_kv, out
        )
    n = qkv.shape[0]
    q = qkv.new_empty(n, n_q, d) if out is None else out
    assert q.shape == (n, n_q, d) and q.stride(-1) == 1 and q.dtype == qkv.dtype
    _qkv_rope_store_kernel[(n, n_q + 2 * n_kv)](
        qkv, qkv.stride(0), positions, cos, sin, cos.stride(0),
        q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slots, rows, eps,
        N_Q=n_q, N_KV=n_kv, D=d, HAS_NORM=q_norm is not None,
        num_warps=1 if d <= 128 else 2, **pdl_kwargs(qkv),
    )  # fmt: skip
    return q
