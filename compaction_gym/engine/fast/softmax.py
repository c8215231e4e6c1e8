"""The two softmaxes of a value-map design in one pass over the probes' logits (Triton).

One-pass replay forms, for every compaction problem ``b`` and probe row ``i``, the attention of the
probe over the span's keys and over the kept keys alone (docs/grpo.md, "Replay in one pass")::

    logits = raw · scale (+ bias)                  # raw = Q Kᵀ, float32 [B, n, w]
    attn   = softmax_w(logits)                      # [B, n, w]
    xs     = softmax_t(logits[kept])                # [B, n, t]; with β: raw[kept] · scale + β
    xs[~row_mask] = 0                               # padding probes drop out of the design

:func:`span_and_kept_softmax` reads each ``raw`` row once and writes ``attn`` over it (in place) and
``xs``, where the torch sequence (scale, bias, gather, two softmaxes) makes six passes over the
``[B, n, w]`` tensors. Every step is the reference's float32 operation, so the two agree to the
last bits of the exponentials. :func:`span_and_kept_softmax_ref` is the reference (and what runs
without Triton).
"""

from __future__ import annotations

import torch

from compaction_gym.engine.fast.kernels import HAS_TRITON, use_triton

#: Widest span the kernel keeps in registers; wider spans run the reference.
MAX_WIDTH = 8192
#: Elements of ``raw`` per program: narrow spans take several rows each (one 768-byte row per program
#: kept the device's memory at half its bandwidth, docs/benchmarks.md).
TILE = 1024

if HAS_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _exp(x, LIBDEVICE: tl.constexpr):
        """``expf`` as torch's softmax takes it (libdevice; ``tl.exp`` is ``ex2.approx`` of ``x·log₂e``);
        ``tl.exp`` under the interpreter (CPU tensors), which has no libdevice."""
        if LIBDEVICE:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _span_and_kept_softmax_kernel(
        RAW, BIAS, KEPT, BETA, MASK, XS, rows, n, w, t, scale,
        HAS_BIAS: tl.constexpr, HAS_BETA: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, LIBDEVICE: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # rows of [B·n]
        rmask = r < rows
        b = r // n
        offs = tl.arange(0, BLOCK_W)
        wmask = rmask[:, None] & (offs[None, :] < w)
        row = RAW + r[:, None] * w
        s = tl.load(row + offs[None, :], mask=wmask, other=0.0) * scale
        if HAS_BIAS:
            s = s + tl.load(BIAS + b[:, None] * w + offs[None, :], mask=wmask, other=0.0)
        offs_t = tl.arange(0, BLOCK_T)
        tmask = rmask[:, None] & (offs_t[None, :] < t)
        kept = tl.load(KEPT + b[:, None] * t + offs_t[None, :], mask=tmask, other=0)
        k = tl.load(row + kept, mask=tmask, other=0.0) * scale
        if HAS_BETA:
            k = k + tl.load(BETA + b[:, None] * t + offs_t[None, :], mask=tmask, other=0.0)
        elif HAS_BIAS:
            k = k + tl.load(BIAS + b[:, None] * w + kept, mask=tmask, other=0.0)
        tl.debug_barrier()  # every thread's reads of the rows precede the in-place store below
        s = tl.where(wmask, s, float("-inf"))
        e = _exp(s - tl.max(s, axis=1)[:, None], LIBDEVICE)
        tl.store(row + offs[None, :], e / tl.sum(e, axis=1)[:, None], mask=wmask)
        k = tl.where(tmask, k, float("-inf"))
        ek = _exp(k - tl.max(k, axis=1)[:, None], LIBDEVICE)
        xs = ek / tl.sum(ek, axis=1)[:, None]
        if HAS_MASK:
            xs = tl.where(tl.load(MASK + r, mask=rmask, other=0)[:, None] != 0, xs, 0.0)
        tl.store(XS + r[:, None] * t + offs_t[None, :], xs, mask=tmask)


def kept_and_span_softmax_of(
    raw: torch.Tensor, logits: torch.Tensor, kept: torch.Tensor, beta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xs, attn)`` from the scaled logits ``raw`` and the biased ones ``logits`` (torch ops)."""
    idx = kept[:, None, :].expand(-1, raw.shape[1], -1)
    kept_logits = torch.gather(logits, 2, idx) if beta is None else torch.gather(raw, 2, idx) + beta[:, None, :]
    return torch.softmax(kept_logits, dim=-1), torch.softmax(logits, dim=-1)


def span_and_kept_softmax_ref(
    raw: torch.Tensor, scale: float, kept: torch.Tensor, bias: torch.Tensor | None = None,
    beta: torch.Tensor | None = None, row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Reference of :func:`span_and_kept_softmax` (torch ops; ``raw`` is scaled in place)."""
    raw.mul_(scale)
    logits = raw if bias is None else raw + bias.float()[:, None, :]
    xs, attn = kept_and_span_softmax_of(raw, logits, kept, None if beta is None else beta.float())
    return (xs if row_mask is None else xs * row_mask[:, :, None].to(xs.dtype)), attn


def span_and_kept_softmax(
    raw: torch.Tensor, scale: float, kept: torch.Tensor, bias: torch.Tensor | None = None,
    beta: torch.Tensor | None = None, row_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(xs, attn)`` of a design from its unscaled logits (module docstring).

    Args:
        raw: ``Q Kᵀ`` float32 ``[B, n, w]``, contiguous; overwritten (by ``attn``, or by the scaled
            logits in the reference).
        scale: the logits' scale.
        kept: the kept keys' columns ``[B, t]`` (int64).
        bias: float32 ``[B, w]`` added to the logits (the span keys' β from earlier events).
        beta: float32 ``[B, t]``: the kept keys' logits are ``raw[kept] · scale + beta`` (without
            ``bias``) instead of ``logits[kept]``.
        row_mask: ``[B, n]`` (bool): rows where it is False get ``xs = 0`` (padding probes).

    Returns:
        ``xs`` ``[B, n, t]`` and ``attn`` ``[B, n, w]`` (float32).
    """
    B, n, w = raw.shape
    t = kept.shape[1]
    if not (use_triton(raw) and raw.dtype == torch.float32 and raw.is_contiguous() and 0 < w <= MAX_WIDTH and t > 0):
        return span_and_kept_softmax_ref(raw, scale, kept, bias, beta, row_mask)
    xs = raw.new_empty(B, n, t)
    bias_t = bias.float().contiguous() if bias is not None else raw
    beta_t = beta.float().contiguous() if beta is not None else raw
    block_w = triton.next_power_of_2(w)
    block_r = min(64, max(1, TILE // block_w))
    mask_t = row_mask.to(torch.bool).contiguous() if row_mask is not None else raw
    _span_and_kept_softmax_kernel[(triton.cdiv(B * n, block_r),)](
        raw, bias_t, kept.contiguous(), beta_t, mask_t, xs, B * n, n, w, t, scale,
        HAS_BIAS=bias is not None, HAS_BETA=beta is not None, HAS_MASK=row_mask is not None,
        LIBDEVICE=raw.is_cuda, BLOCK_R=block_r, BLOCK_W=block_w, BLOCK_T=triton.next_power_of_2(t),
        num_warps=4 if block_w * block_r <= 2048 else 8,
    )  # fmt: skip
    return xs, raw
